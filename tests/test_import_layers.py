"""The package's import layers: every import points down, none forms a cycle, none takes a private name.

Read from the source with ``ast`` (imports inside functions count too), so it needs no third-party
linter. The layers, highest first; a module may import its own layer and any layer below:

1. front ends: the package root, ``plugin``, ``cli`` (and ``entry``, its console script; ``cli_help``, its help; ``show``, what
   it prints of records), ``probes``
2. ``run`` (one run: its parts and the flow that measures what the gate asks for), ``assertions``,
   ``testing``
3. ``report``
4. ``gate`` (pure verdicts: it imports no ``rungs`` and needs no torch, tests below)
5. ``settings``
6. ``rungs``
7. ``record`` (the one record: figures, schema, store, shards, looks)
8. ``model``
9. base: ``errors``, ``options``, ``fsio``, ``progress``

The one exception: ``from pytest_circuits import __version__`` (package metadata, no code) is
allowed from any layer.
"""

from __future__ import annotations

import ast
import functools
from pathlib import Path

import pytest

import pytest_circuits

PACKAGE = Path(pytest_circuits.__file__).resolve().parent
ROOT = "pytest_circuits"
LAYERS = (
    (ROOT, "plugin", "cli", "cli_help", "show", "entry", "probes"),
    ("run", "assertions", "testing"),
    ("report",),
    ("gate",),
    ("settings",),
    ("rungs",),
    ("record",),
    ("model",),
    ("errors", "options", "fsio", "progress"),
)


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(path): path for path in sorted(PACKAGE.rglob("*.py"))}


def imports_of(name: str) -> list[tuple[str, list[str]]]:
    """``(module imported, names taken from it)`` for every import of the package's own modules in ``name``."""
    path = MODULES[name]
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                target = ".".join([*base, node.module] if node.module else base)
            else:
                target = node.module or ""
            if target == ROOT or target.startswith(ROOT + "."):
                names = [alias.name for alias in node.names]
                submodules = [f"{target}.{n}" for n in names if f"{target}.{n}" in MODULES]
                found += [(sub, []) for sub in submodules]
                rest = [n for n in names if f"{target}.{n}" not in MODULES]
                if rest or not submodules:
                    found.append((target, rest))
        elif isinstance(node, ast.Import):
            found += [(alias.name, []) for alias in node.names if alias.name.split(".")[0] == ROOT]
    return found


def layer_of(name: str) -> int:
    """Index in `LAYERS` of a module (0 highest): by its first component below the package."""
    top = name.split(".")[1] if "." in name else ROOT
    for index, layer in enumerate(LAYERS):
        if top in layer:
            return index
    raise AssertionError(f"{name} is in no layer: add its package to LAYERS in {Path(__file__).name}")


def test_every_module_has_a_layer():
    for name in MODULES:
        layer_of(name)


def test_imports_point_down():
    upward = []
    for name in MODULES:
        for target, names in imports_of(name):
            if target == ROOT and names == ["__version__"]:
                continue
            if layer_of(target) < layer_of(name):
                upward.append(f"{name} imports {target} ({LAYERS[layer_of(target)][0]} is above)")
    assert not upward, "\n".join(upward)


def test_no_private_names_cross_modules():
    private = [
        f"{name} takes {n} from {target}"
        for name in MODULES
        for target, names in imports_of(name)
        for n in names
        if n.startswith("_") and not n.startswith("__")
    ]
    assert not private, "\n".join(private)


def find_cycle(graph: dict[str, list[str]]) -> list[str] | None:
    """One import cycle of ``graph`` (module -> modules it imports) as a path that returns to its start, or None."""
    done: set[str] = set()
    path: list[str] = []

    def visit(name: str) -> list[str] | None:
        if name in path:
            return [*path[path.index(name) :], name]
        if name in done:
            return None
        path.append(name)
        for target in graph.get(name, []):
            cycle = visit(target)
            if cycle is not None:
                return cycle
        path.pop()
        done.add(name)
        return None

    for name in graph:
        cycle = visit(name)
        if cycle is not None:
            return cycle
    return None


