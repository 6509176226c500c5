"""The random-repeat probe: copy losses and per-head routing scores (docs/definitions.md, "The random-repeat probe").

Tokens come from `repeat.repeat_tokens` (``[BOS] x x``, ``x`` of length ``L``); write
``o`` for the BOS offset (0 or 1) and index positions of ``x x`` by ``t = 0 .. 2L-1``
(absolute position ``o + t``). With ``A[b, h, dst, src]`` the attention pattern a head
actually used, averaged over sequences ``b``:

- prefix-matching (induction): ``mean A[o+t, o+t-L+1]`` over ``t in L .. 2L-1``;
- previous-token: ``mean A[o+t, o+t-1]`` over ``t in 1 .. 2L-1``;
- duplicate-token: ``mean A[o+t, o+t-L]`` over ``t in L .. 2L-1``;
- path factor (per layer, shown on each of its heads): ``mean 1/(s_pre s_post s_final)`` over
  ``t in 0 .. 2L-1``, the positive per-position factors that norm folding leaves out of a head's
  direct path ``W_E -> head -> W_U``: ``s`` of the pre-attention norm's input (the residual
  stream), of the norm on the attention output (sandwich norms) and of the final norm's input
  (`selfcheck.norm_divisor`; 1 where there is no such norm). ``ov_gain x path_factor`` is what
  the head writes on the probe, in the units of its OV gain (the gate's negligible-head cut).

Memory: a forward hook on every attention module reduces that layer's pattern
``(batch, heads, T, T)`` to per-head sums as the layer runs, so no more than about one
layer's pattern is alive at a time; ``output_attentions`` is never requested. A long probe runs
in blocks of queries (`query_blocks`: a layer's pattern ``(batch, heads, c, T)``, logits ``c x
vocab``), and a build served with transformers' ``QuantizedCache`` in decode mode (``c = 1``
through that cache); the hooks read the diagonals each block holds.
"""

from __future__ import annotations

import math
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
import pandas as pd
import torch

from ..errors import CircuitsError
from ..model.builds import LoadedBuild
from ..model.families import (
    attention_block,
    attention_module,
    attn_norm_module,
    family_of,
    final_norm_module,
    head_label,
    post_attn_norm_module,
)
from ..model.hooks import hooked
from ..model.quantized_cache import decode_cache_of
from ..model.selfcheck import norm_divisor
from ..options import flag
from ..record.figures import SAMPLED_MODEL_FIGURES, sequences_key
from .query_blocks import block_losses, forward_blocks, query_block
from .repeat import bos_offset, check_fits, next_token_losses, repeat_losses
from .repeat_settings import RepeatSettings
from .text_probe import probe_ids

SCORES = ("prefix_matching", "previous_token", "duplicate_token")


@dataclass
class RepeatProbe:
    """Model-level losses (nats) and per-head routing scores of one build on the repeat probe."""

    copy_loss: float
    first_copy_loss: float
    copy_gain: float
    uniform_loss: float  # ln(vocab)
    heads: pd.DataFrame  # head, layer, head_index, prefix_matching, previous_token, duplicate_token, path_factor
    settings: RepeatSettings
    bos_id: int | None
    copy_losses: np.ndarray | None = None  # (n,) float64 per sequence; their mean is copy_loss
    first_copy_losses: np.ndarray | None = None  # (n,) float64 per sequence; their mean is first_copy_loss
    position_loss: tuple[float, ...] = ()  # mean CE_t over the sequences, t = 1 .. 2L-1 (`position_slice`)

    def model_figures(self) -> dict:
        """The four model-level floats, keyed as in the scan record."""
        return {
            "copy_loss": self.copy_loss,
            "first_copy_loss": self.first_copy_loss,
            "copy_gain": self.copy_gain,
            "uniform_loss": self.uniform_loss,
        }

    def sequence_figures(self) -> dict[str, list[float]]:
        """Per-sequence copy loss, first-copy loss and copy gain (``first_i - copy_i``), keyed
        ``<figure>_sequences`` as in the scan record; empty when they were not kept."""
        if self.copy_losses is None or self.first_copy_losses is None:
            return {}
        per = {
            "copy_loss": self.copy_losses,
            "first_copy_loss": self.first_copy_losses,
            "copy_gain": self.first_copy_losses - self.copy_losses,
        }
        return {sequences_key(name): [float(v) for v in per[name]] for name in SAMPLED_MODEL_FIGURES}


