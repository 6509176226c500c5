"""One meaning per word (issue #39, item 6; the glossary in docs/architecture.md): a scan of the
package's source that fails when an ambiguous name comes back; the old names are gone (#50: a 0.x
package removes what a redesign replaced, no deprecated aliases).

Read with ``ast`` from the installed package, so it holds however the package was installed.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest_circuits
from pytest_circuits import errors

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
            if any(a.arg == "cached" for a in parameters(node)):
                cached.append(f"{module}: {name}")
        for call in (n for n in ast.walk(tree) if isinstance(n, ast.Call)):
            if any(k.arg == "cached" for k in call.keywords) and ast.unparse(call.func) != "df.attrs.update":
                cached.append(f"{module}: line {call.lineno}")
    assert not cached, cached


def test_module_names_say_what_they_hold():
    assert (PACKAGE / "report" / "plots.py").is_file() and not (PACKAGE / "report" / "figures.py").exists()


def test_no_deprecated_alias_remains():
    """No shim module, deprecation warning, renamed keyword or old name: what a redesign replaced is removed."""
    assert not (PACKAGE / "rungs" / "reference.py").exists()
    assert not hasattr(errors, "CircuitsDeprecationWarning") and not hasattr(errors, "renamed_keywords")
    for old in ("register_invariant", "Run"):
        assert not hasattr(pytest_circuits, old)
