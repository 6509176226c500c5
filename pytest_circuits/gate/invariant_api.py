"""The invariants of the gate, one registry entry each (docs/definitions.md, "The gate").

An `Invariant` reads two scan records (``before``: the baseline, ``after``: the build under
test) and returns a `Comparison`: one `Row` per figure it compared (subject, metric,
before, after, limit, broken?). Everything else derives from those rows in one flow,
`evaluate`: pass or fail, the failure table, the CLI verdict, ``circuits diff``, the
report's broken list and ``scripts/measure_gate.py``. An invariant that compared nothing
never passes: it fails with its reason, or is skipped when the baseline model has none of
the mechanism it guards (a random model has no induction head).

The extension API: `Row`, `Comparison`, `Invariant`, `register`, `within` and the one flow
(`evaluate`, `gate_all`, `verdict`). The built-in invariants: `builtin_invariants.py`, those
across base models: `swap_invariants.py`; `invariants.py` is the registry with all of them.
A user adds one with `register` (docs/invariants.md, "Your own invariant").
"""

from __future__ import annotations

import inspect
import keyword
import math
import re
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any, ClassVar

from ..errors import CircuitsError, did_you_mean
from ..options import flag
from ..record.read import has_figures, lacking_figures
from ..record.schema import Record, RecordLike
from ..record.store import geometry_difference
from . import tolerances as tolerances_module
from .tolerances import Number, Tolerance, Tolerances

__all__ = [
    "Row",
    "Comparison",
    "Invariant",
    "InvariantResult",
    "REGISTRY",
    "STATUSES",
    "MAX_ROWS",
    "register",
    "get",
    "own_tolerance_defaults",
    "declared_tolerances",
    "tolerances_of",
    "evaluate",
    "gate_all",
    "runnable",
    "across_models",
    "per_build_invariants",
    "guarded",
    "verdict",
    "format_rows",
    "format_interval",
    "within",
    "model_name",
    "scope_skip",
    "signed",
]

MAX_ROWS = 20
STATUSES = ("passed", "failed", "skipped", "error")  # error: the invariant itself raised (`evaluate`)
NOT_PASSED = ("failed", "error")  # what fails a gate


@dataclass(frozen=True)
class Row:
    """One compared figure: ``subject`` (a head ``L1H0``, ``model``, ``all heads``) and its numbers."""

    subject: str
    metric: str
    before: float
    after: float
    limit: float
    broken: bool
    note: str = ""
    interval: tuple[float, float] | None = None  # 95% paired interval of after - before (sampled figures)
    sequences: int | None = None  # the paired sequences that decided a sampled row (all looks)
    wants: int = 0  # the look an undecided sampled row needs next (record.looks.extend measures it); 0: decided

    def as_dict(self) -> dict[str, Any]:
        return {
            "head": self.subject,
            "metric": self.metric,
            "before": self.before,
            "after": self.after,
            "change": self.after - self.before,
            "interval": None if self.interval is None else [self.interval[0], self.interval[1]],
            "tolerance": self.limit,
            "broken": self.broken,
            "note": self.note,
        }


@dataclass
class Comparison:
    """What one invariant compared: its rows, and why some or all heads were left out."""

    rows: list[Row] = field(default_factory=list)
    context: list[Row] = field(default_factory=list)  # shown under a failure (e.g. the heads driving a shift)
    left_out: str = ""  # "; 4 heads with OV gain < 0.01 x the largest not compared"
    detail: str = ""  # appended to the pass line (e.g. the mean shifts)
    nothing: str = ""  # why nothing was compared
    nothing_is_skip: bool = False  # the baseline model has none of this mechanism: skip, not fail

    @property
    def broken(self) -> list[Row]:
        return [r for r in self.rows if r.broken]


