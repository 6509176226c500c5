#!/usr/bin/env python
"""Measure what the gate catches and how often it cries wolf; write the blocks of docs/sensitivity.md.

Per model (the fp32 build, its shipped fp32 baseline, the default tolerances):

1. graded damage to each of the baseline's key heads, one at a time (`pytest_circuits.run.sensitivity`:
   OV scaled / negated, QK logits scaled, OV rotated into the next head, noise in the head's
   layer), whole-model noise and low-rank updates, and the recipes' builds, each gated with the
   gate's own code (`sensitivity.gate_record`: `records.measure_record` measured the baseline's way, then
   `gate_all`), beside the held-out text loss of `measure_formats.held_out_loss`;
2. false alarms: for each held-out probe seed (knockout seed 1000 + seed), an fp32 baseline is
   recorded at 1 thread and the benign builds are gated against it: fp32 at 2 threads, bf16, fp16,
   rtn-int8 and fp32 with 1e-3 relative weight noise; per invariant the failures, with the
   Clopper-Pearson 95% interval of the rate;
3. GGUF builds (``--gguf``): the model written at each GGML type the installed ``gguf`` package
   quantizes (`model.gguf_quant.cached_gguf`, every 2-D weight at that type), each loaded as an
   external build the way a user gives ``NAME=FILE.gguf`` and gated like a recipe (block
   ``MODEL-gguf``).

``--trials FILE`` keeps each false-alarm trial and each gated damage's verdicts (under both rules)
as it is measured, and ``--kept FILE,...`` counts kept ones beside this run's: a long sweep split over
processes (seed ranges, a damage grid) is tabled by one later run that measures nothing
(``--seeds 0`` and no damages).

Each model rewrites only its own blocks (``<!-- measured: NAME -->``), so models can be run apart;
``--tag T`` writes ``MODEL-T-...`` blocks instead, so a second grid of one model (SmolLM2 with its
knockouts) stands beside the first:

    python scripts/measure_sensitivity.py --models tiny-induction
    python scripts/measure_sensitivity.py --models smollm2-135m --heads 2 --ov 0.75,0.5,0,-1 --qk 0.5,0 \\
        --rotations '' --noise '' --whole '' --recipes rtn-int8 --seeds 0
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shlex
import time
from dataclasses import replace
from pathlib import Path

import torch
from measure_formats import held_out_loss, write_blocks
from scipy.stats import binomtest

from pytest_circuits.errors import CircuitsError
from pytest_circuits.gate.invariants import gate_all, get, key_heads, per_build_invariants
from pytest_circuits.gate.tolerances import Tolerances
from pytest_circuits.model.gguf_quant import cached_gguf
from pytest_circuits.record.looks import SEQUENTIAL
from pytest_circuits.record.read import has_figures
from pytest_circuits.record.schema import Record
from pytest_circuits.record.store import read_baseline
from pytest_circuits.run import sensitivity as S
from pytest_circuits.run.looks import with_looks
from pytest_circuits.run.run import Run
from pytest_circuits.settings import build_settings

ROOT = Path(__file__).resolve().parent.parent
PAGE = ROOT / "docs" / "sensitivity.md"
BENIGN_RECIPES = ("bf16", "fp16", "rtn-int8")
KNOCKOUT_SEED_OFFSET = 1000
FIXED = Tolerances().updated({"looks": 1})  # today's fixed rule, measured beside the sequential default


def floats(text: str) -> tuple[float, ...]:
    return tuple(float(x) for x in text.split(",") if x.strip())


def cell(value, spec="{:.3f}") -> str:
    return "n/a" if value is None else spec.format(value)


def verdict_cell(outcome: S.Outcome) -> str:
    if outcome.failed or outcome.empty:
        return outcome.verdict()
    return "pass" if outcome.passed else "nothing compared"


def outcome_rows(outcomes: list[S.Outcome], baseline: dict, tol) -> list[str]:
    lines = [
        "| damage | gate (default tolerances) | most of a tolerance used | copy loss | first-copy loss "
        "| held-out text loss | s |",
        "|---|---|---|---|---|---|---|",
    ]
    for o in outcomes:
        used = tolerance_used(baseline, o.record, tol)
        name = max(used, key=lambda k: used[k]) if used else ""
        shown = f"{used[name]:.2f} (`{name}`)" if name else "n/a"
        lines.append(
            f"| {o.label} | {verdict_cell(o)} | {shown} | {o.copy_loss:.3f} | {o.first_copy_loss:.3f} "
            f"| {cell(o.text_loss)} | {o.seconds:.1f} |"
        )
    return lines


def gate_recipes(session, baseline, tol, recipes, text_loss, write, knockout=True) -> list[S.Outcome]:
    """Each recipe's build gated against the fp32 baseline (a build that cannot load here: said)."""
    out = []
    for recipe in recipes:
        try:
            o = S.gate_outcome(
                session, recipe, baseline, tol, label=f"build {recipe}", text_loss=text_loss, knockout=knockout
            )
        except (CircuitsError, RuntimeError, ImportError) as error:
            write(f"build {recipe}: not run ({str(error).splitlines()[0]})")
            continue
        out.append(o)
        write(f"build {recipe}: {verdict_cell(o)} ({o.seconds:.1f} s)")
    return out


