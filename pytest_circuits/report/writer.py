"""Write the report folder (HTML page, summary.md, PNGs) from scan records, or from baseline files."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from ..errors import CircuitsError
from ..gate.store import read_baseline
from . import data, figures, html, markdown
from .sections import build_section
from .summary import REPORT_PAGE, SUMMARY_PAGE, summary_lines

DEFAULT_OUT = "circuits-report"


def write_report(
    out_dir: str | Path,
    records: Iterable[dict],
    references: dict[str, dict | None] | None = None,
    results: Iterable[Any] | None = None,
) -> Path:
    """Write ``report.html``, ``summary.md`` and one PNG per figure into ``out_dir``; return the page's path.

    ``records``: one scan record per build. ``references``: recipe -> the scan record the build
    was gated against (its per-head maps are drawn as differences). ``results``: the gate's
    InvariantResults (objects or dicts); failed ones are named at the top of the page.
    """
    figures.require_matplotlib()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    grouped = data.results_by_build(results)
    references = references or {}
    sections, used = [], set()
    for record in records:
        recipe = data.recipe_of(record)
        slug = data.slug(recipe)
        while slug in used:
            slug += "-2"
        used.add(slug)
        sections.append(build_section(record, references.get(recipe), grouped.get(recipe, []), slug))
    seen = {s.label for s in sections}
    extra = [r for build, rs in grouped.items() if build not in seen for r in rs]
    for section in sections:
        for figure in section.figures:
            (out / figure.file).write_bytes(figure.png)
    (out / SUMMARY_PAGE).write_text(markdown.summary(sections, extra), encoding="utf-8")
    page = out / REPORT_PAGE
    page.write_text(html.page(sections, extra), encoding="utf-8")
    return page


def report_from_files(
    out_dir: str | Path,
    baseline_path: str | Path,
    against_path: str | Path | None = None,
    results: Iterable[Any] | None = None,
) -> Path:
    """Draw the report again from baseline files alone, without the model.

    ``baseline_path`` is the build shown; ``against_path`` (optional) the reference it is drawn
    against. Without ``results`` the differences are descriptive: verdicts come from the gate.
    """
    record = read_baseline(baseline_path)
    references: dict[str, dict | None] | None = (
        {data.recipe_of(record): read_baseline(against_path)} if against_path else None
    )
    return write_report(out_dir, [record], references, results)


def report_command(argv: Sequence[str] | None = None) -> int:
    """``circuits report BASELINE [--against BASELINE] [--out DIR]``; returns the exit status."""
    parser = argparse.ArgumentParser(
        prog="circuits report", description="Draw the circuits report again from baseline files, without the model."
    )
    parser.add_argument("baseline", help="baseline JSON file of the build to show")
    parser.add_argument("--against", help="baseline JSON file of the reference to draw differences against")
    parser.add_argument("--out", "-o", default=DEFAULT_OUT, help=f"report folder (default: {DEFAULT_OUT})")
    args = parser.parse_args(argv)
    try:
        page = report_from_files(args.out, args.baseline, args.against)
        record = read_baseline(args.baseline)
    except CircuitsError as error:
        print(f"circuits report: {error}", file=sys.stderr)
        return 2
    for line in summary_lines([], [record], page):
        print(line)
    return 0
