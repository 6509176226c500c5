"""The ``circuits`` console script. `main` loads the command (`cli`: argparse, the option table,
the errors) inside its guard, so Ctrl-C while the command is still loading is one line and status
130, never a traceback: only this module and the package's light ``__init__`` load before it."""

import sys


def main() -> int:
    """`cli.main`, imported under the guard."""
    try:
        from .cli import main as run
    except KeyboardInterrupt:
        print("circuits: interrupted", file=sys.stderr)
        return 130
    return run()
