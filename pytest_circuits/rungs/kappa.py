"""Rung 1, weights: the OV copying score kappa of every head, against a rotation null.

Definitions (docs/definitions.md, "Rung 1, weights: kappa"):

* reduced OV matrix of head ``LlHh``: ``M_h = W_O W_U W_E W_V`` (``d_head x d_head``); its
  nonzero eigenvalues are those of ``W_E W_OV W_U`` (``vocab x vocab``, never formed).
  ``W_U W_E`` (``d_model x d_model``) is formed once per model; ``W_V`` is the head's
  key/value group's (grouped-query attention).
* ``W_U`` is centred by default: ``W_U - W_U 11^T / vocab`` (each residual direction's mean
  over the vocabulary removed), because a logit shift common to every token changes no
  softmax, so that part of ``W_U`` carries nothing a head can copy. The uncentred kappa and
  kappa_trace are reported beside it (``kappa_uncentred``, ``kappa_trace_uncentred``).
* ``kappa = (1/d_head) sum_i f(l_i)``, ``f(l) = Re(l)/|l|``, ``f = 0`` where
  ``|l| <= 1e-6 max|l|``; trace-weighted ``kappa_trace = sum_i Re(l_i) / sum_i |l_i|``.
* rotation null: ``kappa(M_h R)`` for Haar-random orthogonal ``R`` keeps the head's singular
  values and destroys the read/write alignment. With ``M_h = P S Q^T``, ``M_h R`` is similar
  to ``S (Q^T R P)`` and ``Q^T R P`` is Haar again: the null depends on the singular values
  alone. It is symmetric about 0 (``-R`` is Haar too and negates every eigenvalue), and it
  is exact on a randomly initialised model (a Gaussian ``W_V`` is rotation-invariant).
  The heads of a layer share that layer's rotations (seeded by ``(seed, layer)``).

Why p-values come from a normal approximation by default: an empirical two-sided p-value
with ``n`` rotations bottoms out at ``1/(n+1)`` (``1/257`` for 256). Benjamini-Hochberg over
``m`` heads needs the smallest p at or below ``q/m`` (``0.05/270 = 1.9e-4`` for
SmolLM2-135M), so an empirical p could only reach significance through many ties at the
floor and a strong copier would be no more significant than a weak one. Instead
``z = (kappa - null_mean) / null_sd`` and ``p = 2 Phi(-|z|)``: kappa is a mean over
``d_head`` eigenvalue terms and its rotation null is close to normal (on SmolLM2-135M,
pooled standardised null draws: skew 0.005, excess kurtosis -0.1, ``P(|z| > 1.96) = 0.047``,
``P(|z| > 2.58) = 0.009``; on random models p-values are uniform, ``tests/test_kappa.py``). The empirical p (``+1``
correction) is reported beside it; ``p_method="empirical"`` uses it instead, and then
needs about ``m/q`` rotations per head to be able to reach significance.

The default, ``p_method="t"``, makes the null cheap (32 draws a head instead of 256) and
keeps it exactly calibrated under that normal approximation: the null is symmetric about 0,
so its mean is known (0) and only its spread is estimated, ``s^2 = mean_i k_i^2`` over the
``n`` draws (``n`` degrees of freedom). If ``k_i`` and a null head's kappa are
``N(0, sigma^2)``, ``t = kappa / s`` follows Student's t with ``n`` degrees of freedom for
every ``n``: ``p = 2 T_n(-|t|)`` accounts for the estimated spread instead of pretending it
exact. The reported ``kappa_z = b_n t`` with ``b_n = sqrt(2/n) Gamma(n/2) / Gamma((n-1)/2)``
(``E[1/s] = 1/(b_n sigma)``), so ``kappa_z`` estimates ``kappa / sigma`` without the ``1/s``
bias (+2.4% at n = 32); its relative error is about ``1/sqrt(2n)`` (12.5% at 32 draws).
"""

from __future__ import annotations

import itertools
import math

import numpy as np
import pandas as pd
import torch

