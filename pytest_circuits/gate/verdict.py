"""Gate one build against its baselines: the reference build's (the precision-swap gate) and
its own (drift). Used by the pytest plugin; the CLI gates one file with `invariants.gate_all`."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..errors import BaselineError, BaselineMissing
from ..rungs import kappa_method
from . import invariants
from .store import compatibility
from .tolerances import Tolerances


@dataclass
class GateOutcome:
    """What gating one invariant of one build produced: results, plus problems that fail it."""

    results: list[invariants.InvariantResult] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)  # missing / refused / corrupt baselines
    notes: list[str] = field(default_factory=list)  # e.g. "the weights differ"

    @property
    def passed(self) -> bool:
        """Nothing broke and at least one comparison compared something (others may be skipped)."""
        return (
            not self.problems
            and any(r.passed for r in self.results)
            and not any(r.status == "failed" for r in self.results)
        )

    @property
    def skipped(self) -> bool:
        """Nothing broke and every comparison was skipped (the baseline model lacks the mechanism)."""
        return not self.problems and bool(self.results) and all(r.skipped for r in self.results)

    def message(self) -> str:
        shown = [r.message for r in self.results if r.status == "failed"]
        if self.skipped or not (shown or self.problems):
            shown = [r.message for r in self.results]
        return "\n".join(list(self.notes) + list(self.problems) + shown)


def comparisons(recipe: str, reference: str) -> list[tuple[str, str]]:
    """``(baseline recipe, label)`` pairs a build is gated against: the reference, then its own."""
    if recipe == reference:  # its own baseline is the reference: missing it fails the gate
        return [(reference, f"{reference} baseline")]
    return [(reference, f"{reference} baseline"), (recipe, "own baseline")]


def candidate_record(session, recipe: str, baseline: dict, knockout: bool) -> dict:
    """The record of build ``recipe`` measured the way ``baseline`` was: kappa on the same
    unembedding, against the same rotation null (`kappa_method.of_record`; a baseline that does
    not say is an older one: uncentred, 256 float64 draws, normal p). The gate's one rule for
    comparing like with like, used by the plugin and ``circuits gate``."""
    return session.record(recipe, knockout=knockout, method=kappa_method.of_record(baseline))


def gate_build(session, recipe: str, invariant: str, tol: Tolerances, fixes: dict[str, str]) -> GateOutcome:
    """Gate one invariant of ``recipe`` against the reference baseline and its own (drift).

    ``session`` provides ``record(recipe, knockout, method)``, ``load_baseline(recipe)`` and
    ``settings.reference``. A missing reference baseline is a problem (the gate fails); a
    missing own baseline only skips the drift comparison. ``fixes`` maps
    ``"reference"``/``"own"`` to the line that ends a failure message.
    """
    inv = invariants.get(invariant)
    outcome = GateOutcome()
    for base_recipe, label in comparisons(recipe, session.settings.reference):
        own = label == "own baseline"
        try:
            baseline = session.load_baseline(base_recipe)
        except BaselineMissing as error:
            if not own:
                outcome.problems.append(str(error))
            continue
        except BaselineError as error:
            outcome.problems.append(str(error))
            continue
        candidate = candidate_record(session, recipe, baseline, knockout="knockout" in inv.needs)
        try:
            outcome.notes.extend(n for n in compatibility(baseline, candidate, label) if n not in outcome.notes)
        except BaselineError as error:  # another geometry or probe
            outcome.problems.append(str(error))
            continue
        fix = fixes.get("own" if own else "reference")
        outcome.results.append(invariants.evaluate(inv, baseline, candidate, tol, recipe, label, fix))
    return outcome
