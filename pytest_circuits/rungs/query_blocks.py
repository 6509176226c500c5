"""A sequence run through the model in blocks of queries, each block reading the keys before it from a cache.

One forward over ``T`` tokens holds, in eager attention, one layer's pattern ``(batch, heads, T, T)``
(scores and softmax) and the logits ``(batch, T, vocab)``. Run as a chunked prefill, ``c``
queries at a time through a ``DynamicCache``, it holds ``(batch, heads, c, T)`` and
``(batch, c, vocab)`` instead, plus the cache's keys and values: `query_block` picks the largest
``c`` that keeps each under `BLOCK_BYTES`, and ``c = T`` (one forward, the probe's usual path)
whenever that fits. Decode mode is ``c = 1`` through the build's own cache (`model.quantized_cache`).

A block's attention weights are ``(batch, heads, c, T_k)`` with ``T_k = start + c``: the routing
hooks read the block's first position as ``T_k - c``.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterator

import torch

BLOCK_BYTES = 256 * 1024**2  # the most one block's pattern (scores + softmax), or its logits, may take


def query_block(geometry, batch: int, T: int) -> int:
    """Queries per block: ``T`` (one forward) if a ``(batch, heads, T, T)`` float32 pattern and
    softmax (``8 b H T^2`` bytes) and the logits (``4 b T V``) each fit `BLOCK_BYTES`, else the most that do."""
    per_query = max(8 * batch * geometry.n_heads * T, 4 * batch * geometry.vocab)
    return max(1, min(T, BLOCK_BYTES // per_query))


def forward_blocks(model, ids: torch.Tensor, block: int, past=None) -> Iterator[tuple[int, torch.Tensor]]:
    """``(start, logits)`` of ``ids`` ``(batch, T)`` run ``block`` queries at a time: one forward
    without a cache when ``block >= T`` and no ``past`` is given, else a chunked prefill through
    ``past`` (default a fresh ``DynamicCache``)."""
    T = ids.shape[1]
    if block >= T and past is None:
        yield 0, model(input_ids=ids, use_cache=False).logits
        return
    if past is None:
        from transformers.cache_utils import DynamicCache

        past = DynamicCache(config=model.config)
    name = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    for start in range(0, T, block):
        yield start, model(input_ids=ids[:, start : start + block], use_cache=True, **{name: past}).logits


def block_losses(logits: torch.Tensor, ids: torch.Tensor, start: int) -> torch.Tensor:
    """``(batch, c')`` float32 cross-entropy of predicting ``ids[:, t + 1]`` from a block's logits
    at positions ``t = start ..`` (the last position of the sequence predicts nothing), one row at a time."""
    stop = min(start + logits.shape[1], ids.shape[1] - 1)
    if stop <= start:
        return torch.zeros(ids.shape[0], 0)
    targets = ids[:, start + 1 : stop + 1].to(logits.device)
    rows = [
        torch.nn.functional.cross_entropy(logits[i, : stop - start].float(), targets[i], reduction="none")
        for i in range(ids.shape[0])
    ]
    return torch.stack(rows).cpu()
