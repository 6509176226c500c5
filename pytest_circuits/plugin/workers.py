"""Builds over pytest-xdist workers: one worker loads a build, with xdist's own ``loadgroup``.

Every test of build ``R`` carries ``xdist_group("circuits-R")`` from its parametrization
(`group_mark`, a ``pytest.param`` mark, so it is there before any hook runs), and ``-n N``
alone means ``--dist loadgroup`` (`pytest_cmdline_main`). Two things made the marks alone not
work, both measured with a 10-line conftest (pytest 9.2, pytest-xdist 3.8):

- A mark added by a ``pytest_collection_modifyitems`` hook of a plugin or conftest loaded before
  the worker's ``WorkerInteractor`` runs after xdist's own hook (pluggy calls later-registered
  plugins first), so xdist never sees it. A ``pytest.param`` mark, or ``tryfirst``, is seen.
- Seen or not, xdist 3.8 writes the group into ``item._nodeid``, and pytest 9 reads a nodeid
  from ``item._id`` (a structured ``NodeId``): the suffix is lost and loadgroup silently
  degrades to per-test scheduling, static ``@pytest.mark.xdist_group`` marks included
  (pytest-xdist issue #1386, fix pending in #1388). `pytest_collection_modifyitems` here
  (``trylast``, after xdist's) carries xdist's ``_nodeid`` over to ``_id``; with a pytest or
  xdist that has it right, it finds nothing to do.

Scheduling stays xdist's: the loadgroup scheduler hands each group to one worker. What we
add is bookkeeping: each worker's build loads go back to the controller in
``config.workeroutput`` and the terminal summary counts them (`load_lines`); a shared run
folder (`SHARED_KEY`, made by the controller) holds the file locks under which a baseline is
written once and the partial knockout results of shards.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import pytest

GROUP_PREFIX = "circuits-"
SHARED_KEY = "circuits_shared"  # workerinput: the run folder every worker shares
LOADGROUP_KEY = "circuits_loadgroup"  # workerinput: the controller runs --dist loadgroup
LOADS_KEY = "circuits_loads"  # workeroutput: the builds this worker loaded
GROUPED_DISTS = ("loadgroup",)


def group_name(build_name: str) -> str:
    """The xdist group of a build's tests: ``circuits-<build name>``."""
    return f"{GROUP_PREFIX}{build_name}"


def group_mark(build_name: str, shard: int = 0) -> pytest.MarkDecorator:
    """A build's group; knockout shard ``i > 0`` of it gets its own (another worker may take it),
    shard 0 stays with the build (its worker has the build loaded)."""
    return pytest.mark.xdist_group(group_name(build_name) + (f"-shard{shard}" if shard else ""))


def worker_id(config: pytest.Config | None = None) -> str | None:
    """``gw0``, ``gw1``, ... on an xdist worker; None in a plain run (or on the controller)."""
    if config is not None and hasattr(config, "workerinput"):
        return str(config.workerinput.get("workerid"))
    return os.environ.get("PYTEST_XDIST_WORKER") or None


def distributing(config: pytest.Config) -> bool:
    """Whether this is the controller of an xdist run with workers."""
    dist = getattr(config.option, "dist", "no")
    return dist not in (None, "no") and bool(getattr(config.option, "tx", None)) and not hasattr(config, "workerinput")


@pytest.hookimpl(wrapper=True)
def pytest_cmdline_main(config: pytest.Config):
    """``-n N`` without ``--dist`` on a circuits run (`asks_for_circuits`): loadgroup, so a build's
    tests stay on one worker.

    A wrapper runs before xdist's own ``tryfirst`` hook, which would make it ``load``; an
    explicit ``--dist`` is kept (the summary then says when a build was loaded twice).
    """
    if getattr(config.option, "numprocesses", None) and getattr(config.option, "dist", None) == "no":
        if asks_for_circuits(config):
            config.option.dist = "loadgroup"
    return (yield)


def asks_for_circuits(config: pytest.Config) -> bool:
    """Whether this run gates models: a circuits option on the command line or in the ini file, or
    the packaged suite (``probes``) among the paths. Other projects' ``-n N`` keeps xdist's default."""
    from ..options import OPTIONS

    if any(getattr(config.option, option.ini, None) not in (None, False) for option in OPTIONS):
        return True
    if any(str(key).startswith("circuits_") for key in _ini_keys(config)):
        return True
    return any("probes" in str(arg) for arg in config.args)


