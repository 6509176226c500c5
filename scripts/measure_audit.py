#!/usr/bin/env python
"""Measure rung 3 (docs/audit.md) of each build of a model on an audit slice, beside the reference's.

Per build: the mean relied drop over the cases the reference relies on (its cited drop, else its drop
for the reference's top chunk; nats), how many keep the reference's top chunk, the mean answer
log-probability per token with every chunk present, the three rung-3 verdicts against the reference
(`gate_all` with the default tolerances, the audit invariants only), and the wall time of the slice
(N + 1 forwards per case). Only rung 3 is measured: each record is the reference's stored scan record
with the build's audit section, so rungs 1-2 never run. Prints a Markdown table.

    python scripts/measure_audit.py --model smollm2-135m --builds fp32,bf16,rtn-int8,rtn-int4,bf16+kv-int4
    python scripts/measure_audit.py --builds fp32,rtn-int8  # the embedded model and its shipped slice
"""

from __future__ import annotations

import argparse
import copy
import os
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def main() -> None:
    from pytest_circuits.gate.audit_invariants import relied_drop
    from pytest_circuits.gate.invariants import gate_all
    from pytest_circuits.gate.tolerances import Tolerances
    from pytest_circuits.record.schema import Record
    from pytest_circuits.record.store import read_record, round_sig, shipped_baselines
    from pytest_circuits.run.measure import measure_audit
    from pytest_circuits.run.run import Run
    from pytest_circuits.rungs.audit_slice import read_slice
    from pytest_circuits.settings import CircuitsSettings

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny-induction")
    parser.add_argument("--builds", default="fp32,rtn-int8")
    parser.add_argument("--audit", default="tiny-induction-audit", help="the slice (default: the shipped example)")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--batch-size", type=int, default=8)
    args = parser.parse_args()

    builds = tuple(args.builds.split(","))
    settings = CircuitsSettings(
        model=args.model,
        builds=builds,
        reference=builds[0],
        device=args.device,
        batch_size=args.batch_size,
        audit=read_slice(args.audit),
    )
    run = Run(settings)
    stored = read_record(shipped_baselines()[f"{args.model}--fp32"]).data  # a valid record of the model
    records, seconds = {}, {}
    for name in builds:
        run.loaded.build(name)
        started = time.perf_counter()
        figures = measure_audit(run.measured, name)
        seconds[name] = time.perf_counter() - started
        records[name] = Record.of({**copy.deepcopy(stored), "audit": round_sig(figures.section())})
    reference = records[builds[0]]
    assert reference.audit is not None
    relied = [c for c in reference.audit.cases if relied_drop(c, c) >= Tolerances().min_reliance]
    print(
        f"slice {reference.audit.slice_name}: {reference.audit.n_cases} cases, {len(relied)} relied on by {builds[0]}"
    )
    print(
        "| build | mean relied drop (nats) | top chunk agrees | answer log-prob / token | verdicts | slice time (s) |"
    )
    print("|---|---|---|---|---|---|")
    for name in builds:
        audit = records[name].audit
        assert audit is not None
        cases = {c.id: c for c in audit.cases}
        drops = [relied_drop(cases[c.id], c) for c in relied]
        agree = sum(cases[c.id].top_chunk == c.top_chunk for c in relied)
        per_token = sum(c.answer_logprob / c.answer_tokens for c in audit.cases) / len(audit.cases)
        results = gate_all(reference, records[name], Tolerances(), name, f"{builds[0]} baseline")
        failed = [r.invariant for r in results if r.status == "failed"]
        verdict = "reference" if name == builds[0] else ("fails " + ", ".join(failed) if failed else "passes")
        mean = sum(drops) / len(drops) if drops else float("nan")
        print(f"| {name} | {mean:.3f} | {agree} of {len(relied)} | {per_token:.3f} | {verdict} | {seconds[name]:.1f} |")


if __name__ == "__main__":
    main()
