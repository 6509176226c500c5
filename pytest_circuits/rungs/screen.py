"""Screening estimates of every head's knockout delta: plain attribution patching (AtP) and AtP*.

For head ``h`` of layer ``l`` knocked out, ``dz_h = z_h^ablated - z_h`` (``-z_h`` zero
ablation, ``mu_h - z_h`` mean ablation; every position of every held-out sequence) and the
copy loss ``CL`` (knockout.py).

* AtP (Nanda 2023): ``est_h = sum_{seq,pos} dz_h . dCL/dz_h``, one forward and one backward.
* AtP* (Kramar et al. 2024) fixes AtP's two failure modes.

  QK fix (attention saturation): AtP's gradient holds the knockout's effect on every later
  attention pattern as a linearised softmax, which misses a head's attention moving from
  one saturated key to another (the embedded model's previous-token head: AtP -0.08, exact
  +7.2). For every later layer ``m > l`` the pattern is recomputed exactly from queries and
  keys of ``attn_norm_m(r_m + dr_h)`` (``r_m`` the residual stream entering block ``m``,
  ``dr_h = dz_h W_O[h]`` the knockout's direct change of it), and the linearised direct
  term is swapped for the exact one:

      est*_h = est_h + sum_{m > l} sum_{heads,seq,t,s} (A'_m - A_m - dA_m^lin) * dCL/dA_m,

  ``dA_m^lin = d/de A_m(attn_norm_m(r_m + e dr_h))`` at ``e = 0`` (autograd). Paths through
  intermediate layers stay linear, as in AtP.

  GradDrop (cancellation across layers), ``method="atp*gd"``: AtP's term is recomputed with
  the gradient through block ``j``'s output dropped, for every ``j`` in ``1 .. n_layers-1``,
  and the head is ranked by ``mean_j |est_h^(-j) + QK correction|`` (a block ``j <= l`` lies
  on no path from the head: those terms are ``|est*_h|``). Off by default: on SmolLM2-135M
  it ranked the exact top heads worse than the QK fix alone and costs ``n_layers - 1``
  backward passes (benchmarks/test_bench_knockout.py, docs/speed.md).

Work: AtP one forward and one backward; the QK fix one attention-module forward per (source
layer, later layer) on ``n_heads`` stacked copies for the exact patterns, and one
attention-module forward and backward per layer for every linearised term (`_qk_fix`). The benchmark
reports each screen's cost in forward-equivalents, timed.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import partial

import numpy as np
import torch

from ..errors import CircuitsError
from ..model.families import attention_module, get_module, layer_modules, out_proj_module
from ..model.hooks import Hook, hooked
from ..model.kv_cache import cached
from ..model.mixer_memory import (
    activation_budget,
    block_bytes,
    kept_bytes,
    map_large_blocks,
    reference_scan,
    weight_bytes,
)
from .ablation import z_differentiable
from .repeat import bos_offset, copy_slices
from .replay import tile, traced_hidden

ATTN_NAME = "circuits_atp"


@dataclass
class _State:
    """What the custom attention function does: capture (pattern + zero leaf), qkfix (exact term), linear."""

    mode: str = "off"  # "capture" | "qkfix" | "linear" | "off"
    layer_of: dict = field(default_factory=dict)  # id(attention module) -> layer
    patterns: dict = field(default_factory=dict)  # layer -> A (detached)
    leaves: dict = field(default_factory=dict)  # layer -> zero leaf added to A
    grads: dict = field(default_factory=dict)  # layer -> dCL/dA
    copies: int = 1
    qk: torch.Tensor | None = None  # (copies,) accumulated exact pattern term of the current source group
    linear: torch.Tensor | None = None  # (copies,) sum A . dCL/dA of the last "linear" call


_STATE = _State()


@dataclass(frozen=True)
class ScreenVariant:
    """Cheaper screens (issue 41; docs/speed.md, "Screen variants"); every knob's default is today's screen.

    ``sequences``: estimate on the first N held-out sequences only (None: all of them); ``qk_top``:
    the QK fix only on plain AtP's top C heads by ``|estimate|``, the rest keep their AtP estimate
    (None, or C of at least the model's heads: every head; else it costs one more forward and
    backward); ``grad_drop_layers``: GradDrop
    (``atp*gd``) over this many blocks spread evenly over ``1 .. n_layers-1`` (None: every block);
    ``ablation``: ``"scan"`` estimates the scan's own ablation, ``"both"`` averages the zero- and
    mean-ablation estimates and their scores (two screens)."""

    sequences: int | None = None
    qk_top: int | None = None
    grad_drop_layers: int | None = None
    ablation: str = "scan"

    def check(self) -> None:
        from ..errors import CircuitsError
        from ..options import SCREEN_ABLATIONS, flag

        for name, value, least in (("sequences", self.sequences, 1), ("qk-top", self.qk_top, 0)):
            if value is not None and value < least:
                raise CircuitsError(f"{flag('knockout-screen-' + name)} {value} must be at least {least}")
        if self.grad_drop_layers is not None and self.grad_drop_layers < 1:
            raise CircuitsError(
                f"{flag('knockout-screen-grad-drop-layers')} {self.grad_drop_layers} must be at least 1"
            )
        if self.ablation not in SCREEN_ABLATIONS:
            raise CircuitsError(
                f"{flag('knockout-screen-ablation')} {self.ablation!r} is unknown; use one of: "
                f"{', '.join(SCREEN_ABLATIONS)}"
            )


TODAY = ScreenVariant()


def _causal_scores(module, query, key, attention_mask, scaling):
    n_rep = query.shape[1] // key.shape[1]
    key = key.repeat_interleave(n_rep, dim=1) if n_rep > 1 else key
    scores = torch.matmul(query, key.transpose(2, 3)) * scaling
    if attention_mask is None:
        t, s = scores.shape[-2:]
        causal = torch.ones(t, s, dtype=torch.bool, device=scores.device).tril(s - t)
        scores = scores.masked_fill(~causal, float("-inf"))
    elif attention_mask.dtype == torch.bool:
        scores = scores.masked_fill(~attention_mask, float("-inf"))
    else:
        scores = scores + attention_mask
    return torch.softmax(scores, dim=-1, dtype=torch.promote_types(scores.dtype, torch.float32))


def _attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """Eager attention that, per ``_STATE.mode``, freezes its pattern behind a zero leaf or adds up the QK fix
    (on the keys and values a KV cache returns, where the build serves one)."""
    state = _STATE
    layer = state.layer_of[id(module)]
    key, value = cached(module, key, value)  # a KV cache: every pair read from it (the ranking only)
    scaling = query.shape[-1] ** -0.5 if scaling is None else scaling
    pattern = _causal_scores(module, query, key, attention_mask, scaling)
    n_rep = query.shape[1] // value.shape[1]
    value = value.repeat_interleave(n_rep, dim=1) if n_rep > 1 else value
    if state.mode in ("qkfix", "linear"):
        grad = state.grads[layer].repeat(state.copies, 1, 1, 1)
        if state.mode == "qkfix":  # exact: sum (A' - A) . dCL/dA per stacked copy
            moved = (pattern - state.patterns[layer].repeat(state.copies, 1, 1, 1)) * grad
            state.qk += moved.reshape(state.copies, -1).double().sum(dim=1).cpu()
        else:  # sum A . dCL/dA per copy, differentiated along the knockout's direction by the caller
            state.linear = (pattern * grad).reshape(state.copies, -1).sum(dim=1)
        raise _PatternRead  # the rest of the module (its output projection) is not needed
    if state.mode == "capture":
        leaf = torch.zeros_like(pattern, requires_grad=True)
        state.patterns[layer], state.leaves[layer] = pattern.detach(), leaf
        pattern = pattern + leaf
    out = torch.matmul(pattern.to(value.dtype), value).transpose(1, 2).contiguous()
    return out, None


class _PatternRead(Exception):
    """Raised by the attention function once it has read the pattern: `_call` stops the module there."""


def _register() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, eager_mask

    AttentionInterface.register(ATTN_NAME, _attention)
    AttentionMaskInterface.register(ATTN_NAME, eager_mask)


class _Drop(torch.autograd.Function):
    """Identity forward; backward multiplies the gradient by ``gates[j]`` (read at backward time)."""

    @staticmethod
    def forward(ctx, x, gates, j):
        ctx.gates, ctx.j = gates, j
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.gates[ctx.j], None, None


def _loss(build, ids, L) -> torch.Tensor:
    """Per-sequence copy loss, unembedding only the copy positions."""
    predict = copy_slices(L, bos_offset(build.tokens))[1]
    logits = build.model(input_ids=ids.to(build.device), use_cache=False).logits[:, predict].float()
    targets = ids[:, predict.start + 1 : predict.stop + 1].to(logits.device)
    ce = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), reduction="none")
    return ce.reshape(targets.shape).mean(dim=1)


def _dz(z: torch.Tensor, means: torch.Tensor | None, layer: int, n_heads: int, d_head: int) -> torch.Tensor:
    """``(rows, T, n_heads, d_head)`` knockout change of every head's z in ``layer``."""
    z = z.reshape(*z.shape[:-1], n_heads, d_head)
    if means is None:
        return -z
    return means[layer].to(z.dtype) - z