def score_diagonals(L: int, offset: int) -> dict[str, tuple[int, slice]]:
    """Per score: ``(k, cols)`` so that ``A.diagonal(-k)[..., cols]`` are its ``A[dst, dst-k]`` entries.

    ``A.diagonal(-k)[i] = A[i+k, i]``; the slice picks the destinations the score averages over.
    """
    return {
        "prefix_matching": (L - 1, slice(offset + 1, offset + L + 1)),  # dst o+L..o+2L-1
        "previous_token": (1, slice(offset, offset + 2 * L - 1)),  # dst o+1..o+2L-1
        "duplicate_token": (L, slice(offset, offset + L)),  # dst o+L..o+2L-1
    }


def score_counts(L: int) -> tuple[int, int, int]:
    """Destinations per sequence of prefix-matching, previous-token and duplicate-token scores."""
    return L, 2 * L - 1, L


def routing_sums(pattern: torch.Tensor, L: int, offset: int) -> torch.Tensor:
    """``(3, heads)`` float64 sums of the score entries of ``pattern`` ``(batch, heads, T, T)``, or
    of one block of its queries ``(batch, heads, c, T_k)``: the rows of positions ``T_k - c ..
    T_k - 1`` (`query_blocks`); summed over the blocks, the whole pattern's sums.

    Rows follow `SCORES`; divide by ``batch * score_counts(L)`` for the means.
    """
    if pattern.dim() != 4 or pattern.shape[-2] > pattern.shape[-1]:
        raise ValueError(f"attention pattern must be (batch, heads, T, T), got {tuple(pattern.shape)}")
    Tq, T = pattern.shape[-2], pattern.shape[-1]
    if T > 2 * L + offset:
        raise ValueError(f"attention pattern covers {T} positions but the probe has 2L+offset={2 * L + offset}")
    start, rows = T - Tq, []
    for name in SCORES:
        k, cols = score_diagonals(L, offset)[name]
        if Tq == T == 2 * L + offset:
            entries = pattern.diagonal(offset=-k, dim1=-2, dim2=-1)[..., cols]  # (batch, heads, count)
        else:  # destinations cols.start + k .. cols.stop - 1 + k, those in this block
            lo = max(cols.start + k, start)
            dst = torch.arange(lo, max(lo, min(cols.stop + k, T)), device=pattern.device)
            entries = pattern[:, :, dst - start, dst - k]
        rows.append(entries.to(torch.float64).sum(dim=(0, 2)))
    return torch.stack(rows)


def routing_scores(pattern: torch.Tensor, L: int, offset: int) -> dict[str, np.ndarray]:
    """Per-head prefix-matching, previous-token and duplicate-token means of one layer's pattern."""
    sums = routing_sums(pattern, L, offset)
    counts = torch.tensor(score_counts(L), dtype=torch.float64).unsqueeze(1) * pattern.shape[0]
    means = (sums / counts).cpu().numpy()
    return {name: means[i] for i, name in enumerate(SCORES)}


@contextmanager
def routing_hooks(model, n_layers: int, L: int, offset: int):
    """Hooks every attention module; yields a ``(n_layers, 3, heads)`` float64 list of running sums.

    Each hook reduces the layer's returned pattern ``(batch, heads, T, T)`` with `routing_sums`
    and drops it, so memory holds about one layer's pattern. Attention implementations that
    return no weights (sdpa, flash) are refused: the scores must come from the pattern used.
    """
    sums: list[torch.Tensor | None] = [None] * n_layers

    def make_hook(layer: int):
        def hook(module, args, output):
            weights = output[1] if isinstance(output, tuple) and len(output) > 1 else None
            if weights is None:
                raise CircuitsError(
                    f"layer {layer}'s attention returned no weights; load the model with "
                    "attn_implementation='eager' (load_build does)"
                )
            layer_sums = routing_sums(weights.detach(), L, offset).cpu()
            sums[layer] = layer_sums if sums[layer] is None else sums[layer] + layer_sums

        return hook

    with hooked(*[(attention_module(model, l), "forward", make_hook(l)) for l in range(n_layers)]):
        yield sums


