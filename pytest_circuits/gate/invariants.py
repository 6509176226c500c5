"""The invariants of the gate, one registry entry each (docs/definitions.md, "The gate").

An `Invariant` reads two scan records (``before``: the baseline, ``after``: the build under
test) and returns a `Comparison`: one `Row` per figure it compared (subject, metric,
before, after, limit, broken?). Everything else derives from those rows in one flow,
`evaluate`: pass or fail, the failure table, the CLI verdict, ``circuits diff``, the
report's broken list and ``scripts/measure_gate.py``. An invariant that compared nothing
never passes: it fails with its reason, or is skipped when the baseline model has none of
the mechanism it guards (a random model has no induction head).

Built in (``REGISTRY``, in gate order):

- ``copying_heads``: every head flagged copying or suppression keeps ``|kappa' - kappa|``
  and ``|kappa_trace' - kappa_trace|`` within ``kappa``; every head keeps kappa_trace within
  ``kappa``; the Spearman rank correlation of kappa over the heads the baseline tells apart
  from the null (``|kappa_z| >= 2``) stays ``>= rank``.
- ``kappa_distribution``: the mean over heads of ``kappa_z' - kappa_z`` (and of the trace
  twin) stays within ``+-shift`` null standard deviations.
- Both kappa invariants leave out heads whose OV gain ``sum_i |lambda_i|`` times its layer's
  ``path_factor`` (the norm factors the fold leaves out, on the probe; 1 in records without it)
  is below ``min_ov_gain`` x the baseline's largest, and say how many.
- ``copy_loss``: copy loss and copy gain each within ``copy_loss`` / ``copy_gain`` nats.
- ``induction_heads``: the baseline's top-``top_k`` prefix-matching and previous-token heads
  scoring at least ``min_score`` keep their score within ``+-prefix``.
- ``knockout_deltas``: the baseline's top-``top_k`` knockout heads (delta at least
  ``min_delta`` nats) keep ``|delta' - delta| <= knockout * |delta|``.
- Both of these compare sampled figures (`sampled_within`): each row carries the 95% paired t
  interval of its change over the probe's sequences, and with ``outside_interval`` (default)
  a change beyond its tolerance breaks only when that interval excludes 0.

Across base models (another geometry, or asked for: heads do not correspond, so the ones above
are skipped saying so, never passed; `gate/profile.py` computes the figures; each fails only
when the new model has less of the mechanism, except where "moves" says either direction):

- ``swap_copy``: copy loss rises by at most ``swap_copy_loss`` nats; copy_gain / first_copy_loss
  falls by at most ``swap_copy_gain``.
- ``swap_induction``: at least ``swap_induction_heads`` heads with prefix_matching >=
  ``swap_induction_score``; the best score falls by at most ``swap_prefix``; their mean depth
  (fraction of the stack) moves by at most ``swap_depth``.
- ``swap_kappa``: the shares of copying / suppression heads move by at most ``swap_share``; the
  1-Wasserstein distance of the kappa_z distributions is at most ``swap_kappa_w1``.
- ``swap_knockout``: the largest knockout delta falls by at most ``swap_knockout`` x its size;
  the top-3 share of the knockout effect moves by at most ``swap_concentration`` (both records
  measured every head).

A user adds one with `register` (docs/invariants.md, "Your own invariant").
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import ClassVar

import numpy as np

from ..errors import CircuitsError
from ..options import flag
from . import tolerances as tolerances_module
from .record import has_figures, record_eigenvalues
from .stats import LEVEL, excludes_zero, implausible_spread, paired_interval, spearman
from .store import geometry_difference
from .tolerances import Tolerances

MAX_ROWS = 20
RANK_MIN_Z = 2.0  # heads in the rank correlation: those the baseline tells apart from the null
STATUSES = ("passed", "failed", "skipped")


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

    def as_dict(self) -> dict:
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
    tolerances: ClassVar[tuple[str, ...]] = ()  # the `Tolerances` fields it reads
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
    # tolerances of its own, name -> default (a float, int or bool): like the built-ins each is an
    # ini key ``circuits_tol_<name>``, a marker keyword and a ``--tol`` name, read as ``tol.<name>``
    own_tolerances: ClassVar[dict[str, float | int | bool]] = {}
    guards: ClassVar[str] = ""  # what it guards, in the verdict line's words (default: its name)

    def compare(self, before: dict, after: dict, tol: Tolerances) -> Comparison:
        raise NotImplementedError


REGISTRY: dict[str, Invariant] = {}


def register(invariant):
    """Add an invariant (an instance, or a subclass to instantiate) to the gate; returns it.

    Usable as a class decorator. Its ``name`` is what ``circuits_gate(name)`` runs.
    """
    instance = invariant() if isinstance(invariant, type) else invariant
    if not getattr(instance, "name", ""):
        raise CircuitsError(f"invariant {type(instance).__name__} has no name; set the class field `name`")
    for name, default in instance.own_tolerances.items():
        taken = name in Tolerances.names() or any(
            name in other.own_tolerances for key, other in REGISTRY.items() if key != instance.name
        )
        if taken or not isinstance(default, (int, float)):
            why = "is taken" if taken else f"needs a number or bool default, got {default!r}"
            raise CircuitsError(f"invariant {instance.name}: own tolerance {name} {why}")
    REGISTRY[instance.name] = instance
    return invariant


def own_tolerance_defaults() -> dict[str, float | int | bool]:
    """Every registered invariant's own tolerances, name -> default."""
    return {name: default for inv in REGISTRY.values() for name, default in inv.own_tolerances.items()}


