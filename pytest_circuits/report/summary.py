"""The short terminal summary (for ``pytest_terminal_summary`` and the CLI); no matplotlib."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

from ..gate.invariants import guarded
from ..record.drawn import drawn_record
from . import data

REPORT_PAGE = "report.html"
SUMMARY_PAGE = "summary.md"
MOVED_PER_BUILD = 3
_MESSAGE_WIDTH = 100


def summary_lines(
    results: Iterable[Any] | None, records: Iterable[dict] | None = None, report_dir: str | Path | None = None
) -> list[str]:
    """Per build: pass or fail per invariant and the heads that moved most; then where the report is.

    Builds with a broken invariant come first. Builds with a record but no gate results get one
    line with their copy loss.
    """
    grouped = data.results_by_build(results)
    broken = [b for b, rs in grouped.items() if any(r["failed"] for r in rs)]
    grouped = {b: grouped[b] for b in broken + [b for b in grouped if b not in broken]}  # broken builds first
    lines = []
    for build, build_results in grouped.items():
        failed = [r for r in build_results if r["failed"]]
        against = sorted({r["against"] for r in build_results if r["against"]})
        head = f"circuits {build}" + (f" vs {', '.join(against)}" if against else "")
        held = sum(r["passed"] for r in build_results)
        verdict = (
            f"FAIL ({len(failed)} of {len(build_results)} invariants broken)"
            if failed
            else f"pass ({held} {'invariant' if held == 1 else 'invariants'} held{_clause(guarded(build_results))})"
        )
        lines.append(f"{head}: {verdict}")
        for r in failed:
            word = "ERROR" if r["status"] == "error" else "FAIL"
            lines.append(f"  {word} {r['invariant']}" + (f": {_first_line(r['message'])}" if r["message"] else ""))
        passed = [r for r in build_results if r["passed"]]
        for against_name in dict.fromkeys(r["against"] for r in passed):
            names = [r["invariant"] for r in passed if r["against"] == against_name]
            where = f" (vs {against_name})" if len(against) > 1 and against_name else ""
            lines.append(f"  pass{where} {', '.join(names)}")
        for reason, names in data.skip_reasons(build_results):
            lines.append(f"  skip {', '.join(names)}: {reason}")
        moved = data.top_moved(failed, MOVED_PER_BUILD) or data.top_moved(build_results, MOVED_PER_BUILD)
        if moved:
            lines.append("  moved most: " + "; ".join(_moved(m) for m in moved))
    for record in records or []:
        build = data.build_name_of(record)
        if build not in grouped:
            loss = data.fmt(drawn_record(record).figure("copy_loss"))
            lines.append(f"circuits {build}: scanned, not gated (copy loss {loss} nats)")
    if report_dir is not None:
        lines.append(f"circuits report: {_page(Path(report_dir))}")
    return lines


def _clause(text: str) -> str:
    return f"; {text}" if text else ""


def _moved(m: dict) -> str:
    text = f"{m.get('head')} {m.get('metric')} {data.fmt(m.get('before'))} -> {data.fmt(m.get('after'))}"
    tolerance = data.number(m.get("tolerance"))
    return text + (f" (tol {data.fmt(tolerance)})" if tolerance == tolerance else "")


def _first_line(message: str) -> str:
    line = next((l.strip() for l in message.splitlines() if l.strip()), "")
    return line if len(line) <= _MESSAGE_WIDTH else line[: _MESSAGE_WIDTH - 3] + "..."


def _page(report_dir: Path) -> Path:
    """The HTML page inside a report folder (or the path itself if it names a file)."""
    return report_dir if report_dir.suffix == ".html" else report_dir / REPORT_PAGE