def tolerance_used(baseline: dict, record: dict, tol) -> dict[str, float]:
    """Per invariant: the largest share of its tolerance a compared row used, ``|after - before| / limit``
    (the rank row: ``(1 - rho) / (1 - rank)``); how close a passing build came to failing."""
    baseline, record = Record.of(baseline), Record.of(record)  # the invariants compare typed records
    used = {}
    for name in per_build_invariants():
        inv = get(name)
        if not all(has_figures(record, need) and has_figures(baseline, need) for need in inv.needs):
            continue
        shares = []
        for row in inv.compare(baseline, record, tol).rows:
            if row.metric == "rank corr":
                shares.append((1 - row.after) / (1 - row.limit))
            elif row.limit > 0:  # a sampled row: the mean change over the sequences that decided it
                change = (row.interval[0] + row.interval[1]) / 2 if row.interval else row.after - row.before
                shares.append(abs(change) / row.limit)
        used[name] = max(shares, default=0.0)
    return used


def rule_figures(baseline: dict, record: dict, tol, build_name: str) -> dict:
    """``{"fixed": {invariant: status under the fixed rule}, "sequences": {invariant: the most
    sequences that decided one of its rows under ``tol``'s sequential rule}}`` of a gated record."""
    fixed = {r.invariant: r.status for r in gate_all(baseline, record, FIXED, build_name, "baseline")}
    baseline, record = Record.of(baseline), Record.of(record)
    sequences = {}
    for name in SEQUENTIAL:
        inv = get(name)
        if all(has_figures(record, need) and has_figures(baseline, need) for need in inv.needs):
            counts = [r.sequences for r in inv.compare(baseline, record, tol).rows if r.sequences]
            if counts:
                sequences[name] = max(counts)
    return {"fixed": fixed, "sequences": sequences}


def false_alarms(session, tol, seeds, recipes, write, knockout: bool = True, keep=lambda trial: None) -> list[dict]:
    """One trial per seed x benign build: ``{"seed", "build", "status": {invariant: status},
    "used": {invariant: share of its tolerance}}``, each handed to ``keep`` as soon as it is gated (so
    a split or stopped run keeps what it measured); ``knockout=False``: no knockouts
    (``knockout_deltas`` not run)."""
    trials = []
    model = session.loaded.build("fp32").model
    restorer = S.Restorer(model)
    for seed in seeds:
        S.with_seeds(session, seed, KNOCKOUT_SEED_OFFSET + seed)
        torch.set_num_threads(1)
        baseline = with_looks(session.records, "fp32", session.records.record("fp32", knockout=knockout), tol).data

        def gated(name, build_name="fp32", threads=1, seed=seed, baseline=baseline):
            torch.set_num_threads(threads)
            results, record = S.gate_record(session, build_name, baseline, tol, knockout)
            torch.set_num_threads(1)
            rules = rule_figures(baseline, record, tol, build_name)
            trial = {
                "seed": seed,
                "build": name,
                "status": {r.invariant: r.status for r in results},
                "used": tolerance_used(baseline, record, tol),
                "fixed_status": rules["fixed"],
                "fixed_used": tolerance_used(baseline, record, FIXED),
                "sequences": rules["sequences"],
            }
            trials.append(trial)
            keep(trial)
            write(f"seed {seed} {name}: {trial_said(trial)}")

        gated("fp32, 2 threads", threads=2)
        for recipe in recipes:
            gated(recipe, recipe)
        try:
            S.Damage("noise_all", 1e-3, seed=seed).apply(model)
            gated("noise 1e-3")
        finally:
            restorer.restore()
        session.loaded.forget_figures()
    return trials