def test_no_import_cycle():
    """No cycle among the modules (a package's ``__init__`` counts as one module)."""
    graph = {name: sorted({t for t, _ in imports_of(name) if t in MODULES and t != name}) for name in MODULES}
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_the_checks_see_a_cycle_and_an_upward_import():
    """The checks themselves: a hand-made cycle is found, a lower layer ranks below a higher one."""
    assert find_cycle({"a": ["b"], "b": ["c"], "c": ["a"], "d": ["a"]}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": ["b"], "b": ["c"], "d": ["a", "c"]}) is None
    assert layer_of("pytest_circuits.model.families") > layer_of("pytest_circuits.gate.check")
    assert layer_of("pytest_circuits.errors") == len(LAYERS) - 1
    screen_imports = dict(imports_of("pytest_circuits.rungs.screen"))
    assert "pytest_circuits.rungs.replay" in screen_imports  # relative imports resolve to full names


def session_uses(source: str) -> list[str]:
    """Where ``source`` names a session: a parameter, variable or attribute called ``session``."""
    tree = ast.parse(source)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.arg) and node.arg == "session":
            found.append(f"parameter session (line {node.lineno})")
        elif isinstance(node, ast.Name) and node.id == "session":
            found.append(f"name session (line {node.lineno})")
        elif isinstance(node, ast.Attribute) and node.attr == "session":
            found.append(f".session (line {node.lineno})")
    return found


def test_the_gate_takes_typed_inputs_never_the_session():
    """No call from gate/ back into the session: its functions take the records (`RecordSource`), the
    baselines and the tolerances, so no gate module names a session at all (the import test alone
    cannot see a session passed in as an argument)."""
    gate = [name for name in MODULES if name.startswith(f"{ROOT}.gate.")]
    assert len(gate) > 10
    found = [f"{name}: {use}" for name in gate for use in session_uses(MODULES[name].read_text(encoding="utf-8"))]
    assert not found, "\n".join(found)
    # what the check finds: the older shape, a gate function that takes the session and calls back into it
    assert len(session_uses("def gate(session):\n    return session.records.record('fp32')\n")) == 2
    assert len(session_uses("def gate(self):\n    return self.session.baselines\n")) == 1


def _classes(source: str) -> list[tuple[str, int, list[str]]]:
    """``(name, own lines, base names)`` of each class of ``source``."""
    return [
        (node.name, node.end_lineno - node.lineno + 1, [ast.unparse(b).rpartition(".")[2] for b in node.bases])
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.ClassDef) and node.end_lineno is not None
    ]


@functools.cache
def _package_classes() -> dict[str, tuple[int, list[str]]]:
    """Every class of the package by name: ``(own lines, base names)``."""
    found = {}
    for path in MODULES.values():
        found.update({name: (lines, bases) for name, lines, bases in _classes(path.read_text(encoding="utf-8"))})
    return found


def long_classes(source: str, most: int = 200, inherited: bool = False) -> list[str]:
    """The classes of ``source`` longer than ``most`` lines (``inherited``: counting the lines of
    every class of the package they derive from, at any depth, by name)."""
    package = _package_classes()

    def total(name: str, lines: int, bases: list[str]) -> int:
        return lines + sum(total(b, *package[b]) for b in bases if b in package and b != name) if inherited else lines

    return [f"{name} ({n} lines)" for name, lines, bases in _classes(source) if (n := total(name, lines, bases)) > most]


def test_no_module_is_over_600_lines():
    """Small modules with one job each (#50): none of the package's over 600 lines."""
    long = {
        name: n for name, path in MODULES.items() if (n := len(path.read_text(encoding="utf-8").splitlines())) > 600
    }
    assert not long, long


def test_no_class_is_over_200_lines_counting_what_it_inherits():
    """The run's objects split by job (docs/architecture.md, "One run"), composed rather than inherited:
    no class of the package grows back into the whole program, its bases' lines counted with its own."""
    found = [c for name in MODULES for c in long_classes(MODULES[name].read_text(encoding="utf-8"), inherited=True)]
    assert not found, "\n".join(found)
    assert long_classes("class Big:\n" + "    x = 1\n" * 200) == ["Big (201 lines)"]
    heir = "class Heir(Run):\n" + "    x = 1\n" * 150  # what it inherits counts: Run is about 100 lines
    assert long_classes(heir, inherited=True) and not long_classes(heir)


