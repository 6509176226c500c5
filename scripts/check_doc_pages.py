#!/usr/bin/env python
"""Check the built docs site as a person reads it: headless Chromium at a laptop's width.

For every page of the site folder (``mkdocs build --site-dir SITE``) it loads a copy with a small
script added and reads back what the browser laid out:

- the page itself is no wider than the window;
- no table is wider than its column (material scrolls it, hiding its last columns);
- no code span without a break opportunity (an identifier such as ``kappa_distribution``) is
  broken across lines.

Prints one line per problem and exits 1 when there is one; exits 2 when Chromium is missing.

    NO_MKDOCS_2_WARNING=1 mkdocs build --strict --site-dir /tmp/site && python scripts/check_doc_pages.py /tmp/site
"""

from __future__ import annotations

import argparse
import html
import json
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

WIDTH, HEIGHT = 1366, 900  # a common laptop screen
MEASURE = """<script>window.addEventListener('load', () => {
  const out = {page: document.documentElement.scrollWidth > window.innerWidth, tables: [], broken: []};
  document.querySelectorAll('article .md-typeset__scrollwrap').forEach((wrap, i) => {
    if (wrap.scrollWidth > wrap.clientWidth + 1) out.tables.push([i + 1, wrap.scrollWidth, wrap.clientWidth]); });
  document.querySelectorAll('article td code, article th code').forEach(code => {
    if (!/[\\s\\-\\/,|]/.test(code.textContent) && code.getClientRects().length > 1) out.broken.push(code.textContent); });
  const said = document.createElement('div'); said.id = 'laid-out'; said.textContent = JSON.stringify(out);
  document.body.appendChild(said); });</script>"""
FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--no-first-run",
    "--disable-sync",
    f"--window-size={WIDTH},{HEIGHT}",
    "--virtual-time-budget=3000",
    "--dump-dom",
)


def chromium() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")


def laid_out(browser: str, page: Path, profile: Path) -> dict:
    """What the browser laid out for ``page`` (a copy with `MEASURE` added, beside it)."""
    probe = page.with_name(f".laid-out-{page.name}")
    probe.write_text(page.read_text(encoding="utf-8").replace("</body>", MEASURE + "</body>"), encoding="utf-8")
    try:
        run = [browser, *FLAGS, f"--user-data-dir={profile}", probe.as_uri()]
        dom = subprocess.run(run, capture_output=True, text=True, timeout=120).stdout
    finally:
        probe.unlink()
    found = re.search(r'<div id="laid-out">(.*?)</div>', dom)
    if found is None:
        raise SystemExit(f"{page}: Chromium returned no layout (is it a page of the site?)")
    return json.loads(html.unescape(found.group(1)))


def problems(site: Path, browser: str) -> list[str]:
    said = []
    with tempfile.TemporaryDirectory() as profile:
        for page in sorted(site.rglob("index.html")):
            name = str(page.parent.relative_to(site)) or "home"
            out = laid_out(browser, page, Path(profile))
            if out["page"]:
                said.append(f"{name}: the page is wider than a {WIDTH} px window")
            for index, wide, room in out["tables"]:
                said.append(f"{name}: table {index} is {wide} px wide in a {room} px column (its last columns scroll)")
            for text in sorted(set(out["broken"])):
                said.append(f"{name}: `{text}` breaks mid-word in a table")
    return said


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("site", type=Path, help="the folder mkdocs built")
    args = parser.parse_args(argv)
    browser = chromium()
    if browser is None:
        print("check_doc_pages: Chromium is not installed (apt-get install chromium)", file=sys.stderr)
        return 2
    if not (args.site / "index.html").is_file():
        print(f"check_doc_pages: {args.site} has no index.html; build the site first (mkdocs build)", file=sys.stderr)
        return 2
    found = problems(args.site, browser)
    for line in found:
        print(line)
    print(
        f"{len(found)} problems in the pages of {args.site} at {WIDTH} px"
        if found
        else "every page reads at a laptop's width"
    )
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
