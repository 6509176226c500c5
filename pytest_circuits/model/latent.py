"""Multi-head latent attention (DeepSeek-V2/V3, GLM-4.7-Flash): each head's value map read through the
shared latent.

The layer projects the (normed) residual ``x`` to a latent and a RoPE key part,
``[c_raw | k_R] = x W_A`` (``kv_a_proj_with_mqa``, ``r + d_rope`` rows), normalises the latent,
``c = c_raw / s(x) * g_c`` with ``s(x) = sqrt(mean c_raw^2 + eps)`` (RMSNorm ``kv_a_layernorm``),
and expands it per head, ``[k_h | v_h] = c W_B^h`` (``kv_b_proj``: ``d_nope`` key then ``d_v`` value
columns per head). So ``v_h = x W_DKV diag(g_c) W_UV^h / s(x)``: head h's ``W_V`` is
``W_DKV diag(g_c) W_UV^h`` (``d_model x d_v``), and the latent norm's divisor ``s(x)`` is one
positive factor per position, as the pre-attention norm's is: it leaves kappa alone and the
self-check applies it. Keys ``[c W_UK^h | rope(k_R)]`` (``k_R`` shared by every head) and
queries (their own low-rank projection and norm) change ``A`` only; there is no ``W_Q``, ``W_K``
as one linear map of ``x``, so the read gives none.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .dense import dense_bias, dense_weight, weight_of
from .family_table import Family, Geometry
from .module_paths import get_module


@dataclass
class LatentRead:
    """The value side of one latent attention layer: ``W_DKV`` ``(d_model, r)``, ``g_c`` ``(r,)``, the
    latent norm's ``eps``, ``W_UV`` ``(n_heads, r, d_v)``."""

    W_DKV: torch.Tensor
    g_c: torch.Tensor
    eps: float
    W_UV: torch.Tensor

    def W_V(self) -> torch.Tensor:
        """``W_DKV diag(g_c) W_UV^h`` for every head: ``(n_heads, d_model, d_v)``, the divisor left out."""
        return (self.W_DKV * self.g_c.to(self.W_DKV.device))[None] @ self.W_UV

    def values(self, x: torch.Tensor) -> torch.Tensor:
        """``v_h = norm_c(x W_DKV) W_UV^h`` in float64: ``(batch, n_heads, T, d_v)`` from ``x`` ``(batch, T, d_model)``."""
        c = x.double() @ self.W_DKV.double().to(x.device)
        c = c / (c.pow(2).mean(dim=-1, keepdim=True) + self.eps).sqrt() * self.g_c.double().to(x.device)
        return torch.einsum("btr,hrv->bhtv", c, self.W_UV.double().to(x.device))


def read_latent(attn: torch.nn.Module, fam: Family, geo: Geometry, device: torch.device) -> LatentRead:
    """The `LatentRead` of one attention module of a ``latent_attention`` family (float32, dequantized)."""
    down, up = (get_module(attn, name) for name in fam.qkv)
    if dense_bias(down) is not None:  # a bias inside the latent norm is no linear map of x: refused in the table
        raise ValueError(f"{type(down).__name__} {fam.qkv[0]} has a bias; the latent read assumes none")
    assert fam.latent_norm is not None, "a latent family names its latent norm"
    norm = get_module(attn, fam.latent_norm)
    g_c = weight_of(norm).detach().float().to(device) + fam.norm_weight_offset
    r = g_c.shape[0]
    W_DKV = dense_weight(down).to(device)[:r].T  # (d_model, r): the latent rows, not the RoPE key rows
    W_B = dense_weight(up).to(device).reshape(geo.n_heads, -1, r)  # per head: d_nope key rows, then d_v value rows
    W_UV = W_B[:, -geo.d_head :].transpose(1, 2).contiguous()  # (n_heads, r, d_v)
    eps = [v for v in (getattr(norm, a, None) for a in ("variance_epsilon", "eps")) if isinstance(v, float)]
    if not eps:
        raise ValueError(f"the latent norm {fam.latent_norm} ({type(norm).__name__}) names no eps")
    return LatentRead(W_DKV=W_DKV.contiguous(), g_c=g_c, eps=eps[0], W_UV=W_UV)
