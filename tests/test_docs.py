"""The docs restate facts declared in code; these keep the two in step (scripts/regenerate_docs.py)."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent


def _script():
    spec = importlib.util.spec_from_file_location("regenerate_docs", ROOT / "scripts" / "regenerate_docs.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


REGENERATE = _script()
FIX = "regenerate with: python scripts/regenerate_docs.py"


def _blocks() -> list[tuple[Path, str, str]]:
    return [
        (page, match.group(2), match.group(3))
        for page in REGENERATE.PAGES
        for match in REGENERATE.BLOCK.finditer(page.read_text(encoding="utf-8"))
    ]


def test_every_generator_fills_a_block():
    names = {name for _, name, _ in _blocks()}
    assert names == set(REGENERATE.GENERATORS), "a generator whose block is nowhere, or a block without a generator"


@pytest.mark.parametrize("name", [n for n in ("options", "invariants", "tolerances", "public_api")])
def test_the_generated_tables_are_current(name):
    if name not in REGENERATE.GENERATORS:
        pytest.fail(f"no generator {name}")
    expected = REGENERATE.GENERATORS[name]()
    for page, block, text in _blocks():
        if block == name:
            assert text == expected, f"{page.name}: block {name} is stale; {FIX}"


def test_the_failure_example_is_what_the_gate_prints_today():
    """The README's example is a real `circuits gate` run (about 10 s of CPU), not typed text."""
    expected = REGENERATE.failure_example()
    found = [(page, text) for page, block, text in _blocks() if block == "failure"]
    assert any(page.name == "README.md" for page, _ in found)
    for page, text in found:
        assert text == expected, f"{page.name}: the failure example is stale; {FIX}"
    assert "FAIL copying_heads" in expected and "gate failed" in expected


def test_the_invariants_table_holds_every_registered_invariant_and_its_tolerances():
    """Against the registry itself, so an invariant the generator missed is caught."""
    from pytest_circuits.gate.invariants import REGISTRY
    from pytest_circuits.gate.tolerances import Tolerances

    table = REGENERATE.invariants_table()
    tolerances = REGENERATE.tolerances_table()
    for name, invariant in REGISTRY.items():
        row = next(line for line in table.splitlines() if line.startswith(f"| `{name}` |"))
        for tolerance in invariant.tolerances:
            assert f"`{tolerance}`" in row
    for name, value in Tolerances().as_dict().items():
        line = next(line for line in tolerances.splitlines() if line.startswith(f"| `{name}` |"))
        assert f"| `{value}` |" in line and not line.endswith("|  |"), f"{name}: no default or no meaning"


def test_the_families_table_is_current():
    page = REGENERATE.FAMILIES_PAGE.read_text(encoding="utf-8")
    assert REGENERATE.families_regenerated(page) == page, FIX


def _nav_pages(nav) -> list[str]:
    pages = []
    for entry in nav:
        for value in entry.values() if isinstance(entry, dict) else [entry]:
            pages.extend(_nav_pages(value) if isinstance(value, list) else [value])
    return pages


def test_every_docs_page_is_in_the_site_nav():
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text(encoding="utf-8"))
    nav = _nav_pages(config["nav"])
    pages = sorted(p.name for p in (ROOT / "docs").glob("*.md"))
    assert sorted(nav) == pages, f"add to (or drop from) the nav of mkdocs.yml: {sorted(set(pages) ^ set(nav))}"


def test_the_readme_stays_short_and_names_no_chapter():
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    assert len(text.encode()) < 12 * 1024, "README.md over 12 KB: move the section to a page of docs/"
    for page in [ROOT / "README.md", *(ROOT / "docs").glob("*.md")]:
        assert not re.search(r"\bthe chapter\b", page.read_text(encoding="utf-8")), page.name
