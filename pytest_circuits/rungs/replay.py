"""The replay engine of the knockout scan (knockout.py): trace the intact model's block calls once, replay from any block.

Fast and exact: the intact model runs once, with forward pre-hooks tracing each decoder
block's call (the residual stream entering it and the kwargs it gets: attention mask,
position embeddings, ...). A knockout in layer ``l`` replays only blocks ``l..end`` from
that trace, then the final norm and the unembedding on the copy positions only; ``k``
knockouts share one replay as ``k`` copies stacked on the batch axis, copy ``j`` with its
own head knocked out. Nothing here is per family beyond the family table.

Bounded trace: every block's input is ``n T d_model`` values in the build's dtype, ``n_layers``
of them. When that exceeds `TRACE_SHARE` of the memory available (or ``trace_bytes``), only
every ``s``-th block's input is kept (``s`` the smallest stride that fits; the other blocks keep
their kwargs alone), and a replay from layer ``l`` first recomputes blocks ``c..l-1`` from the
nearest kept input ``c <= l`` (one copy, no knockout: the intact pass's own inputs again, bit for
bit). The replays run in the build's dtype, like the intact pass.
"""

from __future__ import annotations

import math
import weakref
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from ..errors import CircuitsError
from ..model.builds import LoadedBuild
from ..model.families import layer_modules, tail_logits
from ..model.hooks import Hook, hooked
from ..model.unembedding import row_major_unembedding
from ..options import flag
from .ablation import ZMeans, z_observed
from .repeat import available_memory, bos_offset, check_fits, copy_slices
from .repeat_settings import RepeatSettings
from .text_probe import probe_ids

FAST_ATTENTION = "sdpa"  # knockouts need no attention weights: the fused exact kernel
TRACE_SHARE = 0.25  # the traced block inputs may take this share of the memory available at the intact pass


@dataclass
class Chunk:
    """One batch of held-out sequences and every block's traced call on it (its input kept
    only at the blocks of ``kept``: the others' hidden state is None, recomputed on replay)."""

    ids: torch.Tensor
    calls: list[tuple[tuple, dict]] = field(default_factory=list)
    copy_losses: torch.Tensor | None = None  # intact, per sequence
    stride: int = 1  # the input of every stride-th block is kept (1: every block's)


@dataclass
class Intact:
    copy_loss: float
    chunks: list[Chunk]
    means: torch.Tensor | None  # (n_layers, n_heads, d_head)
    losses: torch.Tensor | None = None  # (n,) float64 intact copy loss per sequence; copy_loss is their mean


@contextmanager
def attention_implementation(model, impl: str = FAST_ATTENTION):
    """Run ``model`` with attention implementation ``impl`` inside the block, then restore its own.

    Knockouts, their replays and the attribution screen need no attention weights, so they run
    on SDPA (same softmax(QK^T/sqrt(d)+mask)V, fused); the probe keeps eager attention for its
    patterns. A model that cannot switch (no ``set_attn_implementation``, or ``impl`` not
    supported) keeps its own.
    """
    from ..model.kv_cache import served

    impl = served(model, impl)  # a build served with a KV cache keeps it
    before = getattr(model.config, "_attn_implementation", None)
    switched = False
    if before != impl and hasattr(model, "set_attn_implementation"):
        try:
            model.set_attn_implementation(impl)
            switched = True
        except (ValueError, ImportError, NotImplementedError, KeyError):
            switched = False
    try:
        yield
    finally:
        if switched:
            model.set_attn_implementation(before)


def held_out_ids(build: LoadedBuild, settings: RepeatSettings) -> torch.Tensor:
    """The ``(n, 2L[+1])`` held-out repeat sequences (`text_probe.probe_ids`), checked against the model's context."""
    check_fits(build.model.config, build.tokens, settings.L)
    return probe_ids(build.source, build.tokens, settings)


def batches(ids: torch.Tensor, batch_size: int) -> list[torch.Tensor]:
    if batch_size < 1:
        raise CircuitsError(f"batch size {batch_size} must be at least 1 ({flag('batch-size')})")
    return list(ids.split(batch_size))


