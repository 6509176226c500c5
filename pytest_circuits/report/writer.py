"""Write the report folder (HTML page, summary.md, PNGs) from scan records, or from baseline files."""

from __future__ import annotations

import sys
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..errors import CircuitsError
from ..fsio import atomic_write_bytes, atomic_write_text, ensure_dir, fs_error
from ..record.schema import Record, RecordLike
from ..record.store import baseline_file, read_record
from . import data, html, markdown, plots
from .arguments import report_parser
from .sections import build_section, failing_first, overview_figures
from .summary import REPORT_PAGE, SUMMARY_PAGE, summary_lines

if TYPE_CHECKING:
    from ..gate.check import Verdicts


def write_report(
    out_dir: str | Path,
    records: Iterable[dict],
    baselines: dict[str, dict | None] | None = None,
    results: Iterable[Any] | None = None,
    attention: dict[str, dict | None] | None = None,
) -> Path:
    """Write ``report.html``, ``summary.md`` and one PNG per figure into ``out_dir``; return the page's path.

    ``records``: one scan record per build. ``baselines``: recipe -> the scan record the build
    was gated against (its per-head maps are drawn as differences). ``results``: the gate's
    InvariantResults (objects or dicts); failed ones are named at the top of the page, and the
    builds with a broken invariant come first. ``attention``: recipe -> one head's attention map
    (`live.head_attention`, or ``{"note": why not}``); without it the page says why there is none.
    """
    plots.require_matplotlib()
    out = ensure_dir(out_dir)
    grouped = data.results_by_build(results)
    baselines = baselines or {}
    sections, used = [], set()
    for record in records:
        recipe = data.build_name_of(record)
        slug = data.slug(recipe)
        while slug in used:
            slug += "-2"
        used.add(slug)
        sections.append(build_section(record, baselines.get(recipe), grouped.get(recipe, []), slug))
    sections = failing_first(sections)
    seen = {s.label for s in sections}
    extra = [r for build, rs in grouped.items() if build not in seen for r in rs]
    overview, overview_notes = overview_figures(sections, attention or {})
    for figure in overview + [f for section in sections for f in section.figures]:  # each whole or absent
        atomic_write_bytes(out / figure.file, figure.png)
    # a lone surrogate in a record's text (valid JSON: "\ud800") is written as its escape, not refused
    summary = markdown.summary(sections, extra, overview, overview_notes, out.name)
    atomic_write_text(out / SUMMARY_PAGE, summary, errors="backslashreplace")
    page = out / REPORT_PAGE
    atomic_write_text(page, html.page(sections, extra, overview, overview_notes), errors="backslashreplace")
    return page


def report_from_files(
    out_dir: str | Path,
    baseline_path: str | Path,
    against_path: str | Path | None = None,
    results: Iterable[Any] | None = None,
) -> Path:
    """Draw the report again from baseline files alone, without the model.

    ``baseline_path`` is the build shown; ``against_path`` (optional) the baseline it is drawn
    against and gated against (`gate_files`, unless ``results`` are given). There is no model
    to run, so the page has no attention map and says so.
    """
    record = read_record(baseline_path)
    baseline = read_record(against_path) if against_path else None
    return _report_of(out_dir, record, baseline, Path(against_path).name if against_path else "", results)


def _report_of(
    out_dir: str | Path, record: Record, baseline: Record | None, against_name: str, results: Iterable[Any] | None
) -> Path:
    """`report_from_files` on records read (each validated once, where it was read): ``record`` drawn against
    ``baseline`` (gated against it unless ``results`` are given)."""
    baselines: dict[str, dict | None] | None = None
    if baseline is not None:
        baselines = {data.build_name_of(record.data): baseline.data}
        if results is None:
            results = gate_files(baseline, record, against_name)
    return write_report(out_dir, [record.data], baselines, results)


def gate_files(baseline: RecordLike, record: RecordLike, against_name: str) -> list:
    """The gate of ``record`` against ``baseline`` with the default tolerances (`gate.check.check`, the one
    verdict), labelled as ``circuits diff`` labels it (``baseline NAME``)."""
    return _checked(baseline, record, against_name).results


def _checked(baseline: RecordLike, record: RecordLike, against_name: str) -> Verdicts:
    from ..gate.check import check
    from ..gate.tolerances import Tolerances

    typed = Record.of(record)
    return check(
        baseline, typed, Tolerances(), build_name=data.build_name_of(typed.data), label=f"baseline {against_name}"
    )


def report_command(argv: Sequence[str] | None = None) -> int:
    """``circuits report BASELINE [--against BASELINE] [--out DIR]``; returns the exit status.

    With ``--against`` the build is gated against that baseline with the default tolerances
    (as ``circuits diff`` does) and the verdicts lead the page; the exit status stays 0 (the
    report was drawn): ``circuits gate`` is the command whose status is the verdict.
    """
    args = report_parser().parse_args(argv)
    if args.against:  # a file, or a shipped baseline's name
        args.against = str(baseline_file(args.against))
    try:
        record = read_record(args.baseline)  # each file read and validated once
        results = None
        baseline = None
        against_name = Path(args.against).name if args.against else ""
        if args.against:
            baseline = read_record(args.against)
            verdicts = _checked(baseline, record, against_name)
            for note in verdicts.notes:
                print(note)
            results = verdicts.results
        page = _report_of(args.out, record, baseline, against_name, results)
    except OSError as error:  # a write outside fsio (matplotlib's font cache, ...): still one line
        print(f"circuits report: {fs_error(error, error.filename or args.out, 'write')}", file=sys.stderr)
        return 2
    except CircuitsError as error:
        print(f"circuits report: {error}", file=sys.stderr)
        return 2
    for line in summary_lines(results or [], [record.data], page):
        print(line)
    if results is not None:
        from ..gate.invariants import verdict

        print(
            f"with default tolerances, {data.build_name_of(record.data)} against {Path(args.against).name}: {verdict(results)[1]}"
        )
    return 0