tolerances_module.OWN_DEFAULTS = own_tolerance_defaults


def get(name: str) -> Invariant:
    """The registered invariant called ``name``, or a one-line error listing the known ones."""
    if name not in REGISTRY:
        raise CircuitsError(f"unknown invariant {name!r}; known: {', '.join(REGISTRY)}")
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
    moved: list[dict] = field(default_factory=list)  # broken rows (and context), as dicts

    @property
    def passed(self) -> bool:
        return self.status == "passed"

    @property
    def skipped(self) -> bool:
        return self.status == "skipped"

    def as_dict(self) -> dict:
        return {**asdict(self), "passed": self.passed}


def evaluate(
    invariant: Invariant | str,
    before: dict,
    after: dict,
    tol: Tolerances,
    build: str,
    against: str,
    fix: str | None = None,
    across: bool | None = None,
) -> InvariantResult:
    """Run one invariant; a failure's message is a table of what broke and ends with ``fix``.

    ``across``: compare the records as two base models (None: when their geometries differ).
    Across models only the `Invariant.across_models` invariants run, and the others are skipped
    saying why; between builds of one model it is the other way round.
    """
    inv = get(invariant) if isinstance(invariant, str) else invariant
    words = dict(
        name=inv.name, build=build, against=against, model=model_name(after), baseline_model=model_name(before)
    )
    other = geometry_difference(before, after)
    scope = scope_skip(inv, bool(other) if across is None else across, other, words)
    if scope:
        return InvariantResult(inv.name, build, against, "skipped", scope)
    missing = [need for need in sorted(inv.needs) if not has_figures(before, need)]
    if missing:
        comparison = Comparison(
            nothing=f"the {against} holds no {', '.join(missing)} figures; record it again with them"
        )
    else:
        comparison = inv.compare(before, after, tol)
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
    return InvariantResult(inv.name, build, against, status, message, len(comparison.rows), moved)


def model_name(record: dict) -> str:
    return str((record.get("model") or {}).get("name") or "the model")


def scope_skip(inv: Invariant, across: bool, other: str, words: dict) -> str:
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


def per_build_invariants() -> list[str]:
    """The registered invariants that compare builds of one model (one gate-suite test each)."""
    return [name for name, inv in REGISTRY.items() if not inv.across_models]


def runnable(after: dict, names=None, across: bool = False) -> list[str]:
    """The invariants (all registered, or ``names``) whose figures the candidate record holds;
    the cross-model ones only ``across`` models (the others then report why they were skipped)."""
    chosen = list(REGISTRY) if names is None else list(names)
    chosen = [n for n in chosen if across or not get(n).across_models]
    return [n for n in chosen if all(has_figures(after, need) for need in get(n).needs)]


def gate_all(
    before: dict,
    after: dict,
    tol: Tolerances,
    build: str,
    against: str,
    fix: str | None = None,
    names=None,
    across: bool | None = None,
) -> list[InvariantResult]:
    """`evaluate` every invariant the candidate has figures for (``across``: see `evaluate`)."""
    across = bool(geometry_difference(before, after)) if across is None else across
    return [evaluate(n, before, after, tol, build, against, fix, across) for n in runnable(after, names, across)]


