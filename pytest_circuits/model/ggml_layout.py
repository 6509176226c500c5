"""How llama.cpp lays a head out before it writes it into a quantized cache, so that the torch
simulation of its blocks (`kv_cache.ggml_roundtrip`) cuts the same 32 values into each block.

Read from ggml-org/llama.cpp as llama-cpp-python 0.3.36 vendors it (commit 0c1e570):

- **Key order.** ``convert_hf_to_gguf.py`` permutes the rows of W_Q and W_K of the Llama converter
  (``LlamaModel.permute``; Llama, Mistral and Mixtral checkpoints) so that rotary pairs are adjacent,
  as llama.cpp's ``LLAMA_ROPE_TYPE_NORM`` wants: channel ``2i + j`` of a GGUF head is channel
  ``j d/2 + i`` of the Hugging Face head. A block of 32 then holds channels ``i..i+15`` and
  ``d/2+i..d/2+i+15``. Values are not permuted; other families keep the Hugging Face order.
- **Rotation** (``llama-kv-cache.cpp``: ``attn_rot_k`` / ``attn_rot_v``; ``llama-graph.cpp``:
  ``build_attn``). With a quantized cache and a head size a multiple of 64, Q and K (after RoPE) are
  multiplied by the orthonormal Walsh-Hadamard matrix ``H_n`` (Sylvester's, entries ``+-1/sqrt(n)``,
  ``H_n^2 = I``) in blocks of ``n`` along the head, ``n`` the largest power of two dividing ``d_head``;
  V by ``H_64``, and the attention output by ``H_64`` again. ``LLAMA_ATTN_ROT_DISABLE=1`` in the
  environment turns both off; the simulation reads the same variable.

Q goes through the same orthogonal maps as K, so a score ``(H P q) . dq(H P k)`` is ``q . P^T H dq(H P
k)``, and an output ``H sum_s a_s dq(H v_s)`` is ``sum_s a_s H dq(H v_s)``: the keys and values the
simulation hands to attention are ``P^T H dq(H P k)`` and ``H dq(H v)`` (`GgmlLayout.roundtrip`).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass

import torch

LLAMA_CPP_SOURCE = "llama.cpp 0c1e570 (llama-cpp-python 0.3.36)"
ROTATION_SWITCH = "LLAMA_ATTN_ROT_DISABLE"
MIN_ROTATION = 64  # llama.cpp rotates a head whose size is a multiple of 64, values always by H_64
INTERLEAVED_MODEL_TYPES = ("llama", "mistral", "mixtral")  # convert_hf_to_gguf's LlamaModel permutes W_Q, W_K


def hadamard(n: int, device=None) -> torch.Tensor:
    """Sylvester's ``H_n`` / sqrt(n) (``n`` a power of two), float32, as ``ggml_gen_hadamard`` builds it."""
    h = torch.ones(1, 1, dtype=torch.float32, device=device)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h / n**0.5


def rotation_disabled(environ=None) -> bool:
    """llama.cpp's own test: ``atoi(getenv("LLAMA_ATTN_ROT_DISABLE")) != 0``."""
    text = (os.environ if environ is None else environ).get(ROTATION_SWITCH, "").strip()
    digits = text.lstrip("+-")
    digits = digits[: len(digits) - len(digits.lstrip("0123456789"))]
    return bool(digits) and int(digits) != 0


def key_rotation(d_head: int) -> int:
    """The size of llama.cpp's key rotation: the largest power of two >= 64 dividing ``d_head`` (0: none)."""
    if d_head % MIN_ROTATION:
        return 0
    n = MIN_ROTATION
    while d_head % (2 * n) == 0:
        n *= 2
    return n


@dataclass(frozen=True)
class GgmlLayout:
    """A head as llama.cpp stores it: ``interleaved`` keys (GGUF's rotary order) and the Hadamard
    block sizes of keys and values (0: not rotated; ``disabled``: by ``LLAMA_ATTN_ROT_DISABLE``)."""

    interleaved: bool
    key_block: int
    value_block: int
    disabled: bool = False

    def describe(self) -> str:
        """The identity's words: ``keys in GGUF's interleaved rotary order; Q and K rotated by H_64, ...``."""
        order = "keys in GGUF's interleaved rotary order" if self.interleaved else "keys in the checkpoint's order"
        if self.key_block or self.value_block:
            rot = f"Q and K rotated by a {self.key_block}x{self.key_block} Walsh-Hadamard matrix, V and the output "
            rot += f"by {self.value_block}x{self.value_block}, before the blocks"
        elif self.disabled:
            rot = f"no Hadamard rotation ({ROTATION_SWITCH} set)"
        else:
            rot = f"no Hadamard rotation (head size not a multiple of {MIN_ROTATION})"
        return f"as {LLAMA_CPP_SOURCE} stores it: {order}; {rot}"

    def keys(self, k: torch.Tensor, blocks: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """``P^T H dq(H P k)`` for keys ``(..., d_head)``, ``blocks`` the quantize-dequantize of 32-blocks."""
        order = interleaved_order(k.shape[-1], k.device) if self.interleaved else None
        x = k if order is None else k[..., order]
        x = _rotate(blocks(_rotate(x, self.key_block)), self.key_block)
        return x if order is None else x[..., torch.argsort(order)]

    def values(self, v: torch.Tensor, blocks: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """``H dq(H v)`` for values ``(..., d_head)``."""
        return _rotate(blocks(_rotate(v, self.value_block)), self.value_block)


def interleaved_order(d_head: int, device=None) -> torch.Tensor:
    """GGUF channel ``c`` of a head is Hugging Face channel ``order[c]``: ``order[2i + j] = j d/2 + i``."""
    return torch.arange(d_head, device=device).view(2, d_head // 2).t().reshape(-1)


def _rotate(x: torch.Tensor, n: int) -> torch.Tensor:
    """``x`` times ``H_n`` in blocks of ``n`` along the last axis (``H_n`` is symmetric; 0: unchanged)."""
    if not n:
        return x
    shape = x.shape
    return (x.reshape(*shape[:-1], shape[-1] // n, n) @ hadamard(n, x.device)).reshape(shape)


def ggml_layout(model_type: str, d_head: int, environ=None) -> GgmlLayout:
    """The layout llama.cpp (`LLAMA_CPP_SOURCE`) gives a quantized cache of a ``model_type`` model."""
    interleaved = model_type in INTERLEAVED_MODEL_TYPES
    if rotation_disabled(environ):
        return GgmlLayout(interleaved, 0, 0, disabled=True)
    key = key_rotation(d_head)
    return GgmlLayout(interleaved, key, MIN_ROTATION if key else 0)