def atp(build, ids, L, mode, means, batch_size, bar=None, recompute: bool = False) -> np.ndarray:
    """The ``atp`` screen (no QK fix), ``(n_layers, n_heads)``: ``sum dz_h . dCL/dz_h`` from one forward and
    one backward per chunk; ``recompute``: the backward recomputes each block (`recomputed_blocks`)."""
    geo, n = build.geometry, ids.shape[0]
    est = torch.zeros(geo.n_layers, geo.n_heads, dtype=torch.float64)
    for batch in ids.split(batch_size):
        with torch.enable_grad(), z_differentiable(build.model, geo.n_layers) as leaves:
            with recomputed_blocks(build.model, recompute):
                loss = _loss(build, batch, L).sum() / n
                leaves.closed = True
                loss.backward()
        for layer, z, leaf in leaves:
            dz = _dz(z, means if mode == "mean" else None, layer, geo.n_heads, geo.d_head).double()
            g = _reached(leaf.grad, layer).reshape(dz.shape).double()
            est[layer] += (dz * g).sum(dim=(0, 1, 3)).cpu()
        if bar is not None:
            bar.update(1)
    return est.numpy()


def _reached(grad: torch.Tensor | None, layer: int) -> torch.Tensor:
    """``grad``, or a RuntimeError when no gradient reached the head outputs of ``layer``: the
    build's kernels ran outside autograd (bitsandbytes 4-bit on a CPU), so no estimate exists."""
    if grad is None:
        raise RuntimeError(
            f"no gradient reached the head outputs of layer {layer} (the build's kernels run outside autograd)"
        )
    return grad


