"""The pytest plugin: the ``circuits`` option group, the per-build fixtures and a few hooks.

Thin by design: options (declared once in `options.py`) become a `CircuitsSettings`, one
`Run` per run computes and caches every figure, fixtures hand them out per
build, and `collect.py` gathers gate results for the terminal summary and the report.
Nothing heavy is imported here: torch, numpy and pandas load only when a fixture runs, and
the session is made only once a circuits test is collected (or the run asks for circuits,
`session_of`), so projects without circuits tests pay next to nothing for the installed plugin
(tests/test_plugin.py checks that no heavy module is imported).
"""

from __future__ import annotations

import threading
from contextlib import nullcontext
from typing import TYPE_CHECKING

import pytest

from ..errors import CircuitsError
from ..gate.tolerances import Tolerances
from ..options import OPTIONS
from .fixture_types import CircuitsGate
from .workers import pytest_cmdline_main  # noqa: F401  (a hook: -n N means --dist loadgroup)

if TYPE_CHECKING:
    import pandas as pd

    from ..model.builds import LoadedBuild
    from ..run.run import Run
    from ..rungs.audit import AuditFigures
    from ..rungs.probe import RepeatProbe
    from .collect import Collected

SESSION_KEY: pytest.StashKey[Run] = pytest.StashKey()
COLLECTED_KEY: pytest.StashKey[Collected] = pytest.StashKey()


def pytest_addoption(parser: pytest.Parser) -> None:
    from ..settings import option_help

    group = parser.getgroup("circuits", "mechanistic invariants of model builds (pytest-circuits)")
    for option in OPTIONS:
        default = "" if option.default is None else str(option.default)
        shown = f" (default: {default})" if default else ""  # None: the help says what happens
        text = option_help(option)
        if option.kind == "bool":
            group.addoption(
                option.pytest_flag,
                dest=option.ini,
                action="store_true",
                default=None,
                help=f"{text} [ini: {option.ini}]",
            )
            parser.addini(option.ini, option.help, type="bool", default=False)
        else:
            group.addoption(
                option.pytest_flag, dest=option.ini, default=None, help=f"{text}{shown} [ini: {option.ini}]"
            )
            parser.addini(option.ini, option.help, type="string", default=default)
    for name, value in Tolerances().as_dict().items():
        parser.addini(f"circuits_tol_{name}", f"gate tolerance {name} (default {value})", type="string", default=None)
    _DECLARED.clear()  # a new run (pytester runs several in one process): a new parser
    _DECLARED.update(Tolerances.names())
    _PARSER[:] = [parser]
    _declare_own_tolerances()


_PARSER: list[pytest.Parser] = []  # the run's parser, to declare the ini keys of invariants registered later
_DECLARED: set[str] = set()


def _declare_own_tolerances() -> None:
    """An ini key ``circuits_tol_<name>`` for each own tolerance of a registered invariant (one
    registered in a conftest.py exists only once that conftest is imported)."""
    if not _PARSER:
        return
    for name in Tolerances.all_names():
        if name not in _DECLARED:
            _PARSER[0].addini(f"circuits_tol_{name}", f"gate tolerance {name} (own)", type="string", default=None)
            _DECLARED.add(name)


@pytest.hookimpl(wrapper=True)
def pytest_load_initial_conftests(early_config, parser, args):
    """A conftest.py whose invariant the registry refuses (a name taken, a tolerance no key can set)
    is a usage error of one line, as under ``circuits``, not pytest's import traceback."""
    from _pytest.config import ConftestImportFailure

    try:
        return (yield)
    except ConftestImportFailure as failure:
        if isinstance(failure.cause, CircuitsError):
            raise pytest.UsageError(f"{failure.path}: {failure.cause}") from None
        raise


def pytest_plugin_registered(plugin, manager) -> None:
    """A conftest.py just imported may have registered an invariant with tolerances of its own."""
    _declare_own_tolerances()


