"""The built-in invariants of one model's builds (registered in gate order) and their shared helpers.

- ``copying_heads``: every head flagged copying or suppression keeps ``|kappa' - kappa|``
  and ``|kappa_trace' - kappa_trace|`` within ``kappa``; every head keeps kappa_trace within
  ``kappa``; the Spearman rank correlation of kappa over the heads the baseline tells apart
  from the null (``|kappa_z| >= 2``) stays ``>= rank``.
- ``kappa_distribution``: the mean over heads of ``kappa_z' - kappa_z`` (and of the trace
  twin) stays within ``+-shift`` null standard deviations.
- Both kappa invariants leave out heads whose OV gain ``sum_i |lambda_i|`` times its layer's
  ``path_factor`` (the norm factors the fold leaves out, on the probe; 1 in records without it)
  is below ``min_ov_gain`` x the baseline's largest, and say how many.
- ``ov_gain``: each key head of the sampled rungs (the heads ``induction_heads`` and
  ``knockout_deltas`` compare) keeps its OV gain, ``|ln(ov_gain' / ov_gain)| <= ov_gain``;
  negligible heads (as above) are left out. kappa is scale-free, so this is the weight-only
  figure that sees a key head's OV circuit weakened or strengthened.
- ``copy_loss``: copy loss and copy gain each within ``copy_loss`` / ``copy_gain`` nats.
- ``induction_heads``: the baseline's top-``top_k`` prefix-matching and previous-token heads
  scoring at least ``min_score`` keep their score within ``+-prefix``.
- ``knockout_deltas``: the baseline's top-``top_k`` knockout heads (delta at least
  ``min_delta`` nats) keep ``|delta' - delta| <= knockout * |delta_bar|``, ``delta_bar`` the
  baseline's delta over every sequence it holds (its further looks too).
- Both of these compare sampled figures (`sampled_within`): each row carries the 95% paired t
  interval of its change over the probe's sequences, and with ``outside_interval`` (default)
  a change beyond its tolerance breaks only when that interval excludes 0.
"""

from __future__ import annotations

import math

import numpy as np

from ..record.looks import look_values, pooled
from ..record.read import record_eigenvalues
from ..record.schema import Head, HeadWrites, Record, RecordLike
from .change_screen import knockout_limit, screened_row
from .invariant_api import Comparison, Invariant, Row, register, signed, within
from .rows import (
    figure,
    fixed_why,
    head_pairs,
    heads_by_label,
    interval_detail,
    num,
    sampled_within,
    spared,
)
from .stats import spearman
from .tolerances import Tolerance, Tolerances

RANK_MIN_Z = 2.0  # heads in the rank correlation: those the baseline tells apart from the null


# ---------------------------------------------------------------- shared helpers of the built-in invariants


def _writer(record: RecordLike | HeadWrites) -> Record | HeadWrites:
    """A partial record of head writes as it is, else the validated `Record` (`Record.of`)."""
    return record if isinstance(record, HeadWrites) else Record.of(record)


def ov_gains(record: RecordLike | HeadWrites) -> dict[str, float]:
    """Each head's OV gain ``sum_i |lambda_i|``: the ``ov_gain`` column, or from the stored
    eigenvalues for records written before that column existed; empty when neither is there
    (a frame's `HeadWrites` hold no eigenvalues)."""
    from ..record.read import ov_gain

    typed = _writer(record)
    heads = {row.head: row for row in typed.heads}
    gains = {name: float(row.ov_gain) for name, row in heads.items() if row.ov_gain is not None}
    if heads and len(gains) == len(heads):
        return gains
    if isinstance(typed, HeadWrites):
        return {}
    return {name: float(ov_gain(lam)) for name, lam in record_eigenvalues(typed.eigenvalues).items() if lam.size}


