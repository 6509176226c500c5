"""One meaning per word (issue #39, item 6; the glossary in docs/architecture.md): a scan of the
package's source that fails when an ambiguous name comes back, and the deprecated old names that
still work, each with a `CircuitsDeprecationWarning`.

Read with ``ast`` from the installed package, so it holds however the package was installed.
"""

from __future__ import annotations

import ast
import contextlib
import importlib
from pathlib import Path

import pytest

import pytest_circuits
from pytest_circuits.errors import CircuitsDeprecationWarning, renamed_keywords

PACKAGE = Path(pytest_circuits.__file__).resolve().parent
PLAIN_LOOPS = "rungs/plain_loops.py"


def sources() -> dict[str, ast.Module]:
    return {
        path.relative_to(PACKAGE).as_posix(): ast.parse(path.read_text(encoding="utf-8"))
        for path in sorted(PACKAGE.rglob("*.py"))
    }


def functions(tree: ast.AST, prefix: str = ""):
    """``(qualified name, node)`` of every function, methods as ``Class.name``."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield prefix + node.name, node
            yield from functions(node, f"{prefix}{node.name}.")
        elif isinstance(node, ast.ClassDef):
            yield from functions(node, f"{prefix}{node.name}.")


def parameters(node) -> list[ast.arg]:
    a = node.args
    return [*a.posonlyargs, *a.args, *a.kwonlyargs]


def test_the_plain_loops_live_in_one_module_under_one_prefix():
    """``naive_*`` and ``*_reference`` are gone; ``plain_*`` means a slow loop of `rungs/plain_loops.py`."""
    wrong = []
    for module, tree in sources().items():
        for name, _ in functions(tree):
            last = name.rpartition(".")[2]
            if last.startswith("naive_") or last.endswith("_reference"):
                wrong.append(f"{module}: {name}")
            elif last.startswith("plain_") and module != PLAIN_LOOPS:
                wrong.append(f"{module}: {name} (plain_* belongs in {PLAIN_LOOPS})")
    defined = [name for name, _ in functions(sources()[PLAIN_LOOPS]) if "." not in name]
    assert defined and all(name.startswith("plain_") for name in defined), defined
    assert not wrong, wrong


def test_no_recipe_parameter_takes_a_build_name():
    """A ``recipe`` parameter is a `Recipe` of the table (model/recipes.py); a build's name is ``build_name``."""
    wrong = []
    for module, tree in sources().items():
        if module == "model/recipes.py":
            continue
        for name, node in functions(tree):
            for arg in parameters(node):
                typed_recipe = arg.annotation is not None and ast.unparse(arg.annotation) == "Recipe"
                if arg.arg == "recipe" and not typed_recipe:
                    wrong.append(f"{module}: {name}")
    assert not wrong, wrong


def test_the_replay_says_trace_and_replay_not_record_and_cached():
    """The replay engine traces block calls (a record is a scan record); its switch is ``replay``."""
    trees = sources()
    replay_names = {
        n.id if isinstance(n, ast.Name) else n.arg if isinstance(n, ast.arg) else n.name
        for n in ast.walk(trees["rungs/replay.py"])
        if isinstance(n, (ast.Name, ast.arg, ast.FunctionDef))
    }
    assert not [n for n in replay_names if "record" in n.lower()], replay_names
    cached = []
    for module, tree in trees.items():
        for name, node in functions(tree):
            if module == "rungs/knockout.py" and name == "knockout_scan":
                continue  # the deprecated keyword itself (test_deprecated_knockout_keywords)
            if any(a.arg == "cached" for a in parameters(node)):
                cached.append(f"{module}: {name}")
        for call in (n for n in ast.walk(tree) if isinstance(n, ast.Call)):
            if any(k.arg == "cached" for k in call.keywords) and ast.unparse(call.func) != "df.attrs.update":
                cached.append(f"{module}: line {call.lineno}")
    assert not cached, cached


def test_module_names_say_what_they_hold():
    assert (PACKAGE / "report" / "plots.py").is_file() and not (PACKAGE / "report" / "figures.py").exists()
    shim = sources()["rungs/reference.py"]
    assert [name for name, _ in functions(shim)] == ["__getattr__"]  # a deprecated alias only


@pytest.mark.parametrize(
    ("old", "module", "new"),
    [
        ("naive_knockout_deltas", "plain_loops", "plain_knockout_deltas"),
        ("naive_losses", "plain_loops", "plain_knockout_losses"),
        ("unembedding_reference", "plain_loops", "plain_unembedding"),
        ("reduced_ov_reference", "plain_loops", "plain_reduced_ov"),
        ("kappa_reference", "plain_loops", "plain_kappa"),
        ("ov_spectrum_reference", "plain_loops", "plain_ov_spectrum"),
        ("knockout_flops", "plan", "knockout_flops"),
    ],
)
def test_the_old_plain_loop_names_warn_and_work(old, module, new):
    reference = importlib.import_module("pytest_circuits.rungs.reference")
    with pytest.warns(CircuitsDeprecationWarning, match=f"rungs.reference.{old} is deprecated.*rungs.{module}.{new}"):
        got = getattr(reference, old)
    assert got is getattr(importlib.import_module(f"pytest_circuits.rungs.{module}"), new)
    with pytest.raises(AttributeError):
        reference.no_such_name  # noqa: B018


