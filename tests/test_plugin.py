"""The plugin end to end with pytester: record baselines, gate benign and sabotaged builds."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from pytest_circuits.gate.invariants import per_build_invariants
from pytest_circuits.probes.registered import gate_tests
from pytest_circuits.testing import make_tiny_model, negate_head_ov, save_tiny_model

from .conftest import IMPORT_ROOT, PROBES, SHIPPED_BASELINES

RUNG1 = len(gate_tests("test_rung1_weights"))  # the suite's rung-1 tests (copying_heads, kappa_distribution, ov_gain)
RUNG12 = len(gate_tests("test_rung12_repeat"))  # its probe tests (copy_loss, induction_heads)
# induction_heads skips on the tiny random model (it has no induction head); the other rung-1/2 tests run
RUNG12_PASS, RUNG12_SKIP = RUNG12 - 1, 1
# what the tiny random model skips: it has no induction, previous-token or key knockout head
RANDOM_SKIPS = ("induction_heads", "ov_gain", "knockout_deltas")

ROOT = Path(__file__).resolve().parent.parent
SHIPPED = SHIPPED_BASELINES


def ini(folder: Path, baselines: Path, builds: str = "fp32") -> str:
    return (
        "[pytest]\n"
        f"circuits_model = {folder}\n"
        f"circuits_builds = {builds}\n"
        f"circuits_baselines = {baselines}\n"
        "circuits_device = cpu\n"
        "circuits_probe_n = 4\n"
        "circuits_probe_length = 16\n"
    )


@pytest.fixture(scope="module")
def warm(tmp_path_factory):
    """Run the whole pipeline once here, so in-process pytester runs import nothing new.

    (pytester drops the modules an inner run imported; torch refuses to register some twice.)
    """
    from pytest_circuits.run.run import Run
    from pytest_circuits.rungs.repeat_settings import RepeatSettings
    from pytest_circuits.settings import CircuitsSettings

    folder = save_tiny_model("gpt2", tmp_path_factory.mktemp("warm") / "m", seed=0)
    Run(CircuitsSettings(model=str(folder), device="cpu", probe=RepeatSettings(0, 2, 4))).records.record("fp32")
    for name in ("pytest_circuits.report", "matplotlib.pyplot", "pytest_circuits.cli"):
        try:
            __import__(name)
        except ImportError:
            pass


@pytest.fixture
def suite(pytester, tmp_path_factory, warm):
    """A pytester folder holding the shipped probes/ suite, gating a tiny gpt2 folder ``m``."""
    work = tmp_path_factory.mktemp("models")
    intact = save_tiny_model("gpt2", work / "intact" / "m", seed=0)
    baselines = work / "baselines"
    for test in sorted(PROBES.glob("test_*.py")):
        pytester.makepyfile(**{test.stem: test.read_text()})
    pytester.makeini(ini(intact, baselines))
    return pytester, intact, baselines


def text_of(result) -> str:
    return "\n".join(result.outlines + result.errlines)


def flagged_head(baselines: Path) -> tuple[str, int, int]:
    """The head with the largest |kappa_trace| in the recorded baseline (negating it must show)."""
    record = json.loads((baselines / "m--fp32.json").read_text())
    best = max(record["heads"], key=lambda h: abs(h["kappa_trace"]))
    return best["head"], best["layer"], best["head_index"]


def test_missing_baseline_fails_with_the_record_command(suite):
    pytester, intact, baselines = suite
    result = pytester.runpytest("-p", "no:cacheprovider")
    result.assert_outcomes(failed=len(per_build_invariants()), skipped=1)  # the base-model swap test: no swap to gate
    out = text_of(result)
    assert "does not exist; record it with: circuits record" in out
    assert "baselines missing:" in out and str(baselines / "m--fp32.json") in out
    assert "Traceback" not in out


def test_record_gate_and_sabotage(suite, tmp_path_factory):
    pytester, intact, baselines = suite
    result = pytester.runpytest("-p", "no:cacheprovider", "--circuits-update", "-rs")
    # a random model has no key head (RANDOM_SKIPS): skipped with the reason, never counted as passes;
    # so is the base-model swap test (no swap asked for)
    result.assert_outcomes(passed=len(per_build_invariants()) - len(RANDOM_SKIPS), skipped=len(RANDOM_SKIPS) + 1)
    assert "no base-model swap to gate: the fp32 baseline is of this model's geometry" in text_of(result)
    assert "has no induction or previous-token head scoring >= 0.2; nothing to check" in text_of(result)
    assert "has no head with knockout delta >= 0.1 nats; nothing to check" in text_of(result)
    assert "baselines written: " + str(baselines / "m--fp32.json") in text_of(result)
    written = json.loads((baselines / "m--fp32.json").read_text())
    assert written["build"]["recipe"] == "fp32" and written["knockout"]["seed"] == 1
    assert all(h["knockout_delta"] is not None for h in written["heads"])

    # recording the same build again rewrites nothing; --circuits-update-all does
    stamp = (baselines / "m--fp32.json").stat().st_mtime_ns
    result = pytester.runpytest("-p", "no:cacheprovider", "--circuits-update", "test_rung12_repeat.py")
    assert "baselines unchanged (not rewritten" in text_of(result)
    assert (baselines / "m--fp32.json").stat().st_mtime_ns == stamp
    result = pytester.runpytest("-p", "no:cacheprovider", "--circuits-update-all", "test_rung12_repeat.py")
    assert "baselines written: " in text_of(result) and (baselines / "m--fp32.json").stat().st_mtime_ns != stamp

    # an orphan: a baseline of this model that no tested build reads
    (baselines / "m--bnb-fp4.json").write_text("{}")
    result = pytester.runpytest("-p", "no:cacheprovider")
    assert "1 other baseline(s) of this model not used by the builds tested (-v names them)" in text_of(result)
    assert "unchanged (not rewritten" not in text_of(result)
    result = pytester.runpytest("-p", "no:cacheprovider", "-v")
    result.assert_outcomes(passed=len(per_build_invariants()) - len(RANDOM_SKIPS), skipped=len(RANDOM_SKIPS) + 1)
    out = text_of(result)
    assert "baselines compared: " + str(baselines / "m--fp32.json") in out
    assert "baselines orphaned (no tested build used them): " + str(baselines / "m--bnb-fp4.json") in out
    assert "weights differ" not in out

    # the same model name, one head's W_O negated: the gate fails and names the head
    name, layer, head = flagged_head(baselines)
    model = make_tiny_model("gpt2", seed=0)
    negate_head_ov(model, layer, head)
    sabotaged = tmp_path_factory.mktemp("sabotaged") / "m"
    model.save_pretrained(sabotaged, safe_serialization=True)
    pytester.makeini(ini(sabotaged, baselines))
    result = pytester.runpytest("-p", "no:cacheprovider")
    out = text_of(result)
    assert (
        "test_copying_heads_survive[fp32] FAILED" in out
        or "FAILED test_rung1_weights.py::test_copying_heads_survive[fp32]" in out
    )
    assert f"{name} " in out and "kappa_trace" in out
    assert "weights differ" in out
    assert "may differ this much from fp32" not in out  # gated against its own name: no reference wording
    assert "Traceback" not in out
    # the hint, pasted, accepts the change: the sabotaged build becomes the baseline and passes
    import re
    import shlex

    hint = shlex.split(re.search(r"record the baseline again: ((?:python -m )?pytest .*)", out).group(1))
    args = hint[3:] if hint[0] == "python" else hint[1:]  # "pytest" where sys.argv is not pytest's (an xdist worker)
    assert args == ["-p", "no:cacheprovider", args[2], "--circuits-update"]  # this run's command, updating
    assert args[2].startswith("--basetemp=")
    pytester.runpytest(*args)
    pytester.runpytest("-p", "no:cacheprovider", "test_rung1_weights.py").assert_outcomes(passed=RUNG1 - 1, skipped=1)

    # a per-test marker loosens it
    pytester.makepyfile(
        test_loose="""
        import pytest

        @pytest.mark.circuits_tolerance(kappa=2.0, rank=-1.0)
        def test_loose(circuits_gate):
            circuits_gate("copying_heads")
    """
    )
    result = pytester.runpytest("-p", "no:cacheprovider", "test_loose.py")
    result.assert_outcomes(passed=1)


def test_ini_tolerance_and_bad_values(suite):
    pytester, intact, baselines = suite
    pytester.runpytest("-p", "no:cacheprovider", "--circuits-update", "test_rung12_repeat.py").assert_outcomes(
        passed=RUNG12_PASS, skipped=RUNG12_SKIP
    )
    pytester.makeini(ini(intact, baselines) + "circuits_tol_copy_loss = -1\n")
    result = pytester.runpytest("-p", "no:cacheprovider", "test_rung12_repeat.py")
    assert "circuits_tol_*: tolerance copy_loss must be >= 0" in text_of(result)
    pytester.makepyfile(
        test_bad_marker="""
        import pytest

        @pytest.mark.circuits_tolerance(kapa=0.1)
        def test_bad(circuits_gate):
            circuits_gate("copy_loss")
    """
    )
    pytester.makeini(ini(intact, baselines))
    result = pytester.runpytest("-p", "no:cacheprovider", "test_bad_marker.py")
    result.assert_outcomes(errors=1)
    assert (
        "@pytest.mark.circuits_tolerance: unknown tolerance(s) kapa (did you mean 'kappa'?); known: kappa"
        in text_of(result)
    )
    assert "During handling" not in text_of(result)


def test_corrupt_baselines_are_one_line_foreign_ones_not_compared_per_head(suite, tmp_path_factory):
    pytester, intact, baselines = suite
    baselines.mkdir(parents=True, exist_ok=True)
    (baselines / "m--fp32.json").write_text("{not json")
    result = pytester.runpytest("-p", "no:cacheprovider", "test_rung12_repeat.py")
    result.assert_outcomes(failed=RUNG12)
    out = text_of(result)
    assert f"baseline {baselines / 'm--fp32.json'} is not valid JSON (line 1); delete it and record it again" in out
    assert "Traceback" not in out

    # a baseline recorded from a model of another geometry under the same name
    other = save_tiny_model("gpt2", tmp_path_factory.mktemp("other") / "m", seed=0, n_embd=32)
    pytester.makeini(ini(other, baselines))
    pytester.runpytest("-p", "no:cacheprovider", "--circuits-update", "test_rung12_repeat.py").assert_outcomes(
        passed=RUNG12_PASS, skipped=RUNG12_SKIP
    )
    pytester.makeini(ini(intact, baselines))
    result = pytester.runpytest("-p", "no:cacheprovider", "-rs", "test_rung12_repeat.py")
    result.assert_outcomes(skipped=RUNG12)  # another base model: not compared per head, never passed
    out = text_of(result)
    assert "per-head invariants are not compared across models (geometry d_model 32 vs 64, d_head 8 vs 16)" in out
    assert "copy_loss (builds of one model) is not compared across models (geometry d_model 32 vs 64" in out


def test_report_option_writes_a_report(suite, tmp_path):
    pytest.importorskip("matplotlib")
    pytester, intact, baselines = suite
    report = tmp_path / "report"
    result = pytester.runpytest(
        "-p", "no:cacheprovider", "--circuits-update", f"--circuits-report={report}", "test_rung1_weights.py"
    )
    result.assert_outcomes(passed=RUNG1 - 1, skipped=1)  # ov_gain (RANDOM_SKIPS)
    assert report.is_dir() and any(report.iterdir()), text_of(result)
    shutil.rmtree(report)


def test_a_report_that_cannot_be_written_fails_the_run_and_summary_md_needs_no_matplotlib(suite, tmp_path, monkeypatch):
    """Without matplotlib the run fails, naming the fix, and summary.md still holds the verdicts
    (the CI step summary); a report folder that cannot be made fails the run too."""
    pytester, intact, baselines = suite
    report = tmp_path / "report"
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib: ImportError
    result = pytester.runpytest(
        "-p", "no:cacheprovider", "--circuits-update", f"--circuits-report={report}", "test_rung12_repeat.py"
    )
    result.assert_outcomes(passed=RUNG12_PASS, skipped=RUNG12_SKIP)
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    out = text_of(result)
    assert f"ERROR --circuits-report {report}: the report could not be written: the circuits report draws with " in out
    assert "pip install matplotlib" in out and f"{report / 'summary.md'} holds the verdicts as text" in out
    text = (report / "summary.md").read_text()
    assert "invariants held" in text and "| pass | fp32 | copy_loss | fp32 baseline |" in text
    assert "No figures and no report page: the circuits report draws with matplotlib" in text
    monkeypatch.delitem(sys.modules, "matplotlib")
    blocked = tmp_path / "a-file"
    blocked.write_text("")
    result = pytester.runpytest("-p", "no:cacheprovider", f"--circuits-report={blocked / 'r'}", "test_rung12_repeat.py")
    result.assert_outcomes(passed=RUNG12_PASS, skipped=RUNG12_SKIP)
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    assert "the report could not be written: " in text_of(result)


def test_an_invariant_registered_in_conftest_runs_through_circuits_gate(suite):
    pytester, intact, baselines = suite
    pytester.makeconftest("""
        from pytest_circuits.gate.invariants import Comparison, Invariant, register, within

        @register
        class FirstCopyLoss(Invariant):
            name = "first_copy_loss"
            reads = ("copy_loss",)

            def compare(self, before, after, tol):
                return Comparison([within("model", "first_copy_loss", before.first_copy_loss,
                                          after.first_copy_loss, tol.copy_loss)])
    """)
    pytester.makepyfile(
        test_mine="""
        def test_first_copy_loss(circuits_gate):
            outcome = circuits_gate("first_copy_loss")
            assert outcome.results[0].compared == 1
    """
    )
    result = pytester.runpytest("-p", "no:cacheprovider", "--circuits-update", "test_mine.py")
    result.assert_outcomes(passed=1)
    result = pytester.runpytest("-p", "no:cacheprovider", "test_mine.py", "--circuits-probe-n", "5")
    result.assert_outcomes(failed=1)  # other probe settings than the baseline's: refused, not compared
    assert "recorded with other probe settings (n=4 vs 5)" in text_of(result)
    from pytest_circuits.gate.invariants import REGISTRY

    REGISTRY.pop("first_copy_loss", None)  # the inner run registered it in this process


def test_a_model_that_cannot_be_gated_is_one_line_once(suite, tmp_path):
    pytester, intact, baselines = suite
    pytester.makeini(ini(tmp_path / "no-such-model", baselines))
    result = pytester.runpytest("-p", "no:cacheprovider")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    out = text_of(result)
    assert out.count("not found: not a folder, a .gguf file, a named model") == 1 and "Traceback" not in out


def test_the_missing_baseline_hint_is_a_command_that_works(suite):
    """Paste the hint the failure prints: it records the right baseline, and the gate then runs."""
    import re
    import shlex
    import subprocess
    import sys

    pytester, intact, baselines = suite
    result = pytester.runpytest("-p", "no:cacheprovider", "test_rung12_repeat.py")
    hint = re.search(r"record it with: (circuits record .*?) \(or add", text_of(result)).group(1)
    words = shlex.split(hint)
    assert words[:3] == ["circuits", "record", str(intact)] and "--probe-n" in words and "--probe-length" in words
    done = subprocess.run(
        [sys.executable, "-m", "pytest_circuits.cli", *words[1:]], capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr
    result = pytester.runpytest("-p", "no:cacheprovider", "test_rung12_repeat.py")
    result.assert_outcomes(passed=RUNG12_PASS, skipped=RUNG12_SKIP)


def test_xdist_workers_send_plain_data_and_the_report_is_written(suite, tmp_path, monkeypatch):
    """Under pytest-xdist every result a worker sends must be plain data (a torch version object
    once broke the run), and the controller writes the report."""
    # the subprocess imports this checkout's package (the probes import pytest_circuits.probes.registered)
    monkeypatch.setenv("PYTHONPATH", IMPORT_ROOT)
    pytest.importorskip("xdist")
    pytest.importorskip("matplotlib")
    pytester, intact, baselines = suite
    report = tmp_path / "report"
    result = pytester.runpytest_subprocess(
        "-p", "no:cacheprovider", "-n", "2", "--circuits-update", f"--circuits-report={report}", "test_rung12_repeat.py"
    )
    result.assert_outcomes(passed=RUNG12_PASS, skipped=RUNG12_SKIP)
    assert "INTERNALERROR" not in text_of(result) and (report / "report.html").is_file()
    assert "circuits report: " in text_of(result)


def _run(words: list[str] | str, cwd: Path, package: Path = ROOT) -> subprocess.CompletedProcess:
    """A command in a shell as a user types it, importing the package from ``package`` (this
    checkout, as an editable install does, or a folder a wheel was installed into)."""
    env = {**os.environ, "PYTHONPATH": str(package)}
    command = words if isinstance(words, str) else shlex.join(words)
    return subprocess.run(command, shell=True, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)


def paste_the_update_hint(tmp_path: Path, how: str, package: Path = ROOT) -> None:
    """A drifted baseline fails the gate; the hint is the command as typed (``--pyargs``, paths from the
    folder it ran in) with ``--circuits-update``; pasted there it rewrites the baseline."""
    baselines = tmp_path / "baselines"
    baselines.mkdir()
    drifted = json.loads((SHIPPED / "tiny-induction--fp32.json").read_text())
    drifted["copy_loss"] += 0.5  # the mean, each sequence and the interval: a consistent, drifted record
    drifted["copy_loss_sequences"] = [x + 0.5 for x in drifted["copy_loss_sequences"]]
    drifted["copy_loss_interval"] = [x + 0.5 for x in drifted["copy_loss_interval"]]
    (baselines / "tiny-induction--fp32.json").write_text(json.dumps(drifted))
    here = tmp_path / "elsewhere"
    here.mkdir()
    target = ["--pyargs", "pytest_circuits.probes"] if how == "pyargs" else [os.path.relpath(ROOT / "probes", here)]
    typed = ["python", "-m", "pytest", *target, "-p", "no:cacheprovider", "-k", "copy_loss", "--circuits-builds"]
    typed += ["fp32", "--circuits-baselines", "../baselines"]
    failed = _run(typed, here, package)
    assert failed.returncode == 1, failed.stdout[-3000:]
    hint = re.search(r"record the baseline again: (.*)", failed.stdout).group(1)
    assert hint == shlex.join([*typed, "--circuits-update"])
    pasted = _run(hint, here, package)
    assert pasted.returncode == 0, pasted.stdout[-3000:]
    assert json.loads((baselines / "tiny-induction--fp32.json").read_text())["copy_loss"] != drifted["copy_loss"]


@pytest.mark.parametrize("how", ["pyargs", "outside-rootdir"])
def test_the_update_hint_pastes_as_the_command_the_user_ran(how, tmp_path):
    """From this checkout (an editable install): ``--pyargs``, and a path outside the rootdir."""
    paste_the_update_hint(tmp_path, how)


def test_no_unknown_mark_warning_without_xdist(tmp_path):
    """Every build's tests carry an xdist_group mark; without pytest-xdist the marker is still known."""
    done = _run(
        ["python", "-m", "pytest", "-p", "no:xdist", "--pyargs", "pytest_circuits.probes", "--co", "-q"], tmp_path
    )
    assert done.returncode == 0 and "PytestUnknownMarkWarning" not in done.stdout, done.stdout[-2000:]