from ..errors import CircuitsError
from ..model.families import head_label
from ..model.weights import VOCAB_BLOCK_ELEMENTS, ModelWeights, StreamedWeights
from ..record import figures
from ..record.kappa_method import P_METHODS, UNEMBEDDINGS, KappaMethod
from ..record.read import ov_gain
from .kappa_null import (
    EIG_REL_TOL,
    benjamini_hochberg,
    empirical_p,
    normal_p,
    null_distributions,
    scores_from_eigenvalues,
    symmetric_t,
    z_scores,
)

DEFAULT = KappaMethod()
N_ROTATIONS = DEFAULT.n_rotations  # default draws per head for p_method "t" (exact t test: any n is calibrated)

COLUMNS = figures.columns("kappa")[:12]  # head .. suppression (record/figures.py declares each)
EXTRA_COLUMNS = figures.columns("kappa")[12:]


class SpectrumError(CircuitsError):
    """Bad settings for, or bad input to, the OV spectrum scan."""


def analytic_floor(d_head: int) -> float:
    """The chapter's heuristic noise floor of kappa, ``1/sqrt(2 d_head)`` (not a calibrated null)."""
    return 1.0 / math.sqrt(2 * d_head)


# ---------------------------------------------------------------- reduced OV matrices


def check_unembedding(unembedding: str) -> None:
    if unembedding not in UNEMBEDDINGS:
        raise SpectrumError(f"unknown unembedding {unembedding!r}; use one of: {', '.join(UNEMBEDDINGS)}")


Weights = ModelWeights | StreamedWeights  # held whole, or read from the model one layer / vocabulary block at a time
# The big products' precision: inputs and each vocabulary block's accumulation in float32 (the machine's
# matmul rate), the blocks summed and every result held in float64. docs/definitions.md, "Rung 1's precision".
PRODUCT_DTYPE = torch.float32
PRODUCT_DTYPES = (torch.float32, torch.float64)


def check_product_dtype(dtype) -> None:
    if dtype not in PRODUCT_DTYPES:
        raise SpectrumError(f"product_dtype must be torch.float32 (default) or torch.float64, got {dtype!r}")


