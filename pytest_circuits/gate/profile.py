"""A model's profile: the model-level figures of a scan record that compare across base models.

Heads do not correspond across two base models (L3H7 of one is not L3H7 of the other), so a
base-model swap is gated on figures of the whole model (docs/definitions.md, "Across base
models"), all computed here from one record:

- copy: ``copy_loss``, ``copy_gain`` and ``uniform_loss = ln V`` as recorded, and
  ``copy_share = copy_gain / first_copy_loss`` (the share of the first-copy loss the repeat
  removes; vocabulary-neutral, where ``copy_gain`` in nats grows with ``ln V``);
- induction: the heads with ``prefix_matching >= threshold`` (best first), the best score over
  every head, and their mean depth ``mean((layer + 0.5) / n_layers)``;
- kappa: the shares of heads flagged ``copying`` / ``suppression`` and every finite ``kappa_z``
  (`kappa_w1` is the distance between two models' distributions);
- knockout: the heads measured exactly, the largest delta among them, and the top-3 share
  ``sum of the 3 largest max(delta, 0) / sum of max(delta, 0)``, defined only when every head
  was measured (a screen leaves the total unknown).

A figure that cannot be computed is NaN, never 0.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ..record.schema import Record, RecordLike

TOP = 3  # heads in the concentration share


@dataclass(frozen=True)
class Profile:
    """The cross-model figures of one record (NaN where a figure is undefined)."""

    model: str
    n_layers: int
    n_heads: int  # every head of the model: n_layers x heads per layer
    uniform_loss: float
    copy_loss: float
    first_copy_loss: float
    copy_gain: float
    copy_share: float
    induction_threshold: float
    induction_heads: tuple[str, ...]  # prefix_matching >= threshold, best first
    best_prefix: float
    best_prefix_head: str
    induction_depth: float  # mean (layer + 0.5) / n_layers of the induction heads
    copying_share: float
    suppression_share: float
    kappa_z: tuple[float, ...]
    knockout_measured: int  # heads with an exact knockout delta
    largest_knockout: float
    largest_knockout_head: str
    top_share: float  # top-3 share of the positive knockout effect; NaN unless every head measured

    @property
    def knockout_complete(self) -> bool:
        return self.knockout_measured == self.n_heads

    def shape(self) -> str:
        return f"{self.n_layers} layers x {self.n_heads // max(self.n_layers, 1)} heads"

    def knockout_coverage(self) -> str:
        """``"all 8 heads measured"`` or ``"12 of 270 heads measured exactly (screened)"``."""
        if self.knockout_complete:
            return f"all {self.n_heads} heads measured"
        return f"{self.knockout_measured} of {self.n_heads} heads measured exactly (screened)"


def _num(value: object) -> float:
    return math.nan if value is None else float(value)  # type: ignore[arg-type]


def depth(layer: int, n_layers: int) -> float:
    """Where layer ``layer`` sits in a stack of ``n_layers``: ``(layer + 0.5) / n_layers`` in (0, 1)."""
    return (layer + 0.5) / n_layers


def profile(record: RecordLike, induction_threshold: float) -> Profile:
    """The `Profile` of ``record``; induction heads score ``prefix_matching >= induction_threshold``."""
    record = Record.of(record)
    geometry = record.model.geometry
    n_layers = geometry.n_layers
    heads = record.heads
    n_heads = n_layers * geometry.n_heads

    prefix = [(row.head, int(row.layer), _num(row.prefix_matching)) for row in heads]
    prefix = sorted((p for p in prefix if not math.isnan(p[2])), key=lambda p: -p[2])
    induction = [p for p in prefix if p[2] >= induction_threshold]
    best_head, _, best = prefix[0] if prefix else ("", 0, math.nan)
    mean_depth = float(np.mean([depth(layer, n_layers) for _, layer, _ in induction])) if induction else math.nan

    deltas = [(row.head, _num(row.knockout_delta)) for row in heads]
    measured = [(h, d) for h, d in deltas if not math.isnan(d)]
    largest_head, largest = max(measured, key=lambda hd: hd[1]) if measured else ("", math.nan)
    positive = sorted((max(d, 0.0) for _, d in measured), reverse=True)
    total = sum(positive)
    top = sum(positive[:TOP]) / total if len(measured) == n_heads and total > 0 else math.nan

    copy_loss, first = _num(record.copy_loss), _num(record.first_copy_loss)
    gain = _num(record.copy_gain)
    return Profile(
        model=record.model.name,
        n_layers=n_layers,
        n_heads=n_heads,
        uniform_loss=_num(record.uniform_loss),
        copy_loss=copy_loss,
        first_copy_loss=first,
        copy_gain=gain,
        copy_share=gain / first if first > 0 else math.nan,
        induction_threshold=induction_threshold,
        induction_heads=tuple(h for h, _, _ in induction),
        best_prefix=best,
        best_prefix_head=best_head,
        induction_depth=mean_depth,
        copying_share=sum(bool(row.copying) for row in heads) / n_heads,
        suppression_share=sum(bool(row.suppression) for row in heads) / n_heads,
        kappa_z=tuple(z for z in (_num(row.kappa_z) for row in heads) if math.isfinite(z)),
        knockout_measured=len(measured),
        largest_knockout=largest,
        largest_knockout_head=largest_head,
        top_share=top,
    )


def kappa_w1(a: Profile, b: Profile) -> float:
    """The 1-Wasserstein distance between the two models' kappa_z distributions (null sds):
    ``integral |F_a(z) - F_b(z)| dz`` of their empirical CDFs; NaN when either has none."""
    from scipy.stats import wasserstein_distance

    if not a.kappa_z or not b.kappa_z:
        return math.nan
    return float(wasserstein_distance(a.kappa_z, b.kappa_z))


def profile_line(p: Profile) -> str:
    """One line of the profile, for ``circuits scan``."""

    def f(x: float, spec: str = "{:.3f}") -> str:
        return "-" if math.isnan(x) else spec.format(x)

    knockout = (
        f"largest knockout {f(p.largest_knockout, '{:+.3f}')} ({p.largest_knockout_head}, {p.knockout_coverage()}), "
        f"top-{TOP} share {f(p.top_share, '{:.2f}')}"
        if p.knockout_measured
        else "no knockouts"
    )
    return (
        f"across models: copy share {f(p.copy_share)} (ln V {f(p.uniform_loss)}); "
        f"induction heads {len(p.induction_heads)} (prefix >= {p.induction_threshold:g}, best {f(p.best_prefix)} "
        f"{p.best_prefix_head}, depth {f(p.induction_depth, '{:.2f}')}); "
        f"copying {p.copying_share:.0%}, suppression {p.suppression_share:.0%} of heads; {knockout}"
    )