HEAVY = ("torch", "pandas", "transformers", "numpy", "scipy")
PLAIN_CONFTEST = f"""
import json, sys

def pytest_unconfigure(config):  # after the session's end, its summary and report hooks
    heavy = sorted(m for m, v in sys.modules.items() if v is not None and m.split(".")[0] in {HEAVY!r})
    seen = {{
        "heavy": heavy,
        "plugin": config.pluginmanager.hasplugin("circuits"),
        "session": "pytest_circuits.run.run" in sys.modules,
    }}
    (config.rootpath / "seen.json").write_text(json.dumps(seen))
"""


def run_plain_project(tmp_path: Path, pythonpath: list[Path] = ()) -> tuple[subprocess.CompletedProcess, dict]:
    """A project with one test and no circuits test, run by ``python -m pytest`` with the plugin
    installed; what its conftest saw in ``sys.modules`` once the run ended."""
    project = tmp_path / "plain"
    project.mkdir()
    (project / "pytest.ini").write_text("[pytest]\n")
    (project / "conftest.py").write_text(PLAIN_CONFTEST)
    (project / "test_one.py").write_text("def test_one():\n    assert 1 + 1 == 2\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([*map(str, pythonpath), IMPORT_ROOT])}
    command = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider"]
    done = subprocess.run(command, cwd=project, env=env, capture_output=True, text=True, timeout=600)
    seen = json.loads((project / "seen.json").read_text()) if (project / "seen.json").is_file() else {}
    return done, seen


def test_a_project_without_circuits_tests_imports_nothing_heavy(tmp_path):
    """The installed plugin costs a project without circuits tests no torch, pandas, transformers,
    numpy or scipy import, no session and no ``circuits`` summary section."""
    done, seen = run_plain_project(tmp_path)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert seen["plugin"], "the circuits plugin was not loaded: this run tests nothing"
    assert seen["heavy"] == [] and not seen["session"], seen
    assert not re.search(r"=+ circuits =+", done.stdout), done.stdout[-2000:]  # no summary section
    assert "Warning" not in done.stdout + done.stderr, done.stdout[-2000:] + done.stderr[-2000:]


def test_a_project_without_circuits_tests_runs_where_pandas_and_torch_are_missing(tmp_path):
    """Where importing pandas or torch fails, a project that never uses circuits still passes (it
    once ended in an INTERNALERROR: the first test report imported pandas)."""
    blocker = tmp_path / "blocker"
    blocker.mkdir()
    (blocker / "sitecustomize.py").write_text(f"import sys\nfor name in {HEAVY!r}:\n    sys.modules[name] = None\n")
    done, seen = run_plain_project(tmp_path, pythonpath=[blocker])
    assert done.returncode == 0 and "INTERNALERROR" not in done.stdout + done.stderr, done.stdout[-3000:]
    assert seen["plugin"] and "1 passed" in done.stdout, done.stdout[-2000:]


def test_importing_bitsandbytes_through_a_bnb_build_raises_no_deprecation_warning(tmp_path):
    """Outside this clone (no filterwarnings of ours), loading a bnb build shows no torch.jit warning."""
    code = (
        "import warnings\n"
        "warnings.simplefilter('always')\n"
        "from pytest_circuits.model.builds import _bnb_config\n"
        "from pytest_circuits.model.recipes import get_recipe\n"
        "with warnings.catch_warnings(record=True) as caught:\n"
        "    _bnb_config(get_recipe('bnb-int8'))\n"
        "print(sum('script_method' in str(w.message) for w in caught))\n"
    )
    done = _run(["python", "-c", code], tmp_path)
    assert done.returncode == 0 and done.stdout.split()[-1] == "0", done.stdout[-2000:] + done.stderr[-2000:]


def test_a_bnb_build_prints_no_hub_kernel_lines(tmp_path):
    """#54: importing bitsandbytes offline printed kernels' "Skipping publisher trust check for
    'kernels-community/quantization-bitsandbytes' ..." and bitsandbytes' "Failed to load CPU
    gemm_4bit_forward ..." on stderr (on CPUs where its backend asks the Hub for a kernel)."""
    code = "from pytest_circuits.model.builds import require_bitsandbytes; require_bitsandbytes('bnb-nf4')"
    done = _run(["python", "-c", code], tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "Skipping publisher trust check" not in done.stderr and "Failed to load CPU" not in done.stderr, done.stderr


def test_only_the_offline_trust_line_of_kernels_is_dropped(caplog):
    """On any CPU: the one message is dropped from its logger, another message of that logger is not."""
    import logging

    from pytest_circuits.model.builds import KERNELS_HUB_LOGGER, quiet_bitsandbytes

    quiet_bitsandbytes()
    quiet_bitsandbytes()  # idempotent: one filter
    hub = logging.getLogger(KERNELS_HUB_LOGGER)
    assert len(hub.filters) == 1
    with caplog.at_level(logging.WARNING, logger=KERNELS_HUB_LOGGER):
        hub.warning("Skipping publisher trust check for 'a/b' because Hugging Face Hub is in offline mode.")
        hub.warning("some other kernels warning")
    assert [r.getMessage() for r in caplog.records if r.name == KERNELS_HUB_LOGGER] == ["some other kernels warning"]
