#!/usr/bin/env python
"""Measure each serving-format build against fp32: the gate's figures beside ordinary-text loss.

Per build: copy loss and its interval, the fp32 induction heads' prefix-matching scores (the top
three, then in the build), the largest knockout delta and that head's delta in the build, the
gate's verdict against fp32 (`gate_all` with the default tolerances; the failing invariants
named), and the mean next-token loss on held-out text (the docstrings of
`calibrated.HELD_OUT_MODULES`, never used for calibration; a model without a tokenizer: n/a).
Prints a Markdown table (docs/formats.md).

    python scripts/measure_formats.py --builds fp32,fp8-e4m3,fp8-e4m3-dyn,int8-w8a8,rtn-int4
    python scripts/measure_formats.py --model smollm2-135m --knockout-screen 12 \\
        --builds fp32,rtn-int4,w4-rtn-g64=DIR,gptq-int4-g64,awq-int4-g64
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from pytest_circuits.gate.invariants import gate_all, key_heads
from pytest_circuits.gate.tolerances import Tolerances
from pytest_circuits.model.calibrated import HELD_OUT_MODULES, text_ids
from pytest_circuits.session import CircuitsSession
from pytest_circuits.settings import build_settings

HELD_OUT_ROWS, HELD_OUT_LENGTH = 16, 256


@torch.no_grad()
def held_out_loss(session: CircuitsSession, name: str) -> float | None:
    """Mean next-token cross-entropy (nats) of the build on the held-out text."""
    ids = text_ids(session.source.folder, HELD_OUT_MODULES, HELD_OUT_ROWS, HELD_OUT_LENGTH)
    if ids is None:
        return None
    model = session.build(name).model
    losses = [float(model(input_ids=row[None], labels=row[None], use_cache=False).loss) for row in ids]
    return sum(losses) / len(losses)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny-induction")
    parser.add_argument("--builds", default="fp32,fp8-e4m3,fp8-e4m3-dyn,int8-w8a8,rtn-int4")
    parser.add_argument("--knockout-screen", default=None, help="screen of N heads (SmolLM2: 12)")
    parser.add_argument("--no-knockout", action="store_true", help="skip rung 2 (knockout deltas)")
    args = parser.parse_args()
    raw = {"model": args.model, "builds": args.builds, "baselines": None, "knockout-screen": args.knockout_screen}
    session = CircuitsSession(build_settings({k: v for k, v in raw.items() if v}, Path("baselines"), device="cpu"))
    knockout = not args.no_knockout
    fp32 = session.record("fp32", knockout=knockout)
    induction = key_heads(fp32, "prefix_matching", 3, 0.0)
    knocked = key_heads(fp32, "knockout_delta", 1, 0.0)
    head = {r["head"]: r for r in fp32["heads"]}
    listed = ", ".join(f"{h} {head[h]['prefix_matching']:.3f}" for h in induction)
    print(f"{args.model}: fp32 induction heads (prefix matching) {listed}")
    print(
        "| build | copy loss [interval] | induction heads | top knockout delta | held-out text loss | gate vs fp32 | s |"
    )
    print("|---|---|---|---|---|---|---|")
    for name in session.settings.builds:
        start = time.perf_counter()
        record = fp32 if name == "fp32" else session.record(name, knockout=knockout)
        rows = {r["head"]: r for r in record["heads"]}
        low, high = record["copy_loss_interval"]
        scores = " ".join(f"{rows[h]['prefix_matching']:.3f}" for h in induction)
        deltas = " ".join(f"{h} {rows[h]['knockout_delta']:.3f}" for h in knocked if rows[h].get("knockout_delta"))
        deltas = deltas or "not measured"
        loss = held_out_loss(session, name)
        if name == "fp32":
            verdict = "reference"
        else:
            results = gate_all(fp32, record, Tolerances(), name, "fp32")
            broken = [r.invariant for r in results if r.status == "failed"]
            verdict = "pass" if broken == [] and any(r.passed for r in results) else "FAIL " + ", ".join(broken)
        text = "n/a" if loss is None else f"{loss:.3f}"
        seconds = time.perf_counter() - start
        print(
            f"| {name} | {record['copy_loss']:.4f} [{low:.4f}, {high:.4f}] | {scores} | {deltas} | {text} "
            f"| {verdict} | {seconds:.0f} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
