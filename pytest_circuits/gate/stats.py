"""Statistics shared by the gate and the users' assertions."""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

LEVEL = 0.95  # confidence level of every interval the gate reports


def spearman(x: Sequence[float], y: Sequence[float]) -> float:
    """Spearman rank correlation (average ranks for ties); nan when either side is constant."""
    from scipy.stats import spearmanr

    a, b = np.asarray(x, dtype=float), np.asarray(y, dtype=float)
    if len(a) < 2 or np.ptp(a) == 0 or np.ptp(b) == 0:
        return float("nan")
    return float(spearmanr(a, b).statistic)


def mean_interval(values: Sequence[float], level: float = LEVEL) -> tuple[float, float] | None:
    """Student t interval of the mean of ``values`` (one per probe sequence):
    ``mean +- t_{(1+level)/2, n-1} * s / sqrt(n)``, ``s`` the sample sd (ddof 1).

    None with fewer than two values or any non-finite one (no interval can be given).
    """
    from scipy.stats import t

    x = np.asarray(values, dtype=float)
    if x.ndim != 1 or x.size < 2 or not np.isfinite(x).all():
        return None
    half = float(t.ppf((1 + level) / 2, x.size - 1)) * float(x.std(ddof=1)) / math.sqrt(x.size)
    centre = float(x.mean())
    return centre - half, centre + half


def paired_interval(
    before: Sequence[float], after: Sequence[float], level: float = LEVEL
) -> tuple[float, float] | None:
    """Interval of the change ``mean(after) - mean(before)`` of two builds on the same sequences:
    `mean_interval` of the paired differences ``d_i = after_i - before_i``. None when the two
    do not pair (other lengths) or `mean_interval` gives none."""
    b, a = np.asarray(before, dtype=float), np.asarray(after, dtype=float)
    if b.shape != a.shape:
        return None
    return mean_interval(a - b, level)


SPREAD_LEVEL = 0.999  # a baseline's spread beyond this quantile of F(n-1, n-1) carries no evidence


def implausible_spread(before: Sequence[float], after: Sequence[float], level: float = SPREAD_LEVEL) -> float | None:
    """``s(before) / s(after)`` when it is implausible for two builds measured on the same ``n``
    sequences, else None: the per-sequence values are close to normal (each a mean of ``L - 1``
    token losses), so with equal spreads ``s_b^2 / s_a^2`` follows ``F(n-1, n-1)``; a ratio past its
    ``level`` quantile (n = 8: an sd ratio above 3.9) says the baseline's values are not noise on
    these tokens. None when the two do not pair or either has fewer than two finite values."""
    from scipy.stats import f

    b, a = np.asarray(before, dtype=float), np.asarray(after, dtype=float)
    if b.shape != a.shape or b.ndim != 1 or b.size < 2 or not (np.isfinite(a).all() and np.isfinite(b).all()):
        return None
    sb, sa = float(b.std(ddof=1)), float(a.std(ddof=1))
    bound = math.sqrt(float(f.ppf(level, b.size - 1, b.size - 1)))
    if sb <= bound * sa:
        return None
    return sb / sa if sa > 0 else math.inf


def excludes_zero(interval: tuple[float, float] | None) -> bool:
    """True when ``interval`` lies wholly on one side of 0 (the change is outside sampling noise)."""
    return interval is not None and (interval[0] > 0 or interval[1] < 0)
