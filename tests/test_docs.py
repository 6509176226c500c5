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


@pytest.mark.parametrize("name", ["options", "invariants", "tolerances", "public_api", "recipes", "exit_codes"])
def test_the_generated_tables_are_current(name):
    if name not in REGENERATE.GENERATORS:
        pytest.fail(f"no generator {name}")
    expected = REGENERATE.GENERATORS[name]()
    for page, block, text in _blocks():
        if block == name:
            assert text == expected, f"{page.name}: block {name} is stale; {FIX}"


def test_no_page_holds_a_stray_block_marker():
    """docs/builds.md began its Recipes with a closing ``<!-- /options -->`` that opened nothing (#54)."""
    for page in REGENERATE.PAGES:
        text = page.read_text(encoding="utf-8")
        for close in re.finditer(r"^<!-- /(.*?) -->", text, re.M):
            opened = f"<!-- {close.group(1)}"
            assert opened in text[: close.start()], f"{page.name}: {close.group(0)} closes no block"


def test_the_builds_page_lists_every_recipe_the_cli_knows():
    """The issue's count: docs/builds.md's Recipes named 8 of the 13 recipes."""
    from pytest_circuits.model.recipes import RECIPES

    text = (ROOT / "docs" / "builds.md").read_text(encoding="utf-8")
    section = text.split("## Recipes\n", 1)[1].split("\n## ", 1)[0]
    assert len(RECIPES) >= 13
    for name in [*RECIPES, "fp8-e4m3-dyn", "int8-w8a8", "gptq-int4", "awq-int4"]:
        assert f"| `{name}` |" in section, name


def test_the_built_in_tolerance_table_is_generated_from_the_invariants():
    """The table the plugin declares its ini keys from at start-up is what the invariants declare."""
    assert REGENERATE.TABLE_MODULE.read_text(encoding="utf-8") == REGENERATE.tolerance_table_module(), FIX


def test_the_failure_example_is_what_the_gate_prints_today():
    """The README's example is a real `circuits gate` run (about 10 s of CPU), not typed text: its verdicts,
    names, counts and lines exactly, its figures within the rounding of another CPU (`FIGURE_TOLERANCE`)."""
    expected = REGENERATE.failure_example()
    found = [(page, text) for page, block, text in _blocks() if block == "failure"]
    assert any(page.name == "README.md" for page, _ in found)
    for page, text in found:
        difference = REGENERATE.failure_differs(text, expected)
        assert difference is None, f"{page.name}: the failure example is stale ({difference}); {FIX}"
    assert "FAIL copying_heads" in expected and "gate failed" in expected


def _nudged(text: str, by: float, index: int) -> str:
    """``text`` with its ``index``-th figure moved by ``by``, printed as the gate prints it."""
    matches = list(REGENERATE.NUMBER.finditer(text))
    figure = matches[index]
    value = float(figure.group()) + by
    decimals = len(figure.group().split(".")[1])
    return text[: figure.start()] + f"{value:+.{decimals}f}" + text[figure.end() :]


@pytest.mark.parametrize("index", [0, 7, -1])
def test_the_failure_example_allows_a_cpus_rounding_and_nothing_more(index):
    """A figure moved by 1e-3 (another CPU's rounding) still matches; by 0.1 it is stale; so is a verdict,
    a head name, a count or a line changed with every figure kept."""
    (text,) = [text for page, block, text in _blocks() if block == "failure" and page.name == "README.md"]
    assert REGENERATE.FIGURE_TOLERANCE < 0.1
    assert REGENERATE.failure_differs(text, _nudged(text, 1e-3, index)) is None
    assert REGENERATE.failure_differs(text, _nudged(text, -1e-3, index)) is None
    assert "beyond" in REGENERATE.failure_differs(text, _nudged(text, 0.1, index))
    assert "beyond" in REGENERATE.failure_differs(text, _nudged(text, -0.1, index))
    for old, new in [("FAIL copying_heads", "PASS copying_heads"), ("L1H0", "L1H1"), ("2 of 6", "3 of 6")]:
        assert "text differs" in REGENERATE.failure_differs(text, text.replace(old, new, 1))
    assert "text differs" in REGENERATE.failure_differs(text, text.replace("\n", "\n\n", 1))


