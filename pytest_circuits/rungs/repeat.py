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
from ..options import flag
from .query_blocks import query_block

CONTEXT_ATTRS = ("max_position_embeddings", "n_positions", "n_ctx", "seq_length")
MIN_ORDINARY_IDS = 2  # with one id every sequence is the same token: no copying to measure
KNOCKOUT_REPLAY_ROWS = 64  # knockout.ROWS_PER_PASS: rows of one knockout replay pass (at most; fewer on a CPU)
KNOCKOUT_CPU_TOKENS = 2048  # knockout.CPU_TOKENS_PER_PASS: the most tokens of one knockout replay pass on a CPU


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


def check_vocabulary(tokens: TokenInfo) -> int:
    """The number of ordinary ids, refused below `MIN_ORDINARY_IDS` (the probe would be one token repeated)."""
    count = int(tokens.ordinary_ids().size)
    if count < MIN_ORDINARY_IDS:
        raise CircuitsError(
            f"the model has {count} ordinary token id(s) (vocab_size {tokens.vocab_size}, "
            f"{len(tokens.special_ids)} special); the repeat probe needs at least {MIN_ORDINARY_IDS} "
            "to draw random sequences: check vocab_size in config.json"
        )
    return count


def token_bytes(n: int, L: int, vocab: int) -> int:
    """Peak bytes of `repeat_tokens`: ``8 n (5L + 2) + 24 V`` plus 64 KiB of bookkeeping."""
    return 8 * n * (5 * L + 2) + 24 * vocab + 65536


