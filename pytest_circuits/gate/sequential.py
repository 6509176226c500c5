"""The sequential rule of the sampled invariants: a group-sequential equivalence test (docs/gate.md,
"The sequential rule").

A sampled figure is a mean over probe sequences; two builds measured on the same sequences give
paired differences ``d_i``. Look ``k`` of at most ``K`` adds ``n`` fresh sequences (seeded by the
probe's seed and ``k``; look 1 is the probe's own batch). After look ``k``, with ``N_k = k n``
differences, mean ``m_k`` and standard error ``se_k = s_k / sqrt(N_k)``, the repeated confidence
interval (Jennison & Turnbull 2000, ch. 9) is

    RCI_k = m_k +- c_k^t se_k,   c_k^t = t_{N_k - 1}^{-1}(Phi(c_k))

with ``c_k`` the two-sided level-``alpha`` group-sequential boundary of ``K`` equally spaced looks
(`pocock`: ``c_k = C_P(K)``; `obrien_fleming`: ``c_k = C_B(K) sqrt(K / k)``), so that
``P(mu in RCI_k for every k) >= 1 - alpha``. Against the tolerance ``delta``:

- ``RCI_k`` inside ``[-delta, delta]``: pass (the change is shown within its tolerance);
- ``RCI_k`` wholly outside it: fail (the change is shown beyond it);
- else another look; at look ``K`` a change not shown within its tolerance fails.

A pass needs ``RCI_k`` inside the tolerance, which a change of exactly ``delta`` reaches with
probability at most ``alpha / 2`` over all looks: the chance of passing a build damaged to its
tolerance. Early fails never raise that chance (tests/test_sequential.py simulates it).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import numpy as np

from .stats import LEVEL

DESIGNS = ("pocock", "obrien_fleming")
DESIGN = "pocock"  # constant boundary: the first look is the least widened (a clear build stops there)
GRID = 401  # points of the numerical integration of the boundary crossing (J&T section 19.2)


def _crossing(constants: tuple[float, ...]) -> float:
    """``P(|Z_k| >= c_k`` for some ``k)`` under the null, ``Z_k = S_k / sqrt(k)`` with ``S_k`` a sum
    of ``k`` independent N(0, 1) increments (equally sized looks): the density of ``S_k`` on the
    continuation region ``|s| < c_k sqrt(k)``, carried look to look by convolution with N(0, 1)."""
    from scipy.stats import norm

    crossed, previous = 0.0, 1.0  # previous: the mass still running after the last look
    carried: tuple[np.ndarray, np.ndarray] | None = None  # (grid, density x weights) of the last look
    for k, c in enumerate(constants, start=1):
        bound = c * math.sqrt(k)
        grid = np.linspace(-bound, bound, GRID)
        if carried is None:
            density = norm.pdf(grid)
        else:
            density = (norm.pdf(grid[:, None] - carried[0][None, :]) * carried[1][None, :]).sum(axis=1)
        weights = np.full(GRID, grid[1] - grid[0])  # Simpson's rule (GRID odd): h/3 [1, 4, 2, ..., 4, 1]
        weights[1:-1:2] *= 4 / 3
        weights[2:-1:2] *= 2 / 3
        weights[[0, -1]] *= 1 / 3
        kept = float((density * weights).sum())
        crossed += previous - kept
        previous, carried = kept, (grid, density * weights)
    return crossed


def _shape(design: str, looks: int) -> tuple[float, ...]:
    """The boundary's shape ``c_k / C``: 1 (Pocock), ``sqrt(K / k)`` (O'Brien-Fleming)."""
    if design == "pocock":
        return (1.0,) * looks
    if design == "obrien_fleming":
        return tuple(math.sqrt(looks / k) for k in range(1, looks + 1))
    raise ValueError(f"unknown sequential design {design!r}; known: {', '.join(DESIGNS)}")


@lru_cache(maxsize=64)
def boundaries(looks: int, alpha: float = 1 - LEVEL, design: str = DESIGN) -> tuple[float, ...]:
    """The normal boundaries ``c_1 .. c_K`` of ``looks`` equally spaced looks, two-sided level
    ``alpha``: ``C`` solved so that `_crossing` equals ``alpha`` (K = 1: ``Phi^{-1}(1 - alpha/2)``)."""
    from scipy.optimize import brentq

    if looks < 1:
        raise ValueError(f"looks must be >= 1, got {looks}")
    shape = _shape(design, looks)
    scale = brentq(lambda C: _crossing(tuple(C * s for s in shape)) - alpha, 1.0, 6.0, xtol=1e-6)
    return tuple(scale * s for s in shape)


@dataclass(frozen=True)
class Decision:
    """The rule's answer after the looks it was given: ``verdict`` ``pass``, ``fail`` or ``more``
    (another look is needed), on ``sequences`` paired differences of ``look`` of ``looks``."""

    verdict: str
    look: int
    looks: int
    sequences: int
    mean: float
    interval: tuple[float, float]

    def said(self) -> str:
        """``"decided on 32 sequences (look 2 of 4)"``."""
        return f"decided on {self.sequences} sequences (look {self.look} of {self.looks})"


@lru_cache(maxsize=1024)
def t_boundary(c: float, n: int) -> float:
    """The normal boundary ``c`` carried to a t statistic of ``n - 1`` degrees of freedom: the
    quantile of the same tail, ``t_{n-1}^{-1}(Phi(c))`` (J&T section 3.8)."""
    from scipy.stats import norm, t

    return float(t.ppf(norm.cdf(c), n - 1))


def repeated_interval(d: np.ndarray, c: float) -> tuple[float, float]:
    """``m +- t_{N-1}^{-1}(Phi(c)) s / sqrt(N)`` of the differences ``d`` (`Decision`'s RCI)."""
    n = d.size
    half = t_boundary(c, n) * float(d.std(ddof=1)) / math.sqrt(n)
    m = float(d.mean())
    return m - half, m + half


def decide(
    differences: Sequence[Any], limit: float, looks: int, alpha: float = 1 - LEVEL, design: str = DESIGN
) -> Decision | None:
    """The sequential rule over the looks given (``differences``: one array of paired differences
    per look, in look order, at most ``looks`` of them). None when a look has fewer than two
    values or a non-finite one (no interval: the caller's fixed rule applies)."""
    cs = boundaries(looks, alpha, design)
    seen: list[np.ndarray] = []
    decision = None
    for k, part in enumerate(list(differences)[:looks], start=1):
        part = np.asarray(part, dtype=float)
        if part.ndim != 1 or part.size < 2 or not np.isfinite(part).all():
            return decision if decision is not None else None
        seen.append(part)
        d = np.concatenate(seen)
        low, high = repeated_interval(d, cs[k - 1])
        if -limit <= low and high <= limit:
            verdict = "pass"
        elif low > limit or high < -limit:
            verdict = "fail"
        else:
            verdict = "fail" if k == looks else "more"
        decision = Decision(verdict, k, looks, int(d.size), float(d.mean()), (low, high))
        if verdict != "more":
            return decision
    return decision