def trial_said(trial: dict) -> str:
    failed = [name for name, status in trial["status"].items() if status == "failed"]
    return "FAIL " + ", ".join(failed) if failed else "pass"


def tally(trials: list[dict]) -> tuple[dict, list[str], dict]:
    """``({invariant: (failures, trials)}, one table row per trial, {invariant: largest share of its
    tolerance used})``; an invariant counts a trial only where it passed or failed (not skipped)."""
    counts = {i: [0, 0] for i in (*per_build_invariants(), "gate")}
    most: dict[str, float] = {}
    lines = []
    for trial in sorted(trials, key=lambda t: t["seed"]):
        for inv, share in trial["used"].items():
            most[inv] = max(most.get(inv, 0.0), share)
        for inv, status in trial["status"].items():
            if status in ("passed", "failed"):
                counts[inv][1] += 1
                counts[inv][0] += status == "failed"
        counts["gate"][1] += 1
        counts["gate"][0] += "failed" in trial["status"].values()
        lines.append(f"| {trial['seed']} | {trial['build']} | {trial_said(trial)} | {margins_said(trial)} |")
    return {k: tuple(v) for k, v in counts.items()}, lines, most


TRIALS_HEADER = [
    "| seed | build | gate | sampled invariants: most of a tolerance used, fixed / sequential rule (sequences) |",
    "|---|---|---|---|",
]


def margins_said(trial: dict) -> str:
    """``"copy_loss 0.41 / 0.41 (8); knockout_deltas 0.88 / 0.79 (24)"``: how near each sampled
    invariant came to its tolerance under the two rules, with the sequences that decided it."""
    said = []
    for name in SEQUENTIAL:
        if name not in trial.get("used", {}):
            continue
        fixed = trial.get("fixed_used", {}).get(name)
        n = trial.get("sequences", {}).get(name)
        said.append(
            f"{name} {'n/a' if fixed is None else f'{fixed:.2f}'} / {trial['used'][name]:.2f}"
            + (f" ({n})" if n else "")
        )
    return "; ".join(said)


def shown_command(command: str) -> str:
    """``command`` with each ``--trials PATH`` and ``--kept PATHS`` cut to the files' names."""
    return re.sub(
        r"(--trials|--kept)(\s+|=)(\S+)",
        lambda m: m.group(1) + m.group(2) + ",".join(Path(p).name for p in m.group(3).split(",")),
        command,
    )


def seeds_folded(command: str) -> str:
    """`shown_command` with its seed range as ``A-B`` and its ``--trials`` file as ``FILE``: the runs of
    one sweep split over processes (one seed range each) read as the one command they are."""
    command = re.sub(r"--seeds(\s+|=)\S+", r"--seeds\1A-B", shown_command(command))
    return re.sub(r"--trials(\s+|=)\S+", r"--trials\1FILE", command)


def trials_said(trials: list[dict], command: str) -> str:
    """Which commands measured the trials (a trial kept without one: this run's), over which seeds;
    runs that differ only in their seed range and ``--trials`` file are one command, ``--seeds A-B``."""
    # a --trials file by its name: the page names no machine's folders
    commands = list(dict.fromkeys(seeds_folded(t.get("command", command)) for t in trials))
    seeds = sorted({t["seed"] for t in trials})
    builds = list(dict.fromkeys(t["build"] for t in trials))
    return (
        f"Trials measured by {' and '.join(f'`{c}`' for c in commands)}: {len(seeds)} held-out probe seeds "
        f"({', '.join(map(str, seeds))}) x {len(builds)} benign builds ({'; '.join(builds)}), "
        f"{len(trials)} trials, each gated against an fp32 record of its seed made at 1 thread."
    )