def tree_map(fn, obj):
    """``obj`` with ``fn`` applied to every tensor in it (through tuples, lists and dicts; other leaves as they are).

    The one walk over a traced call: detached when traced, stacked ``k`` times and moved to a block's device on replay.
    """
    if torch.is_tensor(obj):
        return fn(obj)
    if isinstance(obj, (tuple, list)):
        return type(obj)(tree_map(fn, o) for o in obj)
    if isinstance(obj, dict):
        return {key: tree_map(fn, v) for key, v in obj.items()}
    return obj


def trace_stride(build: LoadedBuild, n_tokens: int, trace_bytes: int | None = None) -> int:
    """Keep every ``s``-th block's input: the smallest ``s`` whose kept inputs (``n_tokens d_model``
    values of the build's dtype each) fit in ``trace_bytes`` (default `TRACE_SHARE` of the
    memory available on the build's device); at most the number of blocks (a hybrid stack's count its
    blocks without attention too)."""
    geo, blocks = build.geometry, len(layer_modules(build.model))
    per_block = n_tokens * geo.d_model * getattr(build.model, "dtype", torch.float32).itemsize
    budget = int(TRACE_SHARE * available_memory(build.device)) if trace_bytes is None else int(trace_bytes)
    kept = max(1, min(blocks, budget // max(per_block, 1)))
    return max(1, math.ceil(blocks / kept))


def _without_hidden(args, kwargs) -> tuple[tuple, dict]:
    """A traced call with its hidden state dropped (recomputed on replay)."""
    if args:
        return (None, *args[1:]), kwargs
    return args, {**kwargs, "hidden_states": None}


def forward_copy_losses(model, batch: torch.Tensor, L: int, offset: int, device) -> torch.Tensor:
    """Per-sequence copy loss from one full forward that unembeds only the last ``L`` positions."""
    ids = batch.to(device)
    try:  # the kept positions reach the unembedding as a row-major copy (model/unembedding.py: no W_U per sequence)
        with row_major_unembedding(model):
            logits = model(input_ids=ids, use_cache=False, logits_to_keep=L).logits
    except TypeError:  # a model without logits_to_keep: unembed every position
        logits = model(input_ids=ids, use_cache=False).logits[:, -L:]
    # the last L positions are offset+L .. offset+2L-1; the first L-1 predict the copy's tokens
    logits = logits[:, : L - 1].float()
    targets = ids[:, offset + L + 1 :]
    losses = torch.nn.functional.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), reduction="none"
    )
    return losses.reshape(targets.shape).mean(dim=1)


@torch.no_grad()
def intact_pass(
    build: LoadedBuild, ids: torch.Tensor, L: int, batch_size: int, trace: bool, trace_bytes: int | None = None
):
    """Run the intact model once: per-sequence copy loss, every block's call (``trace``; inputs
    kept at every `trace_stride`-th block), z means."""
    model, geo, n = build.model, build.geometry, ids.shape[0]
    blocks = layer_modules(model)
    z_means = ZMeans(geo)
    chunks, per_sequence = [], []
    stride = trace_stride(build, ids.numel(), trace_bytes) if trace else 1
    for batch in batches(ids, batch_size):
        chunk = Chunk(batch, stride=stride)
        tracing: list[Hook] = []
        if trace:

            def keep(module, args, kwargs, _calls=chunk.calls, _stride=stride):
                call = tree_map(lambda tensor: tensor.detach(), (args, kwargs))
                _calls.append(call if len(_calls) % _stride == 0 else _without_hidden(*call))

            tracing = [(b, "pre_kwargs", keep) for b in blocks]
        with hooked(*tracing), z_observed(model, geo.n_layers, z_means.observe):
            per_seq = forward_copy_losses(model, batch, L, bos_offset(build.tokens), build.device)
        chunk.copy_losses = per_seq.float().cpu()
        per_sequence.append(per_seq.double().cpu())
        chunks.append(chunk)
    losses = torch.cat(per_sequence)
    return Intact(copy_loss=float(losses.sum()) / n, chunks=chunks, means=z_means.means(), losses=losses)