def guarded(results) -> str:
    """What a gate that skipped something checked, for its verdict line: ``"guarded: the copy loss,
    the copying heads; NOT guarded: the induction and previous-token heads (skipped)"``; "" when
    nothing was skipped. ``results``: objects or dicts with ``invariant`` and ``status``; an
    invariant held against one baseline is guarded."""

    def field(r, key):
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
    broken = [r.invariant for r in results if r.status == "failed"]
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


def _signed(x: float) -> str:
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
        change = f": {_signed(r.after - r.before)} {format_interval(r.interval)}" if r.interval is not None else ""
        lines.append(
            f"  {r.subject:<{width}} {r.metric:<{mwidth}} {_signed(r.before)} -> "
            f"{_signed(r.after)}{change} (tolerance {r.limit:.3g}){note}"
        )
    if len(rows) > max_rows:
        lines.append(f"  ... and {len(rows) - max_rows} more")
    return "\n".join(lines)


def format_interval(interval: tuple[float, float] | None) -> str:
    """``[+0.21, +0.37]``; "" without one."""
    return "" if interval is None else f"[{_signed(interval[0])}, {_signed(interval[1])}]"


# ---------------------------------------------------------------- shared helpers of the built-in invariants


def num(value) -> float:
    """A float, NaN for None (a figure that was not measured)."""
    return float("nan") if value is None else float(value)


def heads_by_label(record: dict) -> dict[str, dict]:
    return {row["head"]: row for row in record.get("heads", [])}


def head_pairs(before: dict, after: dict) -> list[tuple[str, dict, dict]]:
    """Heads present in both records, in the baseline's order."""
    b, a = heads_by_label(before), heads_by_label(after)
    return [(name, b[name], a[name]) for name in b if name in a]


def within(subject: str, metric: str, before: float, after: float, limit: float, note: str = "") -> Row:
    """A row that holds when ``|after - before| <= limit`` (NaN never holds)."""
    return Row(subject, metric, before, after, limit, not abs(after - before) <= limit, note)


NO_INTERVAL = (
    "interval not available ({side} recorded without per-sequence figures; re-record); plain tolerance applies"
)


def sampled_within(
    subject: str, metric: str, before: dict, after: dict, limit: float, tol: Tolerances, note: str = ""
) -> Row:
    """A row of a sampled figure (a mean over the probe's sequences; rungs/figures.py), read from
    ``before`` / ``after`` (a record, or one of its head rows) with its per-sequence values.

    Its interval is the 95% paired t interval of the change (`stats.paired_interval`). It breaks
    when ``|after - before| > limit`` and, with ``tol.outside_interval`` (the default), the
    interval excludes 0; without per-sequence values on both sides the plain tolerance applies
    and the note says so.
    """
    from ..rungs.figures import sequences_key

    x, y = num(before.get(metric)), num(after.get(metric))
    key = sequences_key(metric)
    xs, ys = before.get(key), after.get(key)
    interval = paired_interval(xs, ys) if xs is not None and ys is not None else None
    beyond = not abs(y - x) <= limit
    said = [note] if note else []
    if interval is None:
        if math.isfinite(y) and (xs is None or ys is None):
            said.append(NO_INTERVAL.format(side="baseline" if xs is None else "build"))
        elif math.isfinite(y) and xs is not None and ys is not None:
            said.append(f"interval not available ({len(xs)} vs {len(ys)} sequences); plain tolerance applies")
        broken = beyond
    elif tol.outside_interval:
        broken = beyond and excludes_zero(interval)
        ratio = implausible_spread(xs, ys) if beyond and not broken else None
        if ratio is not None:
            broken = True  # only the baseline's implausible spread held the interval over 0
            said.append(NO_EVIDENCE.format(ratio=ratio, n=len(xs or ())))
        elif beyond and not broken:
            said.append(f"beyond {limit:.3g} but {SPARED} (the {LEVEL:.0%} interval holds 0)")
    else:
        broken = beyond
    return Row(subject, metric, x, y, limit, broken, " ".join(said), interval)


