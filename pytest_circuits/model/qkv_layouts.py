"""Per-head slicing of Q/K/V: each packing of the projections (`QKV_LAYOUTS`) split into heads."""

from __future__ import annotations

import torch

from ..errors import UnknownFamilyError
from .family_table import Geometry

# ---------------------------------------------------------------- per-head slicing of Q/K/V


def split_qkv(layout: str, weights: list[torch.Tensor], geo: Geometry):
    """Split dense ``(out, in)`` projection weights (or biases, 1-D) into per-head Q, K, V.

    Returns ``(q, k, v)`` with leading head axes: weights ``(heads, d_head, in)``,
    biases ``(heads, d_head)``; ``k`` and ``v`` have ``n_kv_heads`` heads. The ``latent`` layout (`latent.py`)
    has no per-head rows of one projection: refused in one line.
    """
    if layout not in QKV_LAYOUTS:
        raise UnknownFamilyError(
            f"the {layout!r} Q/K/V layout has no per-head rows of a Q/K/V projection (multi-head latent attention: "
            "queries and keys pass through low-rank norms); this operation is not defined for it"
        )
    return QKV_LAYOUTS[layout](weights, geo)


def _fused_split(weights, geo):
    """Rows ``[q | k | v]``: ``n_heads*d_head`` query rows, then ``n_kv_heads*d_head`` each of K and V
    (GPT-2 thirds, Phi-3 qkv_proj, GPT-BigCode and Falcon multi-query); head h is a block of rows."""
    (w,) = weights
    kv_rows = geo.n_kv_heads * geo.d_head
    q, k, v = w.split([geo.n_heads * geo.d_head, kv_rows, kv_rows], dim=0)
    return (
        q.reshape(geo.n_heads, geo.d_head, *q.shape[1:]),
        k.reshape(geo.n_kv_heads, geo.d_head, *k.shape[1:]),
        v.reshape(geo.n_kv_heads, geo.d_head, *v.shape[1:]),
    )


def _fused_per_head(weights, geo):
    """GPT-NeoX, BLOOM, Falcon and GPT-BigCode multi-head: rows grouped per head as ``[q_h | k_h | v_h]``."""
    (w,) = weights
    per_head = w.reshape(geo.n_heads, 3, geo.d_head, *w.shape[1:])
    return per_head[:, 0], per_head[:, 1], per_head[:, 2]


def _fused_grouped(weights, geo):
    """Falcon's new decoder: per K/V group g, rows ``[q_{g,0} .. q_{g,G-1} | k_g | v_g]`` (G = group size)."""
    (w,) = weights
    grouped = w.reshape(geo.n_kv_heads, geo.group_size + 2, geo.d_head, *w.shape[1:])
    q = grouped[:, : geo.group_size].reshape(geo.n_heads, geo.d_head, *w.shape[1:])
    return q, grouped[:, -2], grouped[:, -1]


def _separate(weights, geo):
    """Separate q_proj, k_proj, v_proj, each head a block of rows."""
    wq, wk, wv = weights
    return (
        wq.reshape(geo.n_heads, geo.d_head, *wq.shape[1:]),
        wk.reshape(geo.n_kv_heads, geo.d_head, *wk.shape[1:]),
        wv.reshape(geo.n_kv_heads, geo.d_head, *wv.shape[1:]),
    )


def _separate_gated(weights, geo):
    """Qwen3-Next's gated attention: q_proj rows per head ``[q_h | g_h]`` (its output gate's rows after
    the query's), then k_proj, v_proj as `_separate`; the query halves here, the gate's in `split_gate`."""
    wq, wk, wv = weights
    per_head = wq.reshape(geo.n_heads, 2, geo.d_head, *wq.shape[1:])
    _, k, v = _separate([wq[: geo.n_heads * geo.d_head], wk, wv], geo)
    return per_head[:, 0], k, v


def split_gate(weight: torch.Tensor, geo) -> torch.Tensor:
    """The output gate's rows of a ``separate_gated`` q_proj weight (or bias): ``(n_heads, d_head, ...)``."""
    return weight.reshape(geo.n_heads, 2, geo.d_head, *weight.shape[1:])[:, 1]


QKV_LAYOUTS = {
    "separate_gated": _separate_gated,
    "fused_split": _fused_split,
    "fused_per_head": _fused_per_head,
    "fused_grouped": _fused_grouped,
    "separate": _separate,
}


def qkv_rows(layout: str, geo: Geometry) -> tuple[list[list[int]], list[list[int]], list[list[int]]]:
    """Row indices (per projection module, concatenated) of each head's Q, each group's K and V.

    Derived by splitting an index vector with the layout itself, so it cannot disagree with `split_qkv`.
    """
    if layout in ("separate", "separate_gated"):
        q_rows = geo.n_heads * geo.d_head * (2 if layout == "separate_gated" else 1)
        sizes = [q_rows, geo.n_kv_heads * geo.d_head, geo.n_kv_heads * geo.d_head]
        parts = [torch.arange(s) for s in sizes]
    else:
        total = geo.n_heads * geo.d_head + 2 * geo.n_kv_heads * geo.d_head
        parts = [torch.arange(total)]
    q, k, v = split_qkv(layout, parts, geo)
    return q.tolist(), k.tolist(), v.tolist()