def tile(obj, rows: int, k: int, memo: dict):
    """Stack ``k`` copies of every batch-shaped tensor (leading dim ``rows``, 2-D or more) in a call."""

    def stacked(tensor: torch.Tensor) -> torch.Tensor:
        if k == 1 or tensor.dim() < 2 or tensor.shape[0] != rows:
            return tensor
        key = id(tensor)
        if key not in memo:
            memo[key] = tensor.repeat(k, *([1] * (tensor.dim() - 1)))
        return memo[key]

    return tree_map(stacked, obj)


def traced_hidden(args, kwargs) -> torch.Tensor:
    return args[0] if args else kwargs["hidden_states"]


@torch.no_grad()
def replay_chunk(build, chunk: Chunk, layer: int, k: int, L: int) -> torch.Tensor:
    """Copy loss per sequence of ``k`` stacked copies of ``chunk``, run from attention layer ``layer``'s block
    on (on a hybrid stack `Geometry.block`; the blocks between are the rest of the stack): ``(k, s)``."""
    blocks = layer_modules(build.model)
    layer = build.geometry.block(layer)
    devices = block_devices(build.model)
    rows = chunk.ids.shape[0]
    memo: dict = {}
    start = layer - layer % chunk.stride  # the nearest block at or before ``layer`` whose input was kept
    hidden = traced_hidden(*chunk.calls[start])
    for index in range(start, layer):  # the intact blocks in between, recomputed once (not stacked)
        args, kwargs = _call_args(*chunk.calls[index], rows, 1, {}, hidden)
        if devices is not None:
            args, kwargs = moved(args, devices[index]), moved(kwargs, devices[index])
        out = blocks[index](*args, **kwargs)
        hidden = out[0] if isinstance(out, (tuple, list)) else out
    hidden = tile(hidden, rows, k, memo)
    last = len(blocks) - 1
    for index in range(layer, len(blocks)):
        args, kwargs = _call_args(*chunk.calls[index], rows, k, memo, hidden)
        if devices is not None:  # a model spread over devices: the traced call moves with its block
            args, kwargs = moved(args, devices[index]), moved(kwargs, devices[index])
        # bnb-int8 picks outlier columns over all rows: cutting rows would change the other rows' result
        cut = index == last and batch_invariant(build) and build.model not in _NOT_POSITIONWISE
        try:
            with _rows_only(getattr(blocks[index], "mlp", None) if cut else None, _predicted(build, L)):
                out = blocks[index](*args, **kwargs)
        except _NotPositionwise:  # e.g. BLOOM's MLP adds the residual, an MoE returns router logits too
            _NOT_POSITIONWISE[build.model] = True
            out = blocks[index](*args, **kwargs)
        hidden = out[0] if isinstance(out, (tuple, list)) else out
    ids = chunk.ids.repeat(k, 1)
    per_copy = [_tail_copy_losses(build, h, i, L) for h, i in zip(hidden.split(rows), ids.split(rows))]
    return torch.cat(per_copy).reshape(k, rows)  # unembedded one copy at a time: logits of one chunk at once


def block_devices(model) -> list[torch.device] | None:
    """Each decoder block's execution device when accelerate spread the model (``hf_device_map``
    over more than one device), else None (every block on the model's one device)."""
    device_map = getattr(model, "hf_device_map", None)
    if not device_map or len(set(map(str, device_map.values()))) <= 1:
        return None
    devices = []
    for block in layer_modules(model):
        found = getattr(getattr(block, "_hf_hook", None), "execution_device", None)
        if found is None:
            found = next(block.parameters()).device
        devices.append(torch.device("cuda", found) if isinstance(found, int) else torch.device(found))
    return devices


def moved(obj, device: torch.device):
    """``obj`` (tensors, in tuples, lists and dicts) on ``device``."""
    return tree_map(lambda tensor: tensor if tensor.device == device else tensor.to(device), obj)


def _predicted(build, L: int) -> slice:
    """Positions whose output the copy loss reads (they predict the second copy's tokens)."""
    return copy_slices(L, bos_offset(build.tokens))[1]


