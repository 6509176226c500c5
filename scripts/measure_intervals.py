#!/usr/bin/env python
"""Verdicts of every build under the plain tolerance and under "larger than X and outside the interval".

Scans fp32 and each build live, with the probe and knockout settings the shipped baselines were
recorded with (probe seed 0, n 8, L 64; knockouts zero ablation, seed 1, n 8, L 64), so that
every record holds per-sequence figures (the shipped SmolLM2 baselines predate them). Per build
it prints the change against fp32 of copy loss and copy gain with its 95% paired interval, the
knockout delta changes of fp32's key heads (delta >= min_delta) and the copy_loss and
knockout_deltas verdicts with ``outside_interval`` off (the plain tolerance) and on (default).

Knockouts run exactly on fp32's key heads only (the heads knockout_deltas compares; a screen
would only add others), read from the shipped fp32 baseline; ``--no-knockout`` skips them.
Records are cached under ``--records`` (a rerun only prints), so builds can be added one by one.

    python scripts/measure_intervals.py --model smollm2-135m --builds rtn-int8,bnb-int8
"""

from __future__ import annotations

import argparse
import json
from dataclasses import replace
from pathlib import Path

from pytest_circuits.gate.invariants import evaluate, key_heads
from pytest_circuits.gate.tolerances import Tolerances
from pytest_circuits.record import figures
from pytest_circuits.record.store import dumps, read_baseline
from pytest_circuits.run.assemble import sampled_model_figures
from pytest_circuits.run.run import Run
from pytest_circuits.settings import CircuitsSettings, RepeatSettings

INVARIANTS = ("copy_loss", "knockout_deltas")


def sampled_record(session: Run, build_name: str, heads: list[str] | None) -> dict:
    """The figures copy_loss and knockout_deltas read: model figures with their per-sequence
    values, and the knockout deltas of ``heads`` with theirs (no kappa: not needed here)."""
    probe = session.measured.repeat_probe(build_name)
    record: dict = {**probe.model_figures(), **sampled_model_figures(probe), "probe": session.settings.probe.as_dict()}
    record["heads"] = [{"head": h} for h in probe.heads["head"]]
    if heads:
        frame = session.measured.head_knockout(build_name, heads=heads)
        record["knockout"] = {**session.settings.knockout_probe.as_dict(), "mode": session.settings.knockout_mode}
        sequences = figures.sequences_key("knockout_delta")
        by_head = {row["head"]: row for _, row in frame.iterrows()}
        for row in record["heads"]:
            ko = by_head[row["head"]]
            measured = isinstance(ko[sequences], list)
            row["knockout_delta"] = float(ko["knockout_delta"]) if measured else None
            row[sequences] = ko[sequences] if measured else None
    return record


def cached(path: Path, compute) -> dict:
    if path.is_file():
        return json.loads(path.read_text())
    record = compute()
    path.write_text(dumps(record))
    return json.loads(path.read_text())


def change(before: dict, after: dict, name: str) -> str:
    from pytest_circuits.gate.stats import paired_interval

    key = figures.sequences_key(name)
    d = after[name] - before[name]
    interval = paired_interval(before[key], after[key])
    return f"{d:+.3f} [{interval[0]:+.3f}, {interval[1]:+.3f}]" if interval else f"{d:+.3f}"


def verdict(before: dict, after: dict, name: str, tol: Tolerances, build_name: str) -> str:
    result = evaluate(name, before, after, tol, build_name, "fp32 scan")
    if result.status != "failed":
        return result.status
    return "FAIL " + "; ".join(f"{m['head']} {m['metric']}" for m in result.moved if m["broken"])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--builds", default="bf16,fp16,rtn-int8,bnb-int8,bnb-nf4,bnb-fp4,rtn-int4")
    p.add_argument("--baseline", default=None, help="fp32 baseline whose settings and key heads to use")
    p.add_argument("--records", default="/tmp/pytest-circuits-intervals", help="where the live records are cached")
    p.add_argument("--no-knockout", action="store_true")
    p.add_argument(
        "--skip-selfcheck",
        action="store_true",
        help="load builds without the per-head weight self-check (it guards the weight read of rung 1, "
        "which nothing here uses; copy losses and knockouts run the model's own forward)",
    )
    args = p.parse_args()
    if args.skip_selfcheck:
        import pytest_circuits.model.builds as builds

        builds.check_decomposition = lambda build: None  # type: ignore[assignment]
    shipped = read_baseline(Path(args.baseline or f"baselines/{args.model}--fp32.json"))
    probe = RepeatSettings(**{k: shipped["probe"][k] for k in ("seed", "n", "L")})
    ko = shipped.get("knockout") or {}
    settings = CircuitsSettings(model=args.model, device="cpu", probe=probe)
    settings = replace(settings, knockout_seed=ko.get("seed", 1), knockout_mode=ko.get("mode", "zero"))
    session = Run(settings)
    tol = Tolerances()
    heads = None if args.no_knockout else key_heads(shipped, "knockout_delta", tol.top_k, tol.min_delta)
    out = Path(args.records)
    out.mkdir(parents=True, exist_ok=True)
    tag = "ko" if heads else "probe"
    reference = cached(out / f"{args.model}--fp32--{tag}.json", lambda: sampled_record(session, "fp32", heads))
    print(
        f"model {args.model}, probe {probe.as_dict()}, knockout {ko.get('mode')} seed {ko.get('seed')}; "
        f"fp32 copy loss {reference['copy_loss']:.3f} {_interval(reference, 'copy_loss')}, "
        f"gain {reference['copy_gain']:.3f} {_interval(reference, 'copy_gain')}"
    )
    builds = [b for b in args.builds.split(",") if b]
    records = {
        r: cached(out / f"{args.model}--{r}--{tag}.json", lambda r=r: sampled_record(session, r, heads)) for r in builds
    }
    plain, rule = tol.updated({"outside_interval": False}), tol
    print(
        "build | d copy loss [95% paired] | d copy gain [95% paired] | "
        + " | ".join(f"{n} plain | {n} outside-interval" for n in INVARIANTS if heads or n == "copy_loss")
    )
    for recipe, after in records.items():
        cells = [change(reference, after, "copy_loss"), change(reference, after, "copy_gain")]
        for name in INVARIANTS:
            if name == "knockout_deltas" and not heads:
                continue
            cells += [verdict(reference, after, name, plain, recipe), verdict(reference, after, name, rule, recipe)]
        print(f"{recipe} | " + " | ".join(cells), flush=True)
        if heads:
            for name in heads:
                b = next(h for h in reference["heads"] if h["head"] == name)
                a = next(h for h in after["heads"] if h["head"] == name)
                print(
                    f"    {name} knockout_delta {b['knockout_delta']:+.3f} -> {a['knockout_delta']:+.3f}: "
                    + _head_change(b, a)
                )


def _interval(record: dict, name: str) -> str:
    low, high = record[figures.interval_key(name)]
    return f"[{low:.3f}, {high:.3f}]"


def _head_change(b: dict, a: dict) -> str:
    from pytest_circuits.gate.stats import paired_interval

    key = figures.sequences_key("knockout_delta")
    interval = paired_interval(b[key], a[key])
    d = a["knockout_delta"] - b["knockout_delta"]
    return f"{d:+.3f} [{interval[0]:+.3f}, {interval[1]:+.3f}]" if interval else f"{d:+.3f}"


if __name__ == "__main__":
    main()
