#!/usr/bin/env python
"""Measure the change screen of ``knockout_deltas`` (issue 55 (c); `pytest_circuits.gate.change_screen`)
on the damage grid of docs/sensitivity.md; write its block of docs/speed.md.

Per model, the fp32 build and its shipped fp32 baseline: the intact build, each damage of the grid
(`pytest_circuits.run.sensitivity`, the same damages as ``scripts/measure_sensitivity.py``) and each
recipe is gated with every key head knocked out exactly, its record also holding each head's plain
AtP estimate (``knockout_atp``; the gate's own flow, `sensitivity.gate_record`). The baseline gets
the intact fp32 build's estimates, as a recording now stores them. For each screen fraction ``f``
the screened gate's verdict is then the pure verdict of the same records with the deltas of the
heads the screen clears taken out (`ChangeScreen.confirm` picks them, `gate.check.check` judges):
the exact rows of the heads it keeps are the ones a screened gate measures, look for look. A miss is
a key head the exact gate fails that the screen clears; the saving is the share of key-head
knockouts not run on look 1.

    python scripts/measure_change_screen.py --models tiny-induction --fractions 0.1,0.25,0.5
"""

from __future__ import annotations

import argparse
import json
import platform
import shlex
import sys
import time
from pathlib import Path

import torch
from measure_formats import write_blocks
from measure_sensitivity import floats, gate_recipes, read_baseline

from pytest_circuits.errors import CircuitsError
from pytest_circuits.gate import invariants
from pytest_circuits.gate.change_screen import ChangeScreen
from pytest_circuits.gate.check import check
from pytest_circuits.gate.invariants import key_heads
from pytest_circuits.gate.tolerances import Tolerances
from pytest_circuits.record.figures import interval_key, sequences_key
from pytest_circuits.record.looks import KNOCKOUT_KEY
from pytest_circuits.record.schema import Record
from pytest_circuits.run import sensitivity as S
from pytest_circuits.run.looks import with_looks
from pytest_circuits.run.run import Run
from pytest_circuits.settings import build_settings

ROOT = Path(__file__).resolve().parent.parent
PAGE = ROOT / "docs" / "speed.md"
ESTIMATED_EVERY_HEAD = "1e-12"  # > 0: every record gets knockout_atp; a baseline without it clears no head


def with_estimates(baseline: dict, record: dict) -> dict:
    """``baseline`` with each head's ``knockout_atp`` taken from ``record`` (the intact build's)."""
    atp = {row["head"]: row.get("knockout_atp") for row in record["heads"]}
    return {**baseline, "heads": [{**row, "knockout_atp": atp.get(row["head"])} for row in baseline["heads"]]}


def cleared(record: dict, heads: set[str]) -> dict:
    """``record`` without the knockout deltas of ``heads`` (what a screened gate does not measure)."""
    gone = {"knockout_delta": None, sequences_key("knockout_delta"): None, interval_key("knockout_delta"): None}
    rows = [{**row, **gone} if row["head"] in heads else row for row in record["heads"]]
    looks = [
        {**look, KNOCKOUT_KEY: {h: v for h, v in (look.get(KNOCKOUT_KEY) or {}).items() if h not in heads}}
        for look in record.get("looks") or []
    ]
    return {**record, "heads": rows, "looks": looks}


def verdict(baseline: dict, record: dict, tol: Tolerances) -> tuple[list[str], list[str]]:
    """``(failed invariants, failed knockout_deltas heads)`` of ``record`` against ``baseline``."""
    verdicts = check(baseline, record, tol, build_name="build", label="baseline", across=False)
    failed = [r.invariant for r in verdicts.results if r.status == "failed"]
    rows = invariants.get("knockout_deltas").compare(Record.of(baseline), Record.of(record), tol).rows
    return failed, sorted(r.subject for r in rows if r.broken)


