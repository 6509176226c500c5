"""The ``circuits`` command: scan, record, gate and diff builds; same code path as the plugin.

Exit status: 0 pass, 1 an invariant broke (``gate``), 2 a usage or input error
(a `CircuitsError` is printed as one line on stderr, never a traceback).
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

from .errors import CircuitsError

EXIT_OK, EXIT_BROKEN, EXIT_USAGE = 0, 1, 2

TABLE_COLUMNS = (
    ("kappa", "kappa", "{:+.3f}"),
    ("kappa_trace", "trace", "{:+.3f}"),
    ("kappa_z", "z", "{:+.2f}"),
    ("kappa_q", "q", "{:.3f}"),
    ("ov_gain_rel", "ov gain", "{:.3f}"),  # sum |lambda| / the largest head's
    ("prefix_matching", "prefix", "{:.3f}"),
    ("previous_token", "prev", "{:.3f}"),
    ("duplicate_token", "dup", "{:.3f}"),
    ("knockout_delta", "knockout", "{:+.3f}"),
)
DIFF_METRICS = ("kappa", "kappa_trace", "kappa_z", "prefix_matching", "previous_token", "duplicate_token",
                "knockout_delta")
MODEL_FIGURES = ("copy_loss", "first_copy_loss", "copy_gain", "uniform_loss")


# ---------------------------------------------------------------- parser


def _probe_options(p: argparse.ArgumentParser, defaults_from_baseline: bool = False) -> None:
    from .settings import CircuitsSettings

    d = CircuitsSettings()
    hint = " (default: the baseline's)" if defaults_from_baseline else ""
    p.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N (default auto)")
    p.add_argument("--probe-seed", type=int, default=None, help=f"repeat-probe seed (default {d.probe.seed}){hint}")
    p.add_argument("--probe-n", type=int, default=None, help=f"repeat sequences (default {d.probe.n}){hint}")
    p.add_argument("--probe-length", type=int, default=None, help=f"segment length L (default {d.probe.L}){hint}")
    p.add_argument("--knockout-mode", choices=("zero", "mean"), default="zero", help="head knockout ablation")
    p.add_argument("--knockout-screen", type=int, default=None, help="exact knockouts only on the top K of a screen")
    p.add_argument("--batch-size", type=int, default=d.batch_size, help="sequences per forward pass")
    p.add_argument("--trust-remote-code", action="store_true", help="allow the model folder's own code to run")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="circuits",
        description="Scan, record, gate and diff model builds on mechanistic invariants (pytest-circuits).",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True

    p = sub.add_parser("scan", help="print every head's figures of one build (and write them as JSON)")
    p.add_argument("model", help="model folder, .gguf file, cache id or named model (tiny-induction, smollm2-135m)")
    p.add_argument("--build", default="fp32", help="build recipe (default fp32)")
    p.add_argument("--json", type=Path, default=None, metavar="FILE", help="write the scan record here")
    p.add_argument("--no-knockout", action="store_true", help="skip the head knockouts (rung 2)")
    _probe_options(p)

    p = sub.add_parser("record", help="write the baselines of builds (atomically)")
    p.add_argument("model")
    p.add_argument("--build", required=True, help="build recipe(s), comma-separated")
    p.add_argument("--baselines", type=Path, default=Path("baselines"), help="baselines folder (default baselines/)")
    _probe_options(p)

    p = sub.add_parser("gate", help="gate one build against a baseline file (exit 1 if an invariant broke)")
    p.add_argument("model")
    p.add_argument("--build", required=True, help="build recipe")
    p.add_argument("--baseline", required=True, type=Path, metavar="FILE", help="baseline file to gate against")
    p.add_argument("--tol", action="append", default=[], metavar="NAME=VALUE",
                   help="override a tolerance (repeatable), e.g. --tol kappa=0.1")
    _probe_options(p, defaults_from_baseline=True)

    p = sub.add_parser("diff", help="what moved between two scan records, per head")
    p.add_argument("file_a", type=Path)
    p.add_argument("file_b", type=Path)
    p.add_argument("--min-change", type=float, default=0.01, help="hide changes smaller than this (default 0.01)")

    sub.add_parser("report", help="write the HTML report of baseline files (see circuits report --help)",
                   add_help=False)
    return parser


# ---------------------------------------------------------------- helpers


def _session(args, probe=None):
    from .rungs.repeat import RepeatSettings
    from .session import CircuitsSession, CircuitsSettings

    d = CircuitsSettings()
    probe = probe or {}
    settings = CircuitsSettings(
        model=args.model,
        device=args.device,
        trust_remote_code=args.trust_remote_code,
        probe=RepeatSettings(
            seed=_pick(args.probe_seed, probe.get("seed"), d.probe.seed),
            n=_pick(args.probe_n, probe.get("n"), d.probe.n),
            L=_pick(args.probe_length, probe.get("L"), d.probe.L),
        ),
        knockout_mode=args.knockout_mode,
        knockout_screen=args.knockout_screen,
        batch_size=args.batch_size,
        baselines=getattr(args, "baselines", None) or d.baselines,
    )
    return CircuitsSession(settings)


def _pick(*values):
    return next(v for v in values if v is not None)


def _fmt(value, spec: str) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return spec.format(value)


def head_table(record: dict) -> str:
    """One line per head: the figures of all three rungs and the copying/suppression flag;
    ``ov gain`` is the head's OV gain over the largest head's (idle heads sit near 0)."""
    from .gate.invariants import ov_gains

    gains = ov_gains(record)
    largest = max(gains.values(), default=0.0)
    heads = [{**h, "ov_gain_rel": gains[h["head"]] / largest if largest > 0 and h["head"] in gains else None}
             for h in record["heads"]]
    cols = [(key, title, spec) for key, title, spec in TABLE_COLUMNS if any(h.get(key) is not None for h in heads)]
    header = f"{'head':<8}" + "".join(f"{title:>10}" for _, title, _ in cols) + "  flag"
    lines = [header]
    for h in heads:
        flag = "copying" if h.get("copying") else "suppression" if h.get("suppression") else ""
        lines.append(f"{h['head']:<8}" + "".join(f"{_fmt(h.get(k), s):>10}" for k, _, s in cols) + f"  {flag}")
    return "\n".join(lines)


def model_lines(record: dict) -> list[str]:
    m, b, p = record["model"], record["build"], record["probe"]
    figures = ", ".join(f"{k} {_fmt(record.get(k), '{:.4f}')}" for k in MODEL_FIGURES)
    return [
        f"model {m['name']} ({m['family']}, {m['geometry']['n_layers']} layers x {m['geometry']['n_heads']} heads), "
        f"build {b['recipe']} ({b['backend_version']}, {b['device']})",
        f"probe seed {p['seed']} n {p['n']} L {p['L']}: {figures} (nats)",
    ]


# ---------------------------------------------------------------- commands


def cmd_scan(args) -> int:
    from .gate.record import build_record
    from .gate.store import dumps
    from .model.builds import get_recipe

    get_recipe(args.build)
    session = _session(args)
    record = build_record(session, args.build, knockout=not args.no_knockout)
    print("\n".join(model_lines(record)))
    print(head_table(record))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(dumps(record), encoding="utf-8")
        print(f"wrote {args.json}")
    return EXIT_OK


def cmd_record(args) -> int:
    from .model.builds import parse_builds

    recipes = parse_builds(args.build)
    session = _session(args)
    for recipe in recipes:
        path = session.write_baseline(recipe)
        record = session.record(recipe, knockout=True)
        print(f"wrote {path}: copy loss {record['copy_loss']:.4f}, copy gain {record['copy_gain']:.4f}, "
              f"{sum(bool(h.get('copying')) for h in record['heads'])} copying heads")
    return EXIT_OK


def _tolerances(pairs: list[str]):
    from .gate.invariants import Tolerances

    overrides = {}
    for pair in pairs:
        name, sep, value = pair.partition("=")
        if not sep:
            raise CircuitsError(f"--tol {pair!r}: write NAME=VALUE, e.g. --tol kappa=0.1")
        overrides[name.strip()] = value.strip()
    try:
        return Tolerances().updated(overrides)
    except ValueError as error:
        raise CircuitsError(f"--tol: {error}") from None


def cmd_gate(args) -> int:
    from .gate.invariants import _has_knockout, gate_all
    from .gate.store import compatibility, read_baseline
    from .model.builds import get_recipe

    get_recipe(args.build)
    tol = _tolerances(args.tol)
    baseline = read_baseline(args.baseline)
    session = _session(args, probe=baseline.get("probe"))
    candidate = session.record(args.build, knockout=_has_knockout(baseline))
    label = f"baseline {args.baseline.name}"
    notes = compatibility(baseline, candidate, label)
    folder = args.baseline.parent
    fix = f"if the change is intended, record the baseline again: circuits record {args.model} --build {args.build} --baselines {folder}"
    results = gate_all(baseline, candidate, tol, args.build, label, fix)
    for note in notes:
        print(note)
    for r in results:
        print(f"{'PASS' if r.passed else 'FAIL'} {r.invariant}: {r.message}")
    broken = [r.invariant for r in results if not r.passed]
    print(f"gate {'failed: ' + ', '.join(broken) if broken else 'passed'} "
          f"({len(results) - len(broken)} of {len(results)} invariants hold)")
    return EXIT_BROKEN if broken else EXIT_OK


def diff_rows(a: dict, b: dict, min_change: float = 0.01) -> list[tuple]:
    """``(head, metric, before, after, change)`` for every per-head figure that moved at least ``min_change``."""
    rows = []
    heads_b = {h["head"]: h for h in b["heads"]}
    for ha in a["heads"]:
        hb = heads_b.get(ha["head"])
        if hb is None:
            continue
        for metric in DIFF_METRICS:
            x, y = ha.get(metric), hb.get(metric)
            if x is None or y is None:
                continue
            if abs(y - x) >= min_change:
                rows.append((ha["head"], metric, x, y, y - x))
        for flag in ("copying", "suppression"):
            if bool(ha.get(flag)) != bool(hb.get(flag)):
                rows.append((ha["head"], flag, float(bool(ha.get(flag))), float(bool(hb.get(flag))), None))
    return rows


def cmd_diff(args) -> int:
    from .gate.invariants import Tolerances, gate_all
    from .gate.store import compatibility, read_baseline

    a, b = read_baseline(args.file_a), read_baseline(args.file_b)
    for note in compatibility(a, b, f"baseline {args.file_a.name}"):
        print(note)
    print(f"A {args.file_a}: {a['model']['name']} {a['build']['recipe']}")
    print(f"B {args.file_b}: {b['model']['name']} {b['build']['recipe']}")
    for key in MODEL_FIGURES:
        x, y = a.get(key), b.get(key)
        if x is not None and y is not None:
            print(f"  {key:<16} {x:10.4f} -> {y:10.4f}  ({y - x:+.4f})")
    rows = diff_rows(a, b, args.min_change)
    if rows:
        print(f"{'head':<8} {'metric':<16} {'A':>10} {'B':>10} {'change':>10}")
        for head, metric, x, y, change in rows:
            print(f"{head:<8} {metric:<16} {x:>10.4f} {y:>10.4f} {_fmt(change, '{:+.4f}'):>10}")
    else:
        print(f"no per-head figure moved by {args.min_change} or more")
    results = gate_all(a, b, Tolerances(), b["build"]["recipe"], f"baseline {args.file_a.name}")
    broken = [r.invariant for r in results if not r.passed]
    print(f"with default tolerances, B against A: {'broken: ' + ', '.join(broken) if broken else 'all invariants hold'}")
    return EXIT_OK


COMMANDS = {"scan": cmd_scan, "record": cmd_record, "gate": cmd_gate, "diff": cmd_diff}


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "report":
        return _report(argv[1:])
    parser = build_parser()
    args = parser.parse_args(argv)  # exits 2 on a usage error, 0 on --help
    try:
        code = COMMANDS[args.command](args)
    except CircuitsError as error:
        print(f"circuits {args.command}: {error}", file=sys.stderr)
        code = EXIT_USAGE
    except KeyboardInterrupt:
        print("circuits: interrupted", file=sys.stderr)
        code = 130
    return code


def _report(argv) -> int:
    try:
        from .report import report_command
    except ImportError as error:
        print(f"circuits report: the report module is unavailable ({error})", file=sys.stderr)
        return EXIT_USAGE
    try:
        return int(report_command(argv) or 0)
    except CircuitsError as error:
        print(f"circuits report: {error}", file=sys.stderr)
        return EXIT_USAGE


if __name__ == "__main__":
    raise SystemExit(main())
