"""Tokens and losses of the random-repeat probe (docs/definitions.md, "The random-repeat probe").

Tokens: ``n`` sequences of ``L`` ordinary ids drawn uniformly with
``numpy.random.Generator(PCG64(seed))``, each followed by an exact copy
(``x[L+i] = x[i]``), with BOS prepended (every index shifted by one) when the
model wants one. Losses, with ``CE_t`` the cross-entropy of predicting token ``t``:
copy loss = mean ``CE_t`` over ``t in L+1 .. 2L-1``; first-copy loss = mean over
``t in 1 .. L-1``; copy gain = first-copy loss - copy loss.
"""

from __future__ import annotations

import numpy as np
import torch

from ..errors import CircuitsError
from ..model.vocab import TokenInfo
from ..settings import RepeatSettings  # noqa: F401  (re-exported: the probe's settings)

CONTEXT_ATTRS = ("max_position_embeddings", "n_positions", "n_ctx", "seq_length")


def bos_offset(tokens: TokenInfo) -> int:
    """1 when a BOS token is prepended, else 0."""
    return 0 if tokens.bos_id is None else 1


def context_length(config) -> int | None:
    """The longest sequence the model's positions allow, if its config says."""
    for attr in CONTEXT_ATTRS:
        value = getattr(config, attr, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def check_fits(config, tokens: TokenInfo, L: int) -> None:
    """Refuse a segment length whose repeated sequence exceeds the model's context."""
    if L < 2:
        raise CircuitsError(f"probe length L={L} is too short; use L >= 2 (e.g. --circuits-probe-length 64)")
    needed = 2 * L + bos_offset(tokens)
    limit = context_length(config)
    if limit is not None and needed > limit:
        raise CircuitsError(
            f"probe length L={L} needs {needed} positions but the model's context is {limit}; "
            f"use --circuits-probe-length {(limit - bos_offset(tokens)) // 2} or less"
        )


def repeat_tokens(tokens: TokenInfo, n: int, L: int, seed: int) -> torch.Tensor:
    """``(n, 2L [+1])`` int64 ids: ``[BOS] x x`` with ``x`` uniform over the ordinary ids."""
    ordinary = tokens.ordinary_ids()
    if ordinary.size == 0:
        raise CircuitsError("the model has no ordinary token ids to sample from; check its vocab_size")
    rng = np.random.Generator(np.random.PCG64(seed))
    first = ordinary[rng.integers(0, ordinary.size, size=(n, L))]
    sequences = np.concatenate([first, first], axis=1)
    if tokens.bos_id is not None:
        sequences = np.concatenate([np.full((n, 1), tokens.bos_id, dtype=np.int64), sequences], axis=1)
    return torch.from_numpy(np.ascontiguousarray(sequences, dtype=np.int64))


def next_token_losses(logits: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
    """``(n, T-1)`` float32 cross-entropy of predicting ``input_ids[:, t]`` from ``logits[:, t-1]``."""
    logits = logits[:, :-1].float()
    targets = input_ids[:, 1:].to(logits.device)
    return torch.nn.functional.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), reduction="none"
    ).reshape(targets.shape)


def copy_slices(L: int, offset: int) -> tuple[slice, slice]:
    """Columns of `next_token_losses` for the first copy (t in 1..L-1) and the second (t in L+1..2L-1)."""
    # column c of next_token_losses predicts position c + 1
    first = slice(offset + 1 - 1, offset + L - 1)
    second = slice(offset + L + 1 - 1, offset + 2 * L - 1)
    return first, second


def repeat_losses(losses: torch.Tensor, L: int, offset: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-sequence mean first-copy and copy losses, each ``(n,)``, from `next_token_losses`."""
    first, second = copy_slices(L, offset)
    return losses[:, first].mean(dim=1), losses[:, second].mean(dim=1)