# ---------------------------------------------------------------- typed records (issue #39, item 4)

# modules that read scan records as typed `record.schema.Record`s, never by key
TYPED = (
    "gate/builtin_invariants.py",
    "gate/swap_invariants.py",
    "gate/profile.py",
    "gate/invariant_api.py",
    "gate/invariants.py",
    "gate/check.py",
    "gate/fixes.py",
    "run/flow.py",
    "run/baselines.py",
    "run/assemble.py",
)
# every module outside the record package (#50: one typed record from measurement to report): the record's
# package is the only one that reads its keys (its typed schema, its store and shard parts, its lenient
# view for drawing)
READERS = sorted(p for p in PACKAGE.rglob("*.py") if p.relative_to(PACKAGE).parts[0] != "record")
# ... but for the modules that read pandas frames and Hugging Face configs, whose columns and keys share
# the figures' names: they never hold a record (test_frame_readers_hold_no_record)
FRAME_READERS = ("rungs", "model", "assertions.py", "probes/test_rung2_knockout.py")
READERS = [p for p in READERS if not p.relative_to(PACKAGE).as_posix().startswith(FRAME_READERS)]
# still reading record dicts by key: to convert (the report)
PENDING: tuple[str, ...] = ()


# names of dicts that share a key with a record: a message's words, a kappa frame's attrs and columns;
# in the report: a gate result (r, raw), its moved rows (m, entry), a change row (c), a record's model
# figures as floats (measured, measured_before), a live attention map (attention)
NOT_RECORDS = {"words", "attrs", "spectrum", "r", "raw", "m", "entry", "c", "measured", "measured_before", "attention"}
NOT_RECORDS |= {"event", "load", "part"}  # the run's baseline events, its build loads, a shard job's part


def _record_keys() -> set[str]:
    """Every key of a scan record, at any depth: the fields of `Record` and its parts."""
    from pytest_circuits.record import schema

    models = (schema.Record, schema.HeadRow, schema.Geometry, schema.ModelInfo, schema.BuildInfo)
    models += (schema.ProbeInfo, schema.KnockoutInfo, schema.Rung1Info, schema.Look)
    return {name for model in models for name in model.model_fields}


def record_reads(source: str, keys: set[str], gets_only: bool = False) -> list[str]:
    """``line: text`` of each read of a record key by name: ``x.get("copy_loss")``, ``x["heads"]``
    (with ``gets_only``, only the ``.get`` reads: a frame's columns share the keys' names)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get":
            key = node.args[0] if node.args else None
        elif isinstance(node, ast.Subscript) and not gets_only:
            key = node.slice
        else:
            continue
        receiver = node.func.value if isinstance(node, ast.Call) else node.value  # type: ignore[union-attr]
        named = receiver.id if isinstance(receiver, ast.Name) else getattr(receiver, "attr", None)
        if named in NOT_RECORDS:
            continue
        if isinstance(key, ast.Constant) and key.value in keys:
            found.append(f"{node.lineno}: {ast.unparse(node)}")
    return found


def test_typed_modules_read_no_record_key_and_the_pending_list_is_exact():
    keys = _record_keys()
    flagged = {}
    for path in READERS:
        rel = path.relative_to(PACKAGE).as_posix()
        if reads := record_reads(path.read_text(), keys):
            flagged[rel] = reads
    typed = {m: flagged[m] for m in TYPED if m in flagged}
    assert not typed, f"record keys read in typed modules (read the Record's attributes): {typed}"
    assert sorted(flagged) == sorted(PENDING), (
        "a pending module was converted (drop it from PENDING) or a new one reads keys"
    )


def test_frame_readers_hold_no_record():
    """The modules left out of the key-read check import no whole-record type from the schema (the
    assertions take its typed partial `HeadWrites`), so what they read by key is a frame or a config."""
    whole = {"Record", "RecordLike", "typed_record", "Identity"}
    holding = {
        name: sorted(set(taken) & whole)
        for name, path in MODULES.items()
        if path.relative_to(PACKAGE).as_posix().startswith(FRAME_READERS)
        for target, taken in imports_of(name)
        if target == "pytest_circuits.record.schema" and set(taken) & whole
    }
    assert not holding, f"a frame reader takes a record type: {holding}"


def test_the_gate_and_the_rungs_import_neither_each_other_nor_torch():
    """gate/ decides from records and rungs/ measures a loaded build: neither imports the other, and
    importing the gate's verdict (every built-in invariant registered) loads no torch."""
    import subprocess
    import sys

    def folder(module: str) -> str:
        return module.split(".")[1] if "." in module else ""

    crossing = [
        (name, target)
        for name in MODULES
        for target, _ in imports_of(name)
        if {folder(name), folder(target)} == {"gate", "rungs"}
    ]
    assert not crossing, f"gate and rungs import each other: {crossing}"
    code = "import sys, pytest_circuits.gate.check, pytest_circuits.gate.invariants; print('torch' in sys.modules)"
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert loaded == "False", "importing the gate loads torch"


