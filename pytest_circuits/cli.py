"""The ``circuits`` command: scan, record, gate and diff builds; same code path as the plugin.

Exit status (`cli_help.EXIT_CODES`): 0 pass, 1 an invariant broke (``gate``), 2 a usage or input error
(a `CircuitsError` is printed as one line on stderr, never a traceback), 130 interrupted. Shared options
come from the one table in `options.py`; errors name the flags as this command spells them.
"""

from __future__ import annotations

import sys

try:  # Ctrl-C while the command is still importing: one line and status 130, never a traceback
    import argparse
    import contextlib
    import typing
    from pathlib import Path

    from .cli_help import EXIT_BROKEN, EXIT_INTERRUPTED, EXIT_OK, EXIT_USAGE, epilog
    from .errors import CircuitsError, line_of
    from .options import FRONT_END, OPTIONS
except KeyboardInterrupt:
    print("circuits: interrupted", file=sys.stderr)
    raise SystemExit(130) from None

STATUS_WORDS = {"passed": "PASS", "failed": "FAIL", "skipped": "SKIP", "error": "ERROR"}
MODEL_HELP = "model folder, .gguf file, cache id or named model (tiny-induction, smollm2-135m)"
SHIPPED_EXAMPLE = "tiny-induction--fp32"  # a shipped baseline's name, as the help and `circuits baselines` show it


# ---------------------------------------------------------------- parser


def _shared_options(p: argparse.ArgumentParser, command: str, defaults_from_baseline: bool = False) -> None:
    """The options of `options.OPTIONS` that ``command`` takes (parsed and checked later, in one place)."""
    for option in OPTIONS:
        if command not in option.cli:
            continue
        text = option.help.replace("--circuits-", "--")  # the help names other options as this front end spells them
        if option.kind == "bool":
            p.add_argument(option.cli_flag, dest=option.dest, action="store_true", default=None, help=text)
            continue
        default = option.cli_default if option.cli_default is not None else option.default
        hint = " (default: the baseline's)" if defaults_from_baseline and option.name.startswith("probe-") else ""
        said = hint or "(default:" in text  # the help states its default itself: once
        shown = f" (default: {default})" if default not in (None, "") and not said else ""
        p.add_argument(
            option.cli_flag,
            dest=option.dest,
            default=None,
            metavar=option.dest.upper(),
            help=f"{text}{shown}{hint}",
        )


def _no_knockout(p: argparse.ArgumentParser, consequence: str) -> None:
    """``--no-knockout``, declared once for every command that takes it."""
    p.add_argument("--no-knockout", action="store_true", help=f"skip the head knockouts (rung 2){consequence}")


def _invariants_option(p: argparse.ArgumentParser) -> None:
    """``--invariants MODULE``, declared once for every command that gates."""
    p.add_argument(
        "--invariants",
        action="append",
        default=[],
        metavar="MODULE",
        help="also gate the invariants MODULE registers (repeatable; MODULE or MODULE:OBJECT); the conftest.py "
        "files of this folder up to the project's root and the pytest_circuits.invariants entry points always are",
    )


def _user_invariants(args) -> None:
    """Register the invariants pytest would gate, in its order: the built-in ones and the entry points'
    (on import), the conftest.py files from the rootdir down to this folder, then ``--invariants``."""
    from .gate import invariants  # noqa: F401  (built-in and entry-point invariants first)
    from .gate.user_invariants import load_conftests, load_module

    load_conftests(Path.cwd())
    for name in args.invariants:
        load_module(name)


class _Parser(argparse.ArgumentParser):
    """argparse that adds "did you mean" to a mistyped option or command (its subcommands are of this class)."""

    typed: tuple[str, ...] = ()  # the words parsed: which command an unknown option was given to

    def parse_known_args(self, args=None, namespace=None):
        self.typed = tuple(sys.argv[1:] if args is None else args)
        return super().parse_known_args(args, namespace)

    def error(self, message: str) -> typing.NoReturn:
        super().error(message + _suggestion(self, message))


