"""Assertions for users' own tests: pure functions of result DataFrames.

Each raises ``AssertionError`` with a message that names the heads and the numbers that
moved, as the gate's failure table (`gate.invariants.Row`, `format_rows`: at most ``MAX_ROWS``
rows). Tolerances left out are the gate's defaults (`Tolerances`). Bad input (missing columns, frames of
different models) raises a one-line ``CircuitsError``. The frames may come straight from
``ov_spectrum`` or be rebuilt from JSON: only the columns are read, never ``attrs``.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from .errors import CircuitsError
from .gate.invariants import MAX_ROWS, Row, format_rows, negligible_heads
from .gate.stats import spearman
from .gate.tolerances import Tolerances
from .record.figures import parse_label
from .record.schema import HeadWrites

DEFAULTS = Tolerances()
__all__ = ["MAX_ROWS", "assert_copying_heads_preserved", "assert_kappa_close", "assert_kappa_distribution_unshifted"]


class FrameError(CircuitsError):
    """A result frame handed to an assertion lacks what the assertion needs."""


def _require(frame: pd.DataFrame, columns, name: str) -> None:
    if not isinstance(frame, pd.DataFrame):
        raise FrameError(f"{name} must be a pandas DataFrame (e.g. from ov_spectrum), got {type(frame).__name__}")
    missing = [c for c in columns if c not in frame.columns]
    if missing:
        raise FrameError(f"{name} lacks column(s) {', '.join(missing)}; pass a frame from ov_spectrum")


def _plain(frame: pd.DataFrame, columns) -> pd.DataFrame:
    """Only ``columns``, no ``attrs`` (pandas cannot merge frames whose attrs hold arrays)."""
    plain = pd.DataFrame({c: frame[c].to_numpy() for c in columns})
    if plain["head"].duplicated().any():
        dup = plain.loc[plain["head"].duplicated(), "head"].iloc[0]
        raise FrameError(f"head {dup} appears twice in one frame; pass one row per head")
    return plain


def _paired(reference: pd.DataFrame, candidate: pd.DataFrame, columns) -> pd.DataFrame:
    """Reference and candidate rows side by side (suffixes ``_ref``, ``_cand``), same heads in both."""
    _require(reference, ["head", *columns], "reference_df")
    _require(candidate, ["head", *columns], "candidate_df")
    ref, cand = _plain(reference, ["head", *columns]), _plain(candidate, ["head", *columns])
    only_ref = sorted(set(ref["head"]) - set(cand["head"]))
    only_cand = sorted(set(cand["head"]) - set(ref["head"]))
    if only_ref or only_cand:
        raise FrameError(
            f"reference has {len(ref)} heads, candidate {len(cand)}; not the same heads "
            f"(e.g. {(only_ref or only_cand)[0]}): compare builds of one model"
        )
    return ref.merge(cand, on="head", suffixes=("_ref", "_cand"))


def _head_writes(frame: pd.DataFrame) -> HeadWrites:
    """The frame's heads as the partial record the gate's negligible-head cut reads (``head``, and
    ``ov_gain`` and ``path_factor`` where the frame has them; NaN reads as not measured)."""
    columns = [c for c in ("head", "ov_gain", "path_factor") if c in frame.columns]
    rows = pd.DataFrame({c: frame[c].to_numpy() for c in columns}).astype(object)
    return HeadWrites.of(rows.where(rows.notna(), None).to_dict("records"))


def _head_order(pairs: pd.DataFrame) -> np.ndarray:
    """Heads in model order (L0H0, L0H1, ..., L1H0, ...) when labels parse, else as given."""
    parsed = [parse_label(label) for label in pairs["head"]]
    cells = [cell for cell in parsed if cell is not None]
    if len(cells) < len(parsed):
        return np.arange(len(pairs))
    return np.lexsort(([h for _, h in cells], [l for l, _ in cells]))


def assert_kappa_close(reference_df, candidate_df, tol: float | None = None, column: str = "kappa") -> None:
    """Every head's ``column`` (kappa by default) within ``tol`` of the reference: ``|k_cand - k_ref| <= tol``
    (default: the gate's ``kappa`` tolerance).

    The message lists the heads outside, largest change first.
    """
    tol = DEFAULTS.kappa if tol is None else tol
    pairs = _paired(reference_df, candidate_df, [column])
    delta = pairs[f"{column}_cand"] - pairs[f"{column}_ref"]
    bad = pairs.assign(delta=delta)[~(delta.abs() <= tol)]  # nan counts as moved
    if bad.empty:
        return
    bad = bad.reindex(bad["delta"].abs().sort_values(ascending=False, na_position="first").index)
    rows = [Row(r["head"], column, r[f"{column}_ref"], r[f"{column}_cand"], tol, True) for _, r in bad.iterrows()]
    raise AssertionError(
        f"{len(bad)} of {len(pairs)} heads moved their {column} by more than {tol:g}:\n" + format_rows(rows)
    )


def assert_copying_heads_preserved(
    reference_df,
    candidate_df,
    *,
    kappa_tol: float = DEFAULTS.kappa,
    min_survival: float = 1.0,
    min_spearman: float | None = DEFAULTS.rank,
    include_suppression: bool = False,
    column: str = "kappa",
    min_ov_gain: float = DEFAULTS.min_ov_gain,
) -> None:
    """The reference's copying heads survive in the candidate, and kappa keeps its ranking.

    A copying head survives when the candidate still flags it ``copying``, or its kappa
    dropped by at most ``kappa_tol`` (``k_cand >= k_ref - kappa_tol``: a head that drifts
    just below significance in a noisier build is not lost, one that falls is). With
    ``include_suppression`` the reference's suppression heads must likewise stay
    (``suppression``, or ``k_cand <= k_ref + kappa_tol``). Fails when the surviving
    fraction is below ``min_survival``, or when the Spearman rank correlation of
    ``column`` across all heads is below ``min_spearman`` (skipped for ``None`` or when
    fewer than 5 heads or a constant column make it undefined). As in the gate
    (`gate.invariants.negligible_heads`), heads whose residual write is below ``min_ov_gain`` x the
    reference's largest write almost nothing and are left out: ``ov_gain x path_factor`` when the
    reference frame has both (``path_factor`` from the repeat probe's heads, merged on ``head``), else
    ``ov_gain`` alone; no cut without ``ov_gain``; ``min_ov_gain=0`` keeps every head.
    """
    kinds = ["copying", "suppression"] if include_suppression else ["copying"]
    pairs = _paired(reference_df, candidate_df, [column, *kinds])
    negligible = negligible_heads(_head_writes(reference_df), min_ov_gain)
    pairs = pairs[~pairs["head"].isin(negligible)]
    pairs = pairs.iloc[_head_order(pairs)]
    k_ref, k_cand = pairs[f"{column}_ref"], pairs[f"{column}_cand"]
    rows: list[Row] = []
    n_watched, n_lost = 0, 0
    for kind in kinds:
        watched = pairs[f"{kind}_ref"].astype(bool)
        if kind == "copying":
            kept = pairs[f"{kind}_cand"].astype(bool) | (k_cand >= k_ref - kappa_tol)
        else:
            kept = pairs[f"{kind}_cand"].astype(bool) | (k_cand <= k_ref + kappa_tol)
        lost = pairs[watched & ~kept]
        n_watched += int(watched.sum())
        n_lost += len(lost)
        rows += [
            Row(r["head"], column, r[f"{column}_ref"], r[f"{column}_cand"], kappa_tol, True, f"{kind} -> not {kind}")
            for _, r in lost.iterrows()
        ]
    problems = []
    survival = 1.0 if n_watched == 0 else (n_watched - n_lost) / n_watched
    if survival < min_survival:
        label = " and ".join(kinds)
        problems.append(
            f"{n_lost} of {n_watched} {label} heads lost (survival {survival:.2f} < {min_survival:.2f}):\n"
            + format_rows(rows)
        )
    rho = spearman(k_ref, k_cand) if len(pairs) >= 5 else float("nan")
    if min_spearman is not None and not np.isnan(rho) and rho < min_spearman:
        problems.append(
            f"Spearman rank correlation of {column} across {len(pairs)} heads {rho:.3f} < {min_spearman:.3f}"
        )
    if problems:
        raise AssertionError("\n".join(problems))


def quantile_shifts(reference, candidate, quantiles=(0.1, 0.25, 0.5, 0.75, 0.9)) -> pd.DataFrame:
    """Quantiles of two samples side by side: columns ``quantile``, ``reference``, ``candidate``, ``delta``."""
    ref = np.quantile(np.asarray(reference, dtype=float), quantiles)
    cand = np.quantile(np.asarray(candidate, dtype=float), quantiles)
    return pd.DataFrame({"quantile": list(quantiles), "reference": ref, "candidate": cand, "delta": cand - ref})


def assert_kappa_distribution_unshifted(
    reference_df,
    candidate_df,
    *,
    column: str = "kappa",
    quantiles=(0.25, 0.5, 0.75),
    quantile_tol: float = 0.1,
    max_ks: float = 0.2,
    alpha: float = 0.01,
) -> None:
    """The distribution of ``column`` across heads has not moved.

    Fails when any of ``quantiles`` moved by more than ``quantile_tol``, or when the
    two-sample Kolmogorov-Smirnov statistic ``D = max |F_ref - F_cand|`` exceeds
    ``max_ks`` *and* its p-value is below ``alpha`` (an effect size and a significance
    test together: with many heads a tiny shift is significant, with few a large ``D``
    is noise). Per-head noise of a few hundredths (int8, nf4 quantization) moves no
    quartile by 0.1. The heads need not match, so this also compares different base
    models; with under ~200 heads a side, the quartiles' own sampling error (about
    ``0.6 sd / sqrt(n)``) approaches 0.1: widen ``quantile_tol`` or compare fewer quantiles.
    """
    from scipy.stats import ks_2samp

    _require(reference_df, [column], "reference_df")
    _require(candidate_df, [column], "candidate_df")
    ref = pd.to_numeric(reference_df[column], errors="coerce").to_numpy(dtype=float)
    cand = pd.to_numeric(candidate_df[column], errors="coerce").to_numpy(dtype=float)
    ref, cand = ref[~np.isnan(ref)], cand[~np.isnan(cand)]
    if len(ref) == 0 or len(cand) == 0:
        raise FrameError(f"no {column} values to compare (reference {len(ref)}, candidate {len(cand)})")
    shifts = quantile_shifts(ref, cand, quantiles)
    ks = ks_2samp(ref, cand)
    moved = shifts[shifts["delta"].abs() > quantile_tol]
    ks_fail = ks.statistic > max_ks and ks.pvalue < alpha
    if moved.empty and not ks_fail:
        return
    rows = [
        Row(
            f"q{r['quantile']:g}",
            column,
            r["reference"],
            r["candidate"],
            quantile_tol,
            broken := bool(abs(r["delta"]) > quantile_tol),
            "moved" if broken else "",
        )
        for _, r in shifts.iterrows()
    ]
    head = (
        f"distribution of {column} shifted ({len(ref)} reference heads, {len(cand)} candidate heads); "
        f"KS D {ks.statistic:.3f} (max {max_ks:.2f}), p {ks.pvalue:.2g} (alpha {alpha:g})"
    )
    raise AssertionError(head + ":\n" + format_rows(rows))
