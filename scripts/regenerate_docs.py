"""Regenerate every docs block that restates the code: ``python scripts/regenerate_docs.py``.

A block sits between ``<!-- generated: NAME (...) -->`` and ``<!-- /generated: NAME -->`` at
the start of a line, in README.md or a page of docs/; `GENERATORS` says what writes each NAME:

- ``options``: the options table, from `pytest_circuits.options.OPTIONS`;
- ``invariants``: one row per registered invariant, from its own metadata (name, docstring,
  the tolerances it reads, whether it compares builds of one model or two base models);
- ``tolerances``: one row per tolerance with its default and what it means, as its invariant declares it;
- ``public_api``: ``pytest_circuits.__all__`` with each name's module and docstring summary;
- ``recipes``: every build recipe (`pytest_circuits.model.recipes.RECIPES`) and the rest of the build syntax;
- ``exit_codes``: the exit codes of ``circuits`` and of ``pytest`` (`pytest_circuits.cli_help`);
- ``failure``: the output of a real ``circuits gate`` of the embedded model with its induction
  head's OV reversed, quantized to nf4, against the shipped fp32 baseline (about 10 s of CPU).

``pytest_circuits/gate/tolerance_table.py`` is written whole (`tolerance_table_module`): the
built-in invariants' tolerances, for the plugin to declare its ini keys without importing them.
docs/families.md ends with `families_markdown()` (from its header row to the end of the file).
``--check`` writes nothing and exits 1 naming each stale block (tests/test_docs.py does the same).
The ``failure`` block is stale only when `failure_differs` says so: its figures may move within
`FIGURE_TOLERANCE` from one CPU to another, and a rerun within it leaves the block as it is.
"""

from __future__ import annotations

import inspect
import json
import re
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # this checkout's package, not another installed copy
    sys.path.insert(0, str(ROOT))
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
BLOCK = re.compile(r"^(<!-- generated: (\w+)[^\n]*-->\n)(.*?)(^<!-- /generated: \2 -->)", re.S | re.M)
FAMILIES_PAGE = ROOT / "docs" / "families.md"
FAMILIES_HEADER = "| model type | layout |"
NUMBER = re.compile(r"(?<![\w.])[+-]?\d+\.\d+(?![\w.])")  # a printed figure; integers (counts) are structure
# The example's figures are float32 sums (copy losses over the probe's tokens, kappa over each head's
# OV matrix, z-scores against a rotation null) printed to 3 decimals; a CPU's kernels (vector width,
# BLAS blocking) order those sums differently. Measured: ATEN_CPU_CAPABILITY=default against AVX-512
# on one machine moves figures by <= 0.001; another CPU (issue 42) moved them by <= 0.006
# (-9.923 -> -9.927, -2.494 -> -2.488). 0.03 is 5 times that, and 3 times below a change of 0.1.
FIGURE_TOLERANCE = 0.03
FAILURE_COMMAND = "circuits gate ./sabotaged --build bnb-nf4 --baseline tiny-induction--fp32"  # the shipped baseline


def options_table() -> str:
    from pytest_circuits.options import markdown_table
    from pytest_circuits.settings import option_help

    return "| option | ini | default | meaning |\n|---|---|---|---|\n" + markdown_table(option_help) + "\n"


def _words(text: str | None) -> str:
    return " ".join((text or "").split()).replace("|", "\\|")


def tolerances_table() -> str:
    from pytest_circuits.gate.invariants import declared_tolerances

    rows = ["| tolerance | default | meaning |", "|---|---|---|"]
    for name, tolerance in declared_tolerances().items():
        rows.append(f"| `{name}` | `{tolerance.default}` | {_words(tolerance.doc)} |")
    return "\n".join(rows) + "\n"


def _package() -> Path:
    import pytest_circuits  # light: its names load lazily

    return Path(pytest_circuits.__file__).resolve().parent


