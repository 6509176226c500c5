"""The plugin's fixtures: prefixed ``circuits_``, annotated, typed objects; the old names are gone."""

from __future__ import annotations

import ast

from pytest_circuits.testing import save_tiny_model

from .conftest import IMPORT_ROOT, PACKAGE

PLUGIN = PACKAGE / "plugin" / "__init__.py"


def _fixtures() -> list[ast.FunctionDef]:
    tree = ast.parse(PLUGIN.read_text(encoding="utf-8"))
    return [
        node
        for node in tree.body
        if isinstance(node, ast.FunctionDef) and any("fixture" in ast.unparse(d) for d in node.decorator_list)
    ]


def test_every_fixture_is_prefixed_annotated_and_documented():
    fixtures = _fixtures()
    assert len(fixtures) >= 9
    for node in fixtures:
        assert node.name.startswith("circuits_"), node.name
        assert node.returns is not None, f"{node.name} has no return annotation"
        assert ast.get_docstring(node), f"{node.name} has no docstring"
        for arg in node.args.args:
            assert arg.annotation is not None, f"{node.name}({arg.arg}) is not annotated"


TYPED = """
import pandas as pd
from pytest_circuits.plugin import CircuitsGate
from pytest_circuits.rungs.probe import RepeatProbe


def test_typed(circuits_ov_spectrum, circuits_repeat_probe, circuits_gate):
    assert isinstance(circuits_ov_spectrum, pd.DataFrame) and "kappa" in circuits_ov_spectrum
    assert isinstance(circuits_repeat_probe, RepeatProbe)
    assert isinstance(circuits_gate, CircuitsGate)
    assert circuits_gate.outcome("copying_heads").results


def test_old_name(ov_spectrum):
    pass
"""


def test_fixtures_hand_out_typed_objects_and_old_names_are_gone(pytester, tmp_path, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", IMPORT_ROOT)  # the package under test in the subprocess
    model = save_tiny_model("gpt2", tmp_path / "m", seed=0)
    pytester.makepyfile(test_mine=TYPED)
    pytester.makeini(
        f"[pytest]\ncircuits_model = {model}\ncircuits_builds = fp32\ncircuits_baselines = {tmp_path / 'b'}\n"
        "circuits_device = cpu\ncircuits_probe_n = 2\ncircuits_probe_length = 8\n"
    )
    update = pytester.runpytest_subprocess("-p", "no:cacheprovider", "--circuits-update", "-k", "typed")
    update.assert_outcomes(passed=1)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    result.assert_outcomes(passed=1, errors=1)  # the pre-0.2 name is no fixture any more
    result.stdout.fnmatch_lines(["*fixture 'ov_spectrum' not found*"])
