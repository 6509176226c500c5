"""The supported names of ``pytest_circuits`` are a checked-in list: an API change is a visible diff."""

from __future__ import annotations

import importlib.metadata
import importlib.resources
import json
from pathlib import Path

import pytest_circuits

LISTED = Path(__file__).resolve().parent / "data" / "public_api.txt"


def test_the_public_names_are_the_checked_in_list():
    listed = LISTED.read_text(encoding="utf-8").split()
    assert pytest_circuits.__all__ == listed, (
        "the public API changed: update tests/data/public_api.txt, docs/api.md "
        "(python scripts/regenerate_docs.py) and CHANGELOG.md together"
    )


def test_every_public_name_resolves_and_private_ones_do_not_leak():
    for name in pytest_circuits.__all__:
        assert getattr(pytest_circuits, name) is not None, name
    assert "pytest_circuits" in repr(pytest_circuits.Invariant) and callable(pytest_circuits.register)
    try:
        pytest_circuits.REGISTRY  # noqa: B018  the registry itself is not public
    except AttributeError as error:
        assert "no attribute 'REGISTRY'" in str(error)
    else:
        raise AssertionError("REGISTRY is reachable from the top level")


def test_the_package_ships_py_typed():
    """The package as imported carries py.typed (PEP 561) however it was installed, editable or from a
    wheel; an installed wheel also lists it among its files (a fresh wheel: tests/test_packaging.py)."""
    assert (importlib.resources.files("pytest_circuits") / "py.typed").is_file()
    dist = importlib.metadata.distribution("pytest-circuits")
    origin = json.loads(dist.read_text("direct_url.json") or "{}")
    if not origin.get("dir_info", {}).get("editable"):  # an editable install lists a path hook, not the files
        assert "pytest_circuits/py.typed" in {str(f).replace("\\", "/") for f in dist.files or ()}


def test_the_removed_names_are_gone():
    """0.x removes what a redesign replaced (#50): no deprecated alias resolves."""
    import pytest

    for name in ("register_invariant", "Run", "CircuitsDeprecationWarning"):
        assert name not in pytest_circuits.__all__
        with pytest.raises(AttributeError):
            getattr(pytest_circuits, name)
