"""Where the gate finds users' invariants, the same for ``pytest`` and ``circuits``.

In gate order, after the built-in ones: the entry point group ``pytest_circuits.invariants``
(pyproject.toml; loaded once, when the registry is first imported), then the project's
``conftest.py`` files (pytest imports them itself; the CLI with `load_conftests`, as
pytest-benchmark's command line does) or ``circuits --invariants MODULE`` (`load_module`).
Each loads a module that calls `register`, or names an `Invariant` (a class, an instance, or a
sequence of them), which is registered. A failure is one line (`CircuitsError`) naming the fix.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.machinery
import importlib.util
import sys
from collections.abc import Iterator
from importlib.machinery import ModuleSpec
from pathlib import Path
from types import ModuleType
from typing import Any

from ..errors import CircuitsError, did_you_mean, one_line

ENTRY_POINT_GROUP = "pytest_circuits.invariants"
ROOT_FILES = ("pytest.ini", "pyproject.toml", "tox.ini", "setup.cfg")  # what makes a folder pytest's rootdir
_loaded: set[str] = set()  # the entry points and conftest files already loaded in this process
_ours: set[str] = set()  # the top-level modules `load_module` loaded from a folder (not installed ones)


def load_entry_points() -> list[str]:
    """Load every entry point of `ENTRY_POINT_GROUP` not loaded yet; their names."""
    from importlib.metadata import entry_points

    names = []
    for point in entry_points(group=ENTRY_POINT_GROUP):
        key = f"entry point {point.name} = {point.value}"
        if key in _loaded:
            continue
        said = f"invariant plugin {point.name!r} ({point.value}, group {ENTRY_POINT_GROUP})"
        try:
            value = point.load()
        except SystemExit as stop:
            raise CircuitsError(f"{said} {_exited(stop)}; fix or uninstall that package") from None
        except Exception as error:  # a third-party package: name it, do not crash deep inside
            raise CircuitsError(
                f"{said} failed to load: {type(error).__name__}: {one_line(error)}; fix or uninstall that package"
            ) from None
        _register_named(value, f"invariant plugin {point.name!r} ({point.value})")
        _loaded.add(key)  # only once loaded: a failure is said again, never skipped on the next try
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
    down to ``start``, outermost first; the files imported. Each file's folder is on ``sys.path``
    (last, `_on_path_last`) while it runs, for its own imports: it never replaces an installed module."""
    start = start.resolve()
    root = rootdir(start)
    folders = [start, *[p for p in start.parents if p == root or root in p.parents]]
    files = [f / "conftest.py" for f in reversed(folders) if (f / "conftest.py").is_file()]
    for file in files:
        if str(file) in _loaded:
            continue
        spec = importlib.util.spec_from_file_location(f"_circuits_conftest_{len(_loaded)}", file)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        fix = "fix it (pytest would fail on it too), or run circuits from another folder"
        try:
            with _on_path_last(file.parent):
                spec.loader.exec_module(module)
        except CircuitsError as error:  # the registry refused what it registers: its own line
            raise CircuitsError(f"{file}: {error}") from None
        except SystemExit as stop:
            raise CircuitsError(f"{file} {_exited(stop)}; {fix}") from None
        except Exception as error:
            raise CircuitsError(f"{file} failed to import: {type(error).__name__}: {one_line(error)}; {fix}") from None
        _loaded.add(str(file))
    return files


def load_module(name: str) -> None:
    """``--invariants MODULE``: import ``name`` (a dotted module, or ``MODULE:OBJECT``); an OBJECT
    names invariants to register. A module of this folder is loaded from its own file (a spec of the
    folder alone), and one named like an installed module is refused: it would replace that module
    for the whole run. The folder is on ``sys.path`` (last) only while the module runs."""
    module_name, colon, attribute = name.partition(":")
    said = f"--invariants {_elided(name)}"
    if not all(part.isidentifier() for part in module_name.split(".")) or (colon and not attribute.isidentifier()):
        raise CircuitsError(
            f"{said}: not a module name; write MODULE or MODULE:OBJECT in Python names (my_invariants, checks.gate:ALL)"
        )
    folder = Path.cwd()
    top = module_name.partition(".")[0]
    spec = importlib.machinery.PathFinder.find_spec(top, [str(folder)])
    installed = None if spec is None else _installed(top, folder)
    if spec is not None and installed is not None:
        if not _places(installed) & _places(spec):
            where = spec.origin if spec.has_location else f"the folder {folder / top}"
            raise CircuitsError(
                f"{said}: {where} is named like the installed module {top}, and importing it would replace that "
                "module for the whole run; rename it"
            )
        spec = None  # this folder's own package, installed (editable): imported as installed
    try:
        with _on_path_last(folder if spec is not None else None):
            module = _import(module_name, spec)
    except CircuitsError as error:  # the registry refused what it registers: its own line
        raise CircuitsError(f"{said}: {error}") from None
    except SystemExit as stop:
        raise CircuitsError(f"{said}: {module_name} {_exited(stop)}; a module of invariants must not exit") from None
    except Exception as error:
        raise CircuitsError(
            f"{said}: cannot import {module_name}: {type(error).__name__}: {one_line(error)}; "
            "name an importable module (dotted, from this folder or the installed packages)"
        ) from None
    if attribute:
        if not hasattr(module, attribute):
            raise CircuitsError(
                f"{said}: module {module_name} has no {attribute}{did_you_mean(attribute, dir(module))}"
            )
        _register_named(getattr(module, attribute), said)


