"""A full default gate's wall and CPU time per build, and its verdicts, on one checkout of the code or
two (issue #55, items 2 and 4): ``circuits gate MODEL --build BUILD --baseline MODEL--fp32`` in a fresh
process per gate, each checkout on ``PYTHONPATH``, so "before" is the code as it was, not an emulation.

Each gate's verdict lines (PASS/FAIL per invariant, with its rows) are compared between the two
checkouts: a fast path must give the same verdicts. Rows may differ in their last digits where the
old code rounded a replay by its stack height (`rungs.knockout._replayed_deltas`).

Run: python scripts/measure_gate_speed.py --before /tmp/before --after . --model smollm2-135m
    --builds bf16,rtn-int4 [--results /tmp/gate-speed.jsonl] [--table]
(``git worktree add /tmp/before COMMIT`` makes the old checkout.) Results append to ``--results``
as they finish; ``--table`` prints the markdown table of what it holds. Without ``--before`` each
build is gated once, on ``--after``; ``--write-docs`` then writes the table of every recipe into
docs/scale.md, between the markers that name the same ``--results`` file (a table per machine; each
row records the CPU, `cpu_said`):

    python scripts/measure_gate_speed.py --builds all --results gate-recipes.jsonl --write-docs
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

from measure_sizes import write_block  # docs/scale.md's measured blocks

VERDICT = re.compile(r"^(PASS|FAIL|SKIP|ERROR) (\w+)")
END = "<!-- measured: end -->"
ROOT = Path(__file__).resolve().parent.parent


def begin_marker(results: Path) -> str:
    """The marker that opens the docs/scale.md block of the gates in ``results`` (one block per file: a
    table per machine)."""
    return f"<!-- measured: begin (scripts/measure_gate_speed.py --results {results}) -->"


def cpu_said() -> str:
    """This CPU as a table says it: its model name, torch's capability and whether oneDNN multiplies
    bfloat16 natively (else a bf16 or fp16 build's products run as float32 GEMMs, `model.half_products`)."""
    import platform

    import torch

    from pytest_circuits.model.half_products import native_half_products

    names = [line.split(":", 1)[1].strip() for line in _cpuinfo() if line.startswith("model name")]
    name = names[0] if names else platform.processor() or platform.machine()
    kernels = "bfloat16 kernels" if native_half_products(torch.bfloat16) else "no bfloat16 kernels"
    return f"{name}, {torch.backends.cpu.get_cpu_capability()}, {kernels}"


def _cpuinfo() -> list[str]:
    try:
        return Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return []


# the child's own peak RSS (ru_maxrss of RUSAGE_CHILDREN is the largest child's so far, not this one's)
CHILD = (
    "import atexit, resource, sys, pytest_circuits; from pytest_circuits.entry import main; "
    "print(pytest_circuits.__file__); "
    "atexit.register(lambda: print(f'peak_rss_kb {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss}', file=sys.stderr)); "
    "sys.exit(main())"
)


def gate(checkout: Path, model: str, build: str) -> dict:
    """One gate in a fresh process on ``checkout``: wall, CPU seconds, load, verdicts, output."""
    env = {**os.environ, "PYTHONPATH": str(checkout.resolve()), "HF_HUB_OFFLINE": "1"}
    command = [sys.executable, "-c", CHILD, "gate", model, "--build", build, "--baseline", f"{model}--fp32"]
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
    peak = re.search(r"peak_rss_kb (\d+)", done.stderr)
    said = {"wall": wall, "cpu": cpu, "load": load, "rc": done.returncode, "verdicts": verdicts, "out": done.stdout}
    said["peak_gb"] = int(peak.group(1)) * 1024 / 1e9 if peak else None
    return said | ({"error": done.stderr[-2000:]} if done.returncode not in (0, 1) else {})


def verdict_words(gated: dict) -> str:
    """``pass``, or ``FAIL`` and the invariants that failed, of one gate's verdict lines."""
    failed = [v.split()[1] for v in gated["verdicts"] if v.startswith("FAIL")]
    return "FAIL " + ", ".join(failed) if failed else "pass"


def table(results: list[dict]) -> str:
    lines = [
        "| build | before: wall, CPU | after: wall, CPU | wall speed-up | verdicts (after) | same verdicts | load |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in results:
        b, a = r["before"], r["after"]
        said = verdict_words(a)
        if "error" in a or "error" in b:  # the gate itself stopped: no verdict to compare
            said = f"ERROR (rc {b['rc']} / {a['rc']})"
        same = "yes" if a["verdicts"] == b["verdicts"] else "**no**"
        lines.append(
            f"| {r['build']} | {b['wall']:.0f} s, {b['cpu']:.0f} CPU-s | {a['wall']:.0f} s, {a['cpu']:.0f} CPU-s | "
            f"{b['wall'] / a['wall']:.2f}x | {said} | {same} | {b['load']:.1f} / {a['load']:.1f} |"
        )
    return "\n".join(lines)


def most_sequences(out: str) -> int:
    """The most sequences any row of a gate's output was decided on (``decided on 8-32 sequences``):
    how many looks the gate drew (8 a look)."""
    said = re.findall(r"decided on (\d+)(?:-(\d+))? sequences", out)
    return max((int(b or a) for a, b in said), default=0)


def one_checkout_table(results: list[dict]) -> str:
    """The gates of one checkout: wall, CPU, peak RSS, the most sequences a row drew, verdicts, load
    as each gate started."""
    lines = [
        "| build | wall | CPU | peak RSS | sequences (most a row drew) | verdicts | load |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in results:
        a = r["after"]
        said = f"ERROR (rc {a['rc']})" if "error" in a else verdict_words(a)
        peak = f"{a['peak_gb']:.2f} GB" if a.get("peak_gb") else "-"
        lines.append(
            f"| {r['build']} | {a['wall']:.0f} s | {a['cpu']:.0f} CPU-s | {peak} | {most_sequences(a['out'])} | {said} | "
            f"{a['load']:.1f} |"
        )
    return "\n".join(lines)


def every_recipe(model: str) -> list[str]:
    """The recipes shipped with a baseline of ``model``, less fp32 (the baseline they are gated against)."""
    from pytest_circuits.model.recipes import RECIPES
    from pytest_circuits.record.store import shipped_baselines

    shipped = shipped_baselines()
    return [name for name in RECIPES if name != "fp32" and f"{model}--{name}" in shipped]


def torch_threads() -> int:
    """The threads a gate's torch uses here: ``OMP_NUM_THREADS`` when set, else every core."""
    return int(os.environ.get("OMP_NUM_THREADS") or os.cpu_count() or 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", type=Path, default=None, help="the old checkout (none: gate --after alone)")
    parser.add_argument("--after", type=Path, default=Path("."), help="the new checkout")
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--builds", default="bf16", help="comma list, or all: every recipe with a shipped baseline")
    parser.add_argument("--results", type=Path, default=Path("/tmp/gate-speed.jsonl"))
    parser.add_argument("--table", action="store_true", help="print the table of --results and stop")
    parser.add_argument("--write-docs", action="store_true", help="write the one-checkout table into docs/scale.md")
    args = parser.parse_args()
    builds = every_recipe(args.model) if args.builds == "all" else args.builds.split(",")
    if not args.table:
        for build in builds:
            row = {"model": args.model, "build": build, "threads": torch_threads(), "cpu": cpu_said()}
            if args.before is not None:
                row["before"] = gate(args.before, args.model, build)
            row["after"] = gate(args.after, args.model, build)
            with args.results.open("a") as out:
                out.write(json.dumps(row) + "\n")
            shown = table if args.before is not None else one_checkout_table
            print(shown([row]).splitlines()[-1], flush=True)
    rows = [json.loads(line) for line in args.results.read_text().splitlines() if line.strip()]
    by_model: dict[str, list[dict]] = {}
    for row in rows:
        by_model.setdefault(row["model"], []).append(row)
    for model, kept in by_model.items():
        compared = [r for r in kept if "before" in r]
        alone = [r for r in kept if "before" not in r]
        for shown, these in ((table, compared), (one_checkout_table, alone)):
            if these:
                print(f"\n{model} ({os.cpu_count()} CPUs):\n\n{shown(these)}")
    if args.write_docs:
        latest = {r["build"]: r for r in rows if "before" not in r and r["model"] == args.model}  # a rerun replaces
        alone = [latest[b] for b in every_recipe(args.model) if b in latest]
        wall = sum(r["after"]["wall"] for r in alone)
        cpus = sorted({r.get("cpu", "a CPU not recorded") for r in alone})
        note = (
            f"`python scripts/measure_gate_speed.py --model {args.model} --builds all --results {args.results} --write-docs`"
            f" ({time.strftime('%Y-%m-%d')}; {'; '.join(cpus)}; {os.cpu_count()} cores, "
            f"{alone[0]['threads'] if alone else '?'} torch threads; one gate at a time, each against `{args.model}--fp32` in a fresh process; the load is the "
            f"1-minute load as each gate started, the previous gate's own; {len(alone)} gates, {wall / 60:.0f} min "
            "in all):"
        )
        begin = begin_marker(args.results)
        if begin not in (ROOT / "docs" / "scale.md").read_text():
            raise SystemExit(
                f"docs/scale.md has no block for {args.results}: add the lines {begin} and {END} where it goes"
            )
        write_block(begin, END, note, one_checkout_table(alone))


if __name__ == "__main__":
    main()