def head_writes(record: RecordLike | HeadWrites) -> tuple[dict[str, float], str]:
    """``(sizes, what)``: each head's OV gain times its layer's ``path_factor`` (what it writes
    on the probe: the per-position norm factors the fold leaves out put back) when every head has
    one, else its OV gain alone (`ov_gains`; records written before ``path_factor``), and the words."""
    typed = _writer(record)
    gains = ov_gains(typed)
    factors = {row.head: float(row.path_factor) for row in typed.heads if row.path_factor is not None}
    if gains and all(name in factors for name in gains):
        return {name: gain * factors[name] for name, gain in gains.items()}, "OV gain on the probe"
    return gains, "OV gain"


def negligible_heads(record: RecordLike | HeadWrites, min_ov_gain: float) -> set[str]:
    """Heads whose residual write (`head_writes`) is below ``min_ov_gain`` x the record's largest
    (a scan record, or a result frame's `HeadWrites`)."""
    gains, _ = head_writes(record)
    if not gains or min_ov_gain <= 0:
        return set()
    largest = max(gains.values())
    return {name for name, gain in gains.items() if gain < min_ov_gain * largest}


def compared_pairs(before: Record, after: Record, tol: Tolerances) -> tuple[list[tuple[str, Head, Head]], str]:
    """``(pairs, left_out)``: the heads the kappa invariants compare, and a note naming how many
    negligible heads were left out ("" when none)."""
    negligible = negligible_heads(before, tol.min_ov_gain)
    pairs = [(name, b, a) for name, b, a in head_pairs(before, after) if name not in negligible]
    if not negligible:
        return pairs, ""
    what = head_writes(before)[1]
    return pairs, f"; {len(negligible)} heads with {what} < {tol.min_ov_gain:g} x the largest not compared"


def kappa_pairs(
    before: RecordLike, after: RecordLike, figures: tuple[str, ...]
) -> tuple[dict[str, tuple[str, str]], str]:
    """``({figure: (figure of before, figure of after)}, why)``: the figures of two records that
    measure the same thing (`record.kappa_method.paired_figures`); ``why`` names the two ways of
    measuring kappa when some figure has no pair ("" when all do)."""
    from ..record.kappa_method import of_record, paired_figures

    mb, ma = of_record(Record.of(before)), of_record(Record.of(after))
    pairs = {f: p for f in figures if (p := paired_figures(f, mb, ma)) is not None}
    if len(pairs) == len(figures):
        return pairs, ""
    return pairs, (
        f"the {{against}} measured kappa with {mb.describe()}, {{build}} with {ma.describe()}: "
        f"{', '.join(f for f in figures if f not in pairs)} of two methods are not compared "
        "(a live gate measures the build the baseline's way)"
    )


def key_heads(record: RecordLike, metric: str, top_k: int, minimum: float) -> list[str]:
    """The record's heads scoring at least ``minimum`` on ``metric``, best first; the top ``top_k``
    of them when ``top_k`` is positive, every one when it is 0. A head's score is its figure over
    every sequence the record holds (`looks.pooled`: a baseline's knockout deltas pool look 1 with
    its further looks, so a head that look 1's few sequences lifted over ``minimum`` is not key)."""
    typed = Record.of(record)
    rows = [(r.head, pooled_score(r, metric, look_values(typed, metric, r.head))) for r in typed.heads]
    rows = [(h, v) for h, v in rows if not math.isnan(v) and v >= minimum]
    rows.sort(key=lambda hv: -hv[1])
    return [h for h, _ in (rows[:top_k] if top_k > 0 else rows)]


def pooled_score(row: Head, metric: str, further: list[list[float]]) -> float:
    """``row``'s ``metric`` pooled with its ``further`` looks' values when the record holds some
    (`looks.pooled`; NaN stays NaN: a figure not measured), else its figure."""
    value = figure(row, metric)
    return pooled(row, metric, further)[0] if further and not math.isnan(value) else value