TABLE_MODULE = _package() / "gate" / "tolerance_table.py"  # this checkout's, or the installed wheel's (CI)


def tolerance_table_module() -> str:
    """``tolerance_table.py``: each built-in invariant's declared tolerance, in gate order."""
    from pytest_circuits.gate import invariants  # noqa: F401  (the built-in invariants registered)
    from pytest_circuits.gate.invariant_api import _DECLARED, BUILT_IN_MODULES, REGISTRY

    lines = [
        '"""The built-in invariants\' tolerances, name -> (default, meaning, least value or None), in gate order.',
        "",
        "Generated from the invariant registry by ``python scripts/regenerate_docs.py``: do not edit; declare a",
        "tolerance on its invariant (``Invariant.tolerances``). Light: the plugin reads it at start-up.",
        '"""',
        "",
        "# fmt: off",
        "BUILT_IN: dict[str, tuple[float | int | bool, str, float | int | None]] = {",
    ]
    for name, declared in _DECLARED.items():
        if type(REGISTRY[name]).__module__ not in BUILT_IN_MODULES:
            continue
        for tolerance, t in declared.items():
            lines.append(f"    {json.dumps(tolerance)}: ({t.default!r}, {json.dumps(t.doc)}, {t.minimum!r}),")
    return "\n".join([*lines, "}", "# fmt: on", ""])


def invariants_table() -> str:
    from pytest_circuits.gate.invariants import REGISTRY, tolerances_of
    from pytest_circuits.gate.tolerances import Tolerances

    defaults = Tolerances().values()
    rows = ["| invariant | compares | what it guards | tolerances (default) |", "|---|---|---|---|"]
    for name, invariant in REGISTRY.items():
        scope = "two base models" if invariant.across_models else "builds of one model"
        tolerances = ", ".join(f"`{t}` {defaults[t]}" for t in tolerances_of(invariant))
        rows.append(f"| `{name}` | {scope} | {_words(type(invariant).__doc__)} | {tolerances} |")
    return "\n".join(rows) + "\n"


def public_api_table() -> str:
    """``pytest_circuits.__all__``: each name, the module it lives in and its docstring's first line."""
    import pytest_circuits

    rows = ["| name | from | what it is |", "|---|---|---|"]
    for name in pytest_circuits.__all__:
        obj = getattr(pytest_circuits, name)
        if callable(obj):
            first = _words((inspect.getdoc(obj) or "").split("\n\n")[0])
        else:  # a constant: say what it holds
            first = f"a {type(obj).__name__} of {len(obj)} built-in entries"
        rows.append(f"| `{name}` | `pytest_circuits.{pytest_circuits._LAZY[name]}` | {first} |")
    return "\n".join(rows) + "\n"


def recipes_table() -> str:
    """docs/builds.md's recipes: every row of the recipe table, what it is and what makes it."""
    from pytest_circuits.model.recipes import RECIPES, build_syntax

    made_by = {
        "torch": "a cast",
        "bitsandbytes": "bitsandbytes (transformers' `BitsAndBytesConfig`; CPU with bitsandbytes >= 0.47)",
        "rtn": "simulated here (every attention and MLP weight)",
        "compressed-tensors": 'compressed-tensors in memory (`pip install "pytest-circuits[formats]"`)',
        "llm-compressor": "llm-compressor, out of process in [its own environment](formats.md#recipes)",
    }
    rows = ["| recipe | what it is | made by |", "|---|---|---|"]
    rows += [
        f"| `{name}` | {_words(r.summary).replace('<', '&lt;')} | {made_by[r.backend]} |" for name, r in RECIPES.items()
    ]
    syntax = "".join(f"\n- `{form}`: {_words(meaning)}" for form, meaning in build_syntax()[1:])
    return "\n".join(rows) + "\n\nBeside a recipe:\n" + syntax + "\n"


def exit_codes_table() -> str:
    from pytest_circuits.cli_help import exit_codes_markdown

    return exit_codes_markdown()