class PathFactors:
    """Running sums, per layer, of the positive factors the fold leaves out of a head's direct
    path, multiplied per position: ``1/s`` of the pre-attention norm's input, of the norm on the
    attention output (where the family has one) and of the final norm's input (`norm_divisor`)."""

    def __init__(self, n_layers: int, L: int, offset: int):
        self.rows, self.sums = (offset, offset + 2 * L), torch.zeros(n_layers, dtype=torch.float64)
        self.seen: dict[tuple[str, int], torch.Tensor] = {}

    def keep(self, where: str, layer: int, module, fam, r: torch.Tensor) -> None:
        self.seen[(where, layer)] = 1.0 / norm_divisor(module, fam, r.detach())[..., 0].cpu()

    def flush(self, start: int = 0) -> None:
        """Add one batch's products (after its forward; of a block of queries from ``start``) and forget it."""
        rows = slice(max(self.rows[0] - start, 0), max(self.rows[1] - start, 0))
        self.seen = {key: factor[:, rows] for key, factor in self.seen.items()}
        final = self.seen.pop(("final", 0), None)
        for layer in range(len(self.sums)):
            product = final if final is not None else torch.ones(())
            for where in ("pre", "post"):
                factor = self.seen.pop((where, layer), None)
                product = product if factor is None else product * factor
            self.sums[layer] += product.sum() if product.dim() else 0.0
        self.seen.clear()


@contextmanager
def path_factor_hooks(model, n_layers: int, L: int, offset: int):
    """Hooks the pre-attention norms, the norms on the attention output and the final norm; yields
    a `PathFactors` (call ``flush()`` after each batch's forward)."""
    fam = family_of(model)
    factors = PathFactors(n_layers, L, offset)

    def hook(where: str, layer: int):
        def keep(module, args, kwargs):
            r = args[0] if args else next(v for v in kwargs.values() if isinstance(v, torch.Tensor))
            factors.keep(where, layer, module, fam, r)  # the final norm: its last call (nanochat's runs twice)

        return keep

    norms = [("final", 0, final_norm_module(model, fam))]
    for layer in range(n_layers):
        block = attention_block(model, layer)
        norms += [("pre", layer, attn_norm_module(block, fam)), ("post", layer, post_attn_norm_module(block, fam))]
    with hooked(*[(m, "pre_kwargs", hook(w, l)) for w, l, m in norms if m is not None]):
        yield factors


def input_device(model) -> torch.device:
    """Where the model wants its token ids (the embedding's device; bnb builds place it themselves)."""
    return model.get_input_embeddings().weight.device


def heads_frame(means: np.ndarray) -> pd.DataFrame:
    """``(n_layers, 3, heads)`` means -> one row per head ``L{l}H{h}`` with the three scores."""
    n_layers, _, n_heads = means.shape
    layer, head = np.divmod(np.arange(n_layers * n_heads), n_heads)
    frame = pd.DataFrame({"head": [head_label(l, h) for l, h in zip(layer, head)], "layer": layer, "head_index": head})
    for i, name in enumerate(SCORES):
        frame[name] = means[:, i, :].reshape(-1)
    return frame


def position_slice(L: int, offset: int) -> slice:
    """Columns of `next_token_losses` predicting ``t = 1 .. 2L-1`` (column ``c`` predicts absolute ``c + 1``)."""
    return slice(offset, offset + 2 * L - 1)