def knockouts_lost(record: Record) -> list[str]:
    """Heads without a knockout_delta in a record whose knockout scan was neither screened nor of
    key heads only (every head exactly): figures lost, not left out."""
    if record.knockout is None or record.knockout.screened is not None or record.knockout.heads is not None:
        return []
    return [r.head for r in record.heads if r.knockout_delta is None]


def other_knockout_settings(before: Record, after: Record) -> list[str]:
    """``["mode zero vs mean", ...]``: the knockout settings (mode, seed, n, L) both records name
    and name differently; deltas of another ablation or other sequences are other figures."""
    settings = [
        (k, getattr(before.knockout, k, None), getattr(after.knockout, k, None)) for k in ("mode", "seed", "n", "L")
    ]
    return [f"{k} {x} vs {y}" for k, x, y in settings if x is not None and y is not None and x != y]


def _role(row: Head) -> str:
    return "copying" if row.copying else "suppression" if row.suppression else ""


# ---------------------------------------------------------------- the built-in invariants


@register
class CopyingHeads(Invariant):
    """Copying/suppression heads keep kappa and kappa_trace; kappa keeps its rank order."""

    name = "copying_heads"
    suite_test = "test_copying_heads_survive"
    suite_module = "test_rung1_weights"
    guards = "the copying heads"
    tolerances = {
        "kappa": Tolerance(0.15, "|delta kappa| and |delta kappa_trace| per head"),
        "rank": Tolerance(0.80, "minimum Spearman rank correlation of kappa across heads", minimum=-1),
        "min_ov_gain": Tolerance(0.01, "heads with OV gain below this x the largest: kappa not compared"),
    }
    held = "copying heads of {build} survive against the {against}"
    moved = "copying heads of {build} moved against the {against}"

    def compare(self, before: Record, after: Record, tol: Tolerances) -> Comparison:
        same, mismatch = kappa_pairs(before, after, ("kappa", "kappa_trace"))
        if mismatch:
            return Comparison(nothing=mismatch)
        (kb, ka), (tb, ta) = (same[f] for f in ("kappa", "kappa_trace"))  # the uncentred twin across unembeddings
        pairs, left_out = compared_pairs(before, after, tol)
        rows = []
        for name, b, a in pairs:
            for metric, x, y in [("kappa", kb, ka), ("kappa_trace", tb, ta)] if _role(b) else [("kappa_trace", tb, ta)]:
                paired = "" if x == y else f" ({x} -> {y})"
                rows.append(within(name, metric, figure(b, x), figure(a, y), tol.kappa, _role(b) + paired))
        ranked = [(b, a) for _, b, a in pairs if abs(figure(b, "kappa_z")) >= RANK_MIN_Z]
        if len(ranked) >= 3:
            rho = spearman([figure(b, kb) for b, _ in ranked], [figure(a, ka) for _, a in ranked])
            undefined = " undefined: kappa is constant on one side" if math.isnan(rho) else ""
            rows.append(
                Row(
                    f"{len(ranked)} heads",
                    "rank corr",
                    1.0,
                    rho,
                    tol.rank,
                    not rho >= tol.rank,
                    f"(Spearman of kappa over heads with |kappa_z| >= {RANK_MIN_Z:g}){undefined}",
                )
            )
        return Comparison(
            rows, left_out=left_out, nothing=f"no head of the {{against}} is compared{left_out}; check the baseline"
        )