def read_kept(paths: str) -> tuple[list[dict], list[tuple[S.Outcome, dict]]]:
    """``(trials, judged)`` kept by earlier runs' ``--trials FILE`` (JSON lines), comma-separated files:
    the false-alarm trials, and the gated damages and builds (`verdict_line`) as ``(outcome, rules)``
    for the side-by-side table (their outcomes carry verdicts only, no figures)."""
    lines = []
    for path in filter(None, (p.strip() for p in paths.split(","))):
        try:
            text = Path(path).read_text(encoding="utf-8")
        except OSError as error:
            raise SystemExit(
                f"{path}: cannot read the kept trials ({error.strerror}); give a file --trials wrote"
            ) from None
        lines += [json.loads(line) for line in text.splitlines() if line.strip()]
    trials = [t for t in lines if "label" not in t]
    judged = [kept_verdict(v) for v in lines if "label" in v]
    seen = [(t["seed"], t["build"]) for t in trials] + [(None, o.label) for o, _ in judged]
    if len(seen) != len(set(seen)):
        raise SystemExit(f"{paths}: a trial or a damage is kept twice; give each run's --trials file once")
    return trials, judged


def verdict_line(outcome: S.Outcome, rules: dict) -> dict:
    """A gated damage or build as ``--trials`` keeps it: its verdict under the sequential rule
    (``failed``, ``passed``), under the fixed rule (``fixed``) and the sequences that decided it."""
    damage = outcome.damage
    return {
        "label": outcome.label,
        "damage": None
        if damage is None
        else {"kind": damage.kind, "strength": damage.strength, "head": damage.head, "seed": damage.seed},
        "failed": outcome.failed,
        "passed": outcome.passed,
        "fixed": rules["fixed"],
        "sequences": rules["sequences"],
    }


def kept_verdict(line: dict) -> tuple[S.Outcome, dict]:
    """`verdict_line` read back: an outcome with its verdicts (no figures) and its rules."""
    damage = S.Damage(**line["damage"]) if line["damage"] else None
    nan = float("nan")
    outcome = S.Outcome(damage, line["label"], line["failed"], line["passed"], nan, nan, nan)
    return outcome, {"fixed": line["fixed"], "sequences": line["sequences"], "command": line.get("command")}


def seed_range(text: str) -> range:
    """``N``: seeds 1..N (0: none); ``A-B``: seeds A..B, so one sweep of trials can be split over processes."""
    first, _, last = text.partition("-")
    try:
        return range(int(first), int(last) + 1) if last else range(1, int(first) + 1)
    except ValueError:
        raise SystemExit(f"--seeds {text}: give a count N (seeds 1..N) or a range A-B") from None


def share(k: int, n: int) -> str:
    """``"0 / 50 [0.000, 0.071]"``: a count of trials with its Clopper-Pearson 95% interval."""
    if n == 0:
        return "0 / 0"
    ci = binomtest(k, n).proportion_ci(confidence_level=0.95, method="exact")
    return f"{k} / {n} [{ci.low:.3f}, {ci.high:.3f}]"


def mean_of(values) -> str:
    values = list(values)
    return f"{sum(values) / len(values):.1f}" if values else "n/a"


