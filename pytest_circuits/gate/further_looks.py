"""The further looks of the sequential rule, measured (`gate.looks` holds their seeds and values).

A baseline is recorded with every look once (`with_looks`: the baseline's build need not be loaded
when a build is gated against it); a build measures look ``k`` on the baseline's seeds of look
``k`` only when a row asks for it (`extend`), so both sides pair on the same sequences. Each look is
measured by the run's `RecordSource` (a merge of shard parts measures none).
"""

from __future__ import annotations

from .looks import KNOCKOUT_KEY, SEQUENTIAL, look_seed
from .record_source import RecordSource


def with_looks(records: RecordSource, recipe: str, record: dict, tol) -> dict:
    """``record`` (a record of ``recipe`` measured now) with its looks 2 .. ``tol.looks`` (a
    baseline's: measured once, with the knockouts of its key heads when it has knockouts)."""
    from .invariants import key_heads

    looks = tol.looks
    knocked = record.get("knockout")
    heads = key_heads(record, "knockout_delta", tol.top_k, tol.min_delta) if knocked else []
    mode = (knocked or {}).get("mode")
    probe_seed, knockout_seed = int(record["probe"]["seed"]), int((knocked or {}).get("seed", 0))
    entries = [
        records.look(recipe, k, look_seed(probe_seed, k), look_seed(knockout_seed, k), heads, mode)
        for k in range(2, looks + 1)
    ]
    if any(entry is None for entry in entries):  # a source that measures nothing (merged shard parts)
        return record
    return {**record, "looks": entries}


def wanted(baseline: dict, candidate: dict, tol) -> int:
    """The largest look a row of the sequential invariants asks for (0: every row is decided)."""
    from .invariants import get
    from .record import has_figures

    most = 0
    for name in SEQUENTIAL:
        inv = get(name)
        if not all(has_figures(baseline, need) and has_figures(candidate, need) for need in inv.needs):
            continue
        try:
            rows = inv.compare(baseline, candidate, tol).rows
        except Exception:  # the gate's own evaluation reports it
            continue
        most = max([most, *(r.wants for r in rows)])
    return most


def extend(records: RecordSource, recipe: str, baseline: dict, candidate: dict, tol) -> dict:
    """``candidate`` with the further looks its undecided rows ask for, measured on the baseline's
    seeds of those looks, in look order, until every row is decided (the candidate's own dict is
    extended in place: the run's record of the build keeps them). A merge of shard parts
    (``--circuits-shard-parts``) loads no build (its `RecordSource.look` measures nothing): its
    undecided rows keep the fixed rule, said."""
    stored = {e.get("look"): e for e in baseline.get("looks") or []}
    while True:
        k = wanted(baseline, candidate, tol)
        have = 1 + len(candidate.get("looks") or [])
        if k <= have or any(j not in stored for j in range(have + 1, k + 1)):
            return candidate
        for j in range(have + 1, k + 1):
            entry = stored[j]
            heads = sorted(entry.get(KNOCKOUT_KEY) or {}) if candidate.get("knockout") else []
            mode = (baseline.get("knockout") or {}).get("mode")
            look = records.look(recipe, j, entry["probe_seed"], entry["knockout_seed"], heads, mode)
            if look is None:
                return candidate
            candidate.setdefault("looks", []).append(look)