def _import(module_name: str, spec: ModuleSpec | None) -> ModuleType:
    """``module_name``, its top-level package loaded from ``spec`` (a file or folder of this folder) when
    given, else imported as Python would (an installed module)."""
    if spec is None:
        return importlib.import_module(module_name)
    top = spec.name
    module = importlib.util.module_from_spec(spec)
    sys.modules[top] = module
    try:
        if spec.loader is not None:
            spec.loader.exec_module(module)
        _ours.add(top)
        return importlib.import_module(module_name) if module_name != top else module
    except BaseException:
        if sys.modules.get(top) is module:
            del sys.modules[top]
        raise


def _installed(top: str, folder: Path) -> ModuleSpec | None:
    """The spec of ``top`` as Python finds it without ``folder`` (a built-in, standard-library or
    installed module, or one already imported from elsewhere), or None when only the folder has it."""
    known = sys.modules.get(top)
    if known is not None:
        return None if top in _ours else getattr(known, "__spec__", None) or ModuleSpec(top, None)
    saved = sys.path[:]
    sys.path[:] = [entry for entry in saved if not _is_folder(entry, folder)]
    try:
        return importlib.util.find_spec(top)
    except (ImportError, ValueError):
        return None
    finally:
        sys.path[:] = saved


def _places(spec: ModuleSpec) -> set[Path]:
    """The file and folders a module of ``spec`` is loaded from (none for a built-in or frozen one)."""
    where = [spec.origin] if spec.has_location and spec.origin else []
    found = set()
    for place in [*where, *(spec.submodule_search_locations or ())]:
        try:
            found.add(Path(place).resolve())
        except (OSError, RuntimeError):
            continue
    return found


def _is_folder(entry: str, folder: Path) -> bool:
    """Whether the ``sys.path`` entry ``entry`` is ``folder`` ("" and "." are the working folder)."""
    try:
        return Path(entry or ".").resolve() == folder.resolve()
    except (OSError, RuntimeError):
        return False


@contextlib.contextmanager
def _on_path_last(folder: Path | None) -> Iterator[None]:
    """``folder`` at the end of ``sys.path`` for the block (so installed modules come first), then
    removed again; nothing when it is already there, or None."""
    entry = None if folder is None or str(folder) in sys.path else str(folder)
    if entry is not None:
        sys.path.append(entry)
    try:
        yield
    finally:
        if entry is not None and entry in sys.path:
            del sys.path[len(sys.path) - 1 - sys.path[::-1].index(entry)]  # the one appended: the last


def _exited(stop: SystemExit) -> str:
    """What a module that called ``sys.exit`` while imported did: the gate did not run, so it has not passed."""
    return f"called sys.exit({stop.code!r}) while imported, so the gate did not run"


def _shown(value: object) -> str:
    """``repr(value)`` on one line, elided past 80 characters."""
    return _elided(repr(value))


def _elided(text: str, most: int = 80) -> str:
    """``text`` as typed (its ``repr`` when blanks around it or unprintable characters would hide
    something), elided past ``most`` characters."""
    text = text if text.isprintable() and text.strip() == text else repr(text)
    return text if len(text) <= most else f"{text[: most - 3]}..."


def _register_named(value: Any, said: str) -> None:
    """Register what an entry point or ``MODULE:OBJECT`` names: an `Invariant` class or instance, a
    list or tuple of them, or a module (which registered its own on import); anything else is one line."""
    from .invariant_api import REGISTRY, Invariant, register

    if isinstance(value, ModuleType):
        return
    if isinstance(value, (type, Invariant)):
        items: list[Any] = [value]
    elif isinstance(value, (list, tuple, set, frozenset)):
        items = list(value)
    else:
        raise CircuitsError(
            f"{said} names {_shown(value)} ({type(value).__name__}), not an Invariant subclass or instance or a "
            "list of them; name one, or the module that registers them"
        )
    for item in items:
        is_class = isinstance(item, type) and issubclass(item, Invariant)
        if not (is_class or isinstance(item, Invariant)):
            raise CircuitsError(f"{said} gave {_shown(item)}, not an Invariant subclass or instance")
        known = REGISTRY.get(getattr(item, "name", ""))
        if known is item or type(known) is item:
            continue
        try:
            register(item)
        except CircuitsError as error:  # the registry refused it: its line, after what named it
            raise CircuitsError(f"{said}: {error}") from None
        except Exception as error:  # the class cannot be made (its __init__ takes arguments, say)
            raise CircuitsError(
                f"{said}: registering {_shown(item)} failed: {type(error).__name__}: {one_line(error)}"
            ) from None