@pytest.mark.slow
def test_the_failure_example_holds_under_another_cpus_kernels(monkeypatch):
    """The generic (non-vectorised) ATen kernels round differently from this CPU's AVX ones: the example
    still matches (on the machine it was measured on, 5 figures moved by 0.001)."""
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "default")
    (text,) = [text for page, block, text in _blocks() if block == "failure" and page.name == "README.md"]
    assert REGENERATE.failure_differs(text, REGENERATE.failure_example()) is None


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


def _develop_lines() -> list[str]:
    """The commands of the README's "Develop" block."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    section = text.split("\n## Develop\n", 1)[1].split("\n## ", 1)[0]
    block = re.search(r"^```console\n(.*?)^```", section, re.S | re.M)
    assert block, 'README.md: the "Develop" section has no console block of set-up lines'
    return [line.strip() for line in block.group(1).splitlines() if line.strip()]


def test_ci_runs_the_readmes_develop_lines_verbatim():
    """.ci/run installs and tests with exactly the README's lines, in their order (its lint and docs
    steps and extra installs may come between): a README change that CI does not run fails here."""
    lines = _develop_lines()
    assert lines[-1] == "python -m pytest" and any(line.startswith("pip install -e ") for line in lines)
    ci = [line.strip() for line in (ROOT / ".ci" / "run").read_text(encoding="utf-8").splitlines()]
    at = 0
    for line in lines:
        assert line in ci[at:], f".ci/run does not run the README's Develop line {line!r} (after line {at})"
        at = ci.index(line, at) + 1


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


def measure_formats():
    spec = importlib.util.spec_from_file_location("measure_formats", ROOT / "scripts" / "measure_formats.py")
    assert spec is not None and spec.loader is not None
    measure = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(measure)
    return measure


def test_every_measured_table_of_formats_and_kv_cache_is_one_plan_of_one_command():
    """``python scripts/measure_formats.py --all --write-docs`` rewrites every ``measured`` block of
    docs/formats.md and docs/kv-cache.md: each block is one of its `PLANS`, each plan a block."""
    measure = measure_formats()
    found = {
        (page, match.group(2))
        for page in ("docs/formats.md", "docs/kv-cache.md")
        for match in measure.BLOCK.finditer((ROOT / page).read_text(encoding="utf-8"))
    }
    assert found == {(page, block) for block, (page, _) in measure.PLANS.items()}
    text = (ROOT / "docs" / "kv-cache.md").read_text(encoding="utf-8")
    for block, (page, arguments) in measure.PLANS.items():  # a block written by its plan shows its plan's command
        if page.endswith("kv-cache.md") and arguments:
            assert f"<!-- measured: {block} -->\n`python scripts/measure_formats.py {' '.join(arguments)}`" in text


def test_the_llama_tables_say_the_number_of_sequences_their_plan_runs():
    """A llama table's heading (``..., L = 64, n = 64: ...``) is its plan's ``--probe-n`` (the option's
    default, 8, without one), and its command is the plan's: rerun, it measures the same sequences."""
    measure = measure_formats()
    text = (ROOT / "docs" / "kv-cache.md").read_text(encoding="utf-8")
    shown = {m.group(2): m.group(3) for m in measure.BLOCK.finditer(text)}
    for block, (_, arguments) in measure.PLANS.items():
        if "--llama-cpp" in arguments:
            n = arguments[arguments.index("--probe-n") + 1] if "--probe-n" in arguments else "8"
            length = arguments[arguments.index("--probe-length") + 1]
            assert f", L = {length}, n = {n}: " in shown[block].splitlines()[2], block


def fake_probe(settings, offset: float) -> dict:
    """Probe figures of ``settings.n`` sequences, each sequence's copy loss ``i / 10 + offset``."""
    values = [i / 10 + offset for i in range(settings.n)]
    mean = sum(values) / len(values)
    return {"copy_loss": mean, "copy_loss_sequences": values, "copy_loss_interval": [mean - 1, mean + 1]}


