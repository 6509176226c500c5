"""scripts/check_doc_pages.py, the docs check CI runs on the built site in Chromium: it finds what a
reader at a laptop's width would see go wrong, and passes a page that reads well."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
import check_doc_pages  # noqa: E402

pytestmark = pytest.mark.skipif(
    check_doc_pages.chromium() is None, reason="Chromium is not installed (apt-get install chromium; CI installs it)"
)
ROW = "<tr><td><code>{}</code></td><td>{}</td></tr>"


def _site(tmp_path: Path, table: str, style: str = "") -> Path:
    page = tmp_path / "site" / "wide" / "index.html"
    page.parent.mkdir(parents=True)
    body = f'<article class="md-typeset"><div class="md-typeset__scrollwrap" style="overflow-x:auto">{table}</div></article>'
    page.write_text(f"<html><head><style>{style}</style></head><body style='margin:0'>{body}</body></html>")
    shutil.copy(page, tmp_path / "site" / "index.html")
    return tmp_path / "site"


def test_a_wide_table_and_an_identifier_broken_mid_word_are_found(tmp_path):
    cells = "".join(f"<td>{'column ' * 3}{i}</td>" for i in range(40))
    table = f"<table><tr>{cells}</tr>{ROW.format('kappa_distribution', 'x')}</table>"
    narrow = "code { word-break: break-all; } td:first-child { width: 10px; max-width: 10px; }"
    said = check_doc_pages.problems(_site(tmp_path, table, narrow), check_doc_pages.chromium())
    assert any("table 1 is" in line and "its last columns scroll" in line for line in said), said
    assert any("`kappa_distribution` breaks mid-word" in line for line in said), said


def test_a_page_that_fits_has_no_problem(tmp_path):
    table = f"<table>{ROW.format('kappa_distribution', 'fits')}</table>"
    assert check_doc_pages.problems(_site(tmp_path, table), check_doc_pages.chromium()) == []