def sequence_losses(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """`next_token_losses`, one sequence at a time: its float copies of the logits stay one row big."""
    return torch.cat([next_token_losses(logits[i : i + 1], ids[i : i + 1]) for i in range(ids.shape[0])])


@torch.no_grad()
def run_repeat_probe(
    build: LoadedBuild, settings: RepeatSettings, batch_size: int = 8, block: int | None = None
) -> RepeatProbe:
    """Copy losses and per-head routing scores of ``build`` on ``settings.n`` seeded repeat sequences.

    copy loss = mean CE over ``t in L+1 .. 2L-1``; first-copy loss = mean CE over
    ``t in 1 .. L-1``; copy gain = their difference; uniform loss = ``ln(vocab)``. Each is the
    mean over the ``n`` sequences of its per-sequence value, kept in ``copy_losses`` and
    ``first_copy_losses`` (the gate's intervals come from them). ``block``: queries per forward
    (default `query_blocks.query_block`: one forward when it fits; 1 in decode mode, a build
    served with transformers' ``QuantizedCache``).

    Each sequence runs alone (``batch_size`` is checked, not used here): a matmul's rounding depends
    on how many rows it multiplies, and through a quantized cache one flipped rounding moves a
    sequence's copy loss by tenths of a nat (bf16 SmolLM2, KIVI int4: 0.25), so batching would make
    the figures depend on ``--batch-size``. The blocks of queries are then a function of the model
    and ``L`` only, the same for a build and its baseline.
    """
    model = build.model
    L, n = settings.L, settings.n
    if n < 1:
        raise CircuitsError(f"probe needs at least one sequence, got n={n}; use e.g. {flag('probe-n')} 8")
    if batch_size < 1:
        raise CircuitsError(f"batch size must be at least 1, got {batch_size}")
    check_fits(model.config, build.tokens, L)
    offset = bos_offset(build.tokens)
    ids = probe_ids(build.source, build.tokens, settings)
    n_layers = build.geometry.n_layers
    device = input_device(model)
    decode = decode_cache_of(model)
    if decode is not None:
        block = 1
    first_parts, copy_parts = [], []
    position_sums = torch.zeros(2 * L - 1, dtype=torch.float64)
    with routing_hooks(model, n_layers, L, offset) as sums, path_factor_hooks(model, n_layers, L, offset) as path:
        for start in range(n):
            batch = ids[start : start + 1].to(device)
            rows = block or query_block(build.geometry, batch.shape[0], batch.shape[1])
            parts = []
            for begin, logits in forward_blocks(model, batch, rows, decode.new() if decode else None):
                path.flush(begin)
                whole = begin == 0 and logits.shape[1] == batch.shape[1]
                parts.append(sequence_losses(logits, batch) if whole else block_losses(logits, batch, begin))
                del logits
            losses = torch.cat(parts, dim=1)
            first, copy = repeat_losses(losses, L, offset)
            position_sums += losses[:, position_slice(L, offset)].double().sum(dim=0).cpu()
            first_parts.append(first.double().cpu())
            copy_parts.append(copy.double().cpu())
    missing = [l for l, s in enumerate(sums) if s is None]
    if missing:
        raise CircuitsError(f"the attention of layers {missing} never ran; is {build.label} a decoder-only LM?")
    counts = torch.tensor(score_counts(L), dtype=torch.float64).view(1, 3, 1) * n
    means = (torch.stack(sums) / counts).numpy()
    heads = heads_frame(means)
    heads["path_factor"] = np.repeat((path.sums / (n * 2 * L)).numpy(), build.geometry.n_heads)
    first_copies, copies = torch.cat(first_parts).numpy(), torch.cat(copy_parts).numpy()
    first_copy, copy_loss = float(first_copies.mean()), float(copies.mean())
    return RepeatProbe(
        copy_loss=copy_loss,
        first_copy_loss=first_copy,
        copy_gain=first_copy - copy_loss,
        uniform_loss=math.log(build.geometry.vocab),
        heads=heads,
        settings=settings,
        bos_id=build.tokens.bos_id,
        copy_losses=copies,
        first_copy_losses=first_copies,
        position_loss=tuple(float(x) for x in position_sums / n),
    )
