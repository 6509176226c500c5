"""The package's own Python warnings are one class, and this suite runs with them as errors (pyproject.toml)."""

from __future__ import annotations

import ast
import warnings
from pathlib import Path

import pytest

import pytest_circuits
from pytest_circuits.errors import CircuitsWarning

PACKAGE = Path(pytest_circuits.__file__).resolve().parent  # the checkout's, or the installed wheel's


def _warn_calls() -> list[tuple[str, ast.Call]]:
    calls = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Call) and ast.unparse(node.func) == "warnings.warn":
                calls.append((f"{path.relative_to(PACKAGE.parent)}:{node.lineno}", node))
    return calls


def test_every_warning_the_package_issues_is_a_circuits_warning():
    calls = _warn_calls()
    assert calls, "no warnings.warn call found: the scan itself is broken"
    for where, call in calls:
        category = (
            call.args[1] if len(call.args) > 1 else next((k.value for k in call.keywords if k.arg == "category"), None)
        )
        assert category is not None and ast.unparse(category) == "CircuitsWarning", (
            f"{where}: warnings.warn without CircuitsWarning (the suite's filter would let it pass)"
        )


def test_a_circuits_warning_fails_this_suite():
    """The ini filter ``error::pytest_circuits.errors.CircuitsWarning`` is in force inside every test."""
    with pytest.raises(CircuitsWarning, match="an own warning"):
        warnings.warn("an own warning", CircuitsWarning, stacklevel=1)
    assert issubclass(CircuitsWarning, UserWarning)  # users' pytest.warns(UserWarning) still catches it