def default_baselines(config: pytest.Config):
    """The baselines folder when none is given: ``baselines/`` beside the ini file (pytest.ini,
    pyproject.toml, ...: the project's rootdir), else in the folder pytest was started in. Never the
    rootdir pytest guesses without an ini file: under ``--pyargs`` that is the common parent of the
    working folder and site-packages. A named model falls back to its shipped baselines
    (`run.baselines.RunBaselines.store`)."""
    from pathlib import Path

    folder = config.rootpath if config.inipath is not None else config.invocation_params.dir
    return Path(folder) / "baselines"


def settings_from_config(config: pytest.Config):
    """Every circuits option: the command line over the ini file over the default."""
    from ..settings import build_settings

    raw = {}
    for option in OPTIONS:
        value = config.getoption(option.ini)
        raw[option.name] = config.getini(option.ini) if value is None else value
    try:
        settings = build_settings(
            raw, baselines=default_baselines(config), front_end="pytest", tolerances=_ini_tolerances(config)
        )
        from ..settings import check_shard_job

        check_shard_job(settings)
        return settings
    except CircuitsError as error:
        raise pytest.UsageError(str(error)) from None


def _ini_tolerances(config: pytest.Config) -> dict:
    found = {}
    _declare_own_tolerances()
    for name in Tolerances.all_names():
        value = config.getini(f"circuits_tol_{name}")
        if value not in (None, ""):
            found[name] = value
    try:
        Tolerances().updated(found)
    except ValueError as error:
        raise CircuitsError(f"circuits_tol_*: {error}") from None
    return found


def pytest_configure(config: pytest.Config) -> None:
    """Markers, and the session when the run asks for circuits (`session_of`); else it waits."""
    from . import workers
    from .collect import Collected, Collector

    config.addinivalue_line("markers", "circuits_tolerance(**tolerances): override gate tolerances for one test")
    if not config.pluginmanager.hasplugin("xdist"):  # our build groups mark tests even when xdist is absent
        config.addinivalue_line("markers", "xdist_group(name): pytest-xdist's group (circuits: one group per build)")
    config.stash[COLLECTED_KEY] = Collected()
    config.pluginmanager.register(Collector(config.stash[COLLECTED_KEY]), "circuits-collector")
    if workers.asks_for_circuits(config) or workers.distributing(config) or hasattr(config, "workerinput"):
        session = session_of(config)  # options checked before any test runs; xdist's run folder made now
        if config.pluginmanager.hasplugin("xdist"):
            config.pluginmanager.register(
                workers.XdistHooks(config, session, config.stash[COLLECTED_KEY]), "circuits-xdist"
            )


def session_of(config: pytest.Config) -> Run:
    """The run's `Run`, made on first use: at configure time when the run asks for
    circuits (a circuits option on the command line or in the ini file, the packaged suite, an
    xdist run), else when a circuits test is collected, so a project without any pays nothing."""
    if SESSION_KEY not in config.stash:
        from ..run.run import Run
        from . import workers

        try:  # the installed packages' invariants: a broken entry point is one line (exit 4), before any test
            from ..gate import invariants  # noqa: F401
        except CircuitsError as error:
            raise pytest.UsageError(str(error)) from None
        session = Run(settings_from_config(config))
        session.loaded.progress_write = lambda line: _report_progress(config, line)
        config.stash[SESSION_KEY] = session
        workers.configure(config, session)
    return config.stash[SESSION_KEY]


def pytest_unconfigure(config: pytest.Config) -> None:
    from . import workers

    workers.unconfigure(config)


_PROGRESS_LOCK = threading.Lock()  # a phase's heartbeat thread and the main thread write lines