def cpu_stack(rows: int, tokens_per_row: int) -> int:
    """Knockouts one replay stacks on a CPU: as many as fit `KNOCKOUT_CPU_TOKENS` tokens, at least one.

    Never more: a CPU's matmuls of about a thousand tokens already run at its rate, so more copies gain
    nothing (SmolLM2 at n 8, L 64, 1,032 tokens a copy, 16 heads of layers 4 and 14 on 2 threads of an
    AMD EPYC with AVX512-BF16: fp32 21.7-22.2 s stacked 1 high, 22.1-23.8 s 2 high, 23.1-24.0 s 4 high), while a layer
    whose heads do not fill its last stack replays fill copies (`knockout._replayed_deltas`: 23% more
    replay work for SmolLM2's 69 key heads stacked 2 high)."""
    return max(1, KNOCKOUT_CPU_TOKENS // (rows * tokens_per_row))


def replay_rows(n: int, L: int, batch_size: int, n_heads: int, device="cpu") -> int:
    """Rows of one knockout replay pass (`knockout.auto_per_pass`): on a CPU ``b`` rows times
    `cpu_stack`, on an accelerator ``min(max(b, 64), n H)``."""
    b, T = min(batch_size, n), 2 * L + 1
    if str(device).startswith("cpu"):
        return b * cpu_stack(b, T)
    return min(max(batch_size, KNOCKOUT_REPLAY_ROWS), n * n_heads)


def probe_memory(geometry, n: int, L: int, batch_size: int, knockout: bool = True, device="cpu") -> dict[str, int]:
    """Estimated peak bytes of the repeat probe (and the knockout scan), by part.

    With ``T = 2L + 1`` (BOS counted), ``b`` = batch size, ``H`` heads, ``V`` vocab, ``d`` = d_model,
    a forward of ``r`` rows holds one layer's attention ``2 * 4 r H T^2`` (scores, softmax) and
    activations ``8 * 4 r T d`` (float32). Token arrays: ``8 n (5L + 2) + 24 V`` bytes per probe
    plus 64 KiB (draw, copy, BOS column and array; the ordinary ids), twice with knockouts. Probe pass: logits ``4 b T V`` plus one sequence's
    float copies ``8 T V``; a long probe runs in blocks of ``c`` queries (`query_blocks.query_block`),
    each forward then holds ``2 * 4 b H c T``, logits ``4 b c V`` and the keys and values of the
    cache, ``2 * 4 b T n_kv d_head n_layers``. Knockout pass: every block's recorded input ``4 n T d n_layers`` plus
    the larger of the intact pass (logits, float copy, log-softmax: ``12 b T V``) and a replay of
    ``R`` rows (`replay_rows`: ``min(max(b, 64), n H)`` on an accelerator, at most 2,048 tokens'
    worth on a CPU) unembedding the ``L`` copy positions (``8 R L V``).
    """
    T = 2 * L + 1
    H, V, d, layers = geometry.n_heads, geometry.vocab, geometry.d_model, geometry.n_layers

    def forward(rows: int) -> int:
        return 2 * 4 * rows * H * T * T + 8 * 4 * rows * T * d

    b = min(batch_size, n)
    c = query_block(geometry, b, T)
    if c >= T:
        probe = forward(b) + 4 * b * T * V + 8 * T * V
    else:
        cache = 2 * 4 * b * T * geometry.n_kv_heads * geometry.d_head * layers
        probe = 2 * 4 * b * H * c * T + 8 * 4 * b * c * d + cache + 4 * b * c * V + 8 * c * V
    parts = {"tokens": token_bytes(n, L, V) * (2 if knockout else 1), "probe pass": probe}
    if knockout:
        replay = replay_rows(n, L, batch_size, H, device)
        intact = forward(b) + 12 * b * T * V
        parts["knockout pass"] = 4 * n * T * d * layers + max(intact, forward(replay) + 8 * replay * L * V)
    return parts


def probe_peak(parts: dict[str, int]) -> int:
    """Peak bytes of `probe_memory`'s parts: the token arrays plus the larger of the two passes (they never overlap)."""
    return parts["tokens"] + max(v for k, v in parts.items() if k != "tokens")


def available_memory(device="cpu") -> int:
    """Bytes free for new tensors: ``psutil``'s available host memory, or the CUDA device's free memory."""
    device = str(device)
    if device.startswith("cuda"):
        import torch

        return int(torch.cuda.mem_get_info(torch.device(device))[0])
    try:
        import psutil

        return int(psutil.virtual_memory().available)
    except ImportError:
        with open("/proc/meminfo") as handle:
            info = dict(line.split(":", 1) for line in handle)
        return int(info["MemAvailable"].split()[0]) * 1024


def check_probe_memory(
    geometry, n: int, L: int, batch_size: int, knockout: bool = True, device="cpu", available: int | None = None
) -> int:
    """Refuse, before anything is allocated, a probe whose estimated peak (`probe_memory`) exceeds
    the memory available (``available`` bytes, by default `available_memory`); returns the estimate."""
    for name, value, least in (("n", n, 1), ("L", L, 2), ("batch size", batch_size, 1)):
        if not isinstance(value, int) or isinstance(value, bool) or value < least:
            raise CircuitsError(f"probe {name} must be an integer >= {least}, got {value!r}")
    parts = probe_memory(geometry, n, L, batch_size, knockout, device)
    needed = probe_peak(parts)
    free = available_memory(device) if available is None else int(available)
    if needed > free:
        gib = 1024**3
        detail = ", ".join(f"{k} {v / gib:.3g}" for k, v in parts.items())
        raise CircuitsError(
            f"the repeat probe with n={n}, L={L}, batch size {batch_size} needs about {needed / gib:.3g} GiB "
            f"({detail} GiB) but {free / gib:.3g} GiB is available on {device}; lower "
            f"{flag('probe-n')}, {flag('probe-length')} or {flag('batch-size')}"
        )
    return needed


def _check_token_memory(n: int, L: int, vocab: int) -> None:
    """Last guard before the draw: the token arrays alone (`token_bytes`) must fit in host memory."""
    needed, free = token_bytes(n, L, vocab), available_memory("cpu")
    if needed > free:
        raise CircuitsError(
            f"the repeat probe's tokens with n={n}, L={L} need {needed / 1024**3:.3g} GiB "
            f"but {free / 1024**3:.3g} GiB is available; lower {flag('probe-n')} or {flag('probe-length')}"
        )


def check_fits(config, tokens: TokenInfo, L: int) -> None:
    """Refuse a vocabulary without two ordinary ids, or a segment length whose repeated sequence
    exceeds the model's context."""
    check_vocabulary(tokens)
    if L < 2:
        raise CircuitsError(f"probe length L={L} is too short; use L >= 2 (e.g. {flag('probe-length')} 64)")
    needed = 2 * L + bos_offset(tokens)
    limit = context_length(config)
    if limit is not None and needed > limit:
        raise CircuitsError(
            f"probe length L={L} needs {needed} positions but the model's context is {limit}; "
            f"use {flag('probe-length')} {(limit - bos_offset(tokens)) // 2} or less"
        )
    check_window(config, needed, L, bos_offset(tokens))


def check_window(config, needed: int, L: int, offset: int) -> None:
    """Refuse a probe longer than a sliding-window layer's span (`families.attention_windows`):
    its later queries could not see the first copy, so copying there is not measured."""
    from ..model.families import attention_windows

    windows = attention_windows(config)
    narrow = sorted(layer for layer, w in windows.items() if w < needed)
    if not narrow:
        return
    window = min(windows[layer] for layer in narrow)
    shown = ", ".join(map(str, narrow[:6])) + (f" and {len(narrow) - 6} more" if len(narrow) > 6 else "")
    raise CircuitsError(
        f"probe length L={L} needs {needed} positions but layer(s) {shown} of this model attend within a "
        f"sliding window of {window} positions; use {flag('probe-length')} {(window - offset) // 2} or less, "
        "so that every layer sees the whole probe"
    )


def repeat_tokens(tokens: TokenInfo, n: int, L: int, seed: int) -> torch.Tensor:
    """``(n, 2L [+1])`` int64 ids: ``[BOS] x x`` with ``x`` uniform over the ordinary ids."""
    check_vocabulary(tokens)
    _check_token_memory(n, L, tokens.vocab_size)
    ordinary = tokens.ordinary_ids()
    rng = np.random.Generator(np.random.PCG64(seed))
    return repeated(ordinary[rng.integers(0, ordinary.size, size=(n, L))], tokens.bos_id)


def repeated(first: np.ndarray, bos_id: int | None) -> torch.Tensor:
    """``(n, 2L [+1])`` int64 ids ``[BOS] x x`` from the ``(n, L)`` first halves ``x`` (BOS where the model has one)."""
    sequences = np.concatenate([first, first], axis=1)
    if bos_id is not None:
        sequences = np.concatenate([np.full((first.shape[0], 1), bos_id, dtype=np.int64), sequences], axis=1)
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
