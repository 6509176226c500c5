"""The pytest plugin: the ``circuits`` option group and the per-build fixtures.

Thin by design: options become a `CircuitsSettings`, one `CircuitsSession` per run
computes and caches every figure, and fixtures hand them out per build recipe.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from ..errors import CircuitsError
from ..gate import invariants as _gate
from ..model.builds import parse_builds
from ..model.named import DEFAULT_MODEL
from ..rungs.repeat import RepeatSettings
from ..session import CircuitsSession
from ..settings import DEFAULT_BUILDS, DEFAULT_REFERENCE, CircuitsSettings

SESSION_KEY = pytest.StashKey[CircuitsSession]()
COLLECTED_KEY = pytest.StashKey[_gate.Collected]()

# (option name, ini type, default, help); each is also an ini key with dashes -> underscores
OPTIONS = (
    ("model", "string", DEFAULT_MODEL,
     "model to gate: a save_pretrained folder, a local Hugging Face cache id, a .gguf file, "
     "or a named model (tiny-induction, smollm2-135m)"),
    ("builds", "string", ",".join(DEFAULT_BUILDS),
     "comma list of build recipes (fp32, bf16, fp16, bnb-int8, bnb-nf4, bnb-fp4, rtn-int8, rtn-int4)"),
    ("reference", "string", DEFAULT_REFERENCE, "the build every other build is gated against"),
    ("baselines", "string", None, "baselines folder (default: baselines/ at the rootdir)"),
    ("device", "string", "auto", "auto, cpu, cuda or cuda:N"),
    ("report", "string", None, "write an HTML and markdown report to this folder"),
    ("probe-seed", "string", "0", "seed of the random-repeat probe tokens"),
    ("probe-n", "string", "8", "number of random-repeat sequences"),
    ("probe-length", "string", "64", "length L of each random segment (sequences are 2L long)"),
    ("knockout-mode", "string", "zero", "head knockout: zero or mean ablation"),
    ("knockout-screen", "string", None,
     "rank heads by attribution patching and knock out only the top K exactly (big models)"),
    ("batch-size", "string", "8", "sequences per forward pass"),
)
FLAGS = (
    ("update", "record (overwrite) the baselines of the builds tested"),
    ("trust-remote-code", "allow the model folder's own Python code to run (off unless asked for)"),
)


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("circuits", "mechanistic invariants of model builds (pytest-circuits)")
    for name, ini_type, default, help_text in OPTIONS:
        group.addoption(f"--circuits-{name}", dest=_dest(name), default=None, help=f"{help_text} [ini: {_ini(name)}]")
        parser.addini(_ini(name), help_text, type=ini_type, default=default)
    for name, help_text in FLAGS:
        group.addoption(f"--circuits-{name}", dest=_dest(name), action="store_true", default=None,
                        help=f"{help_text} [ini: {_ini(name)}]")
        parser.addini(_ini(name), help_text, type="bool", default=False)
    defaults = _gate.Tolerances()
    for name in _gate.Tolerances.names():
        parser.addini(f"circuits_tol_{name}", f"gate tolerance {name} (default {getattr(defaults, name)})",
                      type="string", default=None)


def _dest(name: str) -> str:
    return "circuits_" + name.replace("-", "_")


def _ini(name: str) -> str:
    return "circuits_" + name.replace("-", "_")


def _value(config: pytest.Config, name: str):
    """The command-line value if given, else the ini value (which carries the default)."""
    value = config.getoption(_dest(name))
    return config.getini(_ini(name)) if value is None else value


def _int(config: pytest.Config, name: str) -> int:
    raw = _value(config, name)
    try:
        return int(raw)
    except (TypeError, ValueError):
        raise pytest.UsageError(f"--circuits-{name} must be an integer, got {raw!r}") from None


def settings_from_config(config: pytest.Config) -> CircuitsSettings:
    """Read every circuits option (command line over ini over default)."""
    try:
        builds = tuple(parse_builds(_value(config, "builds")))
        reference = parse_builds(_value(config, "reference"))[0]
    except CircuitsError as error:
        raise pytest.UsageError(str(error)) from None
    baselines = _value(config, "baselines")
    report = _value(config, "report")
    mode = _value(config, "knockout-mode")
    if mode not in ("zero", "mean"):
        raise pytest.UsageError(f"--circuits-knockout-mode must be zero or mean, got {mode!r}")
    screen = _value(config, "knockout-screen")
    return CircuitsSettings(
        model=_value(config, "model"),
        builds=builds,
        reference=reference,
        baselines=Path(baselines) if baselines else Path(config.rootpath) / "baselines",
        update=bool(_value(config, "update")),
        device=_value(config, "device"),
        report=Path(report) if report else None,
        trust_remote_code=bool(_value(config, "trust-remote-code")),
        probe=RepeatSettings(
            seed=_int(config, "probe-seed"), n=_int(config, "probe-n"), L=_int(config, "probe-length")
        ),
        knockout_mode=mode,
        knockout_screen=_int(config, "knockout-screen") if screen not in (None, "") else None,
        batch_size=_int(config, "batch-size"),
        tolerances=_ini_tolerances(config),
    )


def _ini_tolerances(config: pytest.Config) -> dict:
    found = {}
    for name in _gate.Tolerances.names():
        value = config.getini(f"circuits_tol_{name}")
        if value not in (None, ""):
            found[name] = value
    try:
        _gate.Tolerances().updated(found)
    except ValueError as error:
        raise pytest.UsageError(f"circuits_tol_*: {error}") from None
    return found


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "circuits_tolerance(**tolerances): override gate tolerances for one test")
    config.stash[SESSION_KEY] = CircuitsSession(settings_from_config(config))
    config.stash[COLLECTED_KEY] = _gate.Collected()
    config.pluginmanager.register(_Collector(config.stash[COLLECTED_KEY]), "circuits-collector")


PER_BUILD_FIXTURES = ("circuits_build", "ov_spectrum", "repeat_probe", "head_knockout")


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """Run every test that asks for a per-build fixture once per build recipe."""
    if "circuits_recipe" in metafunc.fixturenames and "circuits_recipe" not in _direct_params(metafunc):
        builds = metafunc.config.stash[SESSION_KEY].settings.builds
        metafunc.parametrize("circuits_recipe", builds, ids=list(builds), scope="session")


def _direct_params(metafunc: pytest.Metafunc) -> set[str]:
    marker_args = set()
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
def circuits_session(pytestconfig: pytest.Config) -> CircuitsSession:
    """The run's `CircuitsSession`: settings plus every cached figure."""
    return pytestconfig.stash[SESSION_KEY]


