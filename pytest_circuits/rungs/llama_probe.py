"""The repeat probe run by llama.cpp on a GGUF file (``--circuits-engine llama.cpp``, `model.llama_engine`):
copy losses from its logits, routing scores from its attention patterns where it forms them
(`model.llama_attention`), on the torch probe's sequences."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import torch

from ..model.llama_attention import PatternReader
from ..model.llama_engine import EngineError, LlamaRunner, routed
from .probe import RepeatProbe, heads_frame, position_slice, routing_sums, score_counts
from .repeat import bos_offset, next_token_losses, repeat_losses, repeat_tokens


def llama_repeat_probe(path: Path, tokens, geometry, settings, kv=None, threads: int = 1):
    """The repeat probe (`probe.RepeatProbe`) of GGUF file ``path`` run by llama.cpp: copy loss,
    first-copy loss, copy gain and the per-position loss from its logits, on the torch probe's
    sequences; the routing scores from its attention patterns where it forms them (its f16
    cache, without flash attention: `llama_attention`), else NaN; path factors NaN (`NOT_MEASURED`)."""

    L, n = settings.L, settings.n
    offset = bos_offset(tokens)
    ids = repeat_tokens(tokens, n, L, settings.seed)
    T = ids.shape[1]
    sums: list = [None] * geometry.n_layers

    def add(layer: int, pattern) -> None:  # one layer's pattern of one sequence, reduced as it is computed
        layer_sums = routing_sums(torch.from_numpy(pattern).unsqueeze(0), L, offset)
        sums[layer] = layer_sums if sums[layer] is None else sums[layer] + layer_sums

    reader = PatternReader(geometry.n_layers, T, add) if routed(kv) else None
    runner = LlamaRunner(path, n_ctx=T, kv=kv, threads=threads, reader=reader)
    try:
        if runner.n_vocab != geometry.vocab:
            raise EngineError(
                f"GGUF file {path}: llama.cpp reads a vocabulary of {runner.n_vocab} tokens, the model has "
                f"{geometry.vocab}; export the file with the model's vocabulary"
            )
        firsts, copies, positions = [], [], torch.zeros(2 * L - 1, dtype=torch.float64)
        for row in ids:
            logits = torch.from_numpy(runner.logits(row.tolist())).unsqueeze(0)
            losses = next_token_losses(logits, row.unsqueeze(0))
            first, copy = repeat_losses(losses, L, offset)
            firsts.append(float(first[0]))
            copies.append(float(copy[0]))
            positions += losses[0, position_slice(L, offset)].double()
    finally:
        runner.close()
    first_copies, copy_losses = np.array(firsts), np.array(copies)
    means = np.full((geometry.n_layers, 3, geometry.n_heads), np.nan)
    if reader is not None:
        if len(reader.seen) != geometry.n_layers:
            missed = sorted(set(range(geometry.n_layers)) - reader.seen)
            raise EngineError(f"llama.cpp formed no attention pattern in layers {missed[:8]} of {path}")
        counts = torch.tensor(score_counts(L), dtype=torch.float64).view(1, 3, 1) * n
        means = (torch.stack(sums) / counts).numpy()
    heads = heads_frame(means)
    heads["path_factor"] = np.nan
    first_copy, copy_loss = float(first_copies.mean()), float(copy_losses.mean())
    return RepeatProbe(
        copy_loss=copy_loss,
        first_copy_loss=first_copy,
        copy_gain=first_copy - copy_loss,
        uniform_loss=math.log(geometry.vocab),
        heads=heads,
        settings=settings,
        bos_id=tokens.bos_id,
        copy_losses=copy_losses,
        first_copy_losses=first_copies,
        position_loss=tuple(float(x) for x in positions / n),
    )
