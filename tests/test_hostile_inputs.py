"""Hostile and careless inputs of the newer surface (issue 51): user-invariant modules, entry points,
baselines by name, cache strings, a missing optional environment. Each ends in one line and exit 2
(pytest: exit 4, a usage error) or a correct verdict; ``--invariants`` never shadows an installed
package, and a module that exits while imported never reads as a pass."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from pytest_circuits.cli import main

from .conftest import IMPORT_ROOT, PROBES, SHIPPED_BASELINES, beyond_progress

SHIPPED = "tiny-induction--fp32"  # recorded with probe n 8, L 64 (the gate takes them from the file)
GATE = ["gate", "tiny-induction", "--build", "fp32", "--baseline", SHIPPED, "--no-knockout", "--device", "cpu"]

INVARIANT = '''
import json
import sys

import helper  # a file beside this module: importable while it runs
from pytest_circuits import Comparison, Invariant, register, within


@register
class SeenFrom(Invariant):
    """Writes what the run imported once the model is loaded (the gate's compare runs after it)."""

    name = "seen_from"

    def compare(self, before, after, tol):
        import safetensors

        with open("seen.json", "w") as out:
            json.dump({"sys_path": sys.path, "safetensors": safetensors.__file__}, out)
        return Comparison([within("model", "copy_loss", before.copy_loss, after.copy_loss, 1.0)])
'''
PLANTED = 'open({marker!r}, "w").write("imported")\nraise ImportError("the planted {name}.py ran")\n'


def _env(*paths: Path | str) -> dict[str, str]:
    """A subprocess's environment: this checkout first on its path, no llm-compressor environment."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([*map(str, paths), IMPORT_ROOT])}
    env.update(HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    env.pop("PYTEST_CIRCUITS_LLMCOMPRESSOR_PYTHON", None)
    return env


def circuits(args: list[str], cwd: Path, *paths: Path) -> subprocess.CompletedProcess:
    """``circuits ARGS`` as the console script runs it: the working folder is not on ``sys.path``."""
    code = "import sys; sys.path.pop(0); from pytest_circuits.entry import main; sys.exit(main())"
    command = [sys.executable, "-c", code, *args]
    return subprocess.run(command, cwd=cwd, env=_env(*paths), capture_output=True, text=True, timeout=600)


def pytest_run(args: list[str], cwd: Path, *paths: Path) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", *args]
    return subprocess.run(command, cwd=cwd, env=_env(*paths), capture_output=True, text=True, timeout=600)


def one_line(err: str) -> str:
    lines = [line for line in beyond_progress(err) if line.strip()]
    assert len(lines) == 1 and "Traceback" not in err, f"expected one line on stderr, got:\n{err}"
    return lines[0]


def usage_error(done: subprocess.CompletedProcess) -> str:
    """pytest's one ``ERROR:`` line of a usage error (exit 4): no test ran, none failed."""
    text = done.stdout + done.stderr
    errors = [line for line in text.splitlines() if line.startswith("ERROR")]
    assert done.returncode == 4, text[-3000:]
    assert len(errors) == 1 and "INTERNALERROR" not in text and "Traceback" not in text, text[-3000:]
    assert " failed" not in text and " passed" not in text, text[-3000:]
    return errors[0]


def probes_project(folder: Path, blocked: tuple[str, ...] = ()) -> Path:
    """A project holding the packaged gate suite; ``blocked``: modules its conftest makes unimportable
    (``sys.modules[name] = None``), as if their package were not installed."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "pytest.ini").write_text("[pytest]\n")
    for test in PROBES.glob("test_*.py"):
        shutil.copy(test, folder / test.name)
    blocks = "".join(f"sys.modules[{name!r}] = None\n" for name in blocked)
    (folder / "conftest.py").write_text(f"import sys\n{blocks}")
    return folder


# ---------------------------------------------------------------- 1. --invariants never shadows a package


def test_an_invariants_module_never_shadows_an_installed_package(tmp_path):
    """``--invariants MOD`` put the working folder first on sys.path and left it there: a
    ``safetensors.py`` beside the module replaced the installed package for the whole run."""
    for name in ("safetensors", "scipy"):
        (tmp_path / f"{name}.py").write_text(PLANTED.format(marker=str(tmp_path / f"{name}-RAN"), name=name))
    (tmp_path / "my_checks.py").write_text(INVARIANT)
    (tmp_path / "helper.py").write_text("HELPER = 1\n")
    done = circuits([*GATE, "--invariants", "my_checks"], tmp_path)
    assert done.returncode == 0, done.stderr
    assert "PASS seen_from:" in done.stdout and "gate passed" in done.stdout
    assert not (tmp_path / "safetensors-RAN").exists() and not (tmp_path / "scipy-RAN").exists()
    seen = json.loads((tmp_path / "seen.json").read_text())
    assert not Path(seen["safetensors"]).is_relative_to(tmp_path)  # the installed package
    assert str(tmp_path) not in seen["sys_path"] and "" not in seen["sys_path"]  # added while it ran, then removed
    # naming the planted file itself: refused, never imported in the package's place
    named = circuits([*GATE, "--invariants", "safetensors"], tmp_path)
    assert named.returncode == 2 and "gate passed" not in named.stdout
    line = one_line(named.stderr)
    assert "safetensors.py is named like the installed module safetensors" in line and "rename it" in line
    assert not (tmp_path / "safetensors-RAN").exists()


def test_the_folders_own_package_installed_editable_is_imported_as_installed(
    tmp_path, monkeypatch, capsys, registry_restored
):
    """Run from a project's root, ``--invariants mypkg.checks`` names the package both in the folder
    and installed editable (a finder mapping it to that same folder, as setuptools' does): the same
    files, so it is imported, not refused as a clash."""
    import importlib.util

    from pytest_circuits.gate.invariants import REGISTRY

    package = tmp_path / "editable_pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "checks.py").write_text(VALID.format(decorator="@register\n", name="editable_check", body=""))

    class EditableFinder:  # setuptools' editable finder, reduced to the one package
        @staticmethod
        def find_spec(name, path=None, target=None):
            if name == "editable_pkg":
                return importlib.util.spec_from_file_location(
                    name, package / "__init__.py", submodule_search_locations=[str(package)]
                )
            return None

    monkeypatch.setattr(sys, "meta_path", [*sys.meta_path, EditableFinder])
    monkeypatch.chdir(tmp_path)
    argv = ["gate", "no-such-model", "--build", "fp32", "--baseline", "no-such-baseline"]
    assert main([*argv, "--invariants", "editable_pkg.checks"]) == 2
    assert "baseline no-such-baseline does not exist" in one_line(capsys.readouterr().err)
    assert type(REGISTRY["editable_check"]).__module__ == "editable_pkg.checks"
    sys.modules.pop("editable_pkg.checks", None)
    sys.modules.pop("editable_pkg", None)


# ---------------------------------------------------------------- 3. what an --invariants module names


MODULES = [  # (module text, what --invariants names after the module, what the one line says)
    ("N = 5\n", ":N", "names 5 (int), not an Invariant subclass"),
    ("def f():\n    pass\n", ":f", "(function), not an Invariant subclass"),
    ("X = [1, 2]\n", ":X", "gave 1, not an Invariant subclass or instance"),
    ("class C:\n    pass\n", ":C", "gave <class"),
    ("S = 'copy_loss'\n", ":S", "names 'copy_loss' (str)"),
    ("import sys\nsys.exit(0)\n", "", "called sys.exit(0) while imported, so the gate did not run"),
    ("import sys\nsys.exit('bye')\n", "", "called sys.exit('bye') while imported"),
    ("raise KeyError('boom')\n", "", "cannot import mod_"),
    ("N = 5\n", ":M", "has no M"),
    (
        "from pytest_circuits import Invariant\nclass Needs(Invariant):\n    name = 'needs'\n"
        "    def __init__(self, x):\n        pass\n",
        ":Needs",
        "registering <class",
    ),
]


@pytest.mark.parametrize(
    "text, suffix, said", MODULES, ids=[f"{i}-{s or 'import'}" for i, (_, s, _) in enumerate(MODULES)]
)
def test_what_an_invariants_module_names_is_one_line(
    tmp_path, monkeypatch, capsys, registry_restored, text, suffix, said
):
    name = f"mod_{MODULES.index((text, suffix, said))}"
    (tmp_path / f"{name}.py").write_text(text)
    monkeypatch.chdir(tmp_path)
    assert main([*GATE, "--invariants", name + suffix]) == 2
    out, err = capsys.readouterr()
    line = one_line(err)
    assert line.startswith(f"circuits gate: --invariants {name}{suffix}") and said in line, line
    assert "gate passed" not in out and "PASS" not in out


@pytest.mark.parametrize("typed", ["my-checks", "checks:", "checks:1", ":Checks", "a..b", "1st", "checks:a.b"])
def test_a_name_that_is_no_module_is_one_line(tmp_path, monkeypatch, capsys, typed):
    monkeypatch.chdir(tmp_path)
    assert main([*GATE, "--invariants", typed]) == 2
    line = one_line(capsys.readouterr().err)
    assert f"--invariants {typed}: not a module name; write MODULE or MODULE:OBJECT" in line


def test_a_conftest_that_exits_while_imported_never_passes(tmp_path, monkeypatch, capsys):
    (tmp_path / "conftest.py").write_text("import sys\nsys.exit(0)\n")
    monkeypatch.chdir(tmp_path)
    baseline = str(SHIPPED_BASELINES / f"{SHIPPED}.json")
    assert main(["diff", baseline, baseline]) == 2
    out, err = capsys.readouterr()
    assert f"{tmp_path / 'conftest.py'} called sys.exit(0) while imported, so the gate did not run" in one_line(err)
    assert out == ""


def test_an_entry_point_naming_a_non_invariant_is_one_line_in_gate_scan_and_pytest(tmp_path):
    """A package whose ``pytest_circuits.invariants`` entry point names a number: a TypeError
    traceback in every front end before."""
    site = tmp_path / "site"
    info = site / "badplug-1.0.dist-info"
    info.mkdir(parents=True)
    (site / "badplug.py").write_text("N = 5\n")
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: badplug\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text("[pytest_circuits.invariants]\nbad = badplug:N\n")
    said = "invariant plugin 'bad' (badplug:N) names 5 (int), not an Invariant subclass or instance"
    for args in (GATE, ["scan", "tiny-induction", "--no-knockout", "--probe-n", "2", "--probe-length", "8"]):
        done = circuits(args, tmp_path, site)
        assert done.returncode == 2 and said in one_line(done.stderr), done.stderr
        assert done.stdout == ""  # before any work
    ran = pytest_run(["--circuits-builds", "fp32"], probes_project(tmp_path / "project"), site)
    assert said in usage_error(ran)


# ---------------------------------------------------------------- 3. a window of 5000 digits, a link loop


LONG = "9" * 5000


@pytest.mark.parametrize(
    "build, said",
    [
        (f"bf16+kv-q4_0-r{LONG}", "has 5000 digits, past any probe; give tokens before each query, e.g. -r128"),
        (f"gptq-int4-g{LONG}", "the group size has 5000 digits; e.g. -g64"),
    ],
    ids=["kv window", "group size"],
)
def test_a_number_of_5000_digits_in_a_build_is_one_line(tmp_path, capsys, build, said):
    assert main(["scan", "tiny-induction", "--build", build, "--no-knockout"]) == 2
    line = one_line(capsys.readouterr().err)
    assert said in line and len(line) < 400, line  # the build is named, elided
    assert said in usage_error(pytest_run(["--circuits-builds", build], probes_project(tmp_path)))


def test_a_baselines_folder_that_is_a_link_loop_is_one_line(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    Path("loop").symlink_to("loop")
    Path("a").symlink_to("b")
    Path("b").symlink_to("a")
    assert main(["record", "tiny-induction", "--build", "fp32", "--baselines", "loop"]) == 2
    assert "--baselines 'loop' is a symbolic link loop (or a path through one); fix the link" in one_line(
        capsys.readouterr().err
    )
    for typed in ("a", "loop/x.json"):
        assert main(["gate", "tiny-induction", "--build", "fp32", "--baseline", typed]) == 2
        line = one_line(capsys.readouterr().err)
        assert f"baseline {typed} is a symbolic link loop" in line and "fix or remove the link" in line, line
    ran = pytest_run(["--circuits-baselines", str(tmp_path / "loop")], probes_project(tmp_path / "project"))
    assert "--circuits-baselines" in usage_error(ran)


# ---------------------------------------------------------------- 4. a build whose environment is missing


@pytest.mark.parametrize(
    "build, blocked, said",
    [
        ("gptq-int4", (), "recipe gptq-int4 runs llm-compressor, which pins transformers"),
        ("awq-int4-g64", (), "recipe awq-int4-g64 runs llm-compressor"),
        ("bnb-nf4", ("bitsandbytes",), "recipe bnb-nf4 needs bitsandbytes: pip install bitsandbytes"),
        ("fp8-e4m3", ("compressed_tensors",), 'recipe fp8-e4m3 needs compressed-tensors: pip install "pytest-circuits[formats]"'),
        ("fp32+kv-hqq-int4-r32", ("hqq",), "the hqq-int4-r32 cache runs transformers' QuantizedCache with its hqq backend"),
        ("fp32+kv-quanto-int2-r32", ("optimum.quanto",), "needs the optimum-quanto package"),
    ],
    ids=["gptq", "awq", "bitsandbytes", "compressed-tensors", "hqq cache", "quanto cache"],
)  # fmt: skip
def test_a_build_that_cannot_be_made_is_a_usage_error_under_pytest(tmp_path, build, blocked, said):
    """``pytest probes --circuits-builds gptq-int4`` without llm-compressor's environment gave six
    FAILED invariants, rc 1: in CI a broken build. It is one line and exit 4, before any test runs."""
    project = probes_project(tmp_path, blocked)
    line = usage_error(pytest_run(["--circuits-builds", build], project))
    assert said in line, line


@pytest.mark.parametrize(
    "quantization, extra_file, blocked, said",
    [
        ({"quant_method": "compressed-tensors"}, None, "compressed_tensors", "(a compressed-tensors checkpoint) needs compressed-tensors"),
        ({"quant_method": "torchao"}, None, "torchao", "(a torchao checkpoint) needs torchao"),
        (None, "quanto_qmap.json", "optimum.quanto", "(an optimum-quanto checkpoint) needs optimum-quanto"),
    ],
    ids=["compressed-tensors", "torchao", "optimum-quanto"],
)  # fmt: skip
def test_an_external_checkpoint_whose_package_is_missing_is_a_usage_error(
    tmp_path, quantization, extra_file, blocked, said
):
    from pytest_circuits.model.named import EMBEDDED_DIR

    checkpoint = shutil.copytree(EMBEDDED_DIR / "tiny-induction", tmp_path / "checkpoint")
    if quantization is not None:
        config = json.loads((checkpoint / "config.json").read_text())
        config["quantization_config"] = quantization
        (checkpoint / "config.json").write_text(json.dumps(config))
    if extra_file is not None:
        (checkpoint / extra_file).write_text("{}")
    project = probes_project(tmp_path / "project", (blocked,))
    line = usage_error(pytest_run(["--circuits-builds", f"fp32,ext={checkpoint}"], project))
    assert f"external build ext={checkpoint} {said}" in line, line


def test_knockouts_of_a_decode_only_cache_are_refused_before_any_work(tmp_path, monkeypatch, capsys):
    """``+kv-quanto-int4-r32`` with knockouts was refused only after its decode-mode probe ran."""
    from pytest_circuits.run import steps

    monkeypatch.chdir(tmp_path)

    def no_load(*args, **kwargs):
        raise AssertionError("a build was loaded before the refusal")

    monkeypatch.setattr(steps, "load_spec", no_load)
    build = "fp32+kv-quanto-int4-r32"
    for args in (
        ["gate", "tiny-induction", "--build", build, "--baseline", SHIPPED],
        ["scan", "tiny-induction", "--build", build],
        ["record", "tiny-induction", "--build", build, "--baselines", "never-written"],
    ):
        assert main(args) == 2
        line = one_line(capsys.readouterr().err)
        assert f"build {build}: the knockout scan runs one forward over whole sequences" in line
        assert "--no-knockout" in line and not Path("never-written").exists()


def test_under_pytest_knockouts_of_a_decode_only_cache_are_a_usage_error_before_any_test(tmp_path):
    """Under pytest the selected knockout test of ``+kv-quanto-int4-r32`` is refused before any test runs
    (exit 4, pytest's way out named), not one failed test after the decode-mode probe; deselected with
    ``-k 'not knockout'``, the refusal goes and the run proceeds."""
    pytest.importorskip("optimum.quanto", reason="the quanto cache needs optimum-quanto: the formats extra")
    project = probes_project(tmp_path / "project")
    build = "fp32+kv-quanto-int4-r32"
    line = usage_error(pytest_run(["--circuits-builds", build], project))
    assert f"build {build}: the knockout scan runs one forward over whole sequences" in line, line
    assert "-k 'not knockout'" in line
    done = pytest_run(["--circuits-builds", build, "-k", "not knockout and ov_gain"], project)
    assert done.returncode == 0 and "1 passed" in done.stdout, (done.stdout + done.stderr)[-3000:]


# ---------------------------------------------------------------- 5. the messages


def test_a_file_that_is_no_baseline_is_never_to_be_deleted(tmp_path, capsys):
    passwd = tmp_path / "passwd"
    passwd.write_text("root:x:0:0:root:/root:/bin/bash\n")
    package = tmp_path / "package.json"
    package.write_text('{"name": "something else"}\n')
    for path, why in ((passwd, "it is not valid JSON (line 1)"), (package, "it holds no schema_version")):
        assert main(["gate", "tiny-induction", "--build", "fp32", "--baseline", str(path)]) == 2
        line = one_line(capsys.readouterr().err)
        assert f"{path} is not a pytest-circuits baseline ({why}); pass a baseline file" in line, line
        assert "delete" not in line
    assert passwd.read_text().startswith("root:")


def test_a_baseline_here_is_used_before_the_shipped_one_of_its_name(tmp_path, monkeypatch, capsys):
    """One rule, with or without ``.json``: a file here first, then the shipped baseline; the first
    line says which file was used. (In a subprocess: an in-process pytester run elsewhere in the suite
    can leave transformers' llama modules half unloaded.)"""
    shipped = SHIPPED_BASELINES / f"{SHIPPED}.json"
    done = circuits(GATE, tmp_path)
    said = "shipped with pytest-circuits (circuits baselines lists its file)"
    assert done.returncode == 0 and done.stdout.splitlines()[0] == f"baseline {shipped.name}, {said}"
    local = tmp_path / f"{SHIPPED}.json"
    shutil.copy(shipped, local)
    for typed in (SHIPPED, f"{SHIPPED}.json"):
        done = circuits([*GATE[:5], typed, *GATE[6:]], tmp_path)
        first = done.stdout.splitlines()[0] if done.stdout else done.stderr
        assert done.returncode == 0 and first == f"baseline {local}, not the shipped baseline of that name"
    local.write_text("{damaged")  # read before any model is loaded: in this process
    monkeypatch.chdir(tmp_path)
    for typed in (SHIPPED, f"{SHIPPED}.json"):
        assert main([*GATE[:5], typed, *GATE[6:]]) == 2
        assert f"baseline {SHIPPED}.json is not valid JSON" in one_line(capsys.readouterr().err)


@pytest.mark.parametrize(
    "args, said",
    [
        (["gate", "tiny-induction", "--build", "fp32", "--baseline", "tiny-induction-fp32"],
         "or gate against the shipped baseline named like it: --baseline tiny-induction--fp32"),
        (["scan", "tiny_induction"], "model 'tiny_induction' not found (did you mean 'tiny-induction'?)"),
        (["scan", "tiny-induction", "--build", "bf16-kv-q4_0"],
         "unknown build recipe 'bf16-kv-q4_0' (did you mean 'bf16+kv-q4_0'? a KV cache follows +kv-)"),
        (["gate", "tiny-induction", "--build", "fp32", "--baseline", "new\nline"],
         "baseline new\\nline does not exist"),
    ],
    ids=["baseline name", "model name", "cache without +", "newline"],
)  # fmt: skip
def test_did_you_mean_and_one_line(tmp_path, monkeypatch, capsys, args, said):
    monkeypatch.chdir(tmp_path)
    assert main(args) == 2
    line = one_line(capsys.readouterr().err)
    assert said in line, line


def test_an_option_of_another_command_says_so(capsys):
    """``record --no-knockout`` said "did you mean '--no-knockout'?", the flag typed."""
    with pytest.raises(SystemExit) as stop:
        main(["record", "tiny-induction", "--build", "fp32", "--no-knockout"])
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert (
        "unrecognized arguments: --no-knockout (--no-knockout is an option of circuits scan, gate, not of record: "
        "a baseline holds every rung (the gate's knockout invariants read it))" in err
    )
    assert "did you mean '--no-knockout'" not in err


# ---------------------------------------------------------------- 6. a seeded property test

VALID = """
from pytest_circuits import Comparison, Invariant, register, within


{decorator}class Inv(Invariant):
    name = "{name}"
{body}
    def compare(self, before, after, tol):
        return Comparison([within("model", "copy_loss", before.copy_loss, after.copy_loss, 1.0)])


ALL = [Inv]
"""
IMPORT_FLAWS = [  # (a line that breaks the module as it is imported, a word of the one line)
    ("raise ValueError('bad value')", "ValueError: bad value"),
    ("raise KeyError('k')", "KeyError"),
    ("1 / 0", "ZeroDivisionError"),
    ("import no_such_module_51", "ModuleNotFoundError"),
    ("def broken(:\n    pass", "SyntaxError"),
    ("import sys\nsys.exit(0)", "called sys.exit(0) while imported"),
    ("import sys\nsys.exit(3)", "called sys.exit(3) while imported"),
    ("import sys\nsys.exit(None)", "called sys.exit(None) while imported"),
    ("raise SystemExit('stop')", "called sys.exit('stop') while imported"),
]
CLASS_FLAWS = [  # (class fields that the registry refuses, a word of the one line)
    ('    name = ""\n', "has no name"),
    ('    tolerances = {"kappa": 0.1}\n', "'kappa' is taken"),
    ('    tolerances = {"own_tol": "a"}\n', "needs a number or bool default"),
    ('    tolerances = {"Bad-Name": 0.1}\n', "cannot be set by --tol or an ini key"),
    ('    name = "copy_loss"\n', "registered twice"),
]
JUNK = ["0", "1.5", "None", "'copy_loss'", "b'x'", "{}", "{'a': 1}", "(1,)", "[None]", "lambda: 0", "object()",
        "print", "range(3)", "type", "Exception", "[Inv, 5]"]  # fmt: skip
BAD_NAMES = ["{m}-x", "9{m}", "{m}:", "{m}:9x", "{m}.", "{m} ", ":{m}", "{m}::Inv", "{m}:Inv.name"]


def _module_case(rng, i: int) -> tuple[str, str, str | None]:
    """``(module text, what follows --invariants, a word of the expected line)``; None: a valid module."""
    name, m = f"inv_{i}", f"mod_p{i}"
    kind = rng.randrange(6)
    decorator, body, named, said = "@register\n", "", m, None
    if kind == 0:  # valid: registered on import, named as a module, MODULE:CLASS or MODULE:LIST
        decorator, named = rng.choice([("@register\n", m), ("", f"{m}:Inv"), ("", f"{m}:ALL")])
    elif kind == 1:
        flaw, said = rng.choice(IMPORT_FLAWS)
    elif kind == 2:
        body, said = rng.choice(CLASS_FLAWS)
        decorator, named = rng.choice([("@register\n", m), ("", f"{m}:Inv")])
    elif kind == 3:
        value = rng.choice(JUNK)
        decorator, body, named = "", f"\n\nJUNK = {value}\n", f"{m}:JUNK"
        said = "not an Invariant subclass or instance"
    elif kind == 4:
        named, said = f"{m}:{rng.choice(['Missing', 'inv', 'ALL_'])}", "has no"
    else:
        named, said = rng.choice(BAD_NAMES).format(m=m), "not a module name"
    text = VALID.format(decorator=decorator, name=name, body=body if kind == 2 else "")
    if kind == 1:
        text += f"\n{flaw}\n"
    if kind == 3:
        text += body
    return text, named, said


def test_malformed_invariant_modules_are_refused_in_one_line(tmp_path, monkeypatch, capsys, registry_restored):
    """Property (seeded generator): a module given to ``--invariants`` (or as a conftest.py) that
    raises, exits, cannot be parsed, registers what the registry refuses or names a non-invariant,
    and a name that is no module, each end in exit 2 with one line naming what was given; a valid
    one is loaded and the gate goes on (here to its missing baseline); never a traceback or a pass."""
    import random

    rng = random.Random(51)
    for i in range(150):
        text, named, said = _module_case(rng, i)
        folder = tmp_path / f"case{i}"
        folder.mkdir()
        monkeypatch.chdir(folder)
        as_conftest = said is not None and ":" not in named and rng.random() < 0.3 and named.isidentifier()
        (folder / ("conftest.py" if as_conftest else f"mod_p{i}.py")).write_text(text)
        argv = ["gate", "no-such-model", "--build", "fp32", "--baseline", "no-such-baseline"]
        code = main(argv if as_conftest else [*argv, "--invariants", named])
        out, err = capsys.readouterr()
        line = one_line(err)
        assert code == 2 and "PASS" not in out and "gate passed" not in out, (i, named, line)
        if said is None:
            assert line.startswith("circuits gate: baseline no-such-baseline does not exist"), (i, named, line)
        else:
            shown = named if named.isprintable() and named.strip() == named else repr(named)
            given = str(folder / "conftest.py") if as_conftest else f"--invariants {shown}"
            assert line.startswith(f"circuits gate: {given}") and said in line, (i, named, text, line)


def test_baselines_by_name_follow_one_rule(tmp_path, monkeypatch, capsys):
    """Property (seeded generator): a ``--baseline`` value (a shipped name mutated, a file here, a
    path, junk) is a file here first, else the shipped baseline of that name, else one line saying
    why not; never a traceback. The file here is a damaged copy (schema version 99), so the line
    says which file was read; a shipped one is read and the gate goes on to the model (missing)."""
    import random

    rng = random.Random(5151)
    monkeypatch.chdir(tmp_path)
    shipped = sorted(p.name.removesuffix(".json") for p in SHIPPED_BASELINES.glob("*.json"))
    here = json.loads((SHIPPED_BASELINES / f"{SHIPPED}.json").read_text())
    here["schema_version"] = 99
    Path(f"{SHIPPED}.json").write_text(json.dumps(here))
    Path("notes.txt").write_text("hello\n")
    Path("empty.json").write_text("")
    Path("folder.json").mkdir()
    Path("loop.json").symlink_to("loop.json")
    files = ["notes.txt", "empty.json", "folder.json", "loop.json", f"{SHIPPED}.json", str(tmp_path / "notes.txt")]

    def there(path: Path) -> bool:
        try:
            return path.exists() or path.is_symlink()
        except OSError:  # a name too long to look at
            return False

    def mutated(name: str) -> str:
        kind = rng.randrange(8)
        if kind == 0:
            return name.replace("--", "-")
        if kind == 1:
            cut = rng.randrange(len(name))
            return name[:cut] + name[cut + 1 :]
        if kind == 2:
            return name.upper()
        if kind == 3:
            return f"./{name}"
        if kind == 4:
            return f"../{name}"
        if kind == 5:
            return name + rng.choice([" ", "\n", "x", ".JSON", ".json.json"])
        return name

    expected_by_local = {  # what the one line says of each file here, read as a baseline
        "notes.txt": "is not a pytest-circuits baseline (it is not valid JSON",
        "empty.json": "is not a pytest-circuits baseline (it is not valid JSON",
        "folder.json": "is a folder, not a file",
        "loop.json": "is a symbolic link loop",
        f"{SHIPPED}.json": "schema version 99",
    }
    for _ in range(150):
        pick = rng.random()
        if pick < 0.5:
            value = mutated(rng.choice(shipped)) + rng.choice(["", ".json"])
        elif pick < 0.8:
            value = rng.choice(files)
        else:
            value = rng.choice(["", ".", "..", "/", "-", "~", "x" * 300, "a/b/c.json", "tiny-induction"])
        path = Path(value)
        bare = len(path.parts) == 1
        stem = path.name.removesuffix(".json")
        local = path if there(path) else Path(f"{stem}.json") if bare and there(Path(f"{stem}.json")) else None
        code = main(["gate", "no-such-model", "--build", "fp32", "--baseline", value, "--device", "cpu"])
        line = one_line(capsys.readouterr().err)
        assert code == 2, (value, line)
        if local is not None and local.name in expected_by_local:
            assert expected_by_local[local.name] in line, (value, line)
        elif local is not None and local.is_dir():
            assert "is a folder" in line, (value, line)
        elif bare and stem in shipped:
            assert line.startswith("circuits gate: model 'no-such-model' not found"), (value, line)
        elif any(len(part) > 255 for part in path.parts):
            assert "has a name longer than the system allows; shorten it" in line, (value, line)
        else:
            assert "does not exist" in line, (value, line)