@register
class KappaDistribution(Invariant):
    """Mean shift across heads of kappa_z (and kappa_trace_z when recorded) within +-shift null sds."""

    name = "kappa_distribution"
    suite_test = "test_kappa_distribution_not_shifted"
    suite_module = "test_rung1_weights"
    guards = "the kappa distribution"
    tolerances = {
        "shift": Tolerance(1.0, "|mean delta kappa_z| across heads, in null standard deviations"),
    }
    reads = ("min_ov_gain",)
    held = "kappa distribution of {build} not shifted against the {against}"
    moved = "kappa distribution of {build} shifted against the null, compared with the {against}"

    def compare(self, before: Record, after: Record, tol: Tolerances) -> Comparison:
        _, mismatch = kappa_pairs(before, after, ("kappa_z", "kappa_trace_z"))
        if mismatch:
            return Comparison(nothing=mismatch)
        pairs, left_out = compared_pairs(before, after, tol)
        rows: list[Row] = []
        context: list[Row] = []
        said: list[str] = []
        for metric in ("kappa_z", "kappa_trace_z"):
            dz = np.array([figure(a, metric) - figure(b, metric) for _, b, a in pairs], float)
            if not np.isfinite(dz).any():
                continue
            shift = float(dz[np.isfinite(dz)].mean()) if np.isfinite(dz).all() else math.nan
            mean_b = float(np.nanmean([figure(b, metric) for _, b, _ in pairs]))
            row = within("all heads", f"mean {metric}", mean_b, mean_b + shift, tol.shift)
            rows.append(row)
            said.append(f"mean d{metric} {shift:+.2f}")
            if row.broken:  # the heads that drive the shift: moved the same way at least as far, largest first
                drivers = sorted(
                    (p for p, d in zip(pairs, dz) if np.sign(d) == np.sign(shift) and abs(d) >= abs(shift)),
                    key=lambda p: -abs(figure(p[2], metric) - figure(p[1], metric)),
                )
                context += [
                    Row(name, metric, figure(b, metric), figure(a, metric), tol.shift, True, "(drives the shift)")
                    for name, b, a in drivers[:5]
                ]
        return Comparison(
            rows,
            context,
            left_out,
            ", ".join(said),
            nothing=f"no kappa z-scores to compare in the {{against}}{left_out}; check the baseline",
        )


@register
class OvGain(Invariant):
    """Key heads keep their OV gain ``sum_i |lambda_i|``: ``|ln(ov_gain' / ov_gain)| <= ov_gain``."""

    name = "ov_gain"
    suite_test = "test_key_heads_keep_their_ov_gain"
    suite_module = "test_rung1_weights"
    guards = "the key heads' OV gain"
    tolerances = {
        "ov_gain": Tolerance(0.1, "|ln(ov_gain' / ov_gain)| of key heads (0.1: about 10%)"),
        "top_k": Tolerance(0, "at most this many key heads per routing score and for knockouts (0: every one)"),
        "min_score": Tolerance(0.2, "a routing score below this does not make a key head"),
        "min_delta": Tolerance(0.1, "a knockout delta below this (nats) does not make a key head"),
    }
    reads = ("min_ov_gain",)
    held = "key heads of {build} keep their OV gain against the {against}"
    moved = "key heads of {build} changed their OV gain against the {against}"

    def compare(self, before: Record, after: Record, tol: Tolerances) -> Comparison:
        from ..record.kappa_method import of_record

        wb, wa = of_record(before).unembedding, of_record(after).unembedding
        if wb != wa:  # the gain reads W_U: a centred and an uncentred gain are other figures
            return Comparison(
                nothing=f"the {{against}}'s OV gains read the {wb} W_U, {{build}}'s the {wa} one: not compared "
                "(a live gate measures the build the baseline's way)"
            )
        keys = sampled_key_heads(before, tol)
        if not keys and not any(not math.isnan(figure(r, m)) for r in before.heads for m in KEY_SCORES):
            return Comparison(nothing="the {against} holds no probe or knockout figures to find key heads by")
        gb, ga = ov_gains(before), ov_gains(after)
        if keys and not gb:
            return Comparison(nothing="the {against} holds no OV gains (no rung-1 figures); record it with rung 1")
        negligible = negligible_heads(before, tol.min_ov_gain)
        rows = []
        for name in (h for h in keys if h not in negligible and gb.get(h, 0) > 0):
            x, y = gb[name], ga.get(name, math.nan)
            note = f"(x{y / x:.3f})" if y == y else "NOT MEASURED in this build: an error, not a change"
            ln_y = math.log(y) if y > 0 else -math.inf if y == 0 else math.nan
            rows.append(within(name, "ln ov_gain", math.log(x), ln_y, tol.ov_gain, note))
        left = len([h for h in keys if h in negligible])
        what = head_writes(before)[1]
        left_out = f"; {left} key heads with {what} < {tol.min_ov_gain:g} x the largest not compared" if left else ""
        if keys and not rows:
            return Comparison(left_out=left_out, nothing=f"every key head of the {{against}} is negligible{left_out}")
        return Comparison(
            rows,
            left_out=left_out,
            nothing_is_skip=True,
            nothing=(
                "the {against} has no key head (no induction, previous-token or knockout head over its "
                "minimum); nothing to check"
            ),
        )


