"""The invariants of a base-model swap (registered after the built-in ones).

Across base models (another geometry, or asked for: heads do not correspond, so the ones above
are skipped saying so, never passed; `gate/profile.py` computes the figures; each fails only
when the new model has less of the mechanism, except where "moves" says either direction):

- ``swap_copy``: copy loss rises by at most ``swap_copy_loss`` nats; copy_gain / first_copy_loss
  falls by at most ``swap_copy_gain``.
- ``swap_induction``: at least ``swap_induction_heads`` heads with prefix_matching >=
  ``swap_induction_score``; the best score falls by at most ``swap_prefix``; their mean depth
  (fraction of the stack) moves by at most ``swap_depth``.
- ``swap_kappa``: the shares of copying / suppression heads move by at most ``swap_share``; the
  1-Wasserstein distance of the kappa_z distributions is at most ``swap_kappa_w1`` (only between
  records whose kappa was measured and flagged alike: `kappa_pairs`).
- ``swap_knockout``: the largest knockout delta falls by at most ``swap_knockout`` x its size;
  the top-3 share of the knockout effect moves by at most ``swap_concentration`` (both records
  measured every head).
"""

from __future__ import annotations

import math

import numpy as np

from ..options import flag
from ..record.schema import Record
from .builtin_invariants import kappa_pairs, other_knockout_settings
from .invariant_api import Comparison, Invariant, Row, register, within
from .profile import Profile, profile
from .tolerances import Tolerance, Tolerances

# ---------------------------------------------------------------- across base models (gate/profile.py)


def at_least(subject: str, metric: str, before: float, after: float, fall: float, note: str = "") -> Row:
    """A row that holds when ``after >= before - fall`` (a rise always holds; NaN never holds)."""
    return Row(subject, metric, before, after, fall, not after >= before - fall, note)


def at_most(subject: str, metric: str, before: float, after: float, rise: float, note: str = "") -> Row:
    """A row that holds when ``after <= before + rise`` (a fall always holds; NaN never holds)."""
    return Row(subject, metric, before, after, rise, not after <= before + rise, note)


def _profiles(before: Record, after: Record, tol: Tolerances) -> tuple[Profile, Profile]:
    return profile(before, tol.swap_induction_score), profile(after, tol.swap_induction_score)


class AcrossModels(Invariant):
    """An invariant of a base-model swap: model-level figures, heads never matched by label.

    Its messages name both models (``{model}``: the build's, ``{baseline_model}``: the baseline's).
    """

    across_models = True
    per_head = False
    held = "{model} {build} holds against {baseline_model} (the {against})"
    moved = "{model} {build} moved against {baseline_model} (the {against})"


@register
class SwapCopy(AcrossModels):
    """Copy loss may rise by ``swap_copy_loss`` nats, copy_gain / first_copy_loss fall by ``swap_copy_gain``."""

    name = "swap_copy"
    guards = "the copy loss across models"
    tolerances = {
        "swap_copy_loss": Tolerance(0.5, "across base models: how far copy loss may rise, nats"),
        "swap_copy_gain": Tolerance(0.1, "across base models: how far copy_gain / first_copy_loss may fall"),
    }

    def compare(self, before: Record, after: Record, tol: Tolerances) -> Comparison:
        b, a = _profiles(before, after, tol)
        vocab = f"ln V {b.uniform_loss:.3f} -> {a.uniform_loss:.3f}"
        rows = [
            at_most("model", "copy_loss", b.copy_loss, a.copy_loss, tol.swap_copy_loss, f"(nats; {vocab})"),
            at_least(
                "model",
                "copy_gain share",
                b.copy_share,
                a.copy_share,
                tol.swap_copy_gain,
                f"(copy_gain / first_copy_loss; copy_gain {b.copy_gain:.3f} -> {a.copy_gain:.3f} nats, {vocab})",
            ),
        ]
        detail = (
            f"copy loss {b.copy_loss:.3f} -> {a.copy_loss:.3f}, copy gain {b.copy_gain:.3f} -> {a.copy_gain:.3f} "
            f"nats ({a.copy_share:.0%} of the first-copy loss), {vocab}"
        )
        return Comparison(rows, detail=detail)


@register
class SwapInduction(AcrossModels):
    """Induction heads (prefix_matching >= swap_induction_score): their number, the best score, their depth."""

    name = "swap_induction"
    guards = "the induction heads across models"
    needs = frozenset({"routing"})
    tolerances = {
        "swap_induction_score": Tolerance(0.3, "across base models: prefix_matching that makes an induction head"),
        "swap_induction_heads": Tolerance(
            1, "across base models: induction heads the new model needs (at most the old model's count)"
        ),
        "swap_prefix": Tolerance(0.15, "across base models: how far the best prefix_matching may fall"),
        "swap_depth": Tolerance(
            0.35, "across base models: how far the induction heads' mean depth (fraction of the stack) may move"
        ),
    }

    def compare(self, before: Record, after: Record, tol: Tolerances) -> Comparison:
        b, a = _profiles(before, after, tol)
        threshold = f"prefix_matching >= {tol.swap_induction_score:g}"
        if not b.induction_heads:
            return Comparison(
                nothing_is_skip=True,
                nothing=f"{{baseline_model}} (the {{against}}) has no induction head ({threshold}); nothing to check",
            )
        needed = min(tol.swap_induction_heads, len(b.induction_heads))
        rows = [
            Row(
                "model",
                "induction heads",
                len(b.induction_heads),
                len(a.induction_heads),
                needed,
                len(a.induction_heads) < needed,
                f"({threshold}; {a.model} needs at least {needed}; of {b.n_heads} -> {a.n_heads} heads)",
            ),
            at_least(
                "model",
                "best prefix_matching",
                b.best_prefix,
                a.best_prefix,
                tol.swap_prefix,
                f"({b.best_prefix_head or '-'} -> {a.best_prefix_head or '-'})",
            ),
        ]
        left_out = ""
        if a.induction_heads:
            rows.append(
                within(
                    "model",
                    "induction depth",
                    b.induction_depth,
                    a.induction_depth,
                    tol.swap_depth,
                    f"(mean (layer + 0.5) / n_layers; {b.shape()} -> {a.shape()})",
                )
            )
        else:
            left_out = f"; induction depth not compared: {a.model} has no induction head"
        detail = (
            f"induction heads {len(b.induction_heads)} -> {len(a.induction_heads)}, best "
            f"{b.best_prefix:.3f} -> {a.best_prefix:.3f}"
        )
        return Comparison(rows, left_out=left_out, detail=detail)