def _report_progress(config: pytest.Config, line: str) -> None:
    """Long scans report through pytest's terminal reporter with output capture suspended (as
    pytest's live logging does), so the line shows with capture on, on a terminal and in CI logs."""
    reporter = config.pluginmanager.get_plugin("terminalreporter")
    if reporter is None:
        return
    capture = config.pluginmanager.get_plugin("capturemanager")
    with _PROGRESS_LOCK, capture.global_and_fixture_disabled() if capture is not None else nullcontext():
        reporter.write_line(f"circuits: {line}")


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """Run every test that asks for a per-build fixture once per build, each build's tests in one
    xdist group (``circuits-<recipe>``: under ``-n N`` one worker loads the build), the reference first."""
    if "circuits_recipe" in metafunc.fixturenames and "circuits_recipe" not in _direct_params(metafunc):
        from .workers import group_mark

        settings = session_of(metafunc.config).settings
        builds = sorted(settings.builds, key=lambda recipe: recipe != settings.reference)  # stable: reference first
        params = [pytest.param(recipe, id=recipe, marks=group_mark(recipe)) for recipe in builds]
        metafunc.parametrize("circuits_recipe", params, scope="session")
    if "circuits_knockout_shard" in metafunc.fixturenames:
        from .workers import group_mark

        session = session_of(metafunc.config)
        count = session.measured.shards
        job = session.settings.shard  # a shard job (--circuits-shard I/K): its one shard, whatever K
        indexes = [job[0] - 1] if job is not None else range(count if count > 1 else 0)
        count = count if job is None else job[1]
        shards = [
            pytest.param((recipe, i), id=f"{recipe}-shard{i + 1}of{count}", marks=group_mark(recipe, i))
            for recipe in session.settings.builds
            for i in indexes
        ]
        metafunc.parametrize("circuits_knockout_shard", shards, scope="session", indirect=True)
    if "circuits_audit_shard" in metafunc.fixturenames:  # rung 3's case shards (`run.measure.audit_shard_count`)
        from ..run.measure import audit_shard_count
        from .workers import group_mark

        session = session_of(metafunc.config)
        count = audit_shard_count(session.measured)
        cases = [
            pytest.param((recipe, i), id=f"{recipe}-audit{i + 1}of{count}", marks=group_mark(recipe, i))
            for recipe in session.settings.builds
            for i in range(count if count > 1 else 0)
        ]
        metafunc.parametrize("circuits_audit_shard", cases, scope="session", indirect=True)


@pytest.hookimpl(tryfirst=True)
def pytest_pycollect_makeitem(collector: pytest.Collector, name: str, obj: object) -> list | None:
    """Tests that would gate nothing in this run are not collected at all (not deselected: every run
    said "1 deselected", unexplained): the knockout shard test unless the scan is sharded, and the test
    of an opt-in invariant (rung 3) unless the run gives its input (``--circuits-audit``)."""
    import inspect

    if not inspect.isfunction(obj):
        return None
    if "circuits_knockout_shard" in inspect.signature(obj).parameters:
        session = session_of(collector.config)
        sharded = session.settings.shard is not None or session.measured.shards > 1
        return None if sharded else []
    if "circuits_audit_shard" in inspect.signature(obj).parameters:
        from ..run.measure import audit_shard_count

        return None if audit_shard_count(session_of(collector.config).measured) > 1 else []
    invariant_name = getattr(obj, "circuits_invariant", None)
    if invariant_name is None:
        return None
    from ..gate.invariants import REGISTRY

    invariant = REGISTRY.get(invariant_name)
    if invariant is None or not invariant.opt_in:
        return None
    asked = session_of(collector.config).settings.audit is not None and "audit" in invariant.needs
    return None if asked else []


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """On an xdist worker the build groups are carried into the nodeids (`workers.carry_groups`)."""
    from .workers import carry_groups

    carry_groups(config, items)


def pytest_collection_finish(session: pytest.Session) -> None:
    """Check the model and probe once, before any test runs: a model we cannot gate is one
    line for the run (exit 4), not the same failure repeated by every test."""
    config = session.config
    if config.option.collectonly or hasattr(config, "workerinput") or COLLECTED_KEY not in config.stash:
        return
    if any("circuits_recipe" in getattr(item, "fixturenames", ()) for item in session.items):
        try:
            run = session_of(config)
            run.loaded.preflight()
            _refuse_decode_knockouts(run, session.items)
        except CircuitsError as error:
            raise pytest.UsageError(str(error)) from None


