"""The gate's one verdict: `check(baseline, candidate, tolerances)` -> `Verdicts`, pure (records in,
verdicts out: nothing measured, no torch). Every front end reaches its verdict here: pytest and
``circuits gate`` through the run's flow (`run.flow`, which measures the candidate and the further
looks a verdict asks for, then checks again), ``circuits diff``, ``circuits report --against`` and
``circuits sensitivity`` on the records they hold. The compatibility checks come first, the same
for all: the probe, the model type and geometry (another model is refused unless a base-model swap
is asked for), the engine of a build's own baseline; then the invariants."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from ..errors import ForeignBaseline
from ..options import flag
from ..record.schema import Record, RecordLike
from ..record.store import compatibility, engine_of, geometry_difference, other_model_type
from . import invariants
from .tolerances import Tolerances

OWN = "own baseline"  # the label of a build's comparison with its own baseline (drift)


@dataclass(frozen=True)
class Verdicts:
    """What `check` found: one result per invariant, the notes on the pairing (other weights, cache,
    engine; two base models), ``wants``: the further look an undecided sampled row asks for
    (0: every row is decided; the run measures that look and checks again), and ``undecided``: the
    ``(metric, subject)`` of those rows (a look measures only the knockouts still undecided)."""

    results: list[invariants.InvariantResult]
    notes: list[str]
    wants: int = 0
    undecided: frozenset[tuple[str, str]] = frozenset()

    def undecided_subjects(self, metric: str) -> set[str]:
        """The subjects (heads) whose ``metric`` row asks for a further look."""
        return {subject for m, subject in self.undecided if m == metric}


def check(
    baseline: RecordLike,
    candidate: RecordLike,
    tolerances: Tolerances,
    *,
    build_name: str,
    label: str,
    invariants_checked: Sequence[invariants.Invariant | str] | None = None,
    fix: str | None = None,
    across: bool | None = None,
    own: bool = False,
) -> Verdicts:
    """The verdicts of ``candidate`` (build ``build_name``) against ``baseline`` (``label``: "fp32
    baseline", "baseline m--fp32.json"), each failure ending with ``fix``.

    ``across``: True compares two base models (the swap invariants); False gates builds of one model,
    so a baseline of another geometry or model type is refused (`ForeignBaseline`, one line); None
    takes another geometry for two base models (pytest's reference baseline of a model replaced under
    its name) and refuses a same-shape model of another type. ``own``: the build's own baseline (drift), which must be of the
    same engine. ``invariants_checked``: default every registered one the candidate has figures for."""
    baseline, candidate = Record.of(baseline), Record.of(candidate)
    across = swap_asked(baseline, candidate, label, across)
    notes = compatibility(baseline, candidate, label, across=across)
    if own and engine_of(baseline) != engine_of(candidate):  # drift is measured on one engine
        raise ForeignBaseline(
            f"{build_name}'s own baseline was recorded on {engine_of(baseline)}, this run measures it on "
            f"{engine_of(candidate)}; record it again with {flag('engine')} {engine_of(candidate)}, or gate "
            f"it on {engine_of(baseline)}"
        )
    if invariants_checked is None:
        results = invariants.gate_all(baseline, candidate, tolerances, build_name, label, fix, across=across)
    else:
        results = [
            invariants.evaluate(inv, baseline, candidate, tolerances, build_name, label, fix, across=across)
            for inv in invariants_checked
        ]
    wants = 0 if across else max([0, *(r.wants for r in results)])
    undecided = frozenset() if across else frozenset().union(*(r.undecided for r in results))
    return Verdicts(results, notes, wants, undecided)


def swap_asked(baseline: RecordLike, candidate: RecordLike, label: str, across: bool | None) -> bool:
    """Whether ``baseline`` and ``candidate`` are compared as two base models: ``across`` when given,
    where a baseline of another geometry is refused unless it is True (`ForeignBaseline`, one line;
    a same-shape model of another type is `compatibility`'s to refuse); None: another geometry is."""
    other = geometry_difference(baseline, candidate)
    if across is None:
        return bool(other)
    if other and not across:
        raise ForeignBaseline(
            f"{label} is of another model ({_other_model(baseline, candidate)}), not a build of this one; gate "
            "against this model's baseline, or ask for a base-model swap (circuits gate --across-models; "
            f"pytest {flag('swap-baseline', 'pytest')} FILE)"
        )
    return across


def _other_model(baseline: RecordLike, candidate: RecordLike) -> str:
    """``"model type gpt2 vs llama; geometry n_layers 2 vs 4, ..."``: how the two records' models differ."""
    kinds, shape = other_model_type(baseline, candidate), geometry_difference(baseline, candidate)
    return "; ".join(
        part for part in (f"model type {kinds}" if kinds else "", f"geometry {shape}" if shape else "") if part
    )


@dataclass
class GateOutcome:
    """What gating one invariant of one build produced: results, plus problems that fail it."""

    results: list[invariants.InvariantResult] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)  # missing / refused / corrupt baselines
    notes: list[str] = field(default_factory=list)  # e.g. "the weights differ"
    absent: str = ""  # why there was nothing to gate (no base-model swap): a skip, not a result

    @property
    def passed(self) -> bool:
        """Nothing broke and at least one comparison compared something (others may be skipped)."""
        return (
            not self.problems
            and any(r.passed for r in self.results)
            and not any(r.status in invariants.NOT_PASSED for r in self.results)
        )

    @property
    def skipped(self) -> bool:
        """Nothing broke and every comparison was skipped (the baseline model lacks the mechanism)."""
        if self.problems:
            return False
        return all(r.skipped for r in self.results) if self.results else bool(self.absent)

    @classmethod
    def merged(cls, outcomes: Iterable[GateOutcome]) -> GateOutcome:
        """One outcome of several invariants' (results in order; notes and problems once each)."""
        out = cls()
        for o in outcomes:
            out.results += o.results
            out.problems += [p for p in o.problems if p not in out.problems]
            out.notes += [n for n in o.notes if n not in out.notes]
            out.absent = out.absent or o.absent
        return out

    def message(self) -> str:
        shown = [r.message for r in self.results if r.status in invariants.NOT_PASSED]
        if self.skipped or not (shown or self.problems):
            shown = list(dict.fromkeys(r.message for r in self.results))
        absent = [self.absent] if self.absent and not self.results else []
        return "\n".join(shown + list(self.problems) + absent + list(self.notes))  # what broke first, notes after


def comparisons(build_name: str, reference: str) -> list[tuple[str, str]]:
    """``(baseline build, label)`` pairs a build is gated against: the reference, then its own."""
    if build_name == reference:  # its own baseline is the reference: missing it fails the gate
        return [(reference, f"{reference} baseline")]
    return [(reference, f"{reference} baseline"), (build_name, OWN)]
