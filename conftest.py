"""Repository-level pytest configuration: slow tests run only when asked for.

The plugin itself is registered through the ``pytest11`` entry point (pyproject.toml);
this file only keeps the default test run fast.
"""

from __future__ import annotations

import pytest

collect_ignore = ["scripts"]


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--run-slow", action="store_true", default=False, help="also run tests marked slow")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if config.getoption("--run-slow"):
        return
    skip_slow = pytest.mark.skip(reason="slow: run with --run-slow")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip_slow)
