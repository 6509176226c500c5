"""The circuits report: an HTML page, ``summary.md`` and PNG figures of the heads and what moved.

Importing this package does not import matplotlib; drawing does (``pip install matplotlib``).

- ``write_report(out_dir, records, references=None, results=None) -> Path`` (the HTML page)
- ``summary_lines(results, records=None, report_dir=None) -> list[str]`` (terminal summary)
- ``report_from_files(out_dir, baseline_path, against_path=None, results=None) -> Path``
- ``report_command(argv) -> int``: ``circuits report BASELINE [--against BASELINE] [--out DIR]``
"""

from .summary import REPORT_PAGE, SUMMARY_PAGE, summary_lines
from .writer import report_command, report_from_files, write_report

__all__ = ["REPORT_PAGE", "SUMMARY_PAGE", "report_command", "report_from_files", "summary_lines", "write_report"]
