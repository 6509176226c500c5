"""The circuits report: an HTML page, ``summary.md`` and PNG figures of the heads and what moved.

Importing this package imports nothing heavy (``circuits report --help`` answers at once); each
name below loads its module on first use, and drawing imports matplotlib.

- ``write_report(out_dir, records, baselines=None, results=None) -> Path`` (the HTML page)
- ``summary_lines(results, records=None, report_dir=None) -> list[str]`` (terminal summary)
- ``report_from_files(out_dir, baseline_path, against_path=None, results=None) -> Path``
- ``report_command(argv) -> int``: ``circuits report BASELINE [--against BASELINE] [--out DIR]``
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .summary import REPORT_PAGE, SUMMARY_PAGE, summary_lines
    from .writer import report_command, report_from_files, write_report

_HOME = {
    "REPORT_PAGE": "summary",
    "SUMMARY_PAGE": "summary",
    "summary_lines": "summary",
    "report_command": "writer",
    "report_from_files": "writer",
    "write_report": "writer",
}
__all__ = ["REPORT_PAGE", "SUMMARY_PAGE", "report_command", "report_from_files", "summary_lines", "write_report"]


def __getattr__(name: str) -> Any:
    if name in _HOME:
        return getattr(import_module(f".{_HOME[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
