"""A full default gate's wall and CPU time per build, and its verdicts, on two checkouts of the code
(issue #55, items 2 and 4): ``circuits gate MODEL --build BUILD --baseline MODEL--fp32`` in a fresh
process per gate, each checkout on ``PYTHONPATH``, so "before" is the code as it was, not an emulation.

Each gate's verdict lines (PASS/FAIL per invariant, with its rows) are compared between the two
checkouts: a fast path must give the same verdicts. Rows may differ in their last digits where the
old code rounded a replay by its stack height (`rungs.knockout._replayed_deltas`).

Run: python scripts/measure_gate_speed.py --before /tmp/before --after . --model smollm2-135m
    --builds bf16,rtn-int4 [--results /tmp/gate-speed.jsonl] [--table]
(``git worktree add /tmp/before COMMIT`` makes the old checkout.) Results append to ``--results``
as they finish; ``--table`` prints the markdown table of what it holds.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import subprocess
import sys
import time
from pathlib import Path

VERDICT = re.compile(r"^(PASS|FAIL|SKIP|ERROR) (\w+)")


def gate(checkout: Path, model: str, build: str) -> dict:
    """One gate in a fresh process on ``checkout``: wall, CPU seconds, load, verdicts, output."""
    env = {**os.environ, "PYTHONPATH": str(checkout.resolve()), "HF_HUB_OFFLINE": "1"}
    code = "import sys, pytest_circuits; from pytest_circuits.entry import main; print(pytest_circuits.__file__); sys.exit(main())"
    command = [sys.executable, "-c", code, "gate", model, "--build", build, "--baseline", f"{model}--fp32"]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    load, start = os.getloadavg()[0], time.perf_counter()
    # run in the checkout: ``python -c`` puts the working folder first on sys.path
    done = subprocess.run(command, env=env, cwd=checkout, capture_output=True, text=True, check=False)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    verdicts = [" ".join(VERDICT.match(line).groups()) for line in done.stdout.splitlines() if VERDICT.match(line)]
    source = done.stdout.splitlines()[0] if done.stdout else ""
    if not source.startswith(str(checkout.resolve())):
        raise SystemExit(f"the gate ran {source or 'nothing'}, not {checkout}: {done.stderr[-400:]}")
    said = {"wall": wall, "cpu": cpu, "load": load, "rc": done.returncode, "verdicts": verdicts, "out": done.stdout}
    return said | ({"error": done.stderr[-2000:]} if done.returncode not in (0, 1) else {})


def table(results: list[dict]) -> str:
    lines = [
        "| build | before: wall, CPU | after: wall, CPU | wall speed-up | verdicts (after) | same verdicts | load |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in results:
        b, a = r["before"], r["after"]
        failed = [v.split()[1] for v in a["verdicts"] if v.startswith("FAIL")]
        said = "FAIL " + ", ".join(failed) if failed else "pass"
        if "error" in a or "error" in b:  # the gate itself stopped: no verdict to compare
            said = f"ERROR (rc {b['rc']} / {a['rc']})"
        same = "yes" if a["verdicts"] == b["verdicts"] else "**no**"
        lines.append(
            f"| {r['build']} | {b['wall']:.0f} s, {b['cpu']:.0f} CPU-s | {a['wall']:.0f} s, {a['cpu']:.0f} CPU-s | "
            f"{b['wall'] / a['wall']:.2f}x | {said} | {same} | {b['load']:.1f} / {a['load']:.1f} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", type=Path, required=True, help="the old checkout")
    parser.add_argument("--after", type=Path, default=Path("."), help="the new checkout")
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--builds", default="bf16")
    parser.add_argument("--results", type=Path, default=Path("/tmp/gate-speed.jsonl"))
    parser.add_argument("--table", action="store_true", help="print the table of --results and stop")
    args = parser.parse_args()
    if not args.table:
        for build in args.builds.split(","):
            row = {"model": args.model, "build": build}
            row["before"] = gate(args.before, args.model, build)
            row["after"] = gate(args.after, args.model, build)
            with args.results.open("a") as out:
                out.write(json.dumps(row) + "\n")
            print(table([row]).splitlines()[-1], flush=True)
    rows = [json.loads(line) for line in args.results.read_text().splitlines() if line.strip()]
    by_model: dict[str, list[dict]] = {}
    for row in rows:
        by_model.setdefault(row["model"], []).append(row)
    for model, kept in by_model.items():
        print(f"\n{model} ({os.cpu_count()} CPUs):\n\n{table(kept)}")


if __name__ == "__main__":
    main()
