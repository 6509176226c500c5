"""The ``circuits report`` command line (no heavy imports: ``--help`` answers at once)."""

from __future__ import annotations

import argparse

DEFAULT_OUT = "circuits-report"


def report_parser() -> argparse.ArgumentParser:
    """``circuits report BASELINE [--against BASELINE] [--out DIR]``."""
    parser = argparse.ArgumentParser(
        prog="circuits report", description="Draw the circuits report again from baseline files, without the model."
    )
    parser.add_argument("baseline", help="baseline JSON file of the build to show")
    parser.add_argument(
        "--against",
        help="baseline JSON file to draw the build against, or a shipped one's name: gate against it (default tolerances) and draw differences",
    )
    parser.add_argument("--out", "-o", default=DEFAULT_OUT, help=f"report folder (default: {DEFAULT_OUT})")
    return parser