class Invariant:
    """One check of a build against a baseline. Subclass, set the class fields, write `compare`."""

    name: ClassVar[str]
    needs: ClassVar[frozenset[str]] = frozenset()  # record figures both sides must hold ("knockout")
    # the tolerances it declares, name -> `Tolerance` (or a plain default: a float, int or bool); each
    # is an ini key ``circuits_tol_<name>``, a marker keyword and a ``--tol`` name, read as ``tol.<name>``
    tolerances: ClassVar[Mapping[str, Tolerance | Number]] = {}
    reads: ClassVar[tuple[str, ...]] = ()  # tolerances another invariant declares that it reads too
    held: ClassVar[str] = "{name} of {build} holds against the {against}"
    moved: ClassVar[str] = "{name} of {build} broke against the {against}"
    # False: compares two builds of one model (skipped across models, `evaluate`); True: compares
    # two base models on model-level figures (gate/profile.py), never two builds of one model
    across_models: ClassVar[bool] = False
    per_head: ClassVar[bool] = True  # reads heads by label (the words of its cross-model skip)
    # the gate suite's test that runs it (pytest_circuits/probes), and the module holding it;
    # empty: ``test_<name>`` in ``test_registered`` (cross-model ones: all in test_base_model_swap)
    suite_test: ClassVar[str] = ""
    suite_module: ClassVar[str] = ""
    guards: ClassVar[str] = ""  # what it guards, in the verdict line's words (default: its name)
    # True: its figures are measured only when asked for (rung 3's audit slice), so a whole gate
    # (`gate_all`) leaves it out where neither record holds them; run alone, it is skipped saying so
    opt_in: ClassVar[bool] = False
    # which of the build's knockouts it reads: "every head", or "key heads" (the baseline's, `key_heads`);
    # a gate that checks only "key heads" invariants knocks out only the baselines' key heads (`run.flow`)
    knockout_heads: ClassVar[str] = "every head"

    def compare(self, before: Record, after: Record, tol: Tolerances) -> Comparison:
        """The rows of ``after`` (the build's record) against ``before`` (the baseline's), both typed
        `schema.Record`s: read their attributes (``after.copy_loss``, ``after.heads``)."""
        raise NotImplementedError


REGISTRY: dict[str, Invariant] = {}
_DECLARED: dict[str, dict[str, Tolerance]] = {}  # invariant name -> the tolerances it declares
BUILT_IN_MODULES = tuple(
    f"{__package__}.{name}" for name in ("builtin_invariants", "audit_invariants", "swap_invariants")
)


def register(invariant: Any = None, *, replace: bool = False) -> Any:
    """Add an invariant (an instance, or a subclass to instantiate) to the gate; returns it.

    Usable as a class decorator (``@register``, ``@register(replace=True)``). Its ``name`` is what
    ``circuits_gate(name)`` runs; its ``tolerances`` are declared with it (one name, one owner),
    each a lowercase identifier (an ini key ``circuits_tol_<name>``, a ``--tol`` name, ``tol.<name>``).
    A name another invariant holds is refused, naming both, unless ``replace`` says the replacement
    is meant; the same class registered again (its module imported again) replaces itself.
    """
    if invariant is None:
        return lambda given: register(given, replace=replace)
    instance = invariant() if isinstance(invariant, type) else invariant
    if not getattr(instance, "name", ""):
        raise CircuitsError(f"invariant {type(instance).__name__} has no name; set the class field `name`")
    held = REGISTRY.get(instance.name)
    if held is not None and not replace and not _same_class(held, instance):
        raise CircuitsError(
            f"invariant {instance.name!r} is registered twice: by {source_of(held)} and by {source_of(instance)}; "
            "rename one, or register the second with register(..., replace=True) to replace the first on purpose"
        )
    if held is None and replace:
        raise CircuitsError(
            f"invariant {instance.name!r} ({source_of(instance)}) is registered with replace=True, but no "
            f"invariant of that name is registered; known: {', '.join(REGISTRY)}"
        )
    declared = _declarations(instance)
    built_in = type(instance).__module__ in BUILT_IN_MODULES
    replaced = _DECLARED.get(instance.name, {}) if held is not None else {}
    for name, tolerance in declared.items():
        taken = (name in Tolerances.names() and not built_in and name not in replaced) or any(
            name in _DECLARED.get(key, {}) for key in REGISTRY if key != instance.name
        )
        if not TOLERANCE_NAME.fullmatch(name) or keyword.iskeyword(name):
            why = "cannot be set by --tol or an ini key: name it in lowercase letters, digits and _"
        elif taken:
            why = "is taken"
        elif not isinstance(tolerance.default, (int, float)) or not math.isfinite(tolerance.default):
            why = f"needs a number or bool default, got {tolerance.default!r}"
        elif tolerance.minimum is not None and (
            isinstance(tolerance.minimum, bool)
            or not isinstance(tolerance.minimum, (int, float))
            or not math.isfinite(tolerance.minimum)
        ):
            why = f"needs a number or None (any value) as its minimum, got {tolerance.minimum!r}"
        else:
            continue
        raise CircuitsError(f"invariant {instance.name} ({source_of(instance)}): tolerance {name!r} {why}")
    REGISTRY[instance.name] = instance
    _DECLARED[instance.name] = declared
    return invariant