def measure(args, model: str, write) -> tuple[list[dict], str]:
    """Per gated build and fraction, one line (dict); and the command's run line."""
    wall = time.perf_counter()
    torch.set_num_threads(args.threads)
    shipped = read_baseline(ROOT / "baselines" / f"{model}--fp32.json")
    raw = {"model": model, "builds": "fp32"}
    settings = build_settings(raw, Path("baselines"), device="cpu", tolerances={"change_screen": ESTIMATED_EVERY_HEAD})
    session = Run(settings, key_heads_of=(Record.of(shipped),))  # no knockout_atp there: every key head exactly
    session.loaded.progress_write = lambda line: None
    tol = Tolerances()
    baseline = shipped
    if len(shipped.get("looks") or []) < int(tol.looks) - 1:
        baseline = {**shipped, "looks": with_looks(session.records, "fp32", Record.of(shipped), tol).data.get("looks")}
    keys = key_heads(baseline, "knockout_delta", tol.top_k, tol.min_delta)
    heads = S.damaged_heads(baseline, tol, args.heads)
    damages = S.head_damages(heads, floats(args.ov), floats(args.qk), floats(args.rotations), floats(args.noise))
    damages += [S.Damage("noise_all", s) for s in floats(args.whole)]
    write(f"{model}: {len(keys)} key heads; damaging {', '.join(heads)} ({len(damages)} damages)")
    outcomes = S.sweep(session, baseline, damages, tol, "fp32", write=write)
    outcomes += gate_recipes(session, baseline, tol, [r for r in args.recipes.split(",") if r], None, write)
    estimated = with_estimates(baseline, outcomes[0].record)  # the intact fp32 build's estimates
    lines = []
    for o in outcomes:
        exact_failed, exact_heads = verdict(estimated, o.record, tol)
        atp = {row["head"]: row.get("knockout_atp") for row in o.record["heads"]}
        for fraction in floats(args.fractions):
            ftol = tol.updated({"change_screen": fraction})
            screen = ChangeScreen.of(lambda: [Record.of(estimated)], lambda r: keys, ftol)
            assert screen is not None
            estimates = {h: float("nan") if atp.get(h) is None else float(atp[h]) for h in keys}
            kept = set(screen.confirm(estimates))
            gone = set(keys) - kept
            failed, failing = verdict(estimated, cleared(o.record, gone), ftol)
            lines.append(
                {
                    "model": model,
                    "build": o.label,
                    "fraction": fraction,
                    "key_heads": len(keys),
                    "cleared": len(gone),
                    "exact_failed": exact_failed,
                    "screened_failed": failed,
                    "exact_heads": exact_heads,
                    "screened_heads": failing,
                    "missed_heads": sorted(set(exact_heads) & gone),
                    "estimated": sum(v is not None for v in atp.values()),
                }
            )
    took = (time.perf_counter() - wall) / 60
    run = (
        f"Measured by `python scripts/measure_change_screen.py {shlex.join(args.argv)}` on {platform.machine()} "
        f"CPU, torch {torch.__version__}, {args.threads} threads: {took:.1f} min wall. {model}: its shipped "
        f"fp32 baseline's {len(keys)} key heads; damaged heads {', '.join(heads)}."
    )
    return lines, run


def table(lines: list[dict]) -> str:
    """The markdown table: per build and fraction, both verdicts, the misses and the saving."""
    out = [
        "| build | f | exact gate fails | screened gate fails | knockout_deltas heads failed (exact) | missed | knockouts cleared on look 1 |",
        "|---|---|---|---|---|---|---|",
    ]
    for line in lines:
        exact = ", ".join(line["exact_failed"]) or "pass"
        screened = ", ".join(line["screened_failed"]) or "pass"
        if line["estimated"] == 0:
            screened += " (no backward: every head exactly)"
        out.append(
            f"| {line['build']} | {line['fraction']:g} | {exact} | {screened} | {', '.join(line['exact_heads']) or '-'} "
            f"| {', '.join(line['missed_heads']) or '0'} | {line['cleared']} of {line['key_heads']} |"
        )
    return "\n".join(out) + "\n"


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="tiny-induction")
    parser.add_argument("--fractions", default="0.1,0.25,0.5", help="screen fractions f of the knockout tolerance")
    parser.add_argument("--heads", type=int, default=2, help="damage the top N key heads")
    parser.add_argument("--ov", default="0.9,0.75,0.5")
    parser.add_argument("--qk", default="0.75,0.5")
    parser.add_argument("--rotations", default="")
    parser.add_argument("--noise", default="")
    parser.add_argument("--whole", default="0.01")
    parser.add_argument("--recipes", default="bf16,fp16,rtn-int8,rtn-int4")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--results", default="", help="also append every line to this JSON-lines file")
    parser.add_argument("--dry-run", action="store_true", help="print the block, leave the page alone")
    args = parser.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    blocks = {}
    for model in args.models.split(","):
        try:
            lines, run = measure(args, model, lambda line: print(line, flush=True))
        except CircuitsError as error:
            raise SystemExit(f"{model}: {error}") from None
        if args.results:
            with open(args.results, "a", encoding="utf-8") as out:
                for line in lines:
                    out.write(json.dumps(line) + "\n")
        blocks[f"change-screen-{model}"] = run + "\n\n" + table(lines)
    if args.dry_run:
        for name, text in blocks.items():
            print(f"--- {name}\n{text}")
    else:
        write_blocks(PAGE, blocks)


if __name__ == "__main__":
    main()