NOT_TAKEN = {("record", "--no-knockout"): "a baseline holds every rung (the gate's knockout invariants read it)"}
"""Why a command does not take an option its neighbours do (said when it is given one)."""


def _option_strings(parser: argparse.ArgumentParser) -> list[str]:
    """Every ``--flag`` of ``parser`` and of its subcommands."""
    found = []
    for action in parser._actions:
        found += [s for s in action.option_strings if s.startswith("--")]
        for sub in (action.choices or {}).values() if isinstance(action, argparse._SubParsersAction) else ():
            found += _option_strings(sub)
    return list(dict.fromkeys(found))


def _suggestion(parser: argparse.ArgumentParser, message: str) -> str:
    """``" (did you mean ...?)"`` for argparse's unrecognized-argument and invalid-choice errors, else ""."""
    import re

    from .errors import did_you_mean

    unknown = re.search(r"unrecognized arguments: (.*)", message)
    if unknown:
        flags = [w.split("=")[0] for w in unknown.group(1).split() if w.startswith("--")]
        return "".join(_other_commands(parser, flag) or did_you_mean(flag, _option_strings(parser)) for flag in flags)
    invalid = re.search(r"invalid choice: '([^']*)' \(choose from (.*)\)", message)
    if invalid:
        return did_you_mean(invalid.group(1), re.findall(r"'([^']*)'", invalid.group(2)))
    return ""


def _other_commands(parser: argparse.ArgumentParser, flag: str) -> str:
    """``" (--no-knockout is an option of circuits scan, gate, not of record: ...)"`` for an option the
    command typed does not take but others do, else "" (a mistyped option: `did_you_mean`)."""
    commands = {
        name: sub
        for action in parser._actions
        if isinstance(action, argparse._SubParsersAction)
        for name, sub in action.choices.items()
    }
    command = next((word for word in getattr(parser, "typed", ()) if word in commands), None)
    if command is None or flag in _option_strings(commands[command]):
        return ""
    takers = [name for name, sub in commands.items() if flag in _option_strings(sub)]
    if not takers:
        return ""
    why = NOT_TAKEN.get((command, flag))
    return f" ({flag} is an option of circuits {', '.join(takers)}, not of {command}{': ' + why if why else ''})"


def _command(sub, name: str, help: str) -> argparse.ArgumentParser:
    """Subcommand ``name``; its help ends with the build syntax (where it takes builds) and the exit codes."""
    return sub.add_parser(name, help=help, epilog=epilog(name), formatter_class=argparse.RawDescriptionHelpFormatter)