TOLERANCE_NAME = re.compile(r"[a-z_][a-z0-9_]*")  # an ini key (configparser lowercases), a keyword, an attribute


def _file_of(cls: type) -> str | None:
    """The file defining ``cls``: its module's, else its methods' (a conftest the CLI executed from a
    spec is in no ``sys.modules``); None where no file is (a REPL)."""
    try:
        return inspect.getsourcefile(cls)
    except TypeError:
        codes = [v.__code__ for v in vars(cls).values() if inspect.isfunction(v)]
        return codes[0].co_filename if codes else None


def _same_class(a: Invariant, b: Invariant) -> bool:
    """One class, or one class of one file imported again (a conftest under pytest and the CLI)."""
    ca, cb = type(a), type(b)
    return ca is cb or (
        ca.__qualname__ == cb.__qualname__ and _file_of(ca) is not None and _file_of(ca) == _file_of(cb)
    )


def source_of(invariant: Invariant) -> str:
    """Where ``invariant``'s class is defined: ``module.Class (file)``, the built-in ones by module."""
    cls = type(invariant)
    where = f"{cls.__module__}.{cls.__qualname__}"
    if cls.__module__ in BUILT_IN_MODULES:
        return f"pytest-circuits ({where})"
    file = _file_of(cls)
    return f"{where} ({file})" if file else where


def _declarations(instance: Invariant) -> dict[str, Tolerance]:
    """The tolerances ``instance`` declares (its ``tolerances``), each as a `Tolerance`."""
    if not isinstance(instance.tolerances, Mapping):
        raise CircuitsError(
            f"invariant {instance.name} ({source_of(instance)}): tolerances must map each name it declares to a "
            f"Tolerance or a default, got {instance.tolerances!r}; name the tolerances it reads of others in `reads`"
        )
    return {name: Tolerance.of(value) for name, value in instance.tolerances.items()}


def tolerances_of(invariant: Invariant | str) -> tuple[str, ...]:
    """The tolerances an invariant reads: those it declares, then the others' it reads."""
    inv = get(invariant) if isinstance(invariant, str) else invariant
    return tuple(dict.fromkeys((*_DECLARED.get(inv.name, {}), *inv.reads)))


def declared_tolerances() -> dict[str, Tolerance]:
    """Every registered invariant's declared tolerance, name -> `Tolerance`, in gate order."""
    return {name: t for key in REGISTRY for name, t in _DECLARED.get(key, {}).items()}


def own_tolerance_defaults() -> dict[str, Number]:
    """The tolerances of the invariants registered besides the built-in ones, name -> default."""
    return {name: t.default for name, t in declared_tolerances().items() if name not in Tolerances.names()}


tolerances_module.DECLARED = declared_tolerances


def get(name: str) -> Invariant:
    """The registered invariant called ``name``, or a one-line error listing the known ones."""
    if name not in REGISTRY:
        raise CircuitsError(f"unknown invariant {name!r}{did_you_mean(name, REGISTRY)}; known: {', '.join(REGISTRY)}")
    return REGISTRY[name]


# ---------------------------------------------------------------- the one flow: rows -> result