def test_the_assertions_read_no_record_key_with_get():
    """The public assertions reach the gate's cut through typed `HeadWrites`, not a record dict."""
    assert record_reads((PACKAGE / "assertions.py").read_text(), _record_keys(), gets_only=True) == []


def test_the_record_read_check_sees_a_key_read():
    keys = _record_keys()
    assert record_reads('x = before.get("copy_loss")\ny = row["knockout_delta"]', keys) == [
        "1: before.get('copy_loss')",
        "2: row['knockout_delta']",
    ]
    assert record_reads('x = fixes.get("own")\ny = gains[name]\nz = before.copy_loss', keys) == []
    assert record_reads('e = spectrum.attrs.get("eigenvalues")\nq = attrs.get("q")', keys) == []  # a frame's attrs
    assert record_reads('x = frame["kappa"]\ny = row.get("ov_gain")', keys, gets_only=True) == ["2: row.get('ov_gain')"]


def _declared_for_mypy(name: str) -> dict[str, str]:
    """``field: annotation`` of class ``name`` in schema.py's ``if TYPE_CHECKING:`` block."""
    tree = ast.parse((PACKAGE / "record" / "schema.py").read_text())
    block = next(n for n in tree.body if isinstance(n, ast.If) and ast.unparse(n.test) == "TYPE_CHECKING")
    cls = next(n for n in block.body if isinstance(n, ast.ClassDef) and n.name == name)
    return {n.target.id: ast.unparse(n.annotation) for n in cls.body if isinstance(n, ast.AnnAssign)}


def _plain_annotation(field) -> str:
    """A pydantic field's annotation without its constraints: ``float | None``, ``list[float]``."""
    import typing

    def plain(kind) -> str:
        if typing.get_origin(kind) is typing.Annotated:
            return plain(typing.get_args(kind)[0])
        if typing.get_origin(kind) in (typing.Union, __import__("types").UnionType):
            return " | ".join(plain(k) for k in typing.get_args(kind))
        if typing.get_origin(kind) is list:
            return f"list[{plain(typing.get_args(kind)[0])}]"
        if typing.get_origin(kind) is dict:
            return f"dict[{', '.join(plain(k) for k in typing.get_args(kind))}]"
        return "None" if kind is type(None) else kind.__name__

    return plain(field.annotation)


@pytest.mark.parametrize("name", ["HeadRow", "_Figures", "_LookValues"])
def test_what_mypy_reads_of_the_figure_models_is_what_they_hold(name):
    """The head rows and model figures are built from the figure table at import; mypy reads a
    declaration of each (schema.py, ``if TYPE_CHECKING``) that must name the same fields and types."""
    from pytest_circuits.record import schema

    built = {field: _plain_annotation(info) for field, info in getattr(schema, name).model_fields.items()}
    assert _declared_for_mypy(name) == built
