"""The pytest side of the gate: results gathered from test reports, the terminal summary,
the report folder. Results travel as plain data in ``user_properties``, so pytest-xdist
carries them from the workers to the controller, where the summary and report are made."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from ..errors import CircuitsError
from ..options import flag

if TYPE_CHECKING:
    from ..record.schema import Record


@dataclass
class Collected:
    """Everything the gate tests of one run attached, gathered where the summary is printed."""

    results: list[dict] = field(default_factory=list)
    events: list[dict] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    records: dict = field(default_factory=dict)  # recipe -> scan record (only with --circuits-report)
    references: dict = field(default_factory=dict)  # recipe -> reference baseline record or None
    attention: dict = field(default_factory=dict)  # recipe -> one head's attention map (report/live.py)
    report_path: Path | None = None
    used: bool = False
    loads: list[dict] = field(default_factory=list)  # {"recipe", "worker"}: every build load of the run
    dist: str | None = None  # pytest-xdist's --dist on the controller
    report_error: str = ""  # why a requested --circuits-report was not written (fails the run)
    parts: list[dict] = field(default_factory=list)  # the part a shard job wrote: recipe, path, index, of, layers

    def add(self, user_properties) -> None:
        """Gather one report's ``circuits_*`` properties (a report of another test adds nothing, imports nothing)."""
        for key, value in user_properties:
            if not key.startswith("circuits_"):
                continue
            self.used = True
            if key == "circuits_results":
                self.results.extend(value)
            elif key == "circuits_events":
                self.events.extend(e for e in value if e not in self.events)
            elif key in ("circuits_notes", "circuits_problems"):
                bucket = self.notes if key == "circuits_notes" else self.problems
                bucket.extend(v for v in value if v not in bucket)
            elif key == "circuits_record":
                from ..record.read import has_figures  # pandas and torch: only once a build was gated

                recipe, record = value
                old = self.records.get(recipe)
                if old is None or has_figures(record, "knockout") or not has_figures(old, "knockout"):
                    self.records[recipe] = record
            elif key == "circuits_reference":
                recipe, record = value
                self.references[recipe] = record
            elif key == "circuits_attention":
                recipe, attention = value
                self.attention[recipe] = attention
            elif key == "circuits_part" and value not in self.parts:
                self.parts.append(value)


def gate_for_test(request, session, build_name: str, invariant: str, tol):
    """`gate_build` for one pytest item; results travel as user properties (pytest-xdist safe)."""
    from ..gate.fixes import fix_lines, update_command
    from ..gate.invariants import get
    from ..run.flow import gate_build

    props = request.node.user_properties
    # a shard job measured one knockout shard: its rung-2 invariants are skipped saying so, never passed
    if session.settings.shard is not None and "knockout" in get(invariant).needs:
        why = shard_job_skip(session.settings)
        props.append(("circuits_results", [error_row(build_name, invariant, why, status="skipped")]))
        pytest.skip(why)
    if session.settings.update:  # record own baseline first: the reference's owner takes its lock before anyone waits
        session.baselines.write(build_name)
    try:
        fixes = fix_lines(session.settings, build_name, update_command(request.config))
        outcome = gate_build(session.records, session.baselines, build_name, invariant, tol, fixes)
    except CircuitsError as error:  # the build could not be gated: the report names it among what broke
        props.append(("circuits_results", [error_row(build_name, invariant, str(error))]))
        raise
    outcome.notes[:0] = session.identity_lines(build_name)  # an external build: which file was gated
    parts = session.settings.shard_parts
    if parts is not None:
        outcome.notes.insert(0, f"gated the record merged from the shard parts {parts} (the build was not loaded)")
    rows = [r.as_dict() for r in outcome.results] + [error_row(build_name, invariant, p) for p in outcome.problems]
    props.append(("circuits_results", rows))
    props.append(("circuits_events", list(session.baselines.events)))
    props.append(("circuits_notes", [f"{build_name}: {n}" for n in outcome.notes]))
    props.append(("circuits_problems", list(outcome.problems)))
    if session.settings.report is not None:
        from ..gate.invariants import get
        from ..record.store import geometry_difference
        from ..run.flow import candidate_record

        checked = get(invariant)
        knockout = "knockout" in checked.needs
        try:
            reference = session.baselines.load(session.settings.reference)
        except Exception:
            reference = None
        # the report draws the build beside the reference: measured its way when there is one
        if reference is None:
            record = session.records.record(build_name, knockout=knockout)
        else:
            record = candidate_record(session.records, build_name, reference, knockout, checked)
        props.append(("circuits_record", (build_name, record.data)))  # user properties travel as JSON (xdist)
        if reference is not None and geometry_difference(reference, record):
            reference = None  # another base model: its heads are not this model's, no per-head differences
        props.append(("circuits_reference", (build_name, None if reference is None else reference.data)))
        props.append(("circuits_attention", (build_name, attention_for_report(session, build_name, reference))))
    return outcome


