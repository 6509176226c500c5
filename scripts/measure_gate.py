#!/usr/bin/env python
"""Measure how far each gate statistic moves under benign changes and under sabotage.

Benign: a bf16 round trip of the weights, 1e-3 relative weight noise, and the build recipes.
Sabotage: negate the OV of the top induction head (its W_O), flatten the QK of the top
previous-token head (zero its W_Q/W_K). The gate's default tolerances must sit between.

    python scripts/measure_gate.py                       # the embedded tiny-induction model
    python scripts/measure_gate.py --model PATH --builds fp32,bnb-nf4
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import numpy as np
import torch

from pytest_circuits.gate.invariants import REGISTRY, gate_all, key_heads, negligible_heads, runnable
from pytest_circuits.gate.tolerances import Tolerances
from pytest_circuits.run.run import Run
from pytest_circuits.rungs.repeat_settings import RepeatSettings
from pytest_circuits.settings import CircuitsSettings
from pytest_circuits.testing import add_weight_noise, flatten_head_qk, negate_head_ov


def session_for(model: str, probe: RepeatSettings) -> Run:
    return Run(CircuitsSettings(model=model, device="cpu", probe=probe))


def statistics(before: dict, after: dict, tol: Tolerances) -> dict[str, float]:
    """What each invariant compared, from its own rows (`Invariant.compare`): per metric the change
    furthest from the baseline (signed), the smallest rank correlation, and knockout changes
    relative to the delta's size."""
    out: dict[str, float] = {}
    for name in runnable(after):
        for row in REGISTRY[name].compare(before, after, tol).rows:
            key = row.metric
            if row.metric == "rank corr":
                value = row.after
                better = value > out.get(key, np.inf)
            elif row.metric == "knockout_delta":
                value = abs(row.after - row.before) / abs(row.before)
                better = value < out.get(key, -np.inf)
            else:
                value = row.after - row.before
                better = abs(value) < abs(out.get(key, 0.0))
            if key not in out or not better:
                out[key] = value
    return out


def edited_folder(source_folder: Path, out: Path, edit) -> Path:
    """A copy of the model with ``edit(model)`` applied, saved as safetensors."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(source_folder, dtype=torch.float32, attn_implementation="eager")
    edit(model)
    model.save_pretrained(out, safe_serialization=True)
    for extra in source_folder.iterdir():  # keep the tokenizer files, if any
        if extra.suffix in (".json", ".txt", ".model") and not (out / extra.name).exists():
            (out / extra.name).write_bytes(extra.read_bytes())
    return out


def bf16_round_trip(model) -> None:
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.to(torch.bfloat16).float())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="tiny-induction")
    p.add_argument("--builds", default="bf16,fp16,bnb-int8,bnb-nf4,bnb-fp4,rtn-int8,rtn-int4")
    p.add_argument("--n", type=int, default=8)
    p.add_argument("--L", type=int, default=64)
    args = p.parse_args()
    probe = RepeatSettings(0, args.n, args.L)
    tol = Tolerances()
    base = session_for(args.model, probe)
    reference = base.records.record("fp32").data
    folder = base.loaded.source.folder
    induction = key_heads(reference, "prefix_matching", 1, 0.0)[0]
    previous = key_heads(reference, "previous_token", 1, 0.0)[0]
    print(
        f"model {args.model}: top induction head {induction}, top previous-token head {previous}; "
        f"copy loss {reference['copy_loss']:.4f}, gain {reference['copy_gain']:.4f}"
    )
    print("copying/suppression heads:", [h["head"] for h in reference["heads"] if h["copying"] or h["suppression"]])
    print(
        f"heads with OV gain < {tol.min_ov_gain:g} x the largest (kappa not compared):",
        sorted(negligible_heads(reference, tol.min_ov_gain)),
    )

    def lh(label):
        l, h = label[1:].split("H")
        return int(l), int(h)

    cases = [(f"build {r}", base, r) for r in args.builds.split(",") if r]
    tmp = Path(tempfile.mkdtemp())
    edits = {
        "bf16 round trip": bf16_round_trip,
        "noise 1e-3": lambda m: add_weight_noise(m, 1e-3, seed=0),
        "noise 1e-2": lambda m: add_weight_noise(m, 1e-2, seed=0),
        f"negate OV {induction}": lambda m: negate_head_ov(m, *lh(induction)),
        f"flatten QK {previous}": lambda m: flatten_head_qk(m, *lh(previous)),
    }
    for i, (name, edit) in enumerate(edits.items()):
        cases.append((name, session_for(str(edited_folder(folder, tmp / f"m{i}", edit)), probe), "fp32"))
    columns = (
        "kappa",
        "kappa_trace",
        "rank corr",
        "mean kappa_z",
        "mean kappa_trace_z",
        "copy_loss",
        "copy_gain",
        "prefix_matching",
        "previous_token",
        "knockout_delta",
    )
    print("largest change per compared figure (rank corr: its value; knockout_delta: relative to its size)")
    print(f"{'case':<24}" + "".join(f"{c:>19}" for c in columns) + "  verdict")
    for name, session, recipe in cases:
        record = session.records.record(recipe).data
        stats = statistics(reference, record, tol)
        results = gate_all(reference, record, tol, recipe, "fp32 baseline")
        broken = [r.invariant for r in results if not r.passed]
        print(
            f"{name:<24}"
            + "".join(f"{stats.get(c, np.nan):>+19.4f}" for c in columns)
            + f"  {'FAIL ' + ','.join(broken) if broken else 'pass'}",
            flush=True,
        )
    print("tolerances:", tol.as_dict())


if __name__ == "__main__":
    main()