def _refuse_decode_knockouts(run: Run, items: list[pytest.Item]) -> None:
    """A selected test that knocks heads out of a build whose cache is read in decode mode only
    (`kv_formats.refuse_decode_knockouts`) is refused before the probe runs, naming the way out."""
    from ..gate.invariants import REGISTRY
    from ..model.kv_formats import refuse_decode_knockouts

    for item in items:
        build = getattr(getattr(item, "callspec", None), "params", {}).get("circuits_recipe")
        invariant = REGISTRY.get(getattr(getattr(item, "function", None), "circuits_invariant", ""))
        knocks = invariant is not None and "knockout" in invariant.needs
        fixtures = set(getattr(item, "fixturenames", ()))
        if build is not None and (knocks or {"circuits_head_knockout", "circuits_knockout_shard"} & fixtures):
            refuse_decode_knockouts(run.settings.spec(build))


def _direct_params(metafunc: pytest.Metafunc) -> set[str]:
    marker_args: set[str] = set()
    for marker in metafunc.definition.iter_markers("parametrize"):
        names = marker.args[0]
        marker_args.update(n.strip() for n in (names.split(",") if isinstance(names, str) else names))
    return marker_args


def _guard(compute):
    """Turn a user-facing error into a one-line test failure, never a traceback."""
    try:
        return compute()
    except CircuitsError as error:
        problem = str(error)
    pytest.fail(problem, pytrace=False)  # outside the except: no "during handling" chain


@pytest.fixture(scope="session")
def circuits_run(pytestconfig: pytest.Config) -> Run:
    """The run's `Run`: settings plus every cached figure."""
    return session_of(pytestconfig)


@pytest.fixture(scope="session")
def circuits_recipe(request: pytest.FixtureRequest) -> str:
    """The build of this test instance (parametrized over ``--circuits-builds``)."""
    return request.param


@pytest.fixture(scope="session")
def circuits_build(circuits_run: Run, circuits_recipe: str) -> LoadedBuild:
    """The `LoadedBuild` of this test's build."""
    return _guard(lambda: circuits_run.loaded.build(circuits_recipe))


@pytest.fixture(scope="session")
def circuits_ov_spectrum(circuits_run: Run, circuits_recipe: str) -> pd.DataFrame:
    """Rung 1 DataFrame of this build: kappa, its rotation null, z, p, BH q, copying, suppression."""
    return _guard(lambda: circuits_run.measured.ov_spectrum(circuits_recipe))


@pytest.fixture(scope="session")
def circuits_repeat_probe(circuits_run: Run, circuits_recipe: str) -> RepeatProbe:
    """Random-repeat probe of this build: copy losses and per-head routing scores."""
    return _guard(lambda: circuits_run.measured.repeat_probe(circuits_recipe))


@pytest.fixture(scope="session")
def circuits_head_knockout(circuits_run: Run, circuits_recipe: str) -> pd.DataFrame:
    """Rung 2 DataFrame of this build: knockout delta of every head on held-out sequences."""
    return _guard(lambda: circuits_run.measured.head_knockout(circuits_recipe))


@pytest.fixture(scope="session")
def circuits_knockout_shard(request: pytest.FixtureRequest, circuits_run: Run) -> pd.DataFrame:
    """One knockout shard's DataFrame (`Run.knockout_shard`), parametrized over
    ``(recipe, index)`` when the scan is sharded; ``attrs["layers"]`` holds its layers."""
    recipe, index = request.param
    frame = _guard(lambda: circuits_run.measured.knockout_shard(recipe, index))
    if circuits_run.settings.shard is not None:  # a shard job: its part, for the job that merges
        request.config.stash[PART_KEY] = _guard(lambda: _write_part(circuits_run, recipe))
    return frame


@pytest.fixture(scope="session")
def circuits_audit_shard(request: pytest.FixtureRequest, circuits_run: Run) -> AuditFigures:
    """One case shard of rung 3 on a build (`run.measure.audit_shard`: `rungs.audit.AuditFigures`),
    parametrized over ``(recipe, index)`` when the audit slice is sharded over pytest-xdist's workers."""
    from ..run.measure import audit_shard

    recipe, index = request.param
    return _guard(lambda: audit_shard(circuits_run.measured, recipe, index))


PART_KEY: pytest.StashKey[dict] = pytest.StashKey()  # the part this shard job wrote (until its test reports it)