def test_probe_n_reaches_a_llama_tables_plan_heading_and_command(monkeypatch, capsys, tmp_path):
    """``--probe-n`` sets the sequences of every run of a llama table (llama.cpp's, torch's, fp32's
    record), its heading, its record folder and the command shown above it; that command, run again,
    writes the same table. The cache's part of the gap is the gap less the f16 row's, per sequence:
    here llama.cpp runs each sequence 0.25 above torch with q4_0 beyond what it runs it with f16."""
    from pytest_circuits.model import gguf_quant
    from pytest_circuits.testing import has_embedded_model

    if not has_embedded_model():
        pytest.skip("the embedded model is not installed")
    measure = measure_formats()
    seen = []
    simulated = {None: 0.0, "q4_0": 0.5}  # torch's copy loss with each cache (f16: none)
    activations = 0.125  # llama.cpp's own gap on the f16 row (its activations), the same for every cache
    part = {None: 0.0, "q4_0": 0.25}  # the cache's own part beyond it, by construction

    def llama_run(source, spec, kv, settings):
        seen.append(settings.n)
        cache = None if kv is None else kv.name
        return fake_probe(settings, simulated[cache] + activations + part[cache])

    def torch_pair(source, spec, kv, settings, bumped=False):
        seen.append(settings.n)
        return fake_probe(settings, simulated[None if kv is None else kv.name])

    monkeypatch.setattr(measure, "llama_run", llama_run)
    monkeypatch.setattr(measure, "torch_pair", torch_pair)
    monkeypatch.setattr(gguf_quant, "cached_gguf", lambda model, kind: tmp_path / f"{kind}.gguf")
    page = tmp_path / "page.md"
    page.write_text("<!-- measured: t -->\n<!-- /measured: t -->\n", encoding="utf-8")
    command = ["--llama-cpp", "Q8_0", "--probe-length", "16", "--probe-n", "3", "--caches", "f16,q4_0", "--spread", "-"]
    measure.main([*command, "--records", str(tmp_path / "records"), "--write-docs", f"{page}:t"])
    assert seen and set(seen) == {3}
    fp32 = (tmp_path / "records" / "tiny-induction-L16-n3" / "llama-fp32-record.json").read_text(encoding="utf-8")
    assert len(__import__("json").loads(fp32)["copy_loss_sequences"]) == 3
    written = page.read_text(encoding="utf-8").splitlines()
    assert written[1] == f"`python scripts/measure_formats.py {' '.join(command)}`"
    assert "tiny-induction, L = 16, n = 3: " in written[3]
    rows = {line.split(" | ")[1]: line.split(" | ") for line in written if line.startswith("| Q8_0 ")}
    assert rows["f16"][5] == "n/a (activations)"
    assert rows["q4_0"][5] == "+0.250 [+0.250, +0.250]"
    capsys.readouterr()
    shown = written[1].strip("`").split()[2:]
    measure.main([*shown, "--records", str(tmp_path / "again")])
    assert [line for line in capsys.readouterr().out.splitlines() if line.startswith("| Q8_0 ")] == [
        line for line in written if line.startswith("| Q8_0 ")
    ]


def fresh_row(capsys, tmp_path, block: str, build: str) -> tuple[list[str], list[str]]:
    """``(the page's lines, a fresh run's lines)`` of plan ``block`` measuring fp32 and ``build`` only;
    the last column (seconds) of every row dropped."""
    measure = measure_formats()
    page, arguments = measure.PLANS[block]
    arguments = list(arguments)
    arguments[arguments.index("--builds") + 1] = build
    capsys.readouterr()
    measure.main([*arguments, "--records", str(tmp_path)])
    fresh = capsys.readouterr().out.splitlines()
    text = (ROOT / page).read_text(encoding="utf-8")
    shown = next(m.group(3) for m in measure.BLOCK.finditer(text) if m.group(2) == block).splitlines()

    def trimmed(lines):
        return [line.rsplit("|", 2)[0] if line.startswith("| ") else line for line in lines if line]

    return trimmed(shown), trimmed(fresh)


