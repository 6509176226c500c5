"""The further looks of the sequential rule (`gate.sequential`): fresh probe sequences per look,
stored in a baseline and measured for a build only when its verdict needs them.

A record's ``looks`` is a list of the looks after the first (look 1 is the record's own
figures), each ``{"look": k, "probe_seed", "knockout_seed", "copy_loss_sequences",
"copy_gain_sequences", ..., "knockout_delta_sequences": {head: [...]}}`` with ``n`` values per
figure. Here: the seeds of each look, the values a record holds and their pooled mean (the size
`knockout_deltas` takes half of); when looks are measured (a baseline's once, a build's as its rows
ask): `run.flow`.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .figures import sequences_key
from .schema import Record

SEQUENTIAL = ("copy_loss", "knockout_deltas")  # the invariants that read further looks
KNOCKOUT_KEY = sequences_key("knockout_delta")


def look_values(record: Record, metric: str, head: str | None = None) -> list[list[float]]:
    """The per-sequence values of ``metric`` (of ``head``) in each further look of ``record``, in
    look order, stopping at the first look that lacks them."""
    out = []
    for entry in sorted(record.looks or [], key=lambda e: e.look):
        values: Any = entry.values(sequences_key(metric))
        if head is not None:
            values = (values or {}).get(head)
        if values is None:
            break
        out.append(list(values))
    return out


def pooled(row: Any, metric: str, further: list[list[float]]) -> tuple[float, int | None]:
    """``(mean, n)``: ``metric``'s mean over every sequence ``row`` (a record or head row) holds, its
    own look's per-sequence values and each further look's (``further``, `look_values`), with their
    count; ``(figure, None)`` when the row holds no per-sequence values (the figure alone)."""
    first = getattr(row, sequences_key(metric), None)
    if not first:
        value = getattr(row, metric, None)
        return (float("nan") if value is None else float(value)), None
    values = np.concatenate([np.asarray(v, dtype=float) for v in (first, *further)])
    return float(values.mean()), int(values.size)