@dataclass
class InvariantResult:
    """One invariant of one build against one baseline."""

    invariant: str
    build: str
    against: str  # "fp32 baseline" or "own baseline"
    status: str  # one of STATUSES
    message: str
    compared: int = 0  # figures compared
    moved: list[dict[str, Any]] = field(default_factory=list)  # broken rows (and context), as dicts
    wants: int = 0  # the further look an undecided sampled row asks for (`gate.check.Verdicts.wants`)
    undecided: frozenset[tuple[str, str]] = frozenset()  # (metric, subject) of the rows that ask for it

    @property
    def passed(self) -> bool:
        return self.status == "passed"

    @property
    def skipped(self) -> bool:
        return self.status == "skipped"

    def as_dict(self) -> dict[str, Any]:
        """What the reports keep: the verdict, not the run's book-keeping (``wants``, ``undecided``)."""
        kept = {key: value for key, value in asdict(self).items() if key not in ("wants", "undecided")}
        return {**kept, "passed": self.passed}


def evaluate(
    invariant: Invariant | str,
    before: RecordLike,
    after: RecordLike,
    tol: Tolerances,
    build: str,
    against: str,
    fix: str | None = None,
    across: bool | None = None,
) -> InvariantResult:
    """Run one invariant; a failure's message is a table of what broke and ends with ``fix``.

    ``across``: compare the records as two base models (None: when their geometries differ).
    Across models only the `Invariant.across_models` invariants run, and the others are skipped
    saying why; between builds of one model it is the other way round. A record dict is validated
    first (`schema.Record.of`); the invariants read the typed `Record`.
    """
    inv = get(invariant) if isinstance(invariant, str) else invariant
    before, after = Record.of(before), Record.of(after)
    words = dict(
        name=inv.name, build=build, against=against, model=model_name(after), baseline_model=model_name(before)
    )
    other = geometry_difference(before.data, after.data)
    scope = scope_skip(inv, bool(other) if across is None else across, other, words)
    if scope:
        return InvariantResult(inv.name, build, against, "skipped", scope)
    lacking = [need for need in sorted(inv.needs) if not has_figures(after, need)]
    # never a pass on figures not measured; an opt-in invariant neither record has figures for was not asked for
    if lacking and (inv.opt_in or all(has_figures(before, need) for need in lacking)):
        return InvariantResult(inv.name, build, against, "skipped", lacking_figures(after, build, ", ".join(lacking)))
    missing = [need for need in sorted(inv.needs) if not has_figures(before, need)]
    if missing:
        comparison = Comparison(
            nothing=f"the {against} holds no {', '.join(missing)} figures; record it again with them"
        )
    else:
        comparison, problem = _compare(inv, before, after, tol)
        if problem:
            return InvariantResult(inv.name, build, against, "error", problem)
    if not comparison.rows:
        status = "skipped" if comparison.nothing_is_skip else "failed"
        message = (comparison.nothing or "{name} compared nothing for {build} against the {against}").format(**words)
    elif comparison.broken:
        status = "failed"
        shown = comparison.broken + comparison.context
        # the invariant and its worst row lead (pytest's short summary shows the first line), the table after
        worst = " ".join(format_rows([max(comparison.broken, key=_moved_size)]).split())
        message = f"{inv.name}: {worst} ({inv.moved.format(**words)}{comparison.left_out})"
        if len(shown) > 1:
            message += f":\n{format_rows(shown)}"
    else:
        status = "passed"
        detail = f" ({comparison.detail})" if comparison.detail else ""
        message = f"{inv.held.format(**words)}{detail}{comparison.left_out} ({len(comparison.rows)} compared)"
    if status == "failed" and fix:
        message = f"{message}\n{fix}"
    moved = [r.as_dict() for r in comparison.broken + (comparison.context if comparison.broken else [])]
    wants = max([0, *(r.wants for r in comparison.rows)])
    undecided = frozenset((r.metric, r.subject) for r in comparison.rows if r.wants)
    return InvariantResult(inv.name, build, against, status, message, len(comparison.rows), moved, wants, undecided)