def attention_for_report(session, build_name: str, reference: Record | None) -> dict | None:
    """The report's attention map: the reference's strongest induction head (the same head in every
    build), on probe sequence 0 of this build; a dict with ``note`` instead when it cannot be drawn."""
    from ..report.live import head_attention, strongest_induction_head

    if session.settings.shard_parts is not None:
        return {"note": "no attention map: the build was gated from its shard parts, not loaded"}
    record = session.records.record(build_name, knockout=False)
    label = (reference and strongest_induction_head(reference.data)) or strongest_induction_head(record.data)
    if label is None:
        return {"note": "no head has a prefix-matching score: no attention map"}
    try:
        return session.loaded.memo(
            ("report_attention", build_name, label),
            lambda: head_attention(session.loaded.build(build_name), session.settings.probe, label),
        )
    except Exception as error:  # the gate's verdict stands without the picture
        return {"note": f"the attention map of {label} could not be computed: {type(error).__name__}: {error}"}


def error_row(build_name: str, invariant: str, problem: str, status: str = "error") -> dict:
    """A result row (plain data) for an invariant that could not be gated: ``status`` "error" (or
    "skipped": a shard job's rung 2)."""
    return {
        "invariant": invariant,
        "build": build_name,
        "against": "",
        "status": status,
        "passed": False,
        "message": problem,
        "compared": 0,
        "moved": [],
    }


def shard_job_skip(settings) -> str:
    """Why a shard job skips rung 2: it measured one shard; the merge job gates the whole scan."""
    index, total = settings.shard
    return (
        f"rung 2 not gated by this job, which measured only knockout shard {index}/{total}; "
        f"the job that merges every part gates it ({flag('shard-parts')} 'part-*.json')"
    )


def shard_lines(session, collected: Collected) -> list[str]:
    """A shard job says what it measured and that it did not gate rung 2 (never a green gate)."""
    s = session.settings
    if s.shard is None:
        return []
    lines = [
        f"shard {part['index']}/{part['of']} of {part['recipe']}: wrote {part['path']} (knockouts of layers "
        f"{', '.join(map(str, part['layers']))} only)"
        for part in collected.parts
    ]
    return lines + ([missing_part(session, collected)] if not collected.parts else []) + [f"NOTE {shard_job_skip(s)}"]


def missing_part(session, collected: Collected) -> str:
    """A shard job whose part was not written (its shard test failed or did not run), else ""."""
    s = session.settings
    if s.shard is None or collected.parts:
        return ""
    return (
        f"ERROR {flag('shard')} {s.shard[0]}/{s.shard[1]}: no part written to {s.shard_out} "
        "(test_knockout_shard failed or did not run)"
    )


