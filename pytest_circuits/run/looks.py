"""The further looks of the sequential rule, measured (`record.looks` reads them, `record.seeds` seeds them).

A baseline is recorded with every look once (`with_looks`): the baseline's build need not be loaded
when a build is gated against it; a build measures look ``k`` on the baseline's seeds of look ``k``
only when a verdict asks for it (`measure_looks`), so both sides pair on the same sequences, and
knocks out only the heads still undecided. A merge
of shard parts measures none (its `RecordSource.look` gives None): its undecided rows keep the fixed
rule, said."""

from __future__ import annotations

from ..gate import invariants
from ..gate.check import Verdicts
from ..gate.tolerances import Tolerances
from ..record.looks import KNOCKOUT_KEY
from ..record.schema import Record
from ..record.seeds import look_seed
from .record_source import RecordSource


def measure_looks(
    records: RecordSource, build_name: str, baseline: Record, candidate: Record, verdicts: Verdicts
) -> Record | None:
    """The candidate with its looks after those it holds, up to ``verdicts.wants``, each measured on
    the baseline's seeds of that look, with the knockouts of the heads whose row is still undecided
    (`Verdicts.undecided`; a decided row reads no later look: `gate.sequential.decide` stops at its
    decision, so its verdict is the same as with every look). Each look is measured once a run
    (`RecordSource.look`). None when none can be (a merge of shard parts, or a look the baseline
    does not hold)."""
    stored = {entry.look: entry for entry in baseline.looks or []}
    have = 1 + len(candidate.looks or [])
    wanted = verdicts.wants
    if wanted <= have or any(k not in stored for k in range(have + 1, wanted + 1)):
        return None
    mode = baseline.knockout.mode if baseline.knockout else None
    undecided = verdicts.undecided_subjects("knockout_delta") if candidate.knockout else set()
    entries = []
    for k in range(have + 1, wanted + 1):
        entry = stored[k]
        heads = sorted(set(entry.values(KNOCKOUT_KEY) or {}) & undecided)
        look = records.look(build_name, k, entry.probe_seed, entry.knockout_seed, heads, mode)
        if look is None:
            return None
        if candidate.knockout and not heads:  # every knockout decided: the look says it knocked out none
            look = {**look, KNOCKOUT_KEY: {}}
        entries.append(look)
    return candidate.with_looks(entries)


def with_looks(records: RecordSource, build_name: str, record: Record, tol: Tolerances) -> Record:
    """``record`` (a record of ``build_name`` measured now) with its looks 2 .. ``tol.looks`` (a
    baseline's: measured once, with the knockouts of its key heads when it has knockouts)."""
    typed = record
    knocked = typed.knockout
    heads = invariants.key_heads(typed, "knockout_delta", int(tol.top_k), float(tol.min_delta)) if knocked else []
    mode = knocked.mode if knocked else None
    probe_seed, knockout_seed = typed.probe.seed, knocked.seed if knocked else 0
    entries = [
        records.look(build_name, k, look_seed(probe_seed, k), look_seed(knockout_seed, k), heads, mode)
        for k in range(2, int(tol.looks) + 1)
    ]
    if any(entry is None for entry in entries):  # a source that measures nothing (merged shard parts)
        return record
    return record.with_looks([entry for entry in entries if entry is not None])