def rules_rows(trials: list[dict], outcomes: list, rules: list[dict]) -> list[str]:
    """The fixed and the sequential rule side by side, per sampled invariant and for the whole gate:
    false alarms over the benign trials with the most of a tolerance used (the fixed rule's on look 1,
    the sequential rule's on the look that decided), the sequences used, and the damages caught."""
    kept = [t for t in trials if "fixed_status" in t]
    damaged = [(o, r) for o, r in zip(outcomes, rules) if o.damage is not None]
    header = (
        "| invariant | false alarms, fixed rule | false alarms, sequential rule | most of a tolerance used, "
        "fixed / sequential | benign: mean sequences (sequential) |"
    )
    lines = [  # a run of trials alone caught no damage: no damage columns
        header + (" damages caught, fixed / sequential | damages: mean sequences (sequential) |" if damaged else ""),
        "|---|---|---|---|---|" + ("---|---|" if damaged else ""),
    ]
    for name in (*SEQUENTIAL, "gate"):

        def failed(status: dict, name=name) -> bool:
            return "failed" in status.values() if name == "gate" else status.get(name) == "failed"

        def counted(status: dict, name=name) -> bool:
            return bool(status) if name == "gate" else status.get(name) in ("passed", "failed")

        fixed = [failed(t["fixed_status"]) for t in kept if counted(t["fixed_status"])]
        seq = [failed(t["status"]) for t in kept if counted(t["status"])]

        def used(key: str, name=name) -> str:
            shares = [v for t in kept for k, v in t.get(key, {}).items() if name in ("gate", k)]
            return f"{max(shares):.2f}" if shares else "n/a"

        def sequences(per: dict, name=name):
            return max(per.values(), default=None) if name == "gate" else per.get(name)

        benign = [n for t in kept if (n := sequences(t.get("sequences", {}))) is not None]
        caught_fixed = sum(
            any(v == "failed" for v in r["fixed"].values()) if name == "gate" else r["fixed"].get(name) == "failed"
            for _, r in damaged
        )
        caught_seq = sum(bool(o.failed) if name == "gate" else name in o.failed for o, _ in damaged)
        damage_n = [n for _, r in damaged if (n := sequences(r["sequences"])) is not None]
        shown = "the whole gate" if name == "gate" else f"`{name}`"
        lines.append(
            f"| {shown} | {share(sum(fixed), len(fixed))} | {share(sum(seq), len(seq))} "
            f"| {used('fixed_used')} / {used('used')} | {mean_of(benign)} |"
            + (f" {caught_fixed} / {caught_seq} of {len(damaged)} | {mean_of(damage_n)} |" if damaged else "")
        )
    return lines


def differing_rows(outcomes: list, rules: list[dict]) -> list[str]:
    """The damages and builds whose verdict the two rules differ on, with the sequences used."""
    lines = ["| damage | fixed rule | sequential rule | sequences (sequential) |", "|---|---|---|---|"]
    for o, r in zip(outcomes, rules):
        fixed = sorted(k for k, v in r["fixed"].items() if v == "failed")
        if fixed != sorted(o.failed):
            counts = ", ".join(f"`{k}` {v}" for k, v in r["sequences"].items())
            lines.append(
                f"| {o.label} | {'FAIL ' + ', '.join(fixed) if fixed else 'pass'} | {verdict_cell(o)} | {counts} |"
            )
    return lines if len(lines) > 2 else lines + ["| (none: both rules give every verdict alike) | | | |"]


def rate_rows(counts: dict, most: dict) -> list[str]:
    lines = [
        "| invariant | false alarms / trials | rate | 95% interval (Clopper-Pearson) | most of its tolerance used |",
        "|---|---|---|---|---|",
    ]
    for name, (k, n) in counts.items():
        shown = f"`{name}`" if name != "gate" else "the whole gate"
        used = f"{most[name]:.2f}" if name in most else ""
        if n == 0:
            lines.append(f"| {shown} | 0 / 0 | n/a | n/a | {used} |")
            continue
        ci = binomtest(k, n).proportion_ci(confidence_level=0.95, method="exact")
        lines.append(f"| {shown} | {k} / {n} | {k / n:.3f} | [{ci.low:.3f}, {ci.high:.3f}] | {used} |")
    return lines