# A baseline whose per-sequence values spread implausibly for its n (`stats.implausible_spread`) cannot
# say a change is noise: its interval would hold 0 whatever the build did (docs/definitions.md).
NO_EVIDENCE = (
    "the baseline's per-sequence values carry no evidence (their spread is {ratio:.3g}x the build's on the "
    "same {n} sequences, beyond F({n}-1, {n}-1) at 99.9%); plain tolerance applies: record the baseline again"
)
SPARED = "within sampling noise"  # the note of a row the interval rule kept from breaking


def spared(rows: list[Row]) -> list[Row]:
    """Rows beyond their tolerance that the interval rule kept (shown under a failure as context)."""
    return [r for r in rows if SPARED in r.note]


def interval_detail(rows: list[Row], shown: list[Row] | None = None) -> str:
    """Pass-line words for sampled rows: the changes of ``shown`` (default all) with their intervals,
    how many rows the interval rule spared, and why an interval was not available."""
    parts = []
    for r in rows if shown is None else shown:
        subject = "" if r.subject == "model" else f"{r.subject} "
        parts.append(
            f"{subject}d{r.metric} {_signed(r.after - r.before)} {format_interval(r.interval) or '(no interval)'}"
        )
    kept = len(spared(rows))
    missing = {r.note[r.note.index("interval not available") :] for r in rows if "interval not available" in r.note}
    said = [", ".join(parts)] if parts else []
    said += [f"{kept} beyond tolerance but {SPARED}"] if kept else []
    return "; ".join(said + sorted(missing))


def ov_gains(record: dict) -> dict[str, float]:
    """Each head's OV gain ``sum_i |lambda_i|``: the ``ov_gain`` column, or from the stored
    eigenvalues for records written before that column existed; empty when neither is there."""
    from ..rungs.kappa import ov_gain

    heads = heads_by_label(record)
    if heads and all(row.get("ov_gain") is not None for row in heads.values()):
        return {name: float(row["ov_gain"]) for name, row in heads.items()}
    return {name: float(ov_gain(lam)) for name, lam in record_eigenvalues(record).items() if lam.size}


def head_writes(record: dict) -> tuple[dict[str, float], str]:
    """``(sizes, what)``: each head's OV gain times its layer's ``path_factor`` (what it writes
    on the probe: the per-position norm factors the fold leaves out put back) when every head has
    one, else its OV gain alone (`ov_gains`; records written before ``path_factor``), and the words."""
    gains = ov_gains(record)
    heads = heads_by_label(record)
    if gains and all(heads.get(name, {}).get("path_factor") is not None for name in gains):
        return {name: gain * float(heads[name]["path_factor"]) for name, gain in gains.items()}, "OV gain on the probe"
    return gains, "OV gain"


def negligible_heads(record: dict, min_ov_gain: float) -> set[str]:
    """Heads whose residual write (`head_writes`) is below ``min_ov_gain`` x the record's largest."""
    gains, _ = head_writes(record)
    if not gains or min_ov_gain <= 0:
        return set()
    largest = max(gains.values())
    return {name for name, gain in gains.items() if gain < min_ov_gain * largest}


def compared_pairs(before: dict, after: dict, tol: Tolerances) -> tuple[list, str]:
    """``(pairs, left_out)``: the heads the kappa invariants compare, and a note naming how many
    negligible heads were left out ("" when none)."""
    negligible = negligible_heads(before, tol.min_ov_gain)
    pairs = [(name, b, a) for name, b, a in head_pairs(before, after) if name not in negligible]
    if not negligible:
        return pairs, ""
    what = head_writes(before)[1]
    return pairs, f"; {len(negligible)} heads with {what} < {tol.min_ov_gain:g} x the largest not compared"


def kappa_pairs(before: dict, after: dict, figures: tuple[str, ...]) -> tuple[dict[str, tuple[str, str]], str]:
    """``({figure: (figure of before, figure of after)}, why)``: the figures of two records that
    measure the same thing (`rungs.kappa_method.paired_figures`); ``why`` names the two ways of
    measuring kappa when some figure has no pair ("" when all do)."""
    from ..rungs.kappa_method import of_record, paired_figures

    mb, ma = of_record(before), of_record(after)
    pairs = {f: p for f in figures if (p := paired_figures(f, mb, ma)) is not None}
    if len(pairs) == len(figures):
        return pairs, ""
    return pairs, (
        f"the {{against}} measured kappa with {mb.describe()}, {{build}} with {ma.describe()}: "
        f"{', '.join(f for f in figures if f not in pairs)} of two methods are not compared "
        "(a live gate measures the build the baseline's way)"
    )