def vocab_rows(weights: Weights) -> int:
    """Vocabulary rows per block of ``W_U W_E``: `VOCAB_BLOCK_ELEMENTS` entries of ``W_E``, held whole or streamed alike."""
    return max(1, VOCAB_BLOCK_ELEMENTS // weights.geometry.d_model)


def vocab_products(
    weights: Weights, rows: int | None = None, dtype: torch.dtype = PRODUCT_DTYPE
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """``(W_U W_E, W_U 1, 1^T W_E, vocab)``, float64, summed over blocks of ``rows`` vocabulary rows
    (None: `vocab_rows`): ``W_U W_E = sum_b W_U[:, b] W_E[b]``, each block's product and sums in ``dtype``.
    Memory is two ``d_model x d_model`` matrices and one block, never ``vocab x vocab``."""
    blocks = weights.vocab_blocks(vocab_rows(weights) if rows is None else rows)
    first = next(blocks, None)
    if first is None or first[1].shape[0] == 0:
        raise SpectrumError("the model's embedding has no rows: no W_U W_E to form")
    d_out, d_in = first[0].shape[0], first[1].shape[1]
    raw, u_sum, e_sum = (torch.zeros(shape, dtype=torch.float64) for shape in ((d_out, d_in), d_out, d_in))
    part = torch.empty(d_out, d_in, dtype=dtype)  # one block's product, reused: no allocation per block
    vocab = 0
    for W_U, W_E in itertools.chain([first], blocks):
        W_U, W_E = W_U.to(dtype), W_E.to(dtype)
        raw += torch.matmul(W_U, W_E, out=part)
        u_sum += W_U.sum(dim=1)
        e_sum += W_E.sum(dim=0)
        vocab += W_E.shape[0]
    return raw, u_sum, e_sum, vocab


def unembed_embed_pair(
    weights: Weights, rows: int | None = None, dtype: torch.dtype = PRODUCT_DTYPE
) -> dict[str, torch.Tensor]:
    """``W_U W_E`` (``d_model x d_model``, float64) on both unembeddings, from one product
    (`vocab_products`, each block in ``dtype``): ``"uncentred"`` as stored, ``"centred"``
    ``W_U (I - 11^T / vocab) W_E = W_U W_E - (W_U 1)(1^T W_E) / vocab`` (each residual
    direction's mean over the vocabulary removed from ``W_U``).
    """
    raw, u_sum, e_sum, vocab = vocab_products(weights, rows, dtype)
    return {"uncentred": raw, "centred": raw - torch.outer(u_sum, e_sum) / vocab}


def shared_unembed_embed(
    weights: Weights, unembedding: str = DEFAULT.unembedding, dtype: torch.dtype = PRODUCT_DTYPE
) -> torch.Tensor:
    """``W_U W_E`` (``d_model x d_model``, float64) of the ``unembedding`` chosen: formed once, shared by every head."""
    check_unembedding(unembedding)
    return unembed_embed_pair(weights, dtype=dtype)[unembedding]


def reduced_ov_layer(
    weights: Weights, layer: int, WUE: torch.Tensor | None = None, lw=None, dtype: torch.dtype = PRODUCT_DTYPE
) -> torch.Tensor:
    """``M_h = W_O[h] (W_U W_E) W_V[group(h)]`` for every head of ``layer``: ``(n_heads, d_head, d_head)``,
    float64, multiplied in ``dtype``.

    ``(W_U W_E) W_V`` is formed once per key/value group, then batched over query heads;
    ``WUE`` defaults to the centred ``shared_unembed_embed``; ``lw``: the layer's weights, already read.
    """
    WUE = shared_unembed_embed(weights, dtype=dtype) if WUE is None else WUE
    lw = weights.layer(layer) if lw is None else lw
    read = WUE.to(dtype) @ lw.W_V.to(dtype)  # (n_kv_heads, d_model, d_head)
    read = read.repeat_interleave(weights.geometry.group_size, dim=0)
    return (lw.W_O.to(dtype) @ read).double()


def rank_one_shift(weights: Weights, lw, u: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
    """``(W_O[h] u)(e^T W_V[group(h)])`` of every head of a layer (float64, ``(n_heads, d_head, d_head)``):
    what ``W_U W_E + u e^T`` adds to ``M_h``."""
    written = lw.W_O.double() @ u  # (n_heads, d_head)
    read = (e @ lw.W_V.double()).repeat_interleave(weights.geometry.group_size, dim=0)  # (n_heads, d_head)
    return written.unsqueeze(-1) * read.unsqueeze(-2)


def reduced_ov_stacks(
    weights: Weights,
    WUEs: list[torch.Tensor],
    dtype: torch.dtype = PRODUCT_DTYPE,
    shift: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> list[torch.Tensor]:
    """``M_h`` of every head for each ``W_U W_E`` in ``WUEs``, each ``(n_layers, n_heads, d_head, d_head)``,
    float64 (multiplied in ``dtype``); each layer is read once and dropped before the next (`StreamedWeights`).

    ``shift=(u, e)``: one more stack, that of ``WUEs[0] + u e^T``, from the first plus `rank_one_shift`
    (float64; no second ``d_model^2`` product per group).
    """
    stacks: list[list[torch.Tensor]] = [[] for _ in range(len(WUEs) + (shift is not None))]
    WUEs = [WUE.to(dtype) for WUE in WUEs]  # converted once, not per layer
    for layer in range(weights.n_layers):
        lw = weights.layer(layer)
        for stack, WUE in zip(stacks, WUEs):
            stack.append(reduced_ov_layer(weights, layer, WUE, lw, dtype))
        if shift is not None:
            stacks[-1].append(stacks[0][-1] + rank_one_shift(weights, lw, *shift))
        del lw
    return [torch.stack(stack) for stack in stacks]


def reduced_ov(
    weights: Weights,
    unembedding: str = DEFAULT.unembedding,
    WUE: torch.Tensor | None = None,
    dtype: torch.dtype = PRODUCT_DTYPE,
) -> torch.Tensor:
    """``M_h`` of every head of the model: ``(n_layers, n_heads, d_head, d_head)``, float64, multiplied
    in ``dtype`` (``WUE``: an already formed ``shared_unembed_embed`` of ``unembedding``)."""
    WUE = shared_unembed_embed(weights, unembedding, dtype) if WUE is None else WUE
    return reduced_ov_stacks(weights, [WUE], dtype)[0]


# ---------------------------------------------------------------- scores from eigenvalues


def kappa_scores(M: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(eigenvalues, kappa, kappa_trace)`` of a batch of square matrices, in float64."""
    lam = torch.linalg.eigvals(M.double())
    kappa, trace = scores_from_eigenvalues(lam)
    return lam, kappa, trace


# ---------------------------------------------------------------- the rotation null


def check_settings(
    n_rotations: int,
    q: float,
    seed: int,
    p_method: str,
    null_dtype=torch.float64,
    n_workers=None,
    min_effect: float = DEFAULT.min_effect,
) -> None:
    if isinstance(min_effect, bool) or not isinstance(min_effect, (int, float)) or not 0.0 <= min_effect < 2.0:
        raise SpectrumError(
            f"min_effect (the least |kappa - null mean| a flag needs) must be in [0, 2), got {min_effect!r}"
        )
    if isinstance(n_rotations, bool) or not isinstance(n_rotations, int) or n_rotations < 2:
        raise SpectrumError(f"n_rotations must be an integer >= 2 (32 or more recommended), got {n_rotations!r}")
    if not isinstance(q, (int, float)) or not 0.0 < q < 1.0:
        raise SpectrumError(f"q (the false discovery rate) must be between 0 and 1, got {q!r}")
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
        raise SpectrumError(f"seed must be a non-negative integer, got {seed!r}")
    if p_method not in P_METHODS:
        raise SpectrumError(f"unknown p_method {p_method!r}; use one of: {', '.join(P_METHODS)}")
    if n_workers is not None and (isinstance(n_workers, bool) or not isinstance(n_workers, int) or n_workers < 1):
        raise SpectrumError(f"n_workers must be a positive integer or None, got {n_workers!r}")
    if null_dtype not in (torch.float32, torch.float64):
        raise SpectrumError(f"null_dtype must be torch.float64 (default) or torch.float32, got {null_dtype!r}")


FLAG_SCORES = (("kappa", ""), ("kappa_trace", "_trace"))  # each score and the suffix of its flags


def set_flags(frame: pd.DataFrame, q: float, min_effect: float) -> pd.DataFrame:
    """Set the flags of every head in place: ``copying = kappa_q <= q and |kappa - kappa_null_mean| >=
    min_effect and kappa > 0``, ``suppression`` likewise with ``kappa < 0``; ``copying_trace`` and
    ``suppression_trace`` the same on ``kappa_trace``. ``min_effect = 0``: the q-value alone.

    A q-value says a head differs from its null; with 256-wide heads the null is so narrow that a
    kappa of 0.015 is significant, and whether it clears BH turns on the null's draw. The minimum
    effect keeps a flag for heads whose kappa is far from the null in kappa's own units.
    """
    for score, suffix in FLAG_SCORES:
        kappa = frame[score].to_numpy(float)
        effect = np.abs(kappa - frame[f"{score}_null_mean"].to_numpy(float))
        flagged = (frame[f"{score}_q"].to_numpy(float) <= q) & (effect >= min_effect)
        frame[f"copying{suffix}"] = flagged & (kappa > 0)
        frame[f"suppression{suffix}"] = flagged & (kappa < 0)
    summary = frame.attrs.get("summary")
    if summary is not None:
        summary.update(
            q=float(q),
            min_effect=float(min_effect),
            n_copying=int(frame["copying"].sum()),
            n_suppression=int(frame["suppression"].sum()),
        )
    return frame


def reflagged(frame: pd.DataFrame, min_effect: float) -> pd.DataFrame:
    """A copy of a spectrum ``frame`` flagged with another ``min_effect`` (the same q; `set_flags`):
    the same scan, no eigenvalue computed again. The arrays in ``attrs`` are shared, the summary copied."""
    copy = frame.copy()
    copy.attrs = {**frame.attrs, "summary": dict(frame.attrs["summary"])}
    return set_flags(copy, frame.attrs["summary"]["q"], min_effect)


def spectrum_frame(
    weights: Weights,
    eigenvalues: np.ndarray,
    kappa: np.ndarray,
    kappa_trace: np.ndarray,
    null_kappa: np.ndarray,
    null_trace: np.ndarray,
    *,
    q: float,
    seed: int,
    p_method: str = "t",
    null_dtype: torch.dtype = torch.float64,
    unembedding: str = DEFAULT.unembedding,
    uncentred: tuple[np.ndarray, np.ndarray] | None = None,
    product_dtype: torch.dtype = torch.float64,
    min_effect: float = DEFAULT.min_effect,
) -> pd.DataFrame:
    """Turn per-head scores and nulls (``(n_layers, n_heads[, ...])`` arrays) into the result frame,
    its heads flagged by `set_flags` (``q``, ``min_effect``).

    ``unembedding``: which ``W_U`` the scores read; ``uncentred``: ``(kappa, kappa_trace)`` on the
    uncentred ``W_U`` (the scores themselves when None, i.e. when they are the uncentred ones).
    Shared by the batched scan and the per-head reference, so both report identically.
    """
    if uncentred is None:
        if unembedding != "uncentred":
            raise SpectrumError("spectrum_frame: a centred frame needs the uncentred scores beside it")
        uncentred = (kappa, kappa_trace)
    geo = weights.geometry
    n_layers, n_heads = kappa.shape
    n_rotations = null_kappa.shape[-1]
    stats = {}
    for name, observed, null in (("kappa", kappa, null_kappa), ("kappa_trace", kappa_trace, null_trace)):
        if p_method == "t":
            mean, sd, z, p_t = symmetric_t(observed, null)
        else:
            mean, sd, z = z_scores(observed, null)
        p_norm, p_emp = normal_p(z), empirical_p(observed, null)
        p = p_t if p_method == "t" else p_norm if p_method == "normal" else p_emp
        p = np.where(sd > 0, p, 1.0)
        stats[name] = dict(mean=mean, sd=sd, z=z, p=p, p_emp=p_emp, q=benjamini_hochberg(p).reshape(p.shape))
    layers = np.repeat(np.arange(n_layers), n_heads)
    heads = np.tile(np.arange(n_heads), n_layers)
    k, t = stats["kappa"], stats["kappa_trace"]
    unset = np.zeros(n_layers * n_heads, dtype=bool)  # the flags' places; set_flags fills them
    frame = pd.DataFrame(
        {
            "head": [head_label(int(l), int(h)) for l, h in zip(layers, heads)],
            "layer": layers,
            "head_index": heads,
            "kappa": kappa.ravel(),
            "kappa_trace": kappa_trace.ravel(),
            "kappa_null_mean": k["mean"].ravel(),
            "kappa_null_sd": k["sd"].ravel(),
            "kappa_z": k["z"].ravel(),
            "kappa_p": k["p"].ravel(),
            "kappa_q": k["q"].ravel(),
            "copying": unset,
            "suppression": unset,
            "kappa_p_empirical": k["p_emp"].ravel(),
            "kappa_trace_null_mean": t["mean"].ravel(),
            "kappa_trace_null_sd": t["sd"].ravel(),
            "kappa_trace_z": t["z"].ravel(),
            "kappa_trace_p": t["p"].ravel(),
            "kappa_trace_q": t["q"].ravel(),
            "kappa_trace_p_empirical": t["p_emp"].ravel(),
            "copying_trace": unset,
            "suppression_trace": unset,
            "kv_group": np.array([geo.kv_group(int(h)) for h in heads]),
            "ov_gain": ov_gain(eigenvalues).ravel(),
            "kappa_uncentred": np.asarray(uncentred[0]).ravel(),
            "kappa_trace_uncentred": np.asarray(uncentred[1]).ravel(),
        }
    )
    frame.attrs["eigenvalues"] = eigenvalues
    frame.attrs["null_kappa"] = null_kappa
    frame.attrs["null_kappa_trace"] = null_trace
    frame.attrs["summary"] = {
        "analytic_floor": analytic_floor(geo.d_head),
        "median_null_sd": float(np.median(k["sd"])),
        "median_trace_null_sd": float(np.median(t["sd"])),
        "q": float(q),
        "min_effect": float(min_effect),
        "n_rotations": int(n_rotations),
        "seed": int(seed),
        "folded": bool(weights.folded),
        "unembedding": unembedding,
        "p_method": p_method,
        "null_dtype": str(null_dtype).removeprefix("torch."),
        "product_dtype": str(product_dtype).removeprefix("torch."),
        "eig_rel_tol": EIG_REL_TOL,
        "family": weights.family,
        "d_head": int(geo.d_head),
        "n_heads_total": int(n_layers * n_heads),
    }
    return set_flags(frame, q, min_effect)


def _sorted_by_magnitude(lam: torch.Tensor) -> np.ndarray:
    order = torch.argsort(lam.abs(), dim=-1, descending=True, stable=True)
    return torch.gather(lam, -1, order).numpy()


@torch.no_grad()
def ov_spectrum(
    weights: Weights,
    *,
    n_rotations: int = N_ROTATIONS,
    q: float = 0.05,
    seed: int = 0,
    p_method: str = "t",
    n_workers: int | None = None,
    null_dtype: torch.dtype = torch.float32,
    unembedding: str = DEFAULT.unembedding,
    min_effect: float = DEFAULT.min_effect,
    product_dtype: torch.dtype = PRODUCT_DTYPE,
) -> pd.DataFrame:
    """kappa and kappa_trace of every head, each against its rotation null, BH across all heads.

    ``unembedding="centred"`` (the default) reads ``W_U`` less its mean over the vocabulary
    (`unembed_embed_pair`); ``kappa_uncentred`` and ``kappa_trace_uncentred`` give the scores
    on the stored ``W_U`` beside it (one more eigenvalue problem per head, no null).

    One row per head (layer-major) with the columns of ``COLUMNS`` then ``EXTRA_COLUMNS``:
    ``kappa_z = (kappa - kappa_null_mean) / kappa_null_sd``; ``kappa_p`` two-sided
    (``p_method="t"``, the default: null mean 0 by symmetry, ``p = 2 T_n(-|t|)``, ``kappa_z``
    bias-corrected, see `symmetric_t` and the module docstring; ``"normal"``: ``2 Phi(-|z|)``;
    ``"empirical"``: ``(1 + #{|k0 - mean| >= |k - mean|}) / (n_rotations + 1)``);
    ``kappa_q`` Benjamini-Hochberg over all heads; ``copying = kappa_q <= q and |kappa - kappa_null_mean|
    >= min_effect and kappa > 0``, ``suppression`` the same with ``kappa < 0`` (`set_flags`; ``min_effect=0``:
    the q-value alone). The ``kappa_trace_*`` columns and
    ``copying_trace``/``suppression_trace`` do the same for the trace-weighted score.

    ``df.attrs`` keys:

    * ``"eigenvalues"``: complex128 ``(n_layers, n_heads, d_head)``, each head's eigenvalues
      of ``M_h`` sorted by decreasing ``|l|``;
    * ``"null_kappa"``, ``"null_kappa_trace"``: float64 ``(n_layers, n_heads, n_rotations)``;
    * ``"summary"``: dict with ``analytic_floor`` (``1/sqrt(2 d_head)``), ``median_null_sd``,
      ``median_trace_null_sd``, ``q``, ``min_effect``, ``n_rotations``, ``seed``, ``folded``, ``p_method``,
      ``unembedding``, ``null_dtype``, ``product_dtype``, ``eig_rel_tol``, ``family``, ``d_head``, ``n_heads_total``, ``n_copying``, ``n_suppression``.

    ``W_U W_E`` and every ``M_h`` are multiplied in ``product_dtype`` (default float32: inputs and each
    vocabulary block's accumulation; blocks summed, results and the centring in float64); the uncentred
    ``M_h`` is the centred one plus its rank-one shift (`reduced_ov_stacks`). Against float64 products
    kappa and kappa_trace move by under 1e-4 (tests/test_kappa.py; docs/definitions.md).
    The head's own eigenvalues are float64; the null's are ``null_dtype``, by default float32
    (about 1.3x faster; their rounding, ~1e-6 in kappa, is far below the null's sampling error).
    ``n_workers`` threads share the null (default ``torch.get_num_threads()``).

    The attrs hold numpy arrays, which pandas cannot compare: drop them (``without_attrs``)
    before ``pd.concat`` or ``merge`` of two spectra.
    """
    check_settings(n_rotations, q, seed, p_method, null_dtype, n_workers, min_effect)
    if not isinstance(weights, (ModelWeights, StreamedWeights)):
        raise SpectrumError(
            f"ov_spectrum takes ModelWeights (from extract_weights) or StreamedWeights, got {type(weights).__name__}; "
            "for a model use ov_spectrum_of_model"
        )
    check_unembedding(unembedding)
    check_product_dtype(product_dtype)
    raw, u_sum, e_sum, vocab = vocab_products(weights, dtype=product_dtype)
    both = unembedding != "uncentred"
    if both:  # the centred stack multiplied, the uncentred one its rank-one shift: raw = centred + u e^T / vocab
        raw.sub_(torch.outer(u_sum, e_sum) / vocab)  # centred in place: one d_model^2 float64 matrix held
        stacks = reduced_ov_stacks(weights, [raw], product_dtype, shift=(u_sum / vocab, e_sum))
    else:
        stacks = reduced_ov_stacks(weights, [raw], product_dtype)
    del raw
    M = stacks[0]
    lam, kappa, trace = kappa_scores(M)
    uncentred = None
    if both:
        _, kappa_u, trace_u = kappa_scores(stacks[1])
        uncentred = (kappa_u.numpy(), trace_u.numpy())
    null_k, null_t = null_distributions(M, n_rotations, int(seed), n_workers, null_dtype)
    return spectrum_frame(
        weights,
        _sorted_by_magnitude(lam),
        kappa.numpy(),
        trace.numpy(),
        null_k,
        null_t,
        q=q,
        seed=int(seed),
        p_method=p_method,
        null_dtype=null_dtype,
        unembedding=unembedding,
        uncentred=uncentred,
        min_effect=min_effect,
        product_dtype=product_dtype,
    )


def ov_spectrum_of_model(model, fold: bool = True, **kw) -> pd.DataFrame:
    """``ov_spectrum`` of a CausalLM or a LoadedBuild, its weights read one layer at a time
    (`StreamedWeights`: the same figures as from ``extract_weights(model, fold)``)."""
    model = getattr(model, "model", model) if not isinstance(model, torch.nn.Module) else model
    if not isinstance(model, torch.nn.Module):
        raise SpectrumError(f"ov_spectrum_of_model takes a CausalLM or a LoadedBuild, got {type(model).__name__}")
    return ov_spectrum(StreamedWeights.of(model, fold=fold), **kw)


def without_attrs(frame: pd.DataFrame) -> pd.DataFrame:
    """A shallow copy of ``frame`` with empty ``attrs`` (safe to ``pd.concat``/``merge``)."""
    plain = frame.copy(deep=False)
    plain.attrs = {}
    return plain