KEY_SCORES = ("prefix_matching", "previous_token", "knockout_delta")  # the figures that make a key head


def sampled_key_heads(record: RecordLike, tol: Tolerances) -> list[str]:
    """The heads ``induction_heads`` and ``knockout_deltas`` compare, in the record's order."""
    minimum = {"prefix_matching": tol.min_score, "previous_token": tol.min_score, "knockout_delta": tol.min_delta}
    keys = {h for score in KEY_SCORES for h in key_heads(record, score, tol.top_k, minimum[score])}
    return [row.head for row in Record.of(record).heads if row.head in keys]


@register
class CopyLoss(Invariant):
    """Copy loss and copy gain (nats) within tolerance, both directions."""

    name = "copy_loss"
    suite_test = "test_copy_loss_within_tolerance"
    suite_module = "test_rung12_repeat"
    guards = "the copy loss"
    per_head = False
    tolerances = {
        "copy_loss": Tolerance(0.25, "|delta copy loss|, nats"),
        "copy_gain": Tolerance(0.25, "|delta copy gain|, nats"),
        "outside_interval": Tolerance(
            True,
            "copy_loss and knockout_deltas weigh sampling noise: by the sequential rule (looks), or, against a baseline without looks, a change fails only when beyond its tolerance and its 95% paired interval over the probe's sequences excludes 0 (the fixed rule); off: the plain tolerance",
        ),
        "looks": Tolerance(
            4,
            "the most looks of the sequential rule (gate/sequential.py), each n fresh probe sequences, drawn while a change is undecided; a pass needs the change shown within its tolerance; 1: the fixed rule",
            minimum=1,
        ),
    }
    held = "copy behaviour of {build} within tolerance of the {against}"
    moved = "copy behaviour of {build} moved against the {against}"

    def compare(self, before: Record, after: Record, tol: Tolerances) -> Comparison:
        rows = [
            sampled_within(
                "model",
                metric,
                before,
                after,
                limit,
                tol,
                looks=(look_values(before, metric), look_values(after, metric)),
            )
            for metric, limit in (("copy_loss", tol.copy_loss), ("copy_gain", tol.copy_gain))
        ]
        detail = f"copy loss {num(after.copy_loss):.3f}, gain {num(after.copy_gain):.3f}; "
        return Comparison(rows, spared(rows), fixed_why(before, rows, tol), detail + interval_detail(rows))


@register
class InductionHeads(Invariant):
    """Top prefix-matching (and previous-token) heads of the baseline keep their scores."""

    name = "induction_heads"
    suite_test = "test_induction_heads_survive"
    suite_module = "test_rung12_repeat"
    guards = "the induction and previous-token heads"
    needs = frozenset({"routing"})
    tolerances = {
        "prefix": Tolerance(0.10, "|delta prefix_matching| / |delta previous_token| of key heads"),
    }
    reads = ("top_k", "min_score")
    held = "induction heads of {build} survive against the {against}"
    moved = "induction heads of {build} moved against the {against}"

    def compare(self, before: Record, after: Record, tol: Tolerances) -> Comparison:
        b, a = heads_by_label(before), heads_by_label(after)
        rows = []
        for metric, role in (("prefix_matching", "induction"), ("previous_token", "previous-token")):
            for name in key_heads(before, metric, tol.top_k, tol.min_score):
                rows.append(
                    within(name, metric, figure(b[name], metric), figure(a.get(name), metric), tol.prefix, role)
                )
        return Comparison(
            rows,
            nothing_is_skip=True,
            nothing=(
                f"the {{against}} has no induction or previous-token head scoring >= {tol.min_score:g}; nothing to check"
            ),
        )