def _ini_keys(config: pytest.Config):
    """The keys the ini file sets. pytest 9 deprecates ``config.inicfg`` (a warning in every run,
    now that `asks_for_circuits` is asked in every run) and keeps them in ``_inicfg``."""
    found = getattr(config, "_inicfg", None)
    return found if found is not None else (getattr(config, "inicfg", None) or {})


def configure(config: pytest.Config, session) -> None:
    """Controller: the shared run folder. Worker: the folder and loadgroup from the controller."""
    if hasattr(config, "workerinput"):
        if config.workerinput.get(LOADGROUP_KEY):
            config.option.loadgroup = True  # xdist's worker reads this to tag nodeids with groups
        shared = config.workerinput.get(SHARED_KEY)
        session.loaded.shared_dir = Path(shared) if shared else None
        session.loaded.worker = worker_id(config)
        session.loaded.workers = int(config.workerinput.get("workercount", 1))
    elif distributing(config):
        session.loaded.shared_dir = Path(tempfile.mkdtemp(prefix="circuits-run-"))
        config.stash[_OWNED_KEY] = session.loaded.shared_dir


_OWNED_KEY: pytest.StashKey[Path] = pytest.StashKey()


def unconfigure(config: pytest.Config) -> None:
    if _OWNED_KEY in config.stash:
        shutil.rmtree(config.stash[_OWNED_KEY], ignore_errors=True)


class XdistHooks:
    """The controller's side of the xdist hooks (registered only where pytest-xdist is installed)."""

    def __init__(self, config: pytest.Config, session, collected):
        self.config, self.session, self.collected = config, session, collected

    @pytest.hookimpl(optionalhook=True)
    def pytest_configure_node(self, node) -> None:
        dist = getattr(self.config.option, "dist", "no")
        node.workerinput[LOADGROUP_KEY] = dist in GROUPED_DISTS
        node.workerinput[SHARED_KEY] = (
            None if self.session.loaded.shared_dir is None else str(self.session.loaded.shared_dir)
        )
        self.collected.dist = dist

    @pytest.hookimpl(optionalhook=True)
    def pytest_testnodedown(self, node, error) -> None:
        output = getattr(node, "workeroutput", None) or {}
        self.collected.loads.extend(output.get(LOADS_KEY, []))


def carry_groups(config: pytest.Config, items: list[pytest.Item]) -> None:
    """On a loadgroup worker: make the ``@group`` suffix xdist wrote into ``item._nodeid`` the
    nodeid pytest reports (pytest 9 reads ``item._id``; see the module docstring)."""
    if not (hasattr(config, "workerinput") and getattr(config.option, "loadgroup", False)):
        return
    for item in items:
        wanted = item.__dict__.get("_nodeid")
        current = getattr(item, "_id", None)
        if isinstance(wanted, str) and current is not None and wanted != item.nodeid and "@" in wanted:
            item._id = type(current).parse(wanted)


def finish_worker(config: pytest.Config, session) -> None:
    """A worker's build loads travel to the controller as plain data."""
    if hasattr(config, "workeroutput"):
        config.workeroutput[LOADS_KEY] = list(session.loaded.loads)


def load_lines(loads: list[dict], dist: str | None) -> list[str]:
    """``builds loaded: fp32 once (gw0), ...``; a build loaded more than once is named with why."""
    by_recipe: dict[str, list[str]] = {}
    for_shards: dict[str, int] = {}
    for load in loads:
        by_recipe.setdefault(load["recipe"], []).append(load.get("worker") or "main")
        if load.get("for"):
            for_shards[load["recipe"]] = for_shards.get(load["recipe"], 0) + 1
    if not by_recipe:
        return []
    parts, twice = [], []
    for recipe, where in by_recipe.items():
        count = "once" if len(where) == 1 else f"{len(where)} times"
        sharded = for_shards.get(recipe, 0)
        why = f"; {sharded} for knockout shards" if sharded and len(where) > 1 else ""
        parts.append(f"{recipe} {count} ({', '.join(sorted(where))}{why})")
        if len(where) - sharded > 1:
            twice.append(recipe)
    lines = [f"builds loaded: {', '.join(parts)}"]
    if twice and dist not in (None, "no", *GROUPED_DISTS):
        lines.append(
            f"  {', '.join(twice)} loaded on several workers: --dist {dist} spreads a build's tests; "
            "drop --dist (the plugin then uses loadgroup) or pass --dist loadgroup"
        )
    return lines
