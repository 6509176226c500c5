"""The further looks of the sequential rule, measured (`gate.looks` holds their seeds and values).

A baseline is recorded with every look once (`with_looks`: the baseline's build need not be loaded
when a build is gated against it); a build measures look ``k`` on the baseline's seeds of look
``k`` only when a row asks for it (`extend`), so both sides pair on the same sequences. Each look is
measured by the run's `RecordSource` (a merge of shard parts measures none).
"""

from __future__ import annotations

from typing import Any

from .looks import KNOCKOUT_KEY, SEQUENTIAL, look_seed
from .record_source import RecordSource
from .schema import Record, RecordLike
from .tolerances import Tolerances


def with_looks(records: RecordSource, build_name: str, record: dict[str, Any], tol: Tolerances) -> dict[str, Any]:
    """``record`` (a record of ``build_name`` measured now, the dict written) with its looks 2 ..
    ``tol.looks`` (a baseline's: measured once, with the knockouts of its key heads when it has
    knockouts)."""
    from .invariants import key_heads

    looks = int(tol.looks)
    typed = Record.of(record)
    knocked = typed.knockout
    heads = key_heads(typed, "knockout_delta", int(tol.top_k), float(tol.min_delta)) if knocked else []
    mode = knocked.mode if knocked else None
    probe_seed, knockout_seed = typed.probe.seed, knocked.seed if knocked else 0
    entries = [
        records.look(build_name, k, look_seed(probe_seed, k), look_seed(knockout_seed, k), heads, mode)
        for k in range(2, looks + 1)
    ]
    if any(entry is None for entry in entries):  # a source that measures nothing (merged shard parts)
        return record
    return {**record, "looks": entries}


def wanted(baseline: RecordLike, candidate: RecordLike, tol: Tolerances) -> int:
    """The largest look a row of the sequential invariants asks for (0: every row is decided)."""
    from .invariants import get
    from .record import has_figures

    baseline, candidate = Record.of(baseline), Record.of(candidate)
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


def extend(
    records: RecordSource, build_name: str, baseline: RecordLike, candidate: dict[str, Any], tol: Tolerances
) -> dict[str, Any]:
    """``candidate`` with the further looks its undecided rows ask for, measured on the baseline's
    seeds of those looks, in look order, until every row is decided (the candidate's own dict is
    extended in place: the run's record of the build keeps them). A merge of shard parts
    (``--circuits-shard-parts``) loads no build (its `RecordSource.look` measures nothing): its
    undecided rows keep the fixed rule, said. Both are the record dicts (what is written); the
    rows that ask are read from their typed `Record`s, validated again as looks are added."""
    typed_baseline = Record.of(baseline)
    # a look without its seeds (a hand-built record) cannot be measured for the build: fixed rule
    stored = {e.look: e for e in typed_baseline.looks or [] if e.probe_seed is not None and e.knockout_seed is not None}
    mode = typed_baseline.knockout.mode if typed_baseline.knockout else None
    while True:
        typed = Record.of(candidate)
        k = wanted(typed_baseline, typed, tol)
        have = 1 + len(typed.looks or [])
        if k <= have or any(j not in stored for j in range(have + 1, k + 1)):
            return candidate
        for j in range(have + 1, k + 1):
            entry = stored[j]
            heads = sorted(entry.values(KNOCKOUT_KEY) or {}) if typed.knockout else []
            look = records.look(build_name, j, int(entry.probe_seed or 0), int(entry.knockout_seed or 0), heads, mode)
            if look is None:
                return candidate
            candidate.setdefault("looks", []).append(look)