@register
class SwapKappa(AcrossModels):
    """Shares of copying / suppression heads within ``swap_share``; kappa_z distributions within
    ``swap_kappa_w1`` (1-Wasserstein, null standard deviations)."""

    name = "swap_kappa"
    guards = "the kappa distribution across models"
    tolerances = {
        "swap_share": Tolerance(0.25, "across base models: how far the shares of copying / suppression heads may move"),
        "swap_kappa_w1": Tolerance(
            5.0, "across base models: 1-Wasserstein distance of the kappa_z distributions, null sds"
        ),
    }

    def compare(self, before: Record, after: Record, tol: Tolerances) -> Comparison:
        from .profile import kappa_w1

        _, mismatch = kappa_pairs(before, after, ("copying", "suppression", "kappa_z"))
        if mismatch:  # flags or z of two methods (another null, another minimum effect) are other figures
            return Comparison(nothing=mismatch)
        b, a = _profiles(before, after, tol)
        share = f"(of {b.n_heads} -> {a.n_heads} heads, flagged by kappa against the rotation null)"
        rows = [
            within("model", "copying share", b.copying_share, a.copying_share, tol.swap_share, share),
            within("model", "suppression share", b.suppression_share, a.suppression_share, tol.swap_share, share),
        ]
        distance = kappa_w1(b, a)
        if not math.isnan(distance):
            rows.append(
                at_most(
                    "all heads",
                    "kappa_z W1",
                    0.0,
                    distance,
                    tol.swap_kappa_w1,
                    f"(1-Wasserstein distance of the kappa_z distributions, null sds; "
                    f"medians {np.median(b.kappa_z):+.2f} -> {np.median(a.kappa_z):+.2f})",
                )
            )
        left_out = "" if not math.isnan(distance) else "; kappa_z distance not compared: a record holds no kappa_z"
        return Comparison(rows, left_out=left_out, detail=f"copying {a.copying_share:.0%}, W1 {distance:.2f} null sds")


@register
class SwapKnockout(AcrossModels):
    """The largest knockout delta may fall by ``swap_knockout`` x its size; the top-3 share of the
    knockout effect may move by ``swap_concentration`` (only when both records measured every head)."""

    name = "swap_knockout"
    guards = "the key knockout heads across models"
    needs = frozenset({"knockout"})
    tolerances = {
        "swap_knockout": Tolerance(0.5, "across base models: how far the largest knockout delta may fall, x its size"),
        "swap_concentration": Tolerance(
            0.3, "across base models: how far the top-3 share of the knockout effect may move"
        ),
    }
    reads = ("min_delta",)

    def compare(self, before: Record, after: Record, tol: Tolerances) -> Comparison:
        from .profile import TOP

        other = other_knockout_settings(before, after)
        if other:  # another ablation or other sequences measure other figures, not a change
            return Comparison(
                nothing=f"the {{against}} was knocked out with other settings ({', '.join(other)}); "
                f"gate with its settings ({flag('knockout-mode')}, the probe's seed, n and L)"
            )
        b, a = _profiles(before, after, tol)
        if not b.largest_knockout >= tol.min_delta:
            return Comparison(
                nothing_is_skip=True,
                nothing=f"{{baseline_model}} (the {{against}}) has no head with knockout delta >= "
                f"{tol.min_delta:g} nats; nothing to check",
            )
        rows = [
            at_least(
                "model",
                "largest knockout_delta",
                b.largest_knockout,
                a.largest_knockout,
                tol.swap_knockout * b.largest_knockout,
                f"(nats; {b.largest_knockout_head}, {b.knockout_coverage()} -> "
                f"{a.largest_knockout_head}, {a.knockout_coverage()})",
            )
        ]
        left_out = ""
        if b.knockout_complete and a.knockout_complete:
            rows.append(
                within(
                    "model",
                    f"top-{TOP} share",
                    b.top_share,
                    a.top_share,
                    tol.swap_concentration,
                    f"(of the positive knockout effect; {b.n_heads} -> {a.n_heads} heads)",
                )
            )
        else:
            short = [p for p in (b, a) if not p.knockout_complete]
            left_out = f"; top-{TOP} share not compared: " + ", ".join(
                f"{p.model} has {p.knockout_coverage()}, so its total effect is unknown" for p in short
            )
        return Comparison(rows, left_out=left_out, detail=f"largest {a.largest_knockout:+.3f} nats")