def build_parser() -> argparse.ArgumentParser:
    from . import __version__

    parser = _Parser(
        prog="circuits",
        description="Scan, record, gate and diff model builds on mechanistic invariants (pytest-circuits).",
        epilog=epilog(None),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"circuits (pytest-circuits) {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True

    p = _command(sub, "scan", "print every head's figures of one build (and write them as JSON)")
    p.add_argument("model", help=MODEL_HELP)
    p.add_argument(
        "--build",
        default="fp32",
        help="the build: a recipe, NAME=PATH or BUILD+kv-FORMAT (builds: below; default: fp32)",
    )
    p.add_argument("--json", type=Path, default=None, metavar="FILE", help="write the scan record here (atomically)")
    _no_knockout(p, "")
    _shared_options(p, "scan")

    p = _command(sub, "record", "write the baselines of builds (atomically)")
    p.add_argument("model", help=MODEL_HELP)
    p.add_argument(
        "--build",
        required=True,
        help="the builds, comma-separated: recipes, NAME=PATH or BUILD+kv-FORMAT (builds: below)",
    )
    p.add_argument(
        "--shard",
        default=None,
        metavar="I/K",
        help="measure only shard I of K of the knockout scan (a separate job each; see circuits merge); needs --out",
    )
    p.add_argument("--out", type=Path, default=None, metavar="FILE", help="with --shard: write the part here")
    _shared_options(p, "record")

    p = _command(sub, "merge", "merge the parts of a sharded record into the unsharded record")
    p.add_argument("parts", nargs="+", type=Path, metavar="PART", help="every part (circuits record --shard I/K --out)")
    p.add_argument("-o", "--output", required=True, type=Path, metavar="FILE", help="write the merged record here")

    p = _command(
        sub, "gate", "gate one build against a baseline file (exit 0 pass, 1 an invariant broke, 2 an input error)"
    )
    p.add_argument("model", help=MODEL_HELP)
    p.add_argument("--build", required=True, help="the build: a recipe, NAME=PATH or BUILD+kv-FORMAT (builds: below)")
    p.add_argument(
        "--baseline",
        required=True,
        type=Path,
        metavar="FILE",
        help=f"baseline file to gate against, or a shipped one by name ({SHIPPED_EXAMPLE}; circuits baselines lists them)",
    )
    p.add_argument(
        "--tol",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="override a tolerance (repeatable), e.g. --tol kappa=0.1",
    )
    p.add_argument(
        "--across-models",
        action="store_true",
        help="gate as a base-model swap (model-level swap_* invariants only) also when the geometry is the "
        "same; another geometry always is one",
    )
    _invariants_option(p)
    _no_knockout(
        p,
        ": knockout_deltas is not checked (the verdict says so); SmolLM2-135M on 2 CPU cores: under a minute, against up to 4 with them (docs/speed.md)",
    )
    _shared_options(p, "gate", defaults_from_baseline=True)

    _command(sub, "baselines", "list the baselines shipped with the package (gate against one by its name)")

    p = _command(sub, "diff", "what moved between two scan records, per head")
    p.add_argument("file_a", type=Path, metavar="A", help="the earlier scan record or baseline file")
    p.add_argument("file_b", type=Path, metavar="B", help="the later scan record or baseline file")
    p.add_argument("--min-change", type=float, default=0.01, help="hide changes smaller than this (default: 0.01)")
    _invariants_option(p)

    p = _command(
        sub,
        "sensitivity",
        "damage the baseline's top key heads step by step; print the mildest damage each invariant catches",
    )
    p.add_argument("model", help=MODEL_HELP)
    p.add_argument("--build", default="fp32", help="the float build to damage (default: fp32)")
    p.add_argument(
        "--baseline",
        type=Path,
        default=None,
        metavar="FILE",
        help="baseline file or a shipped one's name (default: the build's own)",
    )
    p.add_argument("--heads", type=int, default=2, help="damage the top N key heads by knockout delta (default: 2)")
    p.add_argument("--tol", action="append", default=[], metavar="NAME=VALUE", help="override a tolerance (repeatable)")
    _invariants_option(p)

    sub.add_parser(
        "report", help="write the HTML report of baseline files (see circuits report --help)", add_help=False
    )
    return parser


# ---------------------------------------------------------------- helpers


def _session(args, probe: dict | None = None, key_heads_of=(), **fixed):
    """A session from the parsed arguments; a gated baseline's probe settings fill the unset ones;
    ``key_heads_of``: records whose key heads a screened scan knocks out exactly."""
    from .run.run import Run
    from .settings import build_settings

    raw = {option.name: getattr(args, option.dest, None) for option in OPTIONS}
    for name, key in (("probe-seed", "seed"), ("probe-n", "n"), ("probe-length", "L")):
        if raw[name] is None and probe:
            raw[name] = probe.get(key)
    raw["model"] = args.model
    raw["builds"] = args.build  # recipes and NAME=PATH external builds (model/recipes.py)
    settings = build_settings(raw, baselines=Path("baselines"), front_end="cli", **fixed)
    return Run(settings, key_heads_of=key_heads_of)


def _one_build(session, command: str) -> str:
    """The one build ``scan`` and ``gate`` take (a recipe or NAME=PATH)."""
    builds = session.settings.builds
    if len(builds) != 1:
        raise CircuitsError(f"--build: {command} takes one build, got {', '.join(builds)}; run it once per build")
    return builds[0]


# ---------------------------------------------------------------- commands


def cmd_scan(args) -> int:
    from .fsio import atomic_write_text, check_output, remove_stale_temps
    from .gate.profile import profile, profile_line
    from .gate.tolerances import Tolerances
    from .model.kv_formats import refuse_decode_knockouts
    from .record.store import dumps
    from .run.records import measure_record
    from .show import head_table, model_lines

    if args.json:
        check_output(args.json)  # a link or a folder ends the command now, not after the scan
    session = _session(args)
    build = _one_build(session, "scan")
    if not args.no_knockout:
        refuse_decode_knockouts(session.settings.spec(build))
    record = measure_record(session.measured, build, knockout=not args.no_knockout)
    print("\n".join(model_lines(record)))
    print(profile_line(profile(record, Tolerances().swap_induction_score)))
    print(head_table(record))
    if args.json:
        remove_stale_temps(args.json.parent, target=args.json.name)  # what a killed scan left beside it
        atomic_write_text(args.json, dumps(record.data))
        print(f"wrote {args.json}")
    return EXIT_OK


def cmd_record(args) -> int:
    if args.shard is not None:
        return _record_shard(args)
    if args.out is not None:
        raise CircuitsError("--out writes a shard's part: give --shard I/K too (or drop --out)")
    from .model.kv_formats import refuse_decode_knockouts

    session = _session(args, update=True)  # compares with and writes to --baselines (./baselines), never the shipped
    for recipe in session.settings.builds:
        refuse_decode_knockouts(session.settings.spec(recipe))  # a baseline holds knockouts: before any work
    for recipe in session.settings.builds:
        path = session.baselines.write(recipe)
        record = session.records.record(recipe, knockout=True)
        written = any(event["event"] == "written" and event["recipe"] == recipe for event in session.baselines.events)
        verb = "wrote" if written else "unchanged (no figure moved; --update-all rewrites it)"
        print(
            f"{verb} {path}: copy loss {record.copy_loss:.4f}, copy gain {record.copy_gain:.4f}, "
            f"{sum(h.copying for h in record.heads)} copying heads"
        )
    return EXIT_OK


def _record_shard(args) -> int:
    """One shard of one build's record, as its own job: ``--shard I/K --out FILE`` (`record.shards`)."""
    from .options import parse_shard
    from .run.records import write_part

    index, total = parse_shard(args.shard)
    if args.out is None:
        raise CircuitsError(f"--shard {args.shard} needs --out FILE: where this job writes its part")
    args.knockout_shards = str(total)
    session = _session(args)
    recipe = _one_build(session, "record --shard")
    part = write_part(session.measured, recipe, index, total, args.out)
    print(f"wrote {args.out}: shard {index}/{total} of {recipe} (layers {', '.join(map(str, part['part']['layers']))})")
    return EXIT_OK


def cmd_merge(args) -> int:
    from .record.shards import merge_files

    _, count = merge_files(args.parts, args.output)
    print(f"wrote {args.output}: {count} parts merged")
    return EXIT_OK


def _tolerance_overrides(pairs: list[str]) -> dict[str, str]:
    """``--tol NAME=VALUE`` pairs, checked as `Tolerances` reads them: the run's settings hold them
    (what it measures reads some, e.g. ``change_screen``), and the gate's verdict reads them."""
    from .gate.tolerances import Tolerances

    overrides = {}
    for pair in pairs:
        name, sep, value = pair.partition("=")
        if not sep:
            raise CircuitsError(f"--tol {pair!r}: write NAME=VALUE, e.g. --tol kappa=0.1")
        overrides[name.strip()] = value.strip()
    try:
        Tolerances().updated(overrides)
    except ValueError as error:
        raise CircuitsError(f"--tol: {error}") from None
    return overrides


def _print_results(results, notes=()) -> bool:
    from .gate.invariants import verdict

    for note in notes:
        print(note)
    for r in results:
        message = r.message.removeprefix(f"{r.invariant}: ")  # a failure's message leads with its invariant
        print(f"{STATUS_WORDS[r.status]} {r.invariant}: {message}")
    passed, line = verdict(results)
    print(line)
    return passed


def _missing_baseline(args) -> str:
    """`circuits gate`'s line for a baseline file that does not exist: the complete command that records it
    (a file named MODEL--RECIPE.json: that very file; another name: the reference build into its folder)."""
    from .errors import closest
    from .gate.fixes import file_record_command, record_command
    from .record.store import SEPARATOR, SUFFIX, shipped_baselines

    path, settings = args.baseline, _session(args).settings
    recipe = path.name.removesuffix(SUFFIX).rpartition(SEPARATOR)[2]
    if path.name.endswith(SUFFIX) and SEPARATOR in path.name:
        how = f"record it with: {file_record_command(settings, recipe, path)}"
    else:
        how = (
            f"record one with: {record_command(settings, settings.reference, path.parent)} and pass the file it writes"
        )
    stem = path.name.removesuffix(SUFFIX)
    near = stem if stem in shipped_baselines() else closest(stem, shipped_baselines())
    if near:
        said = "of that name" if near == stem else "named like it"
        shipped = f"; or gate against the shipped baseline {said}: --baseline {near}"
    else:
        shipped = "; or gate against a shipped baseline by name (circuits baselines lists them)"
    return f"baseline {path} does not exist; {how}{shipped}"


def cmd_baselines(args) -> int:
    """The shipped baselines, one a line: the name `--baseline` takes anywhere, and the file."""
    from .record.store import shipped_baselines

    shipped = shipped_baselines()
    width = max(map(len, shipped), default=0)
    for name, path in shipped.items():
        print(f"{name:<{width}}  {path}")
    print(
        f"gate against one by its name, in any folder: circuits gate MODEL --build RECIPE --baseline {SHIPPED_EXAMPLE}"
    )
    return EXIT_OK


def cmd_gate(args) -> int:
    from .errors import BaselineMissing
    from .gate.fixes import file_fix_line
    from .model.kv_formats import refuse_decode_knockouts
    from .model.recipes import describe_identity
    from .record.store import baseline_file, baseline_line, read_record
    from .run.flow import gate_file

    overrides = _tolerance_overrides(args.tol)
    args.baseline = baseline_file(args.baseline)
    try:
        baseline = read_record(args.baseline)  # validated once: the gate reads this typed record
    except BaselineMissing:
        raise BaselineMissing(_missing_baseline(args)) from None
    # on the same model a screened scan knocks the file's key heads out exactly (another model's are skipped)
    key_heads_of = () if args.across_models else (baseline,)
    session = _session(args, probe=baseline.probe.model_dump(), key_heads_of=key_heads_of, tolerances=overrides)
    tol = session.tolerances
    build = _one_build(session, "gate")
    if not args.no_knockout:
        refuse_decode_knockouts(session.settings.spec(build))
    label = f"baseline {args.baseline.name}"
    fix = file_fix_line(session.settings, baseline, args.baseline, args.across_models)
    candidate, verdicts = gate_file(
        session.records, build, baseline, label, tol, fix, args.across_models, not args.no_knockout
    )
    identities = [
        f"{who} {line}"
        for who, record in (("candidate", candidate), ("baseline", baseline))
        if (line := describe_identity(record.build.model_dump(exclude_none=True)))
    ]
    notes = [baseline_line(args.baseline), *identities, *verdicts.notes]
    return EXIT_OK if _print_results(verdicts.results, notes) else EXIT_BROKEN


def cmd_diff(args) -> int:
    from .show import diff_lines

    for line in diff_lines(args.file_a, args.file_b, args.min_change):
        print(line)
    return EXIT_OK


def cmd_sensitivity(args) -> int:
    """`sensitivity.run_command` on the build against its baseline (its probe settings)."""
    from .record.store import baseline_file, read_record
    from .run.sensitivity import run_command

    overrides = _tolerance_overrides(args.tol)
    if args.heads < 1:
        raise CircuitsError(f"--heads {args.heads}: damage at least 1 head")
    baseline = read_record(baseline_file(args.baseline)) if args.baseline is not None else None
    probe = None if baseline is None else baseline.probe.model_dump()
    given = () if baseline is None else (baseline,)  # the change screen reads the file it gates against
    session = _session(args, probe=probe, key_heads_of=given, tolerances=overrides)
    tol = session.tolerances
    build = _one_build(session, "sensitivity")
    if baseline is None:
        baseline = session.baselines.load(build)
    return EXIT_OK if run_command(session, baseline.data, tol, args.heads, build) else EXIT_BROKEN


COMMANDS = {
    "scan": cmd_scan,
    "sensitivity": cmd_sensitivity,
    "record": cmd_record,
    "gate": cmd_gate,
    "diff": cmd_diff,
    "merge": cmd_merge,
    "baselines": cmd_baselines,
}


def main(argv=None) -> int:
    """Run one command; Ctrl-C at any moment (its imports included) is one line and status 130."""
    try:
        with _escaping_output():
            return _run(list(sys.argv[1:] if argv is None else argv))
    except KeyboardInterrupt:
        print("circuits: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED


QUIET_LOGGERS = ("torchao", "torch.utils._pytree")
"""Loggers of optional libraries whose import-time warnings are not the command's to print: with the
``formats`` extra installed, every model load imports torchao (transformers' quantizer table), which
logs each CUDA kernel library it cannot load on a CPU and a torch pytree deprecation."""


def _quiet_imports() -> None:
    import logging

    for name in QUIET_LOGGERS:
        logging.getLogger(name).setLevel(logging.ERROR)


def _run(argv: list[str]) -> int:
    _quiet_imports()
    token = FRONT_END.set("cli")
    try:
        if argv and argv[0] == "report":
            return _report(argv[1:])
        parser = build_parser()
        args = parser.parse_args(argv)  # exits 2 on a usage error, 0 on --help
        try:
            if hasattr(args, "invariants"):  # a command that gates: the same invariants as pytest
                _user_invariants(args)
            elif args.command in ("scan", "record"):  # the entry points' invariants: a broken one before any work
                from .gate import invariants  # noqa: F401
            return COMMANDS[args.command](args)
        except CircuitsError as error:
            print(f"circuits {args.command}: {line_of(error)}", file=sys.stderr)
            return EXIT_USAGE
    finally:
        FRONT_END.reset(token)


@contextlib.contextmanager
def _escaping_output():
    """stdout and stderr write text they cannot encode (a lone surrogate ``\\ud800`` in a record's model
    name, valid JSON) as its escape instead of raising; their settings are restored afterwards."""
    streams = [(s, s.errors) for s in (sys.stdout, sys.stderr) if hasattr(s, "reconfigure")]
    for stream, _ in streams:
        stream.reconfigure(errors="backslashreplace")
    try:
        yield
    finally:
        for stream, errors in streams:
            stream.reconfigure(errors=errors)


def _report(argv) -> int:
    if any(word in ("-h", "--help") for word in argv):  # answered before the report's imports (torch)
        from .report.arguments import report_parser

        report_parser().parse_args(argv)
    try:
        from .report import report_command
    except ImportError as error:
        print(f"circuits report: the report module is unavailable ({error})", file=sys.stderr)
        return EXIT_USAGE
    try:
        return int(report_command(argv) or 0)
    except CircuitsError as error:
        print(f"circuits report: {line_of(error)}", file=sys.stderr)
        return EXIT_USAGE


if __name__ == "__main__":
    raise SystemExit(main())