@pytest.fixture(scope="session")
def circuits_recipe(request) -> str:
    """The build recipe of this test instance (parametrized over ``--circuits-builds``)."""
    return request.param


@pytest.fixture(scope="session")
def circuits_build(circuits_session, circuits_recipe):
    """The `LoadedBuild` of this test's recipe."""
    return _guard(lambda: circuits_session.build(circuits_recipe))


@pytest.fixture(scope="session")
def ov_spectrum(circuits_session, circuits_recipe):
    """Rung 1 DataFrame of this build: kappa, its rotation null, z, p, BH q, copying, suppression."""
    return _guard(lambda: circuits_session.ov_spectrum(circuits_recipe))


@pytest.fixture(scope="session")
def repeat_probe(circuits_session, circuits_recipe):
    """Random-repeat probe of this build: copy losses and per-head routing scores."""
    return _guard(lambda: circuits_session.repeat_probe(circuits_recipe))


@pytest.fixture(scope="session")
def head_knockout(circuits_session, circuits_recipe):
    """Rung 2 DataFrame of this build: knockout delta of every head on held-out sequences."""
    return _guard(lambda: circuits_session.head_knockout(circuits_recipe))


# ---------------------------------------------------------------- the gate (logic in gate.py)


@pytest.fixture
def circuits_tolerances(request, circuits_session) -> _gate.Tolerances:
    """Gate tolerances of this test: defaults < ini ``circuits_tol_*`` < ``@pytest.mark.circuits_tolerance``."""
    overrides = {}
    for marker in reversed(list(request.node.iter_markers("circuits_tolerance"))):
        overrides.update(marker.kwargs)
    try:
        return circuits_session.tolerances.updated(overrides)
    except ValueError as error:
        problem = str(error)
    pytest.fail(f"@pytest.mark.circuits_tolerance: {problem}", pytrace=False)


@pytest.fixture
def circuits_gate(request, circuits_session, circuits_recipe, circuits_tolerances):
    """``circuits_gate(invariant)``: gate this build against the reference and its own baseline.

    Fails the test with a table of the heads and numbers that moved; every result also goes
    to the terminal summary and the ``--circuits-report``.
    """

    def run(invariant: str):
        outcome = _guard(
            lambda: _gate.gate_for_test(request, circuits_session, circuits_recipe, invariant, circuits_tolerances)
        )
        if not outcome.passed:
            pytest.fail(outcome.message(), pytrace=False)
        return outcome

    return run


class _Collector:
    """Collects the gate results tests attach as user properties (on the controller under xdist)."""

    def __init__(self, collected: _gate.Collected):
        self.collected = collected

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        if report.when == "call":
            self.collected.add(report.user_properties)


def pytest_terminal_summary(terminalreporter, exitstatus, config) -> None:
    if COLLECTED_KEY in config.stash and config.stash[COLLECTED_KEY].used:
        _gate.terminal_summary(terminalreporter, config.stash[SESSION_KEY], config.stash[COLLECTED_KEY])


def pytest_sessionfinish(session, exitstatus) -> None:
    config = session.config
    if COLLECTED_KEY not in config.stash or _is_xdist_worker(config):
        return
    collected = config.stash[COLLECTED_KEY]
    if collected.used:
        _gate.write_report(config.stash[SESSION_KEY], collected)


def _is_xdist_worker(config) -> bool:
    return hasattr(config, "workerinput")
