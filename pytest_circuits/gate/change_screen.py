"""The change screen of ``knockout_deltas``: which key heads a gate knocks out exactly (docs/gate.md,
"The change screen").

A key head ``h`` of the baseline, with knockout delta ``d`` over every sequence the baseline holds,
may change by ``limit = knockout * |d|``. Both records hold plain AtP's estimate of ``h``'s
knockout on look 1's held-out sequences (``knockout_atp``: ``sum dz_h . dCL/dz_h``, one forward and
one backward, `rungs.screen.atp`); the estimated change is ``e = atp' - atp``. With the tolerance
``change_screen = f > 0`` a head is knocked out exactly only when ``|e| >= f * limit``, or when
either side lacks its estimate; the others pass on the estimate, and their rows say so. ``f = 0``
(the default) knocks out every key head exactly.

The measurement (`ChangeScreen.confirm`, before the knockouts) and the verdict (`screened_row`, from
the two records alone) apply this one rule, so a gate's verdict is what its records say.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

from ..record.looks import look_values, pooled
from ..record.schema import Head, Record
from .invariant_api import Row, signed
from .rows import figure, heads_by_label
from .tolerances import Tolerances

FIGURE = "knockout_atp"


def knockout_limit(before: Record, row: Head, tol: Tolerances) -> tuple[float, int | None, float]:
    """``(size, n, limit)``: the baseline head's knockout delta over every sequence it holds (look 1 and
    its further looks, `record.looks.pooled`), their count, and its tolerance ``knockout * |size|``."""
    size, n = pooled(row, "knockout_delta", look_values(before, "knockout_delta", row.head))
    return size, n, float(tol.knockout) * abs(size)


def estimated_change(before: Head, after: Head | None) -> float:
    """``atp' - atp``: the change plain AtP estimates for the head's knockout delta (NaN where either
    side lacks ``knockout_atp``)."""
    return figure(after, FIGURE) - figure(before, FIGURE)


def needs_exact(change: float, limit: float, fraction: float) -> bool:
    """Whether a head is knocked out exactly: the screen is off (``fraction <= 0``), the change is not
    estimated (NaN), or its size reaches ``fraction`` of the tolerance."""
    return fraction <= 0 or not abs(change) < fraction * limit


def screened_row(name: str, before: Head, after: Head | None, limit: float, fraction: float) -> Row | None:
    """The passing row of a key head the build did not knock out because the screen cleared it, or None
    when the screen does not clear it (off, not estimated, or a change too large: not measured is then
    an error, never a pass)."""
    change = estimated_change(before, after)
    if needs_exact(change, limit, fraction):
        return None
    note = (
        f"not knocked out: its estimated change {signed(change)} (plain AtP, {FIGURE}) is under "
        f"{fraction:.0%} of its tolerance {limit:.3g}, so the change screen passed it"
    )
    return Row(name, "knockout_delta", figure(before, "knockout_delta"), math.nan, limit, False, note)


@dataclass(frozen=True)
class ChangeScreen:
    """The rule for one run's gate before its knockouts: per key head, the ``(knockout_atp, limit)`` of
    every baseline it is a key head of, and the fraction ``f``."""

    fraction: float
    baselines: Mapping[str, tuple[tuple[float, float], ...]]

    @classmethod
    def of(
        cls, records: Callable[[], Iterable[Record]], keys_of: Callable[[Record], Iterable[str]], tol: Tolerances
    ) -> ChangeScreen | None:
        """The screen of ``records()`` (each with ``keys_of(record)``, its key heads) under ``tol``; None,
        without reading them, when ``tol.change_screen`` is 0 (every key head exactly)."""
        fraction = float(tol.change_screen)
        if fraction <= 0:
            return None
        baselines: dict[str, list[tuple[float, float]]] = {}
        for record in records():
            rows = heads_by_label(record)
            for name in keys_of(record):
                baselines.setdefault(name, []).append(
                    (figure(rows[name], FIGURE), knockout_limit(record, rows[name], tol)[2])
                )
        return cls(fraction, {name: tuple(pairs) for name, pairs in baselines.items()})

    def confirm(self, estimates: Mapping[str, float]) -> list[str]:
        """The key heads to knock out exactly, given the build's ``knockout_atp`` by label: those that
        `needs_exact` against some baseline; a head of no baseline's keys is kept (it was asked for)."""
        kept = []
        for name, estimate in estimates.items():
            pairs = self.baselines.get(name)
            if pairs is None or any(needs_exact(estimate - atp, limit, self.fraction) for atp, limit in pairs):
                kept.append(name)
        return kept
