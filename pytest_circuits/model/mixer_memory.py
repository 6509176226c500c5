"""The transient memory of a Mamba-2 mixer's PyTorch reference scan, and the rows it allows.

Without the ``mamba_ssm`` kernels (none on a CPU) transformers runs a hybrid stack's Mamba-2 mixers
(`falcon_h1`, `bamba`, `granitemoehybrid`, `nemotron_h`) through its reference chunked scan, which
forms, per sequence and layer, the products ``C_i B_j`` of every pair of positions of a chunk for
every head and state channel: ``ceil(T / c) c^2 h N`` values (``c`` the chunk size, ``h`` the SSM
heads, ``N`` the state size). On Falcon-H1-1.5B at the probe's 129 tokens that is 1.6 GB per
sequence in bfloat16 (chunk 256, 48 heads, state 256): eight sequences at once are 13 GB for a
3.1 GB model. `scan_rows` caps the sequences of one forward so that this stays under the same
budget as the screen's saved activations.
"""

from __future__ import annotations

import importlib.util
from typing import Any

import torch

# (SSM heads, state size, chunk size) attribute names per config, first match wins
SSM_ATTRS = (
    ("mamba_n_heads", "mamba_d_state", "mamba_chunk_size"),
    ("mamba_num_heads", "ssm_state_size", "chunk_size"),
)
ACTIVATION_FLOOR = 256 << 20  # the budget: this plus an eighth of the weights (as the screen's, `screen.screen_rows`)


def reference_scan_bytes(model: Any, tokens: int, device: str | torch.device) -> int:
    """Bytes of the largest transient tensor of one sequence's reference scan, ``ceil(T/c) c^2 h N``
    values of the model's dtype; 0 for a model without Mamba-2 mixers or with the fused kernels."""
    config = getattr(model, "config", None)
    if torch.device(device).type == "cuda" and importlib.util.find_spec("mamba_ssm") is not None:
        return 0
    for heads_attr, state_attr, chunk_attr in SSM_ATTRS:
        heads, state, chunk = (getattr(config, name, None) for name in (heads_attr, state_attr, chunk_attr))
        if heads and state and chunk:
            item = getattr(model, "dtype", torch.float32).itemsize
            return -(-tokens // chunk) * chunk * chunk * heads * state * item
    return 0


def scan_rows(model: Any, batch_size: int, tokens: int, device: str | torch.device) -> int:
    """Sequences per forward: ``batch_size``, or fewer where the reference scan's transient
    (`reference_scan_bytes`) would pass ``ACTIVATION_FLOOR + weights / 8`` (at least one)."""
    per_row = reference_scan_bytes(model, tokens, device)
    if per_row == 0:
        return batch_size
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    return max(1, min(batch_size, (ACTIVATION_FLOOR + weights // 8) // per_row))