class _NotPositionwise(Exception):
    """The block's MLP is not a plain map of one hidden-state tensor to one: no rows are cut."""


_NOT_POSITIONWISE: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # models whose MLP is not


@contextmanager
def _rows_only(mlp, positions: slice):
    """Run a position-wise ``mlp`` on ``positions`` only, zeros elsewhere (in the last block only
    the copy positions reach the unembedding, so the rest of its MLP output is never read)."""
    if mlp is None:
        yield
        return

    length: list[int] = []

    def pick(module, args, kwargs):
        tensors = [a for a in (*args, *kwargs.values()) if torch.is_tensor(a) and a.dim() >= 2]
        if len(tensors) != 1:
            raise _NotPositionwise
        hidden = args[0] if args else next(iter(kwargs.values()))
        length[:] = [hidden.shape[1]]
        if args:
            return (hidden[:, positions].contiguous(), *args[1:]), kwargs
        return args, {**kwargs, next(iter(kwargs)): hidden[:, positions].contiguous()}

    def place(module, args, kwargs, out):
        if not torch.is_tensor(out):
            raise _NotPositionwise
        full = out.new_zeros(out.shape[0], length[0], *out.shape[2:])
        full[:, positions] = out
        return full

    with hooked((mlp, "pre_kwargs", pick), (mlp, "forward_kwargs", place)):
        yield


def _call_args(args, kwargs, rows, k, memo, hidden):
    """The traced call of a block with ``hidden`` as its input and batch tensors stacked ``k`` times."""
    if args:
        return (hidden, *tile(tuple(args[1:]), rows, k, memo)), tile(kwargs, rows, k, memo)
    return (), {**tile(kwargs, rows, k, memo), "hidden_states": hidden}


def _tail_copy_losses(build, hidden, ids, L) -> torch.Tensor:
    """Per-sequence copy loss from the last block's output: norm and unembed the copy positions only."""
    predict = copy_slices(L, bos_offset(build.tokens))[1]
    with row_major_unembedding(build.model):  # a family without a final norm unembeds the slice itself
        logits = tail_logits(build.model, hidden[:, predict], build.family).float()
    targets = ids[:, predict.start + 1 : predict.stop + 1].to(logits.device)
    losses = torch.nn.functional.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), reduction="none"
    )
    return losses.reshape(targets.shape).mean(dim=1)


def replay_gap(build: LoadedBuild, intact: Intact, L: int) -> str | None:
    """Why replaying the traced last block and the tail does not reproduce the intact copy losses, or None."""
    chunk = intact.chunks[0]
    assert chunk.copy_losses is not None  # the intact pass keeps them
    with attention_implementation(build.model):
        replayed = replay_chunk(build, chunk, build.geometry.n_layers - 1, 1, L)[0].float().cpu()
    tol = 1e-4 if next(build.model.parameters()).dtype == torch.float32 else 2e-2
    gap = float((replayed - chunk.copy_losses).abs().max())
    if gap <= tol:
        return None
    return f"replaying the traced decoder blocks does not reproduce the model's copy loss (gap {gap:.2g} > {tol:g})"


def replay_cost(n_layers: int, layer: int) -> int:
    """Blocks a knockout in ``layer`` replays (``n_layers - layer``): the progress bar's cost per head."""
    return n_layers - layer


def batch_invariant(build: LoadedBuild) -> bool:
    """False for bitsandbytes LLM.int8(): its outlier columns are picked over the whole batch,
    so stacking knockouts would let one knockout's activations change another's result."""
    return not build.llm_int8


def sequence_deltas(losses: torch.Tensor, intact: Intact) -> list[float]:
    """Per-sequence knockout deltas ``copy_loss_i(knocked out) - copy_loss_i(intact)`` (float64)."""
    assert intact.losses is not None  # the intact pass keeps them
    return (losses.double() - intact.losses).tolist()


def mean_delta(per_sequence: list[float]) -> float:
    """The knockout delta: the mean of its per-sequence deltas (so they average back to it)."""
    return math.fsum(per_sequence) / len(per_sequence)