def key_heads(record: dict, metric: str, top_k: int, minimum: float) -> list[str]:
    """The record's heads scoring at least ``minimum`` on ``metric``, best first; the top ``top_k``
    of them when ``top_k`` is positive, every one when it is 0."""
    rows = [(r["head"], num(r.get(metric))) for r in record.get("heads", [])]
    rows = [(h, v) for h, v in rows if not math.isnan(v) and v >= minimum]
    rows.sort(key=lambda hv: -hv[1])
    return [h for h, _ in (rows[:top_k] if top_k > 0 else rows)]


def _role(row: dict) -> str:
    return "copying" if row.get("copying") else "suppression" if row.get("suppression") else ""


# ---------------------------------------------------------------- the built-in invariants


@register
class CopyingHeads(Invariant):
    """Copying/suppression heads keep kappa and kappa_trace; kappa keeps its rank order."""

    name = "copying_heads"
    suite_test = "test_copying_heads_survive"
    suite_module = "test_rung1_weights"
    guards = "the copying heads"
    tolerances = ("kappa", "rank", "min_ov_gain")
    held = "copying heads of {build} survive against the {against}"
    moved = "copying heads of {build} moved against the {against}"

    def compare(self, before, after, tol):
        same, mismatch = kappa_pairs(before, after, ("kappa", "kappa_trace"))
        if mismatch:
            return Comparison(nothing=mismatch)
        (kb, ka), (tb, ta) = same["kappa"], same["kappa_trace"]  # the uncentred twin across unembeddings
        pairs, left_out = compared_pairs(before, after, tol)
        rows = []
        for name, b, a in pairs:
            for metric, x, y in [("kappa", kb, ka), ("kappa_trace", tb, ta)] if _role(b) else [("kappa_trace", tb, ta)]:
                paired = "" if x == y else f" ({x} -> {y})"
                rows.append(within(name, metric, num(b.get(x)), num(a.get(y)), tol.kappa, _role(b) + paired))
        ranked = [(b, a) for _, b, a in pairs if abs(num(b.get("kappa_z"))) >= RANK_MIN_Z]
        if len(ranked) >= 3:
            rho = spearman([num(b.get(kb)) for b, _ in ranked], [num(a.get(ka)) for _, a in ranked])
            undefined = " undefined: kappa is constant on one side" if math.isnan(rho) else ""
            rows.append(
                Row(
                    f"{len(ranked)} heads",
                    "rank corr",
                    1.0,
                    rho,
                    tol.rank,
                    not rho >= tol.rank,
                    f"(Spearman of kappa over heads with |kappa_z| >= {RANK_MIN_Z:g}){undefined}",
                )
            )
        return Comparison(
            rows, left_out=left_out, nothing=f"no head of the {{against}} is compared{left_out}; check the baseline"
        )


@register
class KappaDistribution(Invariant):
    """Mean shift across heads of kappa_z (and kappa_trace_z when recorded) within +-shift null sds."""

    name = "kappa_distribution"
    suite_test = "test_kappa_distribution_not_shifted"
    suite_module = "test_rung1_weights"
    guards = "the kappa distribution"
    tolerances = ("shift", "min_ov_gain")
    held = "kappa distribution of {build} not shifted against the {against}"
    moved = "kappa distribution of {build} shifted against the null, compared with the {against}"

    def compare(self, before, after, tol):
        _, mismatch = kappa_pairs(before, after, ("kappa_z", "kappa_trace_z"))
        if mismatch:
            return Comparison(nothing=mismatch)
        pairs, left_out = compared_pairs(before, after, tol)
        rows, context, said = [], [], []
        for metric in ("kappa_z", "kappa_trace_z"):
            dz = np.array([num(a.get(metric)) - num(b.get(metric)) for _, b, a in pairs], float)
            if not np.isfinite(dz).any():
                continue
            shift = float(dz[np.isfinite(dz)].mean()) if np.isfinite(dz).all() else math.nan
            mean_b = float(np.nanmean([num(b.get(metric)) for _, b, _ in pairs]))
            row = within("all heads", f"mean {metric}", mean_b, mean_b + shift, tol.shift)
            rows.append(row)
            said.append(f"mean d{metric} {shift:+.2f}")
            if row.broken:  # the heads that drive the shift: moved the same way at least as far, largest first
                drivers = sorted(
                    (p for p, d in zip(pairs, dz) if np.sign(d) == np.sign(shift) and abs(d) >= abs(shift)),
                    key=lambda p: -abs(num(p[2].get(metric)) - num(p[1].get(metric))),
                )
                context += [
                    Row(name, metric, num(b.get(metric)), num(a.get(metric)), tol.shift, True, "(drives the shift)")
                    for name, b, a in drivers[:5]
                ]
        return Comparison(
            rows,
            context,
            left_out,
            ", ".join(said),
            nothing=f"no kappa z-scores to compare in the {{against}}{left_out}; check the baseline",
        )