def _output_change(build, layer: int, dz: torch.Tensor) -> torch.Tensor:
    """``(n_heads * rows, T, d_model)``: ``dr_h = o_proj(dz_h in head h's columns) - o_proj(0)``, heads stacked."""
    geo = build.geometry
    rows, T = dz.shape[:2]
    placed = dz.new_zeros(geo.n_heads, rows, T, geo.n_heads, geo.d_head)
    for h in range(geo.n_heads):
        placed[h, :, :, h] = dz[:, :, h]
    proj = out_proj_module(build.model, layer)
    placed = placed.reshape(geo.n_heads * rows, T, geo.n_heads * geo.d_head)
    return proj(placed) - proj(torch.zeros_like(placed[:1]))


def grad_drop_blocks(n_layers: int, sample: int | None) -> list[int]:
    """The blocks GradDrop drops: every one of ``1 .. n_layers-1``, or ``sample`` of them spread evenly."""
    blocks = list(range(1, n_layers))
    if sample is None or sample >= len(blocks):
        return blocks
    return sorted({blocks[round(i * (len(blocks) - 1) / max(sample - 1, 1))] for i in range(sample)})


def atp_star(
    build,
    ids,
    L,
    mode,
    means,
    batch_size,
    grad_drop: bool = False,
    bar=None,
    qk_heads=None,
    drop_sample: int | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """``(estimate, rank_score)``, each ``(n_layers, n_heads)``: the AtP* estimate (AtP + QK fix)
    and the score heads are ranked by (GradDrop's ``mean_j |.|``, or ``|estimate|``). ``bar``: a
    `progress.Progress` told of each chunk of ``batch_size`` sequences. ``qk_heads``: the
    ``(layer, head)`` pairs the QK fix runs on (None: every head); ``drop_sample``: `grad_drop_blocks`."""
    if build.geometry.attention_layers is not None or build.family.beside is not None:
        # its QK fix and GradDrop rerun each block's attention on its norm's output, and nothing else
        raise CircuitsError(
            "the atp* screens are not defined on a hybrid stack yet (blocks without attention, or Mamba beside "
            "it); use --circuits-knockout-screen-method atp, or knock out every head exactly"
        )
    _register()
    model, geo, n = build.model, build.geometry, ids.shape[0]
    blocks = layer_modules(model)
    attn = [attention_module(model, m) for m in range(geo.n_layers)]
    norms = [get_module(blocks[m], build.family.attn_norm) for m in range(geo.n_layers)]
    means = means if mode == "mean" else None
    drops = grad_drop_blocks(geo.n_layers, drop_sample) if grad_drop else []
    atp_term = torch.zeros(len(drops) + 1, geo.n_layers, geo.n_heads, dtype=torch.float64)
    qk_term = torch.zeros(geo.n_layers, geo.n_heads, dtype=torch.float64)
    state = _STATE
    before = model.config._attn_implementation
    model.set_attn_implementation(ATTN_NAME)
    try:
        for batch in ids.split(batch_size):
            rows = batch.shape[0]
            state.layer_of = {id(a): m for m, a in enumerate(attn)}
            state.patterns, state.leaves, state.grads = {}, {}, {}
            residual: dict[int, torch.Tensor] = {}
            calls: dict[int, tuple] = {}
            gates = torch.ones(geo.n_layers, dtype=torch.float64)

            def keep_block(module, args, kwargs, *, m: int, residual=residual):
                residual[m] = traced_hidden(args, kwargs).detach()

            def keep_attn(module, args, kwargs, *, m: int, calls=calls):
                calls[m] = (args, {k: v.detach() if torch.is_tensor(v) else v for k, v in kwargs.items()})

            def drop_block(module, args, kwargs, out, *, m: int, gates=gates):
                inp = traced_hidden(args, kwargs)
                hidden = out[0] if isinstance(out, (tuple, list)) else out
                gated = inp + _Drop.apply(hidden - inp, gates, m)
                return (gated, *out[1:]) if isinstance(out, (tuple, list)) else gated

            hooks: list[Hook] = []
            for m, block in enumerate(blocks):
                hooks += [
                    (block, "pre_kwargs", partial(keep_block, m=m)),
                    (attn[m], "pre_kwargs", partial(keep_attn, m=m)),
                ]
                if grad_drop:
                    hooks.append((block, "forward_kwargs", partial(drop_block, m=m)))
            try:
                state.mode = "capture"
                with hooked(*hooks), torch.enable_grad(), z_differentiable(model, geo.n_layers) as zleaves:
                    loss = _loss(build, batch, L).sum() / n
                    zs = [leaf for _, _, leaf in zleaves]
                    pattern_leaves = [state.leaves[m] for m in range(geo.n_layers)]
                    grads = torch.autograd.grad(loss, zs + pattern_leaves, retain_graph=bool(drops), allow_unused=True)
                    dzs = [_dz(z, means, layer, geo.n_heads, geo.d_head) for layer, z, _ in zleaves]
                    reached = [_reached(g, layer) for (layer, _, _), g in zip(zleaves, grads)]
                    _add_atp_term(atp_term[0], zleaves, dzs, reached)
                    for m in range(geo.n_layers):
                        g = grads[len(zs) + m]
                        state.grads[m] = torch.zeros_like(state.patterns[m]) if g is None else g.detach()
                    for i, j in enumerate(drops, start=1):
                        gates.fill_(1.0)
                        gates[j] = 0.0
                        dropped = torch.autograd.grad(loss, zs, retain_graph=j != drops[-1], allow_unused=True)
                        _add_atp_term(atp_term[i], zleaves, dzs, dropped)
                    del loss, grads, pattern_leaves
            finally:
                state.mode = "off"
            with torch.no_grad():
                _qk_fix(build, qk_term, dzs, residual, calls, norms, attn, rows, qk_heads)
            state.patterns, state.leaves, state.grads = {}, {}, {}
            if bar is not None:
                bar.update(1)
    finally:
        state.mode = "off"
        model.set_attn_implementation(before)
    estimate = atp_term[0] + qk_term
    if drops:
        # dropping a block j <= l says nothing about a head of layer l (j < l: no path through it;
        # j = l: its own output): those terms are the undropped |estimate|
        dropped_terms = (atp_term[1:] + qk_term).abs()
        layer_index = torch.arange(geo.n_layers)[None, :, None]
        dropped_block = torch.tensor(drops)[:, None, None]
        score = torch.where(dropped_block > layer_index, dropped_terms, estimate.abs()[None]).mean(dim=0)
    else:
        score = estimate.abs()
    return estimate.numpy(), score.numpy()


def _add_atp_term(out: torch.Tensor, zleaves, dzs, grads) -> None:
    for (layer, _, _), dz, g in zip(zleaves, dzs, grads):
        if g is not None:
            out[layer] += (dz.double() * g.reshape(dz.shape).double()).sum(dim=(0, 1, 3)).cpu()


def _qk_fix(build, qk_term, dzs, residual, calls, norms, attn, rows, qk_heads=None) -> None:
    """Add ``sum_{m > l} (A'_m - A_m - dA_m^lin) . dCL/dA_m`` for every head of every layer ``l``.

    The linearised term is a directional derivative, so it needs no pass per head: with
    ``S_m(r) = A_m(attn_norm_m(r)) . dCL/dA_m`` and ``g_m = dS_m/dr`` at ``r_m`` (one backward per
    layer), ``sum_{m > l} dA_m^lin . dCL/dA_m = (sum_{m > l} g_m) . dr_h``, the sum kept as a
    suffix sum while ``l`` runs down. Only the exact patterns ``A'_m`` take a pass per source layer.
    ``qk_heads``: only these ``(layer, head)`` pairs (None: every head), stacked per source layer.
    """
    geo = build.geometry
    chosen = {layer: list(range(geo.n_heads)) for layer in range(geo.n_layers)}
    if qk_heads is not None:
        chosen = {}
        for layer, head in sorted(qk_heads):
            chosen.setdefault(layer, []).append(head)
    lowest = min(chosen, default=geo.n_layers)
    toward: torch.Tensor | None = None  # sum_{m > l} g_m
    for layer in reversed(range(lowest, geo.n_layers - 1)):
        g = pattern_gradient(residual[layer + 1], calls[layer + 1], norms[layer + 1], attn[layer + 1], rows)
        toward = g if toward is None else toward + g
        heads = chosen.get(layer)
        if not heads:
            continue
        dr = _output_change(build, layer, dzs[layer].detach())
        if len(heads) < geo.n_heads:
            dr = dr.reshape(geo.n_heads, rows, *dr.shape[1:])[heads].reshape(len(heads) * rows, *dr.shape[1:])
        exact = exact_pattern_change(build, layer, dr, residual, calls, norms, attn, rows, len(heads))
        linear = (dr.reshape(len(heads), rows, *dr.shape[1:]).double() * toward.double()[None]).sum(dim=(1, 2, 3))
        qk_term[layer, heads] += exact - linear.cpu()


def pattern_gradient(residual, call, norm, attention, rows: int) -> torch.Tensor:
    """``dS/dr`` at ``r = residual`` (``(rows, T, d_model)``), ``S(r) = A(norm(r)) . dCL/dA`` of one attention layer."""
    state = _STATE
    r = residual.detach().clone().requires_grad_(True)
    state.mode, state.copies = "linear", 1
    try:
        with torch.enable_grad():
            _call(attention, call, norm(r), rows, 1)
            assert state.linear is not None  # set by the attention function in "linear" mode
            (grad,) = torch.autograd.grad(state.linear.sum(), r)
    finally:
        state.mode, state.linear = "off", None
    return grad


QK_FIX_BYTES = 16 << 20  # the QK fix stacks at most this many bytes of one layer's float32 patterns at once


def exact_pattern_change(
    build, layer: int, dr, residual, calls, norms, attn, rows: int, copies: int | None = None
) -> torch.Tensor:
    """``(copies,)``: ``sum_{m > layer} (A'_m - A_m) . dCL/dA_m`` per head of ``layer``, ``A'_m`` the
    pattern of ``attn_norm_m(r_m + dr_h)`` (``dr``: `_output_change`, ``copies`` heads (default
    every head of the layer) stacked on the batch), in groups of heads whose stacked patterns fit in
    `QK_FIX_BYTES` (each head's sum is its own: the grouping changes the memory, not the figures)."""
    geo, state = build.geometry, _STATE
    k = geo.n_heads if copies is None else copies
    T = residual[layer].shape[-2]
    per_head = rows * geo.n_heads * T * T * 4  # one head's float32 patterns of one later layer
    group = max(1, min(k, QK_FIX_BYTES // max(per_head, 1)))
    out = torch.zeros(k, dtype=torch.float64)
    try:
        with torch.no_grad():
            for start in range(0, k, group):
                size = min(group, k - start)
                state.copies, state.qk = size, torch.zeros(size, dtype=torch.float64)
                moved = dr[start * rows : (start + size) * rows]
                for m in range(layer + 1, geo.n_layers):
                    state.mode = "qkfix"
                    _call(attn[m], calls[m], norms[m](residual[m].repeat(size, 1, 1) + moved), rows, size)
                out[start : start + size] = state.qk
        return out
    finally:
        state.mode, state.copies = "off", 1


def _call(module, call, hidden, rows: int, k: int) -> None:
    """Run an attention module as traced, with ``hidden`` as its input and batch tensors stacked
    ``k`` times, up to its attention function (in "qkfix" or "linear" mode), which reads the pattern."""
    args, kwargs = call
    memo: dict = {}
    kwargs = tile(kwargs, rows, k, memo)
    try:
        if args:
            module(hidden, *tile(tuple(args[1:]), rows, k, memo), **kwargs)
        else:
            module(**{**kwargs, "hidden_states": hidden})
    except _PatternRead:
        return
    raise RuntimeError(f"{type(module).__name__} did not call its attention function: no pattern to read")


SPLIT_FROM_BYTES = 1 << 30  # models with more weight bytes than this run the screen's backward in fewer rows


@dataclass(frozen=True)
class ScreenLayout:
    """How the screen's forward-and-backward runs: ``rows`` sequences a chunk; ``recompute``: each
    block recomputed in the backward (`recomputed_blocks`), one more forward for a smaller memory."""

    rows: int
    recompute: bool = False


def screen_layout(build, batch_size: int, L: int) -> ScreenLayout:
    """Rows a chunk, so that the activations the backward keeps stay under `mixer_memory.activation_budget`.

    * A hybrid stack on transformers' reference Mamba-2 scan (`mixer_memory.reference_scan`) keeps
      `mixer_memory.kept_bytes` a sequence, counted: as many rows as fit, or, when one sequence does
      not fit (Falcon-H1-1.5B: 2.8 GB against 0.66 GB), each block recomputed in the backward, which
      then keeps the blocks' inputs and one block's activations and their gradients at a time.
    * Other models of more than `SPLIT_FROM_BYTES` of weights: ``T n_layers (6 d_model + 4 d_ff)`` values
      of the build's dtype a row plus the copy positions' float logits (``10 L V`` bytes). Smaller models
      keep the batch: at SmolLM2's size the whole batch's activations are about 1.4 GB.
    """
    model, geo = build.model, build.geometry
    T = 2 * L + bos_offset(build.tokens)
    budget = activation_budget(model)
    item = getattr(model, "dtype", torch.float32).itemsize
    if reference_scan(model, build.device):
        kept = kept_bytes(model, T)
        if kept <= budget:
            return ScreenLayout(max(1, min(batch_size, budget // kept)))
        inputs = len(layer_modules(model)) * T * geo.d_model * item
        return ScreenLayout(max(1, min(batch_size, budget // (2 * block_bytes(model, T) + inputs))), recompute=True)
    if weight_bytes(model) <= SPLIT_FROM_BYTES:
        return ScreenLayout(batch_size)
    d_ff = int(getattr(model.config, "intermediate_size", None) or 4 * geo.d_model)
    per_row = T * geo.n_layers * (6 * geo.d_model + 4 * d_ff) * item + 10 * L * geo.vocab
    return ScreenLayout(max(1, min(batch_size, budget // per_row)))


@contextmanager
def recomputed_blocks(model, on: bool = True):
    """Each decoder block's forward run under non-reentrant `torch.utils.checkpoint.checkpoint`: the
    backward keeps each block's input only and recomputes its intermediates when it reaches it (the
    same values: gradients equal the kept run's), with large blocks mapped (`mixer_memory.map_large_blocks`). Hooks
    inside a block run again then; hooks on the block itself do not."""
    if not on:
        yield
        return
    from torch.utils.checkpoint import checkpoint

    map_large_blocks()
    blocks = layer_modules(model)
    own = [vars(block).get("forward") for block in blocks]
    for block in blocks:
        block.forward = partial(checkpoint, block.forward, use_reentrant=False)
    try:
        yield
    finally:
        for block, forward in zip(blocks, own):
            if forward is None:
                del block.forward
            else:
                block.forward = forward


def screen_estimate(
    build, ids, L, mode, means, method: str, batch_size: int, bar=None, variant: ScreenVariant = TODAY
) -> tuple[np.ndarray, np.ndarray]:
    """``(estimate, rank_score)`` of every head by ``method``: "atp*", "atp*gd" (with GradDrop) or "atp";
    ``bar`` (a `progress.Progress`) counts the chunks of ``batch_size`` sequences; ``variant``: `ScreenVariant`."""
    from ..model.quantized_cache import refuse_decode_only

    refuse_decode_only(build, "the attribution screen")
    variant.check()
    layout = screen_layout(build, batch_size, L)
    ids = ids if variant.sequences is None else ids[: variant.sequences]
    if variant.ablation == "both":
        parts = [_one_screen(build, ids, L, m, means, method, layout, bar, variant) for m in ("zero", "mean")]
        return (parts[0][0] + parts[1][0]) / 2, (parts[0][1] + parts[1][1]) / 2
    return _one_screen(build, ids, L, mode, means, method, layout, bar, variant)


def _one_screen(build, ids, L, mode, means, method, layout, bar, variant) -> tuple[np.ndarray, np.ndarray]:
    batch_size = layout.rows
    if method == "atp":
        est = atp(build, ids, L, mode, means, batch_size, bar, recompute=layout.recompute)
        return est, np.abs(est)
    qk_heads = None
    geo = build.geometry
    if variant.qk_top is not None and variant.qk_top < geo.n_layers * geo.n_heads:  # else: every head
        first = np.abs(atp(build, ids, L, mode, means, batch_size, recompute=layout.recompute))
        order = sorted(np.ndindex(first.shape), key=lambda p: (-first[p], p))
        qk_heads = [(int(l), int(h)) for l, h in order[: variant.qk_top]]
    return atp_star(
        build,
        ids,
        L,
        mode,
        means,
        batch_size,
        grad_drop=method == "atp*gd",
        bar=bar,
        qk_heads=qk_heads,
        drop_sample=variant.grad_drop_layers,
    )
