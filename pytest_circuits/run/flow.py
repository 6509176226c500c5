"""The run's side of a verdict: measure the candidate the baseline's way, ask the pure gate
(`gate.check.check`), and while a sampled row asks for a further look of the sequential rule,
measure that look on the baseline's seeds and ask again (`settle`). pytest (`gate_build`),
``circuits gate`` (`gate_file`) and ``circuits sensitivity`` (`settle` on its own measurement) run it.

The looks themselves are measured by `looks` (a baseline's once, every one; a build's as a verdict asks)."""

from __future__ import annotations

from typing import Any

from ..errors import BaselineError, BaselineMissing
from ..gate import invariants
from ..gate.check import OWN, GateOutcome, Verdicts, check, comparisons, swap_asked
from ..gate.tolerances import Tolerances
from ..options import flag
from ..record import kappa_method
from ..record.read import has_figures
from ..record.schema import Record, RecordLike
from ..record.store import compatibility, geometry_difference, read_record
from .baselines import RunBaselines
from .looks import measure_looks
from .record_source import RecordSource


def candidate_record(
    records: RecordSource,
    build_name: str,
    baseline: RecordLike,
    knockout: bool,
    invariant: invariants.Invariant | None = None,
    across: bool | None = None,
) -> Record:
    """The record of build ``build_name`` measured the way ``baseline`` was: kappa on the same
    unembedding, against the same rotation null (`kappa_method.of_record`; a baseline that does
    not say is an older one: uncentred, 256 float64 draws, normal p). The gate's one rule for
    comparing like with like. Its knockouts are of the run's key heads only when what is checked
    (``invariant``, or every per-build one) reads no other (`reads_key_heads_only`)."""
    method = kappa_method.of_record(baseline)
    key_heads = knockout and not across and reads_key_heads_only(invariant)
    return records.record(build_name, knockout=knockout, method=method, key_heads=key_heads)


def reads_key_heads_only(invariant: invariants.Invariant | None) -> bool:
    """Whether ``invariant`` (None: every registered per-build invariant) reads no knockout but those
    of the baselines' key heads (`Invariant.knockout_heads`): then a gate knocks out only those."""
    names = invariants.per_build_invariants(opt_in=True)
    checked = [invariant] if invariant is not None else [invariants.get(name) for name in names]
    return all(inv.knockout_heads == "key heads" for inv in checked if "knockout" in inv.needs)


def settle(
    records: RecordSource,
    build_name: str,
    baseline: RecordLike,
    candidate: Record,
    tol: Tolerances,
    **how: Any,
) -> tuple[Record, Verdicts]:
    """``(candidate with its further looks, verdicts)``: `check` ``candidate`` against ``baseline``
    (``how``: its keywords), measuring the further looks a verdict asks for (`Verdicts.wants`) on the
    baseline's seeds, in look order, until every row is decided or no look can be measured (each
    look is measured once a run: the run's other invariants ask for it again at no cost)."""
    typed_baseline = Record.of(baseline)
    while True:
        verdicts = check(typed_baseline, candidate, tol, build_name=build_name, **how)
        extended = measure_looks(records, build_name, typed_baseline, candidate, verdicts)
        if extended is None:  # every row decided, or no look to measure
            return candidate, verdicts
        candidate = extended


def gate_against(
    records: RecordSource,
    build_name: str,
    baseline: RecordLike,
    label: str,
    tol: Tolerances,
    fix: str | None,
    *,
    invariant: invariants.Invariant | str | None = None,
    across: bool | None = None,
    knockout: bool | None = None,
) -> tuple[Record, Verdicts]:
    """The run's one flow against one baseline: ``(candidate, verdicts)``. Other probe settings are
    refused before any figure is measured (`store.compatibility` on the run's stand-in, a
    `BaselineError`); the candidate is then measured the baseline's way (`candidate_record`) and
    settled against it (`settle`): ``invariant``, or every one the candidate has figures for."""
    stand_in = records.stand_in()  # before anything is measured: another probe, or an unasked swap, is refused
    compatibility(baseline, stand_in, label, across=True)
    swap_asked(baseline, stand_in, label, across)
    inv = None if invariant is None else invariants.get(invariant) if isinstance(invariant, str) else invariant
    if knockout is None:  # measure knockouts when the invariant needs them, or the baseline has them
        knockout = "knockout" in inv.needs if inv is not None else has_figures(Record.of(baseline), "knockout")
    candidate = candidate_record(records, build_name, baseline, knockout, inv, across)
    return settle(
        records,
        build_name,
        baseline,
        candidate,
        tol,
        label=label,
        invariants_checked=None if inv is None else [inv],
        fix=fix,
        across=across,
        own=label == OWN,
    )


def gate_build(
    records: RecordSource,
    baselines: RunBaselines,
    build_name: str,
    invariant: str,
    tol: Tolerances,
    fixes: dict[str, str],
) -> GateOutcome:
    """pytest: one invariant of ``build_name`` against the reference baseline and its own (drift).

    A missing reference baseline is a problem (the gate fails); a missing own baseline only skips
    the drift comparison. ``fixes`` maps ``"reference"``/``"own"`` to the line that ends a failure
    message. A reference baseline of another geometry is the model replaced under its name: the
    per-build invariants skip it, saying so, and the swap invariants compare it (`gate_swap`).
    """
    inv = invariants.get(invariant)
    if inv.across_models:
        return gate_swap(records, baselines, build_name, inv, tol, fixes)
    outcome = GateOutcome()
    if "audit" in inv.needs and baselines.settings.audit is None:  # rung 3 is measured only when asked for
        outcome.absent = f"not checked: no audit slice was given ({flag('audit')} FILE, docs/audit.md)"
        return outcome
    for base_build, label in comparisons(build_name, baselines.settings.reference):
        own = label == OWN
        try:
            baseline = baselines.load(base_build)
        except BaselineMissing as error:
            if not own:
                outcome.problems.append(str(error))
            continue
        except BaselineError as error:
            outcome.problems.append(str(error))
            continue
        if own and inv.opt_in and not all(has_figures(Record.of(baseline), need) for need in inv.needs):
            note = (
                f"{build_name}'s own baseline holds no {', '.join(sorted(inv.needs))} figures: its drift is not "
                f"checked (record it with {flag('audit')} FILE)"
            )
            outcome.notes += [note] if note not in outcome.notes else []
            continue  # like a missing own baseline: the reference still gates it
        fix = fixes.get("own" if own else "reference")
        try:
            _, verdicts = gate_against(records, build_name, baseline, label, tol, fix, invariant=inv)
        except BaselineError as error:  # another probe or engine
            outcome.problems.append(str(error))
            continue
        outcome.notes.extend(n for n in verdicts.notes if n not in outcome.notes)
        outcome.results += verdicts.results
    return outcome


def gate_file(
    records: RecordSource,
    build_name: str,
    baseline: RecordLike,
    label: str,
    tol: Tolerances,
    fix: str,
    across: bool,
    knockout: bool = True,
) -> tuple[Record, Verdicts]:
    """``circuits gate``: `gate_against` one baseline file with every invariant; a baseline of another
    model is refused unless ``across`` (``--across-models``) asks for the swap. ``knockout=False``
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
        _, verdicts = gate_against(
            records, build_name, baseline, label, tol, fixes.get("swap"), invariant=inv, across=True
        )
    except BaselineError as error:
        outcome.problems.append(str(error))
        return outcome
    outcome.notes.extend(verdicts.notes)
    outcome.results += verdicts.results
    return outcome