@register
class CopyLoss(Invariant):
    """Copy loss and copy gain (nats) within tolerance, both directions."""

    name = "copy_loss"
    suite_test = "test_copy_loss_within_tolerance"
    suite_module = "test_rung12_repeat"
    guards = "the copy loss"
    per_head = False
    tolerances = ("copy_loss", "copy_gain", "outside_interval")
    held = "copy behaviour of {build} within tolerance of the {against}"
    moved = "copy behaviour of {build} moved against the {against}"

    def compare(self, before, after, tol):
        rows = [
            sampled_within("model", metric, before, after, limit, tol)
            for metric, limit in (("copy_loss", tol.copy_loss), ("copy_gain", tol.copy_gain))
        ]
        detail = f"copy loss {num(after.get('copy_loss')):.3f}, gain {num(after.get('copy_gain')):.3f}; "
        return Comparison(rows, spared(rows), detail=detail + interval_detail(rows))


@register
class InductionHeads(Invariant):
    """Top prefix-matching (and previous-token) heads of the baseline keep their scores."""

    name = "induction_heads"
    suite_test = "test_induction_heads_survive"
    suite_module = "test_rung12_repeat"
    guards = "the induction and previous-token heads"
    tolerances = ("prefix", "top_k", "min_score")
    held = "induction heads of {build} survive against the {against}"
    moved = "induction heads of {build} moved against the {against}"

    def compare(self, before, after, tol):
        b, a = heads_by_label(before), heads_by_label(after)
        rows = []
        for metric, role in (("prefix_matching", "induction"), ("previous_token", "previous-token")):
            for name in key_heads(before, metric, tol.top_k, tol.min_score):
                rows.append(
                    within(name, metric, num(b[name].get(metric)), num(a.get(name, {}).get(metric)), tol.prefix, role)
                )
        return Comparison(
            rows,
            nothing_is_skip=True,
            nothing=(
                f"the {{against}} has no induction or previous-token head scoring >= {tol.min_score:g}; nothing to check"
            ),
        )


@register
class KnockoutDeltas(Invariant):
    """Key heads' knockout deltas keep their size: ``|d' - d| <= knockout * |d|``."""

    name = "knockout_deltas"
    suite_test = "test_knockout_deltas_keep_size"
    suite_module = "test_rung2_knockout"
    guards = "the key knockout heads"
    needs = frozenset({"knockout"})
    tolerances = ("knockout", "top_k", "min_delta", "outside_interval")
    held = "knockout deltas of {build}'s key heads keep their size against the {against}"
    moved = "knockout deltas of {build}'s key heads changed against the {against}"

    def compare(self, before, after, tol):
        settings = [
            (k, (before.get("knockout") or {}).get(k), (after.get("knockout") or {}).get(k))
            for k in ("mode", "seed", "n", "L")
        ]
        other = [f"{k} {x} vs {y}" for k, x, y in settings if x is not None and y is not None and x != y]
        if other:  # deltas of another ablation or other sequences are other figures, not a change
            return Comparison(
                nothing=f"the {{against}} was knocked out with other settings ({', '.join(other)}); "
                "record it again with this run's knockout settings"
            )
        b, a = heads_by_label(before), heads_by_label(after)
        rows = []
        for name in key_heads(before, "knockout_delta", tol.top_k, tol.min_delta):
            x, y = num(b[name].get("knockout_delta")), num(a.get(name, {}).get("knockout_delta"))
            note = (
                f"({tol.knockout:.0%} of its size)"
                if not math.isnan(y)
                else "NOT MEASURED in this build (screened out): an error, not a change; measure it exactly"
            )
            rows.append(
                sampled_within(name, "knockout_delta", b[name], a.get(name, {}), tol.knockout * abs(x), tol, note)
            )
        return Comparison(
            rows,
            spared(rows),
            detail=interval_detail(rows, spared(rows)[:5]),
            nothing_is_skip=True,
            nothing=(f"the {{against}} has no head with knockout delta >= {tol.min_delta:g} nats; nothing to check"),
        )


