"""pytest and ``circuits gate`` gate one build with the same invariants, in the same order, with the
same messages: a user's invariant found in conftest.py, through ``--invariants MODULE`` (pytest:
``-p MODULE``), or through the entry point group ``pytest_circuits.invariants``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from pytest_circuits.testing import save_tiny_model

ROOT = Path(__file__).resolve().parent.parent

INVARIANT = '''
from pytest_circuits import Comparison, Invariant, register, within


@register
class FirstCopyLoss(Invariant):
    """Fresh tokens stay as unpredictable as in the baseline."""

    name = "first_copy_loss"
    tolerances = {"first_copy_loss": 0.5}

    def compare(self, before, after, tol):
        figure = "first_copy_loss"
        return Comparison([within("model", figure, getattr(before, figure), getattr(after, figure), tol.first_copy_loss)])
'''

# the pytest side: every invariant pytest would gate, through the fixture, printed as `circuits gate` prints them
VERDICTS = """
import json
import os

from pytest_circuits.cli import STATUS_WORDS
from pytest_circuits.gate.invariants import per_build_invariants, verdict


def test_verdicts(circuits_gate):
    outcome = circuits_gate.outcome(*per_build_invariants())
    lines = [f"{STATUS_WORDS[r.status]} {r.invariant}: {r.message.removeprefix(r.invariant + ': ')}" for r in outcome.results]
    lines.append(verdict(outcome.results)[1])
    with open(os.environ["CIRCUITS_VERDICTS"], "w") as out:
        json.dump(lines, out)