def measure(args, model: str, write) -> dict[str, str]:
    """The blocks of one model: ``{block name: text}``."""
    wall, cpu = time.perf_counter(), time.process_time()
    torch.set_num_threads(1)
    ggufs = {f"gguf-{t.lower()}": t for t in args.gguf.split(",") if t.strip()}
    files = {name: cached_gguf(model, t) for name, t in ggufs.items()}
    raw = {"model": model, "builds": ",".join(["fp32", *(f"{name}={path}" for name, path in files.items())])}
    session = Run(build_settings(raw, Path("baselines"), device="cpu"))
    session.loaded.progress_write = lambda line: None
    tol = Tolerances()
    # every look of the sequential rule: the shipped file's (`circuits record` stored them from the
    # intact fp32 build), measured only where it lacks them, and then without knockouts under --no-knockout
    shipped = read_baseline(ROOT / "baselines" / f"{model}--fp32.json")
    baseline = shipped
    if len(shipped.get("looks") or []) < int(tol.looks) - 1:
        probed = {**shipped, "knockout": None} if args.no_knockout else shipped  # no key heads: the probe's looks
        baseline = {**shipped, "looks": with_looks(session.records, "fp32", Record.of(probed), tol).data.get("looks")}
    keys = key_heads(baseline, "knockout_delta", tol.top_k, tol.min_delta)
    heads = S.damaged_heads(baseline, tol, args.heads if args.heads else len(keys))

    def text_loss(sess, build_name):
        return held_out_loss(sess, build_name)

    damages = S.head_damages(heads, floats(args.ov), floats(args.qk), floats(args.rotations), floats(args.noise))
    damages += [S.Damage("noise_all", s) for s in floats(args.whole)]
    damages += [S.Damage("low_rank", e) for e in floats(args.low_rank)]
    write(f"{model}: damaging {', '.join(heads)} ({len(damages)} damages); {len(keys)} key knockout heads")
    knockout = not args.no_knockout
    outcomes = (  # a run of GGUF builds or of trials alone gates no intact build
        S.sweep(session, baseline, damages, tol, "fp32", text_loss=text_loss, write=write, knockout=knockout)
        if damages or args.recipes
        else []
    )
    recipes = [r for r in args.recipes.split(",") if r]
    builds = gate_recipes(session, baseline, tol, recipes, text_loss, write, knockout)
    gguf_builds = gate_recipes(session, baseline, tol, list(ggufs), text_loss, write, knockout)
    ran = outcomes + builds + gguf_builds
    seeds = seed_range(args.seeds)
    command = f"python scripts/measure_sensitivity.py {shlex.join(args.argv)}".strip()
    trials, judged = read_kept(args.kept) if args.kept else ([], [])
    sink = Path(args.trials) if args.trials else None

    def keep(line):
        if sink is not None:
            with sink.open("a", encoding="utf-8") as out:
                out.write(json.dumps({**line, "command": command, "torch": torch.__version__}) + "\n")

    measured = [(o, rule_figures(baseline, o.record, tol, "fp32")) for o in ran]
    for o, rules in measured:  # the damages' verdicts, for a later run's side-by-side table
        keep(verdict_line(o, rules))
    judged = measured + judged
    invariants = [
        i for i in per_build_invariants() if any(i in o.passed + o.failed for o in ran + [o for o, _ in judged])
    ]
    if seeds:
        trials += false_alarms(session, tol, seeds, BENIGN_RECIPES, write, knockout, keep)
    counts, alarm_lines, most = tally(trials)
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    run = (
        f"Measured by `{command}` on {platform.machine()} CPU, torch {torch.__version__}, "
        f"1 thread{' (2 for the 2-thread trials)' if seeds else ''}: {wall / 60:.1f} min wall, "
        f"{cpu / 60:.1f} min CPU of this process. Damaged heads: {', '.join(heads)} (the baseline's top key "
        "knockout heads by delta, then its top induction head). "
        + (
            f"No knockouts: `knockout_deltas` (which compares the baseline's {len(keys)} key knockout heads) "
            "was not run on these damages"
            + (" nor in the false-alarm trials." if seeds else ", and no false-alarm trials.")
            if args.no_knockout
            else f"The baseline's {len(keys)} key knockout heads, which `knockout_deltas` compares, are knocked "
            "out in every damaged build."
        )
    )
    block = f"{model}-{args.tag}" if args.tag else model
    blocks = {}
    if outcomes or builds:  # a run of GGUF builds or trials alone leaves the damage blocks alone
        blocks[f"{block}-run"] = run + "\n"
        blocks[f"{block}-caught"] = "\n".join(S.caught_table(outcomes, invariants)) + "\n"
        blocks[f"{block}-damages"] = "\n".join(outcome_rows(outcomes + builds, baseline, tol)) + "\n"
    if gguf_builds:
        said = (
            f"Measured by `{command}` ({wall / 60:.1f} min wall for the whole run): {len(gguf_builds)} GGUF "
            f"builds of {model}, "
            + (
                "no knockouts."
                if args.no_knockout
                else f"the baseline's {len(keys)} key knockout heads knocked out in each."
            )
        )
        blocks[f"{block}-gguf"] = "\n".join([said, "", *outcome_rows(gguf_builds, baseline, tol)]) + "\n"
    if trials or judged:
        ran, rules = [o for o, _ in judged], [r for _, r in judged]
        gated_by = list(dict.fromkeys(shown_command(r["command"]) for r in rules if r.get("command")))
        fixed_outcomes = [
            replace(o, failed=[k for k, v in r["fixed"].items() if v == "failed"])
            for o, r in judged
            if o.damage is not None
        ]
        gated_tables = [  # the gated builds' tables: none in a run of trials alone
            "",
            "Verdicts the two rules differ on:",
            "",
            *differing_rows(ran, rules),
            "",
            "The mildest damage each invariant catches under the fixed rule (compare the table above, "
            "the sequential rule's):",
            "",
            *S.caught_table(fixed_outcomes, invariants),
        ]
        blocks[f"{block}-rules"] = (
            "\n".join(
                [
                    f"Measured by `{command}`"
                    + (f" (the damages as gated by {' and '.join(f'`{c}`' for c in gated_by)})" if gated_by else "")
                    + f": the sequential rule (default, at most {tol.looks} looks of "
                    f"{session.settings.probe.n} sequences) and the fixed rule (`looks=1`) on the same records.",
                    "",
                    *rules_rows(trials, ran, rules),
                    *(gated_tables if ran else []),
                ]
            )
            + "\n"
        )
    if trials:
        blocks[f"{block}-false-alarms"] = "\n".join([trials_said(trials, command), "", *rate_rows(counts, most)]) + "\n"
        blocks[f"{block}-trials"] = "\n".join([*TRIALS_HEADER, *alarm_lines]) + "\n"
    return blocks