def baseline_lines(session, collected: Collected, verbosity: int = 0) -> list[str]:
    """Which baselines were written, compared, missing, corrupt; orphans counted (named with -v,
    left out with -q)."""

    lines = []
    for event, verb in (
        ("written", "written"),
        ("unchanged", "unchanged (not rewritten; --circuits-update-all forces it)"),
        ("compared", "compared"),
        ("missing", "missing"),
        ("corrupt", "unreadable"),
    ):
        paths = sorted({e["path"] for e in collected.events if e["event"] == event})
        if paths:
            lines.append(f"baselines {verb}: {', '.join(paths)}")
    missing = sorted({event["recipe"] for event in collected.events if event["event"] == "missing"})
    for recipe in missing:
        lines.append(f"  {recipe}: {session.baselines.missing_message(recipe, session.baselines.path(recipe))}")
    try:
        used = set(session.settings.builds) | {session.settings.reference}
        orphaned = session.baselines.store.orphans(session.loaded.model_name, used)
    except Exception:  # the model did not resolve: the tests already said why
        orphaned = []
    if orphaned and verbosity > 0:
        lines.append(f"baselines orphaned (no tested build used them): {', '.join(str(p) for p in orphaned)}")
    elif orphaned and verbosity == 0:
        lines.append(f"{len(orphaned)} other baseline(s) of this model not used by the builds tested (-v names them)")
    return lines


def result_lines(collected: Collected) -> list[str]:
    """The report module's summary lines when it is installed, else one line per failed result."""
    try:
        from ..report import summary_lines

        return list(summary_lines(collected.results, report_dir=collected.report_path))
    except ImportError:
        pass
    failed = [r for r in collected.results if r["status"] in ("failed", "error")]
    lines = [f"gate: {len(collected.results) - len(failed)} of {len(collected.results)} invariant checks passed"]
    lines += [f"  FAILED {r['build']} {r['invariant']} against the {r['against']}" for r in failed]
    return lines


def terminal_summary(terminalreporter, session, collected: Collected) -> None:
    """The ``circuits`` section of the terminal summary."""
    from .workers import load_lines

    terminalreporter.section("circuits")
    verbosity = terminalreporter.config.get_verbosity()
    lines = (
        collected.notes + load_lines(collected.loads, collected.dist) + baseline_lines(session, collected, verbosity)
    )
    for line in lines + (result_lines(collected) if collected.used else []):
        terminalreporter.write_line(line)
    for line in shard_lines(session, collected):
        terminalreporter.write_line(line, yellow=not line.startswith("ERROR"), red=line.startswith("ERROR"))
    if collected.report_error:
        terminalreporter.write_line(f"ERROR {collected.report_error}", red=True)


def write_report(session, collected: Collected) -> None:
    """``--circuits-report DIR``: the report module's HTML page, summary.md and figures. A report
    that cannot be written fails the run (`Collected.report_error`), and its summary.md is still
    written as text, without figures (it needs no matplotlib)."""
    if session.settings.report is None:
        return
    out = Path(session.settings.report)
    try:
        from ..progress import phase
        from ..report import write_report as write

        with phase(f"writing the report to {out}", session.loaded.progress_write):
            collected.report_path = write(
                out,
                list(collected.records.values()),
                collected.references,
                collected.results,
                attention=collected.attention,
            )
        return
    except Exception as error:  # the gate's verdict stands; the missing report fails the run
        from ..errors import first_line

        problem = error if isinstance(error, CircuitsError) else f"{type(error).__name__}: {first_line(error)}"
    collected.report_error = f"{flag('report')} {out}: the report could not be written: {problem}"
    try:
        from ..fsio import atomic_write_text
        from ..report import SUMMARY_PAGE, data, markdown

        out.mkdir(parents=True, exist_ok=True)
        results = [data.result_dict(r) for r in collected.results]
        text = markdown.summary([], results) + f"\nNo figures and no report page: {problem}\n"
        atomic_write_text(out / SUMMARY_PAGE, text)
        collected.report_error += f" ({out / SUMMARY_PAGE} holds the verdicts as text, without figures)"
    except Exception:  # no folder to write into: the line above already fails the run
        pass


class Collector:
    """Collects the gate results tests attach as user properties (on the controller under xdist)."""

    def __init__(self, collected: Collected):
        self.collected = collected

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        if report.when == "call":
            self.collected.add(report.user_properties)