def test_renamed_keywords_warn_pass_on_and_refuse_both():
    @renamed_keywords(recipe="build_name")
    def f(build_name: str, other: int = 0) -> tuple[str, int]:
        return build_name, other

    assert f("fp32", other=1) == ("fp32", 1)
    with pytest.warns(CircuitsDeprecationWarning, match=r"f\(recipe=\.\.\.\) is deprecated.*use build_name="):
        assert f(recipe="bf16") == ("bf16", 0)
    with pytest.raises(TypeError, match="both recipe= and build_name="):
        f(recipe="bf16", build_name="fp32")


def test_the_session_methods_take_their_old_keyword(tmp_path):
    """`CircuitsSession` (deprecated) and `BuildMeasurement` methods: ``recipe=`` still names the build."""
    from pytest_circuits.session import CircuitsSession
    from pytest_circuits.settings import CircuitsSettings

    session = CircuitsSession(CircuitsSettings(model="tiny-induction", builds=("fp32",), baselines=tmp_path))
    with pytest.warns(CircuitsDeprecationWarning, match="baseline_path"):
        old = session.baseline_path(recipe="fp32")
    assert old == session.baseline_path("fp32") == session.baseline_path(build_name="fp32")
    with pytest.warns(CircuitsDeprecationWarning, match="forget_figures"):
        session.forget_figures(recipe="fp32")


@pytest.mark.parametrize(
    ("module", "name"),
    [
        ("gate.verdict", "candidate_record"),
        ("gate.verdict", "gate_build"),
        ("gate.verdict", "gate_against"),
        ("gate.verdict", "gate_file"),
        *(
            ("gate.baselines", f"RunBaselines.{m}")
            for m in ("path", "record_command", "write", "load", "missing_message")
        ),
        *(
            ("records", f"{c}.{m}")
            for c in ("MeasuredRecords", "ShardPartRecords")
            for m in ("record", "identity", "look")
        ),
    ],
)
def test_the_documented_gate_functions_take_their_old_keyword(module, name):
    """The gate's functions and records named in docs/ keep ``recipe=`` as a deprecated keyword."""
    fn = importlib.import_module(f"pytest_circuits.{module}")
    for part in name.split("."):
        fn = getattr(fn, part)
    with pytest.warns(CircuitsDeprecationWarning, match=f"{name}\\(recipe=.*use build_name="):
        with pytest.raises(TypeError):  # reached the function as build_name=, short of its other arguments
            fn(recipe="fp32")


def test_the_run_baselines_path_takes_recipe(tmp_path):
    from pytest_circuits.gate.baselines import RunBaselines

    baselines = RunBaselines.__new__(RunBaselines)
    baselines.store = type("S", (), {"path": staticmethod(lambda model, name: tmp_path / f"{model}--{name}.json")})()
    baselines._model_name = lambda: "m"
    with pytest.warns(CircuitsDeprecationWarning, match="RunBaselines.path"):
        old = baselines.path(recipe="fp32")
    assert old == baselines.path("fp32") == baselines.path(build_name="fp32") == tmp_path / "m--fp32.json"


@pytest.mark.parametrize(("old", "new", "value"), [("cached", "replay", False), ("record_bytes", "trace_bytes", 1)])
def test_deprecated_knockout_keywords(monkeypatch, old, new, value):
    """``knockout_scan(cached=, record_bytes=)`` warn and reach ``replay=``/``trace_bytes=`` (stopped
    at the first step that reads them, so no model is needed)."""
    from pytest_circuits.rungs import knockout

    seen = {}

    def intact_pass(build, ids, L, batch_size, trace, trace_bytes=None):
        seen.update(replay=trace, trace_bytes=trace_bytes)
        raise RuntimeError("stop")

    build = type(
        "B", (), {"tokens": type("T", (), {"bos_id": None})(), "geometry": None, "model": None, "label": "b"}
    )()
    monkeypatch.setattr(knockout, "refuse_decode_only", lambda *a: None)
    monkeypatch.setattr(knockout, "query_block", lambda *a: 10**9)
    monkeypatch.setattr(knockout, "parse_heads", lambda *a: [])
    monkeypatch.setattr(knockout, "held_out_ids", lambda *a: None)
    monkeypatch.setattr(knockout, "intact_pass", intact_pass)
    monkeypatch.setattr(knockout, "attention_implementation", lambda model: contextlib.nullcontext())
    settings = type("S", (), {"L": 4, "n": 2})()
    with pytest.warns(CircuitsDeprecationWarning, match=f"knockout_scan\\({old}=.*use {new}="):
        with pytest.raises(RuntimeError, match="stop"):
            knockout.knockout_scan(build, settings, progress=False, **{old: value})
    assert seen[new] == value