def _compare(inv: Invariant, before: Record, after: Record, tol: Tolerances) -> tuple[Comparison, str]:
    """``(inv.compare(before, after, tol), "")``, or ``(empty, why)`` where the invariant itself fails: it
    raises, reads a tolerance it does not declare, or returns other than a `Comparison`. One line naming
    the invariant, its file and the error, so that the others still run and the gate fails."""
    where, file = source_of(inv), _file_of(type(inv)) or ""
    try:
        comparison = inv.compare(before, after, tol)
    except Exception as error:  # a user's code: any exception is that invariant's error, not the run's
        line = _line_in(error, file)
        said = " ".join(f"{type(error).__name__}: {error}".split())
        return Comparison(), f"{inv.name}: {where}{line} raised {said}; fix the invariant or leave its module out"
    if not isinstance(comparison, Comparison):
        what = type(comparison).__name__
        return Comparison(), f"{inv.name}: {where} returned {what}, not a Comparison; return Comparison(rows)"
    return comparison, ""


def _line_in(error: BaseException, file: str) -> str:
    """`` line N`` of the last traceback frame of ``error`` in ``file`` ("" when none is)."""
    line = ""
    tb = error.__traceback__
    while tb is not None:
        if file and tb.tb_frame.f_code.co_filename.endswith(file):
            line = f", line {tb.tb_lineno},"
        tb = tb.tb_next
    return line


def model_name(record: RecordLike) -> str:
    return Record.of(record).model.name or "the model"


def scope_skip(inv: Invariant, across: bool, other: str, words: dict[str, Any]) -> str:
    """Why ``inv`` is not compared in this pairing ("" when it is): a build invariant across two
    base models, or a cross-model invariant between builds of one model."""
    geometry = f"geometry {other}" if other else "the same geometry, compared as two models"
    if across and not inv.across_models:
        what = "per-head invariants are" if inv.per_head else f"{inv.name} (builds of one model) is"
        return f"{what} not compared across models ({geometry}); the swap_* invariants compare the models"
    if not across and inv.across_models:
        return (
            f"{inv.name} compares two base models; the {words['against']} is of {words['model']}'s own geometry "
            f"(to gate a base-model swap, pass {flag('swap-baseline')} FILE, the baseline of the model it replaces)"
        )
    return ""


def across_models() -> list[str]:
    """The registered invariants that compare two base models."""
    return [name for name, inv in REGISTRY.items() if inv.across_models]


def per_build_invariants(opt_in: bool = False) -> list[str]:
    """The registered invariants that compare builds of one model (one gate-suite test each), the
    `Invariant.opt_in` ones only with ``opt_in`` (their tests run only where the run asks for them)."""
    return [name for name, inv in REGISTRY.items() if not inv.across_models and (opt_in or not inv.opt_in)]


def runnable(after: RecordLike, names: Iterable[str] | None = None, across: bool = False) -> list[str]:
    """The invariants (all registered, or ``names``) whose figures the candidate record holds;
    the cross-model ones only ``across`` models (the others then report why they were skipped)."""
    after = Record.of(after)
    return [n for n in in_scope(names, across) if all(has_figures(after, need) for need in get(n).needs)]


def in_scope(names: Iterable[str] | None = None, across: bool = False) -> list[str]:
    """The invariants (all registered, or ``names``) a comparison runs, whatever figures they need:
    the cross-model ones only ``across`` models."""
    chosen = list(REGISTRY) if names is None else list(names)
    return [n for n in chosen if across or not get(n).across_models]


def gate_all(
    before: RecordLike,
    after: RecordLike,
    tol: Tolerances,
    build: str,
    against: str,
    fix: str | None = None,
    names: Iterable[str] | None = None,
    across: bool | None = None,
) -> list[InvariantResult]:
    """`evaluate` every invariant the candidate has figures for (``across``: see `evaluate`); one it
    has none for (a scan without knockouts) is skipped saying so, so the verdict names it as not guarded."""
    before, after = Record.of(before), Record.of(after)
    across = bool(geometry_difference(before.data, after.data)) if across is None else across
    scope = [n for n in in_scope(names, across) if asked(get(n), before, after)]
    run = [n for n in runnable(after, names, across) if n in scope]
    results = {n: evaluate(n, before, after, tol, build, against, fix, across) for n in run}
    for n in scope:
        if n not in results:
            lacking = ", ".join(need for need in sorted(get(n).needs) if not has_figures(after, need))
            results[n] = InvariantResult(n, build, against, "skipped", lacking_figures(after, build, lacking))
    return [results[n] for n in scope]


