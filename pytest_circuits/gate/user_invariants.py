"""Where the gate finds users' invariants, the same for ``pytest`` and ``circuits``.

In gate order, after the built-in ones: the entry point group ``pytest_circuits.invariants``
(pyproject.toml; loaded once, when the registry is first imported), then the project's
``conftest.py`` files (pytest imports them itself; the CLI with `load_conftests`, as
pytest-benchmark's command line does) or ``circuits --invariants MODULE`` (`load_module`).
Each loads a module that calls `register`, or names an `Invariant` (a class, an instance, or a
sequence of them), which is registered. A failure is one line (`CircuitsError`) naming the fix.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from ..errors import CircuitsError

ENTRY_POINT_GROUP = "pytest_circuits.invariants"
ROOT_FILES = ("pytest.ini", "pyproject.toml", "tox.ini", "setup.cfg")  # what makes a folder pytest's rootdir
_loaded: set[str] = set()  # the entry points and conftest files already loaded in this process


def load_entry_points() -> list[str]:
    """Load every entry point of `ENTRY_POINT_GROUP` not loaded yet; their names."""
    from importlib.metadata import entry_points

    names = []
    for point in entry_points(group=ENTRY_POINT_GROUP):
        key = f"entry point {point.name} = {point.value}"
        if key in _loaded:
            continue
        _loaded.add(key)
        try:
            value = point.load()
        except Exception as error:  # a third-party package: name it, do not crash deep inside
            raise CircuitsError(
                f"invariant plugin {point.name!r} ({point.value}, group {ENTRY_POINT_GROUP}) failed to load: "
                f"{type(error).__name__}: {error}; fix or uninstall that package"
            ) from None
        _register_named(value, f"invariant plugin {point.name!r} ({point.value})")
        names.append(point.name)
    return names


def rootdir(start: Path) -> Path:
    """pytest's rootdir for a run started in ``start``: the nearest folder holding an ini file, else ``start``."""
    for folder in (start, *start.parents):
        if any((folder / name).is_file() for name in ROOT_FILES):
            return folder
    return start


def load_conftests(start: Path) -> list[Path]:
    """Import the ``conftest.py`` files pytest would for a run started in ``start``: from the rootdir
    down to ``start``, outermost first; the files imported."""
    start = start.resolve()
    root = rootdir(start)
    folders = [start, *[p for p in start.parents if p == root or root in p.parents]]
    files = [f / "conftest.py" for f in reversed(folders) if (f / "conftest.py").is_file()]
    for file in files:
        if str(file) in _loaded:
            continue
        _loaded.add(str(file))
        spec = importlib.util.spec_from_file_location(f"_circuits_conftest_{len(_loaded)}", file)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.path.insert(0, str(file.parent))  # its own imports resolve as under pytest (rootdir-relative)
        try:
            spec.loader.exec_module(module)
        except CircuitsError as error:  # the registry refused what it registers: its own line
            raise CircuitsError(f"{file}: {error}") from None
        except Exception as error:
            raise CircuitsError(
                f"{file} failed to import: {type(error).__name__}: {error}; fix it (pytest would fail on it too), "
                "or run circuits from another folder"
            ) from None
        finally:
            sys.path.remove(str(file.parent))
    return files


def load_module(name: str) -> None:
    """``--invariants MODULE``: import ``name`` (a dotted module, or ``package.module:OBJECT``); an
    OBJECT names invariants to register."""
    module_name, _, attribute = name.partition(":")
    said = f"--invariants {name}"
    if str(Path.cwd()) not in sys.path:
        sys.path.insert(0, str(Path.cwd()))  # a module of the project, as under pytest's rootdir
    try:
        module = importlib.import_module(module_name)
    except Exception as error:
        raise CircuitsError(
            f"{said}: cannot import {module_name}: {type(error).__name__}: {error}; "
            "name an importable module (dotted, from this folder or the installed packages)"
        ) from None
    if attribute:
        if not hasattr(module, attribute):
            raise CircuitsError(f"{said}: module {module_name} has no {attribute}")
        _register_named(getattr(module, attribute), said)


def _register_named(value: Any, said: str) -> None:
    """Register what an entry point or ``MODULE:OBJECT`` names: an `Invariant` class or instance, a
    sequence of them, or a module (which registered its own on import)."""
    from types import ModuleType

    from .invariant_api import REGISTRY, Invariant, register

    if isinstance(value, ModuleType):
        return
    items: Iterable[Any] = [value] if isinstance(value, (type, Invariant)) else value
    for item in list(items):
        is_class = isinstance(item, type) and issubclass(item, Invariant)
        if not (is_class or isinstance(item, Invariant)):
            raise CircuitsError(f"{said} gave {item!r}, not an Invariant subclass or instance")
        if REGISTRY.get(item.name) is not item and type(REGISTRY.get(item.name)) is not item:
            register(item)