@pytest.mark.parametrize(
    "block, build",
    [
        ("kv-tiny-L64", "bf16+kv-q8_0"),
        pytest.param("kv-smollm2-L64", "bf16+kv-q4_0", marks=[pytest.mark.slow, pytest.mark.real]),
    ],
)
def test_a_measured_kv_table_is_what_its_plan_measures_today(capsys, tmp_path, block, build):
    """One cheap row of a table, measured again by its plan: its figures (and fp32's, and the header
    naming fp32's induction heads) are the page's, to the digit. A table left stale after a change to
    the code it measures fails here."""
    from pytest_circuits.testing import has_embedded_model, has_smollm2

    if not (has_smollm2() if "smollm2" in block else has_embedded_model()):
        pytest.skip("the model of this table is not installed")
    shown, fresh = fresh_row(capsys, tmp_path, block, build)
    assert fresh[0] in shown, (fresh[0], shown[:2])  # fp32's induction heads
    for row in fresh[1:]:
        assert row in shown, f"{block}: a fresh run gives {row!r}; regenerate the table (see its command)"


def test_ci_runs_the_whole_suite_from_an_installed_wheel_outside_the_clone():
    """#54: the README's test command runs in CI against a wheel (not the editable checkout), from a copy
    of the clone without the package, after checking that the import finds the installed one."""
    ci = [line.strip() for line in (ROOT / ".ci" / "run").read_text(encoding="utf-8").splitlines()]
    at = 0
    for start in (
        "pip wheel -q --no-deps -w",
        "pip uninstall -q -y pytest-circuits",
        "pip install -q --no-deps",
        "tar -cf - --exclude=./pytest_circuits",
        'cd "$outside"',
        "python -c 'import pathlib, pytest_circuits",
    ):
        at = next((i for i in range(at, len(ci)) if ci[i].startswith(start)), None)
        assert at is not None, f".ci/run: no step {start!r} where the wheel's run needs it"
    assert "site-packages" in ci[at] and ci[at + 1] == "python -m pytest", "the import checked, then the suite"


def test_the_gate_of_every_recipe_is_measured_and_gives_the_stored_records_verdicts(capsys):
    """#55 item 4: docs/scale.md's table of SmolLM2's whole gates holds every recipe shipped with a
    baseline, and each row's verdict is what ``circuits diff`` of the stored fp32 and build records
    gives (the invariants that fail, by name): a live gate on the key heads alone decided as the full
    records do, and a baseline recorded again with other verdicts leaves the table stale here."""
    from pytest_circuits.cli import main
    from pytest_circuits.record.store import shipped_baselines

    text = (ROOT / "docs" / "scale.md").read_text(encoding="utf-8")
    blocks = re.findall(
        r"<!-- measured: begin \(scripts/measure_gate_speed.py --results (\S+)\) -->(.*?)<!-- measured: end -->",
        text,
        re.S,
    )
    assert len(blocks) >= 2, "a table per machine: one with bfloat16 kernels, one without"
    shipped = shipped_baselines()
    recipes = {name.split("--")[1] for name in shipped if name.startswith("smollm2-135m--")} - {"fp32"}
    said_by_build: dict[str, set[str]] = {}
    for results, block in blocks:
        assert (ROOT / results).is_file(), results
        cells = [
            [c.strip() for c in line.strip("|").split("|")] for line in block.splitlines() if line.startswith("| ")
        ]
        rows = {row[0]: row[-2] for row in cells[1:]}  # build -> verdicts (the header left out)
        assert set(rows) == recipes, (
            f"regenerate: python scripts/measure_gate_speed.py --builds all --results {results} --write-docs"
        )
        for build, said in rows.items():
            said_by_build.setdefault(build, set()).add(said)
    for build, said in said_by_build.items():
        capsys.readouterr()
        main(["diff", str(shipped["smollm2-135m--fp32"]), str(shipped[f"smollm2-135m--{build}"])])
        verdict = re.search(r"gate (passed|failed: ([\w, ]+)) \(", capsys.readouterr().out)
        assert verdict is not None, build
        assert said == {"FAIL " + verdict.group(2) if verdict.group(2) else "pass"}, build