def failure_example() -> str:
    """``FAILURE_COMMAND`` run for real in a scratch folder holding the sabotaged model (the baseline: the package's)."""
    from pytest_circuits.testing import save_sabotaged

    with tempfile.TemporaryDirectory() as scratch:
        folder = Path(scratch)
        save_sabotaged(folder / "sabotaged")  # the README's two lines: L1H0 writes the opposite of what it reads
        done = subprocess.run(
            [sys.executable, "-m", "pytest_circuits.cli", *FAILURE_COMMAND.split()[1:]],
            cwd=folder,
            capture_output=True,
            text=True,
            timeout=600,
            env=_env(),
        )
    if done.returncode != 1:
        raise RuntimeError(f"{FAILURE_COMMAND} exited {done.returncode}, not 1:\n{done.stdout}{done.stderr}")
    return f"```text\n$ {FAILURE_COMMAND}\n{done.stdout.rstrip()}\n```\n"


def failure_differs(expected: str, found: str, tolerance: float = FIGURE_TOLERANCE) -> str | None:
    """How ``found`` differs from ``expected`` beyond a CPU's rounding, or None: the text between
    figures (verdicts, names, counts, lines) must be equal, each figure within ``tolerance``."""
    if NUMBER.sub("#", expected) != NUMBER.sub("#", found):
        lines = zip(NUMBER.sub("#", expected).splitlines(), NUMBER.sub("#", found).splitlines())
        first = next(((a, b) for a, b in lines if a != b), ("(a line count)", "(differs)"))
        return f"the text differs: {first[0]!r} became {first[1]!r}"
    for a, b in zip(NUMBER.findall(expected), NUMBER.findall(found)):
        if abs(float(a) - float(b)) > tolerance:
            return f"a figure moved beyond {tolerance}: {a} became {b}"
    return None


def _env() -> dict:
    import os

    return {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"}


GENERATORS: dict[str, Callable[[], str]] = {
    "options": options_table,
    "invariants": invariants_table,
    "tolerances": tolerances_table,
    "failure": failure_example,
    "public_api": public_api_table,
    "recipes": recipes_table,
    "exit_codes": exit_codes_table,
}


def regenerated(text: str, cache: dict[str, str]) -> str:
    """``text`` with every generated block rewritten (each generator runs once, through ``cache``)."""

    def fill(match: re.Match) -> str:
        name = match.group(2)
        if name not in GENERATORS:
            raise KeyError(f"no generator for block {name!r}; known: {', '.join(GENERATORS)}")
        if name not in cache:
            cache[name] = GENERATORS[name]()
        if name == "failure" and failure_differs(match.group(3), cache[name]) is None:
            return match.group(0)  # the same run on this CPU: keep the block as it is
        return match.group(1) + cache[name] + match.group(4)

    return BLOCK.sub(fill, text)


def families_regenerated(text: str) -> str:
    from pytest_circuits.model.families import families_markdown

    start = text.index(FAMILIES_HEADER)
    return text[:start] + families_markdown()


def main(argv: list[str]) -> int:
    check = "--check" in argv
    cache: dict[str, str] = {}
    stale = []
    for page in PAGES:
        text = page.read_text(encoding="utf-8")
        new = regenerated(text, cache)
        if page == FAMILIES_PAGE:
            new = families_regenerated(new)
        if new != text:
            stale.append(page.relative_to(ROOT))
            if not check:
                page.write_text(new, encoding="utf-8")
    module = tolerance_table_module()
    if TABLE_MODULE.read_text(encoding="utf-8") != module:
        stale.append(TABLE_MODULE.relative_to(ROOT))
        if not check:
            TABLE_MODULE.write_text(module, encoding="utf-8")
    verb = "stale" if check else "rewritten"
    print(f"{verb}: {', '.join(map(str, stale))}" if stale else "every generated block is current")
    return 1 if check and stale else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