# ---------------------------------------------------------------- across base models (gate/profile.py)


def at_least(subject: str, metric: str, before: float, after: float, fall: float, note: str = "") -> Row:
    """A row that holds when ``after >= before - fall`` (a rise always holds; NaN never holds)."""
    return Row(subject, metric, before, after, fall, not after >= before - fall, note)


def at_most(subject: str, metric: str, before: float, after: float, rise: float, note: str = "") -> Row:
    """A row that holds when ``after <= before + rise`` (a fall always holds; NaN never holds)."""
    return Row(subject, metric, before, after, rise, not after <= before + rise, note)


def _profiles(before: dict, after: dict, tol: Tolerances):
    from .profile import profile

    return profile(before, tol.swap_induction_score), profile(after, tol.swap_induction_score)


class AcrossModels(Invariant):
    """An invariant of a base-model swap: model-level figures, heads never matched by label.

    Its messages name both models (``{model}``: the build's, ``{baseline_model}``: the baseline's).
    """

    across_models = True
    per_head = False
    held = "{model} {build} holds against {baseline_model} (the {against})"
    moved = "{model} {build} moved against {baseline_model} (the {against})"


@register
class SwapCopy(AcrossModels):
    """Copy loss may rise by ``swap_copy_loss`` nats, copy_gain / first_copy_loss fall by ``swap_copy_gain``."""

    name = "swap_copy"
    guards = "the copy loss across models"
    tolerances = ("swap_copy_loss", "swap_copy_gain")

    def compare(self, before, after, tol):
        b, a = _profiles(before, after, tol)
        vocab = f"ln V {b.uniform_loss:.3f} -> {a.uniform_loss:.3f}"
        rows = [
            at_most("model", "copy_loss", b.copy_loss, a.copy_loss, tol.swap_copy_loss, f"(nats; {vocab})"),
            at_least(
                "model",
                "copy_gain share",
                b.copy_share,
                a.copy_share,
                tol.swap_copy_gain,
                f"(copy_gain / first_copy_loss; copy_gain {b.copy_gain:.3f} -> {a.copy_gain:.3f} nats, {vocab})",
            ),
        ]
        detail = (
            f"copy loss {b.copy_loss:.3f} -> {a.copy_loss:.3f}, copy gain {b.copy_gain:.3f} -> {a.copy_gain:.3f} "
            f"nats ({a.copy_share:.0%} of the first-copy loss), {vocab}"
        )
        return Comparison(rows, detail=detail)


@register
class SwapInduction(AcrossModels):
    """Induction heads (prefix_matching >= swap_induction_score): their number, the best score, their depth."""

    name = "swap_induction"
    guards = "the induction heads across models"
    tolerances = ("swap_induction_score", "swap_induction_heads", "swap_prefix", "swap_depth")

    def compare(self, before, after, tol):
        b, a = _profiles(before, after, tol)
        threshold = f"prefix_matching >= {tol.swap_induction_score:g}"
        if not b.induction_heads:
            return Comparison(
                nothing_is_skip=True,
                nothing=f"{{baseline_model}} (the {{against}}) has no induction head ({threshold}); nothing to check",
            )
        needed = min(tol.swap_induction_heads, len(b.induction_heads))
        rows = [
            Row(
                "model",
                "induction heads",
                len(b.induction_heads),
                len(a.induction_heads),
                needed,
                len(a.induction_heads) < needed,
                f"({threshold}; {a.model} needs at least {needed}; of {b.n_heads} -> {a.n_heads} heads)",
            ),
            at_least(
                "model",
                "best prefix_matching",
                b.best_prefix,
                a.best_prefix,
                tol.swap_prefix,
                f"({b.best_prefix_head or '-'} -> {a.best_prefix_head or '-'})",
            ),
        ]
        left_out = ""
        if a.induction_heads:
            rows.append(
                within(
                    "model",
                    "induction depth",
                    b.induction_depth,
                    a.induction_depth,
                    tol.swap_depth,
                    f"(mean (layer + 0.5) / n_layers; {b.shape()} -> {a.shape()})",
                )
            )
        else:
            left_out = f"; induction depth not compared: {a.model} has no induction head"
        detail = (
            f"induction heads {len(b.induction_heads)} -> {len(a.induction_heads)}, best "
            f"{b.best_prefix:.3f} -> {a.best_prefix:.3f}"
        )
        return Comparison(rows, left_out=left_out, detail=detail)