"""

PROBE = ("--probe-n", "4", "--probe-length", "16")


def _circuits(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [sys.executable, "-m", "pytest_circuits.cli", *args], cwd=cwd, capture_output=True, text=True, env=env
    )


def _first_lines(lines: list[str], label: str) -> list[str]:
    """Each verdict line, and the table under a failure, as both front ends word it: the baseline named
    as pytest names it, the fix line (which names each front end's own command) left out."""
    split = [part for line in lines for part in line.split("\n")]
    kept = [
        line for line in split if line.split(" ", 1)[0] in ("PASS", "FAIL", "SKIP", "gate") or line.startswith("  ")
    ]
    return [line.replace(label, "fp32 baseline") for line in kept]


@pytest.fixture(scope="module")
def recorded(tmp_path_factory) -> tuple[Path, Path]:
    """A tiny model and its fp32 baseline, made once (and before pytester snapshots sys.modules: torch
    imported inside a pytester test is dropped after it, and importing it again fails)."""
    folder = tmp_path_factory.mktemp("front_ends")
    model = save_tiny_model("gpt2", folder / "m", seed=0)
    baselines = folder / "b"
    done = _circuits("record", str(model), "--build", "fp32", "--baselines", str(baselines), *PROBE, cwd=folder)
    assert done.returncode == 0, done.stderr
    return model, baselines


def _both(pytester, tmp_path, monkeypatch, recorded, pytest_args: tuple[str, ...], cli_args: tuple[str, ...], tol: str):
    """The verdict lines of rtn-int8 against the fp32 baseline: ``(pytest's, circuits gate's)``."""
    monkeypatch.setenv("PYTHONPATH", f"{ROOT}:{pytester.path}")
    model, baselines = recorded
    verdicts = tmp_path / "verdicts.json"
    monkeypatch.setenv("CIRCUITS_VERDICTS", str(verdicts))
    pytester.makepyfile(test_verdicts=VERDICTS)
    pytester.makeini(
        f"[pytest]\ncircuits_model = {model}\ncircuits_builds = rtn-int8\ncircuits_baselines = {baselines}\n"
        "circuits_device = cpu\ncircuits_probe_n = 4\ncircuits_probe_length = 16\n"
    )
    ran = pytester.runpytest_subprocess(
        "-p", "no:cacheprovider", "-o", f"circuits_tol_first_copy_loss={tol}", *pytest_args
    )
    assert ran.ret == 0, ran.stdout.str()
    by_pytest = json.loads(verdicts.read_text())
    gated = _circuits(
        "gate", str(model), "--build", "rtn-int8", "--baseline", str(baselines / "m--fp32.json"), "--device", "cpu",
        "--tol", f"first_copy_loss={tol}", *cli_args, cwd=pytester.path,
    )  # fmt: skip
    assert gated.returncode in (0, 1), gated.stderr
    label = "baseline m--fp32.json"
    return _first_lines(by_pytest, label), _first_lines(gated.stdout.splitlines(), label)


@pytest.mark.slow
def test_a_conftest_invariant_is_gated_alike_by_pytest_and_circuits_gate(pytester, tmp_path, monkeypatch, recorded):
    pytester.makeconftest(INVARIANT)
    by_pytest, by_cli = _both(pytester, tmp_path, monkeypatch, recorded, (), (), "0")
    assert by_pytest == by_cli
    assert any(line.startswith("FAIL first_copy_loss: model first_copy_loss") for line in by_cli)  # tolerance 0
    assert by_cli[-1].startswith("gate failed: first_copy_loss")
    assert len([line for line in by_cli if line[:4] in ("PASS", "FAIL", "SKIP")]) == 7  # 6 built-in + the user's


@pytest.mark.slow
def test_an_invariants_module_is_gated_alike_by_pytest_and_circuits_gate(pytester, tmp_path, monkeypatch, recorded):
    pytester.makepyfile(my_invariants=INVARIANT)
    by_pytest, by_cli = _both(
        pytester, tmp_path, monkeypatch, recorded, ("-p", "my_invariants"), ("--invariants", "my_invariants"), "1"
    )
    assert by_pytest == by_cli
    assert [line.split(":")[0] for line in by_cli if line.startswith("PASS first_copy_loss")] == [
        "PASS first_copy_loss"
    ]


def test_a_bad_invariants_module_or_conftest_is_one_line_and_exit_2(tmp_path):
    missing = _circuits(
        "gate", "m", "--build", "fp32", "--baseline", "b.json", "--invariants", "no_such_mod", cwd=tmp_path
    )
    assert missing.returncode == 2 and "Traceback" not in missing.stderr
    assert (
        missing.stderr.strip().count("\n") == 0
        and "--invariants no_such_mod: cannot import no_such_mod" in missing.stderr
    )
    (tmp_path / "conftest.py").write_text("import no_such_dependency\n")
    broken = _circuits("diff", "a.json", "b.json", cwd=tmp_path)
    assert broken.returncode == 2 and "Traceback" not in broken.stderr
    assert f"{tmp_path / 'conftest.py'} failed to import: ModuleNotFoundError" in broken.stderr
    assert broken.stderr.strip().count("\n") == 0


def test_an_entry_point_invariant_is_registered_after_the_built_in_ones(tmp_path, monkeypatch):
    """A package that declares ``[project.entry-points."pytest_circuits.invariants"]`` (a dist-info
    on sys.path here) has its invariant gated by both front ends, after the built-in ones."""
    from pytest_circuits.gate import invariants
    from pytest_circuits.gate.user_invariants import ENTRY_POINT_GROUP, load_entry_points

    (tmp_path / "circuits_extra.py").write_text(
        INVARIANT.replace("@register\n", "")
        .replace("first_copy_loss", "extra_copy_loss")
        .replace("getattr(before, figure), getattr(after, figure)", "before.first_copy_loss, after.first_copy_loss")
    )
    info = tmp_path / "circuits_extra-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: circuits-extra\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text(f"[{ENTRY_POINT_GROUP}]\nextra = circuits_extra:FirstCopyLoss\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    before = dict(invariants.REGISTRY)
    try:
        assert load_entry_points() == ["extra"]
        assert list(invariants.REGISTRY)[-1] == "extra_copy_loss" and list(invariants.REGISTRY)[: len(before)] == list(
            before
        )
        assert invariants.get("extra_copy_loss").tolerances == {"extra_copy_loss": 0.5}
        assert load_entry_points() == []  # once per process
    finally:
        invariants.REGISTRY.clear()
        invariants.REGISTRY.update(before)
    (info / "entry_points.txt").write_text(f"[{ENTRY_POINT_GROUP}]\nbroken = circuits_extra:Nothing\n")
    from pytest_circuits.errors import CircuitsError

    with pytest.raises(CircuitsError, match="invariant plugin 'broken' .* failed to load: AttributeError"):
        load_entry_points()


def _verdict_lines(results, label: str) -> list[str]:
    """``STATUS invariant: first line``, as ``circuits gate`` prints each result, the baseline's label
    (each front end names it its own way) read as ``<baseline>``."""
    from pytest_circuits.cli import STATUS_WORDS

    lines = []
    for r in results:
        first = r.message.removeprefix(f"{r.invariant}: ").split("\n")[0]
        lines.append(f"{STATUS_WORDS[r.status]} {r.invariant}: {first}".replace(label, "<baseline>"))
    return lines


PYTEST_VERDICTS = """
import json
import os

from pytest_circuits.gate.invariants import per_build_invariants, verdict


def test_verdicts(circuits_gate):
    outcome = circuits_gate.outcome(*per_build_invariants())
    kept = [dict(invariant=r.invariant, status=r.status, message=r.message) for r in outcome.results]
    with open(os.environ["CIRCUITS_VERDICTS"], "w") as out:
        json.dump({"results": kept, "verdict": verdict(outcome.results)[1]}, out)
"""


def test_the_five_front_ends_reach_one_verdict(recorded, tmp_path):
    """pytest, ``circuits gate``, ``circuits diff``, ``circuits report --against`` and ``circuits
    sensitivity``'s gate give the same verdict lines on the same build against the same baseline: each
    reaches it through the one pure gate (`gate.check.check`). diff and report read the build's record
    from the file ``circuits record`` wrote (with its further looks); the others measure it."""
    from types import SimpleNamespace

    from pytest_circuits.gate.invariants import verdict
    from pytest_circuits.gate.tolerances import Tolerances
    from pytest_circuits.record.store import read_record
    from pytest_circuits.report.writer import gate_files
    from pytest_circuits.run.run import Run
    from pytest_circuits.run.sensitivity import gate_record
    from pytest_circuits.settings import CircuitsSettings, RepeatSettings

    model, baselines = recorded
    fp32 = baselines / "m--fp32.json"
    label = f"baseline {fp32.name}"
    # the build's record, as a file (diff, report)
    built = tmp_path / "built"
    done = _circuits("record", str(model), "--build", "rtn-int8", "--baselines", str(built), *PROBE, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    record_file = built / "m--rtn-int8.json"
    # pytest, against the fp32 baseline alone (no own baseline: one comparison, as the others make)
    (tmp_path / "test_verdicts.py").write_text(PYTEST_VERDICTS)
    (tmp_path / "pytest.ini").write_text(
        f"[pytest]\ncircuits_model = {model}\ncircuits_builds = rtn-int8\ncircuits_baselines = {baselines}\n"
        "circuits_device = cpu\ncircuits_probe_n = 4\ncircuits_probe_length = 16\n"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    env["CIRCUITS_VERDICTS"] = str(tmp_path / "verdicts.json")
    ran = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "test_verdicts.py"],
        cwd=tmp_path, capture_output=True, text=True, env=env,
    )  # fmt: skip
    assert ran.returncode == 0, ran.stdout + ran.stderr
    by_pytest = json.loads((tmp_path / "verdicts.json").read_text())
    pytest_results = [SimpleNamespace(**r) for r in by_pytest["results"]]
    front_ends = {"pytest": _verdict_lines(pytest_results, "fp32 baseline") + [by_pytest["verdict"]]}
    # circuits gate
    gated = _circuits(
        "gate", str(model), "--build", "rtn-int8", "--baseline", str(fp32), "--device", "cpu", cwd=tmp_path
    )
    assert gated.returncode in (0, 1), gated.stderr
    front_ends["circuits gate"] = [
        line.replace(label, "<baseline>")
        for line in gated.stdout.splitlines()
        if line[:5] in ("PASS ", "FAIL ", "SKIP ") or line.startswith("gate ")
    ]
    # circuits report --against: its results, and the verdict line it prints
    baseline, build = read_record(fp32), read_record(record_file)
    reported = gate_files(baseline, build, fp32.name)
    shown = _circuits("report", str(record_file), "--against", str(fp32), "--out", str(tmp_path / "r"), cwd=tmp_path)
    assert shown.returncode == 0, shown.stderr
    said = shown.stdout.splitlines()[-1]
    assert said.startswith(f"with default tolerances, rtn-int8 against {fp32.name}: ")
    front_ends["circuits report"] = _verdict_lines(reported, label) + [said.split(": ", 1)[1]]
    # circuits sensitivity's gate of the build as it stands (no damage)
    run = Run(CircuitsSettings(model=str(model), builds=("rtn-int8",), device="cpu", probe=RepeatSettings(0, 4, 16)))
    results, _ = gate_record(run, "rtn-int8", baseline.data, Tolerances())
    front_ends["circuits sensitivity"] = _verdict_lines(results, "baseline") + [verdict(results)[1]]
    # circuits diff prints the verdict line alone
    diffed = _circuits("diff", str(fp32), str(record_file), cwd=tmp_path)
    assert diffed.returncode == 0, diffed.stderr
    diff_line = diffed.stdout.splitlines()[-1]
    assert diff_line.startswith("with default tolerances, B against A: ")
    lines = front_ends["circuits gate"]
    assert len([line for line in lines if line[:4] in ("PASS", "FAIL", "SKIP")]) == 6, lines  # every built-in
    for name, theirs in front_ends.items():
        assert theirs == lines, f"{name} differs from circuits gate"
    assert diff_line.split(": ", 1)[1] == lines[-1]
