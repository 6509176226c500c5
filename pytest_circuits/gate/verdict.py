"""Gate one build against its baselines: the reference build's (the precision-swap gate) and
its own (drift), or, for the cross-model invariants, the baseline of the model it replaces (a
base-model swap). `gate_against` is the one flow against one baseline: the plugin (`gate_build`)
and ``circuits gate`` (`gate_file`) both run it. Every function takes typed inputs: the run's
`RecordSource` (the records), the `RunBaselines`, the tolerances; none reads a session."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from ..errors import BaselineError, BaselineMissing, ForeignBaseline, renamed_keywords
from ..options import flag
from ..rungs import kappa_method
from . import invariants
from .baselines import RunBaselines
from .record import has_figures
from .record_source import RecordSource
from .schema import Record, RecordLike
from .store import compatibility, engine_of, geometry_difference, read_record
from .tolerances import Tolerances


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
            and not any(r.status == "failed" for r in self.results)
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
        shown = [r.message for r in self.results if r.status == "failed"]
        if self.skipped or not (shown or self.problems):
            shown = list(dict.fromkeys(r.message for r in self.results))
        absent = [self.absent] if self.absent and not self.results else []
        return "\n".join(shown + list(self.problems) + absent + list(self.notes))  # what broke first, notes after


OWN = "own baseline"  # the label of a build's comparison with its own baseline (drift)


def comparisons(build_name: str, reference: str) -> list[tuple[str, str]]:
    """``(baseline recipe, label)`` pairs a build is gated against: the reference, then its own."""
    if build_name == reference:  # its own baseline is the reference: missing it fails the gate
        return [(reference, f"{reference} baseline")]
    return [(reference, f"{reference} baseline"), (build_name, OWN)]


@renamed_keywords(recipe="build_name")
def candidate_record(records: RecordSource, build_name: str, baseline: RecordLike, knockout: bool) -> dict[str, Any]:
    """The record of build ``build_name`` measured the way ``baseline`` was: kappa on the same
    unembedding, against the same rotation null (`kappa_method.of_record`; a baseline that does
    not say is an older one: uncentred, 256 float64 draws, normal p). The gate's one rule for
    comparing like with like, used by the plugin and ``circuits gate``."""
    return records.record(build_name, knockout=knockout, method=kappa_method.of_record(baseline))


@renamed_keywords(recipe="build_name")
def gate_build(
    records: RecordSource,
    baselines: RunBaselines,
    build_name: str,
    invariant: str,
    tol: Tolerances,
    fixes: dict[str, str],
) -> GateOutcome:
    """Gate one invariant of ``build_name`` against the reference baseline and its own (drift).

    A missing reference baseline is a problem (the gate fails); a missing own baseline only skips
    the drift comparison. ``fixes`` maps ``"reference"``/``"own"`` to the line that ends a failure
    message.
    """
    inv = invariants.get(invariant)
    if inv.across_models:
        return gate_swap(records, baselines, build_name, inv, tol, fixes)
    outcome = GateOutcome()
    for base_recipe, label in comparisons(build_name, baselines.settings.reference):
        own = label == OWN
        try:
            baseline = baselines.load(base_recipe)
        except BaselineMissing as error:
            if not own:
                outcome.problems.append(str(error))
            continue
        except BaselineError as error:
            outcome.problems.append(str(error))
            continue
        fix = fixes.get("own" if own else "reference")
        try:
            _, notes, results = gate_against(records, build_name, baseline, label, tol, fix, invariant=inv)
        except BaselineError as error:  # another geometry or probe
            outcome.problems.append(str(error))
            continue
        outcome.notes.extend(n for n in notes if n not in outcome.notes)
        outcome.results += results
    return outcome


@renamed_keywords(recipe="build_name")
def gate_against(
    records: RecordSource,
    build_name: str,
    baseline: RecordLike,
    label: str,
    tol: Tolerances,
    fix: str | None,
    *,
    invariant: invariants.Invariant | str | None = None,
    across: bool = False,
    knockout: bool | None = None,
) -> tuple[dict[str, Any], list[str], list[invariants.InvariantResult]]:
    """The gate's one flow against one baseline: ``(candidate, notes, results)``. Other probe settings
    are refused before any figure is measured (`store.compatibility` on the run's stand-in, a
    `BaselineError`); the candidate is then measured the baseline's way (`candidate_record`) and
    checked against it, and ``invariant`` is evaluated (default: every one the candidate has
    figures for, `invariants.gate_all`), each failure ending with ``fix``."""
    compatibility(baseline, records.stand_in(), label, across=True)  # the probe only: nothing measured yet
    inv = None if invariant is None else invariants.get(invariant) if isinstance(invariant, str) else invariant
    if knockout is None:  # measure knockouts when the invariant needs them, or the baseline has them
        knockout = "knockout" in inv.needs if inv is not None else has_figures(baseline, "knockout")
    candidate = candidate_record(records, build_name, baseline, knockout=knockout)
    notes = compatibility(baseline, candidate, label, across=across)
    if label == OWN and engine_of(baseline) != engine_of(candidate):  # drift is measured on one engine
        raise ForeignBaseline(
            f"{build_name}'s own baseline was recorded on {engine_of(baseline)}, this run measures it on "
            f"{engine_of(candidate)}; record it again with {flag('engine')} {engine_of(candidate)}, or gate "
            f"it on {engine_of(baseline)}"
        )
    if not across:  # the further looks an undecided sampled row needs (gate/further_looks.py)
        from .further_looks import extend

        candidate = extend(records, build_name, baseline, candidate, tol)
    if inv is None:
        return candidate, notes, invariants.gate_all(baseline, candidate, tol, build_name, label, fix, across=across)
    evaluated = invariants.evaluate(
        inv, baseline, candidate, tol, build_name, label, fix, across=True if across else None
    )
    return candidate, notes, [evaluated]


@renamed_keywords(recipe="build_name")
def gate_file(
    records: RecordSource,
    build_name: str,
    baseline: RecordLike,
    label: str,
    tol: Tolerances,
    fix: str,
    across: bool,
    knockout: bool = True,
) -> tuple[dict[str, Any], list[str], list[invariants.InvariantResult]]:
    """``circuits gate``: `gate_against` one baseline file with every invariant. ``knockout=False``
    (``--no-knockout``): no knockouts measured, so the invariants that need them are not run (the
    verdict says which are not guarded). (A screened scan knocks the file's key heads out exactly
    because the CLI gave them to the run's rung-2 plan, `RunBaselines.key_heads_of`.)"""
    return gate_against(
        records, build_name, baseline, label, tol, fix, across=across, knockout=None if knockout else False
    )


def swap_baseline(records: RecordSource, baselines: RunBaselines) -> tuple[Record | None, str, str]:
    """``(baseline, label, why_none)``: the baseline of the model this one replaces, the
    `--circuits-swap-baseline` file, else the reference baseline when it is of another geometry
    (the model was swapped under the same name); ``None`` and the reason when there is none.
    Unreadable files raise their `BaselineError`."""
    s = baselines.settings
    if s.swap_baseline is not None:
        try:
            baseline = read_record(s.swap_baseline)
        except BaselineMissing:
            raise BaselineMissing(
                f"{flag('swap-baseline')} {s.swap_baseline}: no such file; pass the baseline file of the model "
                "this one replaces (e.g. baselines/<old model>--fp32.json)"
            ) from None
        return baseline, f"baseline {s.swap_baseline.name}", ""
    hint = f"pass {flag('swap-baseline')} FILE, the baseline of the model this one replaces"
    try:
        reference = baselines.load(s.reference)
    except BaselineMissing:
        return None, "", f"no base-model swap to gate: no {s.reference} baseline, and no {flag('swap-baseline')}"
    if geometry_difference(reference, records.stand_in()):
        return reference, f"{s.reference} baseline", ""
    return None, "", f"no base-model swap to gate: the {s.reference} baseline is of this model's geometry; {hint}"


def gate_swap(
    records: RecordSource,
    baselines: RunBaselines,
    build_name: str,
    inv: invariants.Invariant | str,
    tol: Tolerances,
    fixes: dict[str, str],
) -> GateOutcome:
    """Gate a cross-model invariant of ``build_name`` against the baseline of the replaced model
    (`swap_baseline`); skipped, saying why, when there is none."""
    outcome = GateOutcome()
    try:
        baseline, label, why_none = swap_baseline(records, baselines)
    except BaselineError as error:
        outcome.problems.append(str(error))
        return outcome
    if baseline is None:
        outcome.absent = why_none
        return outcome
    try:
        _, notes, results = gate_against(
            records, build_name, baseline, label, tol, fixes.get("swap"), invariant=inv, across=True
        )
    except BaselineError as error:
        outcome.problems.append(str(error))
        return outcome
    outcome.notes.extend(notes)
    outcome.results += results
    return outcome