@register
class SwapKappa(AcrossModels):
    """Shares of copying / suppression heads within ``swap_share``; kappa_z distributions within
    ``swap_kappa_w1`` (1-Wasserstein, null standard deviations)."""

    name = "swap_kappa"
    guards = "the kappa distribution across models"
    tolerances = ("swap_share", "swap_kappa_w1")

    def compare(self, before, after, tol):
        from .profile import kappa_w1

        b, a = _profiles(before, after, tol)
        share = f"(of {b.n_heads} -> {a.n_heads} heads, flagged by kappa against the rotation null)"
        rows = [
            within("model", "copying share", b.copying_share, a.copying_share, tol.swap_share, share),
            within("model", "suppression share", b.suppression_share, a.suppression_share, tol.swap_share, share),
        ]
        distance = kappa_w1(b, a)
        if not math.isnan(distance):
            rows.append(
                at_most(
                    "all heads",
                    "kappa_z W1",
                    0.0,
                    distance,
                    tol.swap_kappa_w1,
                    f"(1-Wasserstein distance of the kappa_z distributions, null sds; "
                    f"medians {np.median(b.kappa_z):+.2f} -> {np.median(a.kappa_z):+.2f})",
                )
            )
        left_out = "" if not math.isnan(distance) else "; kappa_z distance not compared: a record holds no kappa_z"
        return Comparison(rows, left_out=left_out, detail=f"copying {a.copying_share:.0%}, W1 {distance:.2f} null sds")


@register
class SwapKnockout(AcrossModels):
    """The largest knockout delta may fall by ``swap_knockout`` x its size; the top-3 share of the
    knockout effect may move by ``swap_concentration`` (only when both records measured every head)."""

    name = "swap_knockout"
    guards = "the key knockout heads across models"
    needs = frozenset({"knockout"})
    tolerances = ("swap_knockout", "swap_concentration", "min_delta")

    def compare(self, before, after, tol):
        from .profile import TOP

        settings = [
            (k, (before.get("knockout") or {}).get(k), (after.get("knockout") or {}).get(k))
            for k in ("mode", "seed", "n", "L")
        ]
        other = [f"{k} {x} vs {y}" for k, x, y in settings if x is not None and y is not None and x != y]
        if other:  # another ablation or other sequences measure other figures, not a change
            return Comparison(
                nothing=f"the {{against}} was knocked out with other settings ({', '.join(other)}); "
                f"gate with its settings ({flag('knockout-mode')}, the probe's seed, n and L)"
            )
        b, a = _profiles(before, after, tol)
        if not b.largest_knockout >= tol.min_delta:
            return Comparison(
                nothing_is_skip=True,
                nothing=f"{{baseline_model}} (the {{against}}) has no head with knockout delta >= "
                f"{tol.min_delta:g} nats; nothing to check",
            )
        rows = [
            at_least(
                "model",
                "largest knockout_delta",
                b.largest_knockout,
                a.largest_knockout,
                tol.swap_knockout * b.largest_knockout,
                f"(nats; {b.largest_knockout_head}, {b.knockout_coverage()} -> "
                f"{a.largest_knockout_head}, {a.knockout_coverage()})",
            )
        ]
        left_out = ""
        if b.knockout_complete and a.knockout_complete:
            rows.append(
                within(
                    "model",
                    f"top-{TOP} share",
                    b.top_share,
                    a.top_share,
                    tol.swap_concentration,
                    f"(of the positive knockout effect; {b.n_heads} -> {a.n_heads} heads)",
                )
            )
        else:
            short = [p for p in (b, a) if not p.knockout_complete]
            left_out = f"; top-{TOP} share not compared: " + ", ".join(
                f"{p.model} has {p.knockout_coverage()}, so its total effect is unknown" for p in short
            )
        return Comparison(rows, left_out=left_out, detail=f"largest {a.largest_knockout:+.3f} nats")