@register
class KnockoutDeltas(Invariant):
    """Key heads' knockout deltas keep their size: ``|d' - d| <= knockout * |d_bar|``, ``d_bar``
    the baseline's delta over every sequence it holds (look 1 and its further looks). With
    ``change_screen = f > 0`` a key head whose plain-AtP change is under ``f`` of that is passed on
    the estimate, not knocked out (`change_screen`)."""

    name = "knockout_deltas"
    suite_test = "test_knockout_deltas_keep_size"
    suite_module = "test_rung2_knockout"
    guards = "the key knockout heads"
    needs = frozenset({"knockout"})
    knockout_heads = "key heads"
    tolerances = {
        "knockout": Tolerance(0.5, "|delta knockout_delta| / |knockout_delta| of key heads"),
        "change_screen": Tolerance(
            0.0,
            "knock out exactly only key heads whose change plain AtP estimates at this fraction of their "
            "tolerance or more (0: every key head exactly)",
        ),
    }
    reads = ("top_k", "min_delta", "outside_interval", "looks")
    held = "knockout deltas of {build}'s key heads keep their size against the {against}"
    moved = "knockout deltas of {build}'s key heads changed against the {against}"

    def compare(self, before: Record, after: Record, tol: Tolerances) -> Comparison:
        other = other_knockout_settings(before, after)
        if other:  # deltas of another ablation or other sequences are other figures, not a change
            return Comparison(
                nothing=f"the {{against}} was knocked out with other settings ({', '.join(other)}); "
                "record it again with this run's knockout settings"
            )
        lost = knockouts_lost(before)
        if lost:  # its key heads cannot be known: comparing the rest would gate fewer, silently
            return Comparison(
                nothing=f"the {{against}} holds no knockout_delta for {len(lost)} head(s) ({', '.join(lost[:8])}"
                f"{', ...' if len(lost) > 8 else ''}) though its knockout scan measured every head exactly: "
                "it is incomplete (a merge of parts that missed layers?), so its key heads are unknown; record it again"
            )
        b, a = heads_by_label(before), heads_by_label(after)
        rows, cleared = [], []
        for name in key_heads(before, "knockout_delta", tol.top_k, tol.min_delta):
            y = figure(a.get(name), "knockout_delta")
            size, n, limit = knockout_limit(before, b[name], tol)  # over every sequence the baseline holds
            if math.isnan(y) and (row := screened_row(name, b[name], a.get(name), limit, tol.change_screen)):
                cleared.append(row)
                continue
            looks = (look_values(before, "knockout_delta", name), look_values(after, "knockout_delta", name))
            over = f" {signed(size)} over {n} sequences" if looks[0] and n else ""
            note = (
                f"({tol.knockout:.0%} of its size{over})"
                if not math.isnan(y)
                else "NOT MEASURED in this build (screened out): an error, not a change; measure it exactly"
            )
            rows.append(sampled_within(name, "knockout_delta", b[name], a.get(name), limit, tol, note, looks))
        screened = (
            f"{len(rows)} key heads knocked out exactly, {len(cleared)} passed by the change screen "
            f"(their estimated change under {tol.change_screen:.0%} of the tolerance)"
            if cleared
            else ""
        )
        return Comparison(
            rows + cleared,
            spared(rows),
            fixed_why(before, rows, tol),
            "; ".join(s for s in (interval_detail(rows, spared(rows)[:5]), screened) if s),
            nothing_is_skip=True,
            nothing=(f"the {{against}} has no head with knockout delta >= {tol.min_delta:g} nats; nothing to check"),
        )