def main(argv=None) -> None:
    import sys

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="tiny-induction,smollm2-135m")
    parser.add_argument("--heads", type=int, default=0, help="damage the top N key heads (0: every key knockout head)")
    parser.add_argument("--ov", default=",".join(map(str, S.OV_SCALES)), help="OV scales s (-1: negated)")
    parser.add_argument("--qk", default=",".join(map(str, S.QK_SCALES)), help="QK logit scales t")
    parser.add_argument("--rotations", default=",".join(map(str, S.ROTATIONS)), help="OV rotation angles, degrees")
    parser.add_argument("--noise", default=",".join(map(str, S.NOISE)), help="noise sigma in the head's layer")
    parser.add_argument("--whole", default=",".join(map(str, S.NOISE)), help="noise sigma in every layer")
    parser.add_argument("--low-rank", default=",".join(map(str, S.LOW_RANK_SIZES)), help="low-rank update sizes")
    parser.add_argument("--recipes", default="bf16,fp16,rtn-int8,rtn-int4,bnb-int8,bnb-nf4,bnb-fp4")
    parser.add_argument(
        "--gguf", default="Q8_0,Q5_1,Q5_0,Q4_1,Q4_0,MXFP4", help="GGML types of the model's GGUF builds ('': none)"
    )
    parser.add_argument(
        "--seeds", default="10", help="held-out probe seeds for the false alarms: N (1..N; 0: none) or A-B"
    )
    parser.add_argument(
        "--trials",
        default="",
        help="append each false-alarm trial and each gated damage's verdicts to this file (JSON lines)",
    )
    parser.add_argument(
        "--kept",
        default="",
        help="count these --trials files' trials and damages too (comma-separated; e.g. a split run)",
    )
    parser.add_argument("--no-knockout", action="store_true", help="no knockouts: knockout_deltas is not run")
    parser.add_argument(
        "--tag", default="", help="write the blocks MODEL-TAG-... (a second run of a model beside its first)"
    )
    parser.add_argument("--dry-run", action="store_true", help="print the blocks, leave the page alone")
    args = parser.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    blocks: dict[str, str] = {}
    for model in args.models.split(","):
        blocks.update(measure(args, model, lambda line: print(line, flush=True)))
    if args.dry_run:
        for name, text in blocks.items():
            print(f"--- {name}\n{text}")
    else:
        write_blocks(PAGE, blocks)
        print(f"rewrote {len(blocks)} blocks of {os.path.relpath(PAGE, ROOT)}")


if __name__ == "__main__":
    main()
