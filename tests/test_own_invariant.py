"""One invariant, one entry: an invariant registered in a conftest.py, with a tolerance of its own,
runs in the shipped gate suite, the terminal summary, summary.md and the report, and its
tolerance is set like a built-in's, with no other file touched."""

from __future__ import annotations

from pathlib import Path

import pytest

from pytest_circuits.gate.tolerances import Tolerances
from pytest_circuits.testing import save_tiny_model

ROOT = Path(__file__).resolve().parent.parent

CONFTEST = '''
from pytest_circuits import Comparison, Invariant, register, within
from pytest_circuits.gate.tolerances import Tolerance


@register
class FirstCopyLoss(Invariant):
    """Fresh tokens stay as unpredictable as in the baseline."""

    name = "first_copy_loss"
    tolerances = {"first_copy_loss": Tolerance(0.5, "how far the first segment's loss may move, nats")}

    def compare(self, before, after, tol):
        return Comparison(
            [within("model", "first_copy_loss", before.first_copy_loss, after.first_copy_loss, tol.first_copy_loss)]
        )
'''


def test_a_conftest_invariant_with_its_own_tolerance_runs_everywhere(pytester, tmp_path, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", str(ROOT))
    model = save_tiny_model("gpt2", tmp_path / "m", seed=0)
    report = tmp_path / "report"
    pytester.makeconftest(CONFTEST)
    pytester.makepyfile(test_gate=(ROOT / "probes" / "test_gate.py").read_text())  # the shipped suite, as is
    pytester.makeini(
        f"[pytest]\ncircuits_model = {model}\ncircuits_builds = fp32,rtn-int8\ncircuits_baselines = {tmp_path / 'b'}\n"
        f"circuits_device = cpu\ncircuits_probe_n = 4\ncircuits_probe_length = 16\ncircuits_report = {report}\n"
    )
    recorded = pytester.runpytest_subprocess("-p", "no:cacheprovider", "--circuits-update", "-v")
    out = recorded.stdout.str()
    assert "test_gate.py::test_first_copy_loss[fp32] PASSED" in out
    assert "test_gate.py::test_first_copy_loss[rtn-int8] PASSED" in out
    assert "first_copy_loss" in out.split("circuits", 1)[1]  # the terminal summary names it
    assert "first_copy_loss" in (report / "summary.md").read_text()
    assert "first_copy_loss" in (report / "report.html").read_text()

    strict = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-o", "circuits_tol_first_copy_loss=0")
    out = strict.stdout.str()
    assert (
        "test_first_copy_loss[rtn-int8] FAILED" in out or "FAILED test_gate.py::test_first_copy_loss[rtn-int8]" in out
    )
    assert "first_copy_loss" in out and "(tolerance 0)" in out

    bad = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-o", "circuits_tol_first_copy_loss=wide")
    assert bad.ret == pytest.ExitCode.USAGE_ERROR
    assert "tolerance first_copy_loss must be a number, got 'wide'" in bad.stderr.str() + bad.stdout.str()


def test_own_tolerances_take_the_marker_and_cli_spelling_and_keep_their_type():
    from pytest_circuits import Comparison, Invariant, register
    from pytest_circuits.gate.invariants import REGISTRY

    class Strict(Invariant):
        name = "own_tolerance_probe"
        tolerances = {"own_limit": 0.5, "own_count": 3, "own_flag": True}

        def compare(self, before, after, tol):
            return Comparison()

    register(Strict)
    try:
        tol = Tolerances()
        assert (tol.own_limit, tol.own_count, tol.own_flag) == (0.5, 3, True)  # the declared defaults
        changed = tol.updated({"own_limit": "0.1", "own_count": "7", "own_flag": "off", "kappa": 0.2})
        assert (changed.own_limit, changed.own_count, changed.own_flag, changed.kappa) == (0.1, 7, False, 0.2)
        assert isinstance(changed.own_count, int) and "own_limit" in Tolerances.all_names()
        with pytest.raises(ValueError, match="own_limit must be >= 0"):
            tol.updated({"own_limit": -1})
    finally:
        del REGISTRY["own_tolerance_probe"]
    with pytest.raises(AttributeError):
        Tolerances().own_limit  # noqa: B018  (gone with its invariant)


def test_an_own_tolerance_may_not_shadow_a_built_in():
    from pytest_circuits import CircuitsError, Comparison, Invariant, register

    class Shadow(Invariant):
        name = "shadow"
        tolerances = {"kappa": 0.5}

        def compare(self, before, after, tol):
            return Comparison()

    with pytest.raises(CircuitsError, match="tolerance 'kappa' is taken"):
        register(Shadow)


def test_every_tolerance_is_declared_by_one_invariant_and_the_table_is_generated_from_them():
    """The built-in table the plugin reads at start-up is the registry's declarations, default for
    default (the ini keys, marker keywords and --tol names all come from it)."""
    from pytest_circuits.gate.invariants import declared_tolerances
    from pytest_circuits.gate.tolerance_table import BUILT_IN

    declared = declared_tolerances()
    assert {name: declared[name].default for name in BUILT_IN} == {name: row[0] for name, row in BUILT_IN.items()}
    assert tuple(BUILT_IN) == Tolerances.names()
    for name, row in BUILT_IN.items():
        assert type(declared[name].default) is type(row[0]), name  # an int stays a count, a bool a flag


def test_an_invariant_reads_typed_records_only():
    """`compare` receives validated `Record`s read by attribute; the older mapping view is gone (#50)."""
    from pytest_circuits.gate.invariants import Comparison, Invariant, evaluate, within
    from pytest_circuits.record import schema
    from pytest_circuits.record.store import read_record

    from .conftest import SHIPPED_BASELINES

    baseline = read_record(SHIPPED_BASELINES / "tiny-induction--fp32.json")
    build = read_record(SHIPPED_BASELINES / "tiny-induction--rtn-int4.json")
    seen = {}

    class Typed(Invariant):
        name = "typed_reads"

        def compare(self, before, after, tol):
            seen["typed"] = (type(after), after.copy_loss, after.heads[0].head, after.model.name)
            return Comparison([within("model", "copy_loss", before.copy_loss, after.copy_loss, 10.0)])

    typed = evaluate(Typed(), baseline, build, Tolerances(), "rtn-int4", "fp32 baseline")
    assert typed.passed
    assert seen["typed"] == (schema.Record, build.data["copy_loss"], "L0H0", "tiny-induction")
    with pytest.raises(TypeError, match="not subscriptable"):
        build["copy_loss"]  # noqa: B018
    assert not hasattr(build, "get")


def test_a_record_dict_that_is_no_scan_record_is_one_line_at_the_gate():
    from pytest_circuits.errors import CircuitsError
    from pytest_circuits.gate.invariants import gate_all

    with pytest.raises(CircuitsError, match=r"^the scan record given is not valid: copy_loss: Field required; [^\n]*$"):
        gate_all({"schema_version": 1}, {"schema_version": 1}, Tolerances(), "fp32", "fp32 baseline")


def _named(name: str, class_name: str = "Mine", **fields):
    from pytest_circuits import Comparison, Invariant

    def compare(self, before, after, tol):
        return Comparison()

    return type(class_name, (Invariant,), {"name": name, "compare": compare, **fields})


def test_two_invariants_of_one_name_are_refused_naming_both():
    from pytest_circuits import CircuitsError, register
    from pytest_circuits.gate.invariants import REGISTRY

    first, second = _named("twice_named", "First"), _named("twice_named", "Second")
    register(first)
    try:
        register(first)  # the same class again (its module imported again): itself, replaced
        assert isinstance(REGISTRY["twice_named"], first)
        with pytest.raises(CircuitsError) as refused:
            register(second)
        line = str(refused.value)
        assert "invariant 'twice_named' is registered twice" in line and line.count(__file__) == 2
        assert isinstance(REGISTRY["twice_named"], first)  # the first still runs
    finally:
        del REGISTRY["twice_named"]


def test_a_built_in_is_replaced_only_on_purpose():
    from pytest_circuits import CircuitsError, register
    from pytest_circuits.gate.invariants import REGISTRY

    built_in = REGISTRY["copy_loss"]
    with pytest.raises(CircuitsError, match=r"by pytest-circuits \(pytest_circuits.gate.builtin_invariants.CopyLoss\)"):
        register(_named("copy_loss"))
    assert REGISTRY["copy_loss"] is built_in
    mine = _named("copy_loss", tolerances={"copy_loss": 0.1})  # a replacement may declare what it replaces
    try:
        register(replace=True)(mine)
        assert isinstance(REGISTRY["copy_loss"], mine) and list(REGISTRY).index("copy_loss") == 3  # in its place
    finally:
        register(built_in, replace=True)
    assert REGISTRY["copy_loss"] is built_in and Tolerances().copy_loss == 0.25
    with pytest.raises(CircuitsError, match="registered with replace=True, but no invariant of that name"):
        register(_named("nothing_to_replace"), replace=True)


@pytest.mark.parametrize("name", ["Upper", "with-dash", "two words", "class", "9lives"])
def test_a_tolerance_no_key_can_set_is_refused(name):
    from pytest_circuits import CircuitsError, register
    from pytest_circuits.gate.invariants import REGISTRY

    with pytest.raises(CircuitsError, match=f"tolerance '{name}' cannot be set by --tol or an ini key"):
        register(_named("odd_tolerance", tolerances={name: 0.5}))
    assert "odd_tolerance" not in REGISTRY


CLASH = """
from pytest_circuits import Comparison, Invariant, register


@register
class MyCopyLoss(Invariant):
    name = "copy_loss"

    def compare(self, before, after, tol):
        return Comparison()
"""


def test_a_conftest_invariant_named_like_a_built_in_is_one_line_under_pytest_and_circuits(
    pytester, monkeypatch, capsys
):
    from pytest_circuits.cli import main
    from pytest_circuits.gate.invariants import REGISTRY

    monkeypatch.setenv("PYTHONPATH", str(ROOT))
    conftest = pytester.makeconftest(CLASH)
    pytester.makepyfile(test_gate=(ROOT / "probes" / "test_gate.py").read_text())
    run = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    err = [line for line in run.stderr.str().splitlines() if line.strip()]
    assert run.ret == pytest.ExitCode.USAGE_ERROR and len(err) == 1, run.stderr.str()
    assert (
        err[0].startswith(f"ERROR: {conftest}: invariant 'copy_loss' is registered twice") and "Traceback" not in err[0]
    )
    built_in = REGISTRY["copy_loss"]
    monkeypatch.chdir(pytester.path)
    capsys.readouterr()
    assert main(["gate", "tiny-induction", "--build", "fp32", "--baseline", "tiny-induction--fp32"]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and f"{conftest}: invariant 'copy_loss' is registered twice" in captured.err
    assert len(captured.err.strip().splitlines()) == 1 and REGISTRY["copy_loss"] is built_in


FAILING = """
from pytest_circuits import Comparison, Invariant, register, within


@register
class Raises(Invariant):
    name = "raises_in_compare"

    def compare(self, before, after, tol):
        return {}["no such figure"]


@register
class ReturnsNone(Invariant):
    name = "returns_none"

    def compare(self, before, after, tol):
        return None


@register
class ReadsUndeclared(Invariant):
    name = "reads_undeclared"

    def compare(self, before, after, tol):
        return Comparison([within("model", "copy_loss", before.copy_loss, after.copy_loss, tol.never_declared)])
"""


def test_a_failing_user_invariant_is_its_own_error_line_and_the_others_still_run(pytester, monkeypatch):
    """An invariant that raises in ``compare``, returns None or reads a tolerance it does not declare is
    that invariant's ERROR line, naming it and its file (and the line, where it raised); the others run,
    and the gate fails. Under pytest: its test fails on that one line, the others pass. (Both in
    subprocesses: an in-process pytester run elsewhere can leave transformers' modules half unloaded.)"""
    import subprocess
    import sys

    monkeypatch.setenv("PYTHONPATH", str(ROOT))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    conftest = pytester.makeconftest(FAILING)
    code = "import sys; sys.path.pop(0); from pytest_circuits.entry import main; sys.exit(main())"
    args = ["gate", "tiny-induction", "--build", "fp32", "--baseline", "tiny-induction--fp32", "--no-knockout"]
    done = subprocess.run(
        [sys.executable, "-c", code, *args], cwd=pytester.path, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 1, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    assert "Traceback" not in done.stdout + done.stderr
    errors = {line.split(":", 1)[0]: line for line in lines if line.startswith("ERROR ")}
    assert set(errors) == {"ERROR raises_in_compare", "ERROR returns_none", "ERROR reads_undeclared"}, lines
    raising = next(n for n, text in enumerate(conftest.read_text().splitlines(), 1) if "no such figure" in text)
    assert f"({conftest}), line {raising}, raised KeyError: 'no such figure'" in errors["ERROR raises_in_compare"]
    assert "returned NoneType, not a Comparison" in errors["ERROR returns_none"]
    assert "raised AttributeError: no tolerance 'never_declared'" in errors["ERROR reads_undeclared"]
    assert all(str(conftest) in line for line in errors.values())
    assert any(line.startswith("PASS copy_loss:") for line in lines)  # the others ran
    assert lines[-1].startswith("gate failed: raises_in_compare, returns_none, reads_undeclared")

    pytester.makepyfile(test_gate=(ROOT / "probes" / "test_gate.py").read_text())
    run = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-k", "fp32 and not knockout", "-rf")
    out = run.stdout.str()
    assert run.ret == pytest.ExitCode.TESTS_FAILED and "Traceback" not in out
    assert "FAILED test_gate.py::test_raises_in_compare[fp32]" in out
    assert "FAILED test_gate.py::test_returns_none[fp32]" in out
    run.assert_outcomes(failed=3, passed=5, skipped=1)  # the skip: the swap test, no --circuits-swap-baseline


def test_a_tolerance_of_another_type_is_refused_at_registration():
    from pytest_circuits import CircuitsError, register
    from pytest_circuits.gate.invariants import REGISTRY
    from pytest_circuits.gate.tolerances import Tolerance

    for declared, said in (
        (Tolerance(0.5, "x", minimum="zero"), "needs a number or None \\(any value\\) as its minimum, got 'zero'"),
        (Tolerance("wide"), "needs a number or bool default, got 'wide'"),
        (float("nan"), "needs a number or bool default, got nan"),
    ):
        with pytest.raises(CircuitsError, match=f"tolerance 'odd_kind' {said}"):
            register(_named("odd_kind", tolerances={"odd_kind": declared}))
        assert "odd_kind" not in REGISTRY