def asked(inv: Invariant, before: Record, after: Record) -> bool:
    """Whether a whole gate runs ``inv``: always, but for an `Invariant.opt_in` one whose figures
    neither record holds (no audit slice was given to either)."""
    return not inv.opt_in or any(all(has_figures(r, need) for need in inv.needs) for r in (before, after))


def guarded(results: Iterable[Any]) -> str:
    """What a gate that skipped something checked, for its verdict line: ``"guarded: the copy loss,
    the copying heads; NOT guarded: the induction and previous-token heads (skipped)"``; "" when
    nothing was skipped. ``results``: objects or dicts with ``invariant`` and ``status``; an
    invariant held against one baseline is guarded."""

    def field(r: Any, key: str) -> Any:
        return r[key] if isinstance(r, dict) else getattr(r, key)

    pairs = [(field(r, "invariant"), field(r, "status")) for r in results]
    held = list(dict.fromkeys(n for n, status in pairs if status == "passed"))
    skipped = list(dict.fromkeys(n for n, status in pairs if status == "skipped" and n not in held))

    def words(names: list[str]) -> str:
        return ", ".join((REGISTRY[n].guards if n in REGISTRY else "") or n for n in names)

    if not skipped:
        return ""
    return (f"guarded: {words(held)}" if held else "nothing guarded") + f"; NOT guarded: {words(skipped)} (skipped)"


def verdict(results: list[InvariantResult]) -> tuple[bool, str]:
    """``(passed, line)`` of a whole gate: it passes when nothing broke and something was compared."""
    broken = [r.invariant for r in results if r.status in NOT_PASSED]
    held = [r for r in results if r.passed]
    skipped = [r.invariant for r in results if r.skipped]
    said = f"{len(held)} of {len(results)} invariants hold" + (
        f", {len(skipped)} skipped ({', '.join(skipped)})" if skipped else ""
    )
    if broken:
        return False, f"gate failed: {', '.join(broken)} ({said})"
    if not held:
        return False, f"gate compared nothing ({said}); a gate that compared nothing has not passed"
    said_guarded = guarded(results)
    return True, f"gate passed ({said})" + (f"; {said_guarded}" if said_guarded else "")


# ---------------------------------------------------------------- the message table


def signed(x: float) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "nan"
    return f"{x:+.3g}" if abs(x) < 1e-3 and x != 0 else f"{x:+.3f}"


def _moved_size(row: Row) -> float:
    """How far a row moved in tolerances (``|after - before| / limit``; inf where not finite)."""
    size = abs(row.after - row.before) / row.limit if row.limit > 0 else abs(row.after - row.before)
    return size if math.isfinite(size) else math.inf


def format_rows(rows: list[Row], max_rows: int = MAX_ROWS) -> str:
    """``L1H2 kappa +0.910 -> -0.880 (tolerance 0.10)`` lines, at most ``max_rows``."""
    lines = []
    width = max((len(r.subject) for r in rows), default=4)
    mwidth = max((len(r.metric) for r in rows), default=6)
    for r in rows[:max_rows]:
        note = f" {r.note}" if r.note else ""
        change = f": {signed(r.after - r.before)} {format_interval(r.interval)}" if r.interval is not None else ""
        lines.append(
            f"  {r.subject:<{width}} {r.metric:<{mwidth}} {signed(r.before)} -> "
            f"{signed(r.after)}{change} (tolerance {r.limit:.3g}){note}"
        )
    if len(rows) > max_rows:
        lines.append(f"  ... and {len(rows) - max_rows} more")
    return "\n".join(lines)


def format_interval(interval: tuple[float, float] | None) -> str:
    """``[+0.21, +0.37]``; "" without one."""
    return "" if interval is None else f"[{signed(interval[0])}, {signed(interval[1])}]"


def within(subject: str, metric: str, before: float, after: float, limit: float, note: str = "") -> Row:
    """A row that holds when ``|after - before| <= limit`` (NaN never holds)."""
    return Row(subject, metric, before, after, limit, not abs(after - before) <= limit, note)
