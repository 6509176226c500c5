"""The README states facts declared in code; these keep the two in step."""

from __future__ import annotations

import re
from pathlib import Path

from pytest_circuits.gate.invariants import REGISTRY
from pytest_circuits.gate.tolerances import Tolerances
from pytest_circuits.options import markdown_table

README = (Path(__file__).resolve().parent.parent / "README.md").read_text(encoding="utf-8")


def test_the_options_table_is_the_one_in_options_py():
    block = re.search(r"<!-- options:.*?-->\n(.*?)\n<!-- /options -->", README, re.S).group(1)
    rows = "\n".join(line for line in block.splitlines() if line.startswith("| `"))
    assert rows == markdown_table(), (
        "regenerate the README table: python -c 'from pytest_circuits.options "
        "import markdown_table; print(markdown_table())'"
    )


def test_every_invariant_and_tolerance_is_documented():
    for name in REGISTRY:
        assert f"| `{name}` |" in README
    for name, value in Tolerances().as_dict().items():
        assert f"`{name}` {value:g}" in README or f"`{name}` {value}" in README, name
