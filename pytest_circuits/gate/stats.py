"""Statistics shared by the gate and the users' assertions."""

from __future__ import annotations

import numpy as np


def spearman(x, y) -> float:
    """Spearman rank correlation (average ranks for ties); nan when either side is constant."""
    from scipy.stats import spearmanr

    x, y = np.asarray(x, dtype=float), np.asarray(y, dtype=float)
    if len(x) < 2 or np.ptp(x) == 0 or np.ptp(y) == 0:
        return float("nan")
    return float(spearmanr(x, y).statistic)