def _write_part(session: Run, build_name: str) -> dict:
    """``--circuits-shard I/K --circuits-shard-out FILE``: the part, by the writer ``circuits record --shard`` uses."""
    from ..run.records import write_part

    s = session.settings
    out = s.shard_out
    assert s.shard is not None and out is not None  # check_shard_job
    index, total = s.shard

    def write() -> dict:
        meta = write_part(session.measured, build_name, index, total, out)["part"]
        return {"recipe": build_name, "path": str(out), "index": index, "of": total, "layers": meta["layers"]}

    return session.loaded.memo(("shard_part", build_name), write)


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_call(item: pytest.Item) -> None:
    """The part a shard job wrote travels to the summary in the test's user properties (xdist-safe)."""
    if PART_KEY in item.config.stash and "circuits_knockout_shard" in getattr(item, "fixturenames", ()):
        item.user_properties.append(("circuits_part", item.config.stash[PART_KEY]))


@pytest.fixture
def circuits_tolerances(request: pytest.FixtureRequest, circuits_run: Run) -> Tolerances:
    """Gate tolerances of this test: defaults < ini ``circuits_tol_*`` < ``@pytest.mark.circuits_tolerance``."""
    overrides = {}
    for marker in reversed(list(request.node.iter_markers("circuits_tolerance"))):
        overrides.update(marker.kwargs)
    try:
        return circuits_run.tolerances.updated(overrides)
    except ValueError as error:
        problem = str(error)
    pytest.fail(f"@pytest.mark.circuits_tolerance: {problem}", pytrace=False)


@pytest.fixture
def circuits_gate(
    request: pytest.FixtureRequest,
    circuits_run: Run,
    circuits_recipe: str,
    circuits_tolerances: Tolerances,
) -> CircuitsGate:
    """A `CircuitsGate` for this build: ``circuits_gate(invariant, ...)`` gates it against the
    reference and its own baseline (a cross-model invariant: against the baseline of the model
    it replaces), failing the test with a table of the heads and numbers that moved, or
    skipping it with the reason."""
    from .collect import gate_for_test

    return CircuitsGate(
        lambda name: _guard(lambda: gate_for_test(request, circuits_run, circuits_recipe, name, circuits_tolerances))
    )


def _ran_circuits(config: pytest.Config) -> bool:
    """Whether this run gated, loaded or sharded anything: else the summary and report hooks do nothing."""
    collected = config.stash.get(COLLECTED_KEY, None)
    session = config.stash.get(SESSION_KEY, None)
    if collected is None or session is None:  # no session: no circuits test was collected
        return False
    return bool(collected.used or collected.loads or session.loaded.loads or session.settings.shard is not None)


def pytest_terminal_summary(terminalreporter, exitstatus, config) -> None:
    if _ran_circuits(config):
        from .collect import terminal_summary

        terminal_summary(terminalreporter, config.stash[SESSION_KEY], config.stash[COLLECTED_KEY])


def pytest_sessionfinish(session, exitstatus) -> None:
    config = session.config
    if not _ran_circuits(config):
        return
    if hasattr(config, "workerinput"):  # the controller writes the report
        from .workers import finish_worker

        finish_worker(config, config.stash[SESSION_KEY])
        return
    if not config.stash[COLLECTED_KEY].loads:  # a plain run: this process loaded the builds
        config.stash[COLLECTED_KEY].loads.extend(config.stash[SESSION_KEY].loaded.loads)
    from .collect import missing_part

    missing = missing_part(config.stash[SESSION_KEY], config.stash[COLLECTED_KEY])
    if missing and not config.option.collectonly and session.exitstatus == pytest.ExitCode.OK:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED  # a shard job that wrote no part has not done its job
    if config.stash[COLLECTED_KEY].used:
        from .collect import write_report

        write_report(config.stash[SESSION_KEY], config.stash[COLLECTED_KEY])
        if config.stash[COLLECTED_KEY].report_error and session.exitstatus == pytest.ExitCode.OK:
            session.exitstatus = pytest.ExitCode.TESTS_FAILED  # a report asked for and not written fails the run
