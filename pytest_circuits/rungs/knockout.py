"""Rung 2: the head knockout scan (docs/definitions.md, "Rung 2, interventions: knockout"), exact and fast.

``knockout_delta(h) = copy_loss(model with h knocked out) - copy_loss(intact model)`` on
held-out repeat sequences (``settings`` carries a seed other than the probe's). Copy loss
is the mean next-token cross-entropy over positions ``L+1 .. 2L-1`` (shifted by one with
BOS) and over the ``n`` sequences. Knockout = zero or mean ablation of the head's ``z``
(`ablation.py`). Per sequence ``i``, ``delta_i(h) = copy_loss_i(h knocked out) -
copy_loss_i(intact)``; the recorded delta is their mean (a difference of means is the mean of
the differences), and the ``n`` values are kept for its interval. Mean ablation uses ``mu_h`` = the mean of ``z_h`` over every position
(BOS included) of every one of the ``n`` held-out sequences, from the intact forward.

Fast and exact: the intact model runs once, with forward pre-hooks recording each decoder
block's call (the residual stream entering it and the kwargs it gets: attention mask,
position embeddings, ...). A knockout in layer ``l`` replays only blocks ``l..end`` from
that record, then the final norm and the unembedding on the copy positions only; ``k``
knockouts share one replay as ``k`` copies stacked on the batch axis, copy ``j`` with its
own head knocked out. Nothing here is per family beyond the family table.

Bounded record: every block's input is ``n T d_model`` values in the build's dtype, ``n_layers``
of them. When that exceeds `RECORD_SHARE` of the memory available (or ``record_bytes``), only
every ``s``-th block's input is kept (``s`` the smallest stride that fits; the other blocks keep
their kwargs alone), and a replay from layer ``l`` first recomputes blocks ``c..l-1`` from the
nearest kept input ``c <= l`` (one copy, no knockout: the intact pass's own inputs again, bit for
bit). The replays run in the build's dtype, like the intact pass.

Screening (big models): attribution patching ranks every head from one forward and one
backward, ``estimate_h = sum over sequences, positions of (z_h^ablated - z_h) . dL/dz_h``
(zero ablation: ``-z_h . dL/dz_h``); exact knockouts then run only on the ``screen_top_k``
heads with the largest ``|estimate_h|`` plus ``must_include``. Gates use exact deltas only.
"""

from __future__ import annotations

import math
import warnings
import weakref
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import pandas as pd
import torch

from ..errors import CircuitsError
from ..model.builds import LoadedBuild
from ..model.dense import weight_of
from ..model.families import flattens_batch_with_heads, head_label, layer_modules, tail_logits
from ..model.unembedding import row_major_unembedding
from ..options import KNOCKOUT_MODES, SCREEN_METHODS, flag
from ..progress import Progress, phase
from .ablation import ZMeans, ablated, parse_heads, z_observed
from .figures import sequences_key
from .repeat import (
    KNOCKOUT_CPU_TOKENS,
    RepeatSettings,
    bos_offset,
    check_fits,
    copy_slices,
    next_token_losses,
    repeat_losses,
    repeat_tokens,
)

MODES = KNOCKOUT_MODES
ROWS_PER_PASS = 64  # default cap on sequences x knockouts in one replay on an accelerator
CPU_TOKENS_PER_PASS = KNOCKOUT_CPU_TOKENS  # on a CPU, stacking past about this many tokens runs slower per knockout
SEQUENCES = sequences_key("knockout_delta")  # the frame's column of per-sequence deltas
FAST_ATTENTION = "sdpa"  # knockouts need no attention weights: the fused exact kernel
RECORD_SHARE = 0.25  # the recorded block inputs may take this share of the memory available at the intact pass


@dataclass
class _Chunk:
    """One batch of held-out sequences and every block's recorded call on it (its input kept
    only at the blocks of ``kept``: the others' hidden state is None, recomputed on replay)."""

    ids: torch.Tensor
    calls: list[tuple[tuple, dict]] = field(default_factory=list)
    copy_losses: torch.Tensor | None = None  # intact, per sequence
    stride: int = 1  # the input of every stride-th block is kept (1: every block's)


@dataclass
class _Intact:
    copy_loss: float
    chunks: list[_Chunk]
    means: torch.Tensor | None  # (n_layers, n_heads, d_head)
    losses: torch.Tensor | None = None  # (n,) float64 intact copy loss per sequence; copy_loss is their mean


def _check_mode(mode: str) -> None:
    if mode not in MODES:
        raise CircuitsError(f"knockout mode {mode!r} is unknown; use zero or mean ({flag('knockout-mode')})")


@contextmanager
def attention_implementation(model, impl: str = FAST_ATTENTION):
    """Run ``model`` with attention implementation ``impl`` inside the block, then restore its own.

    Knockouts, their replays and the attribution screen need no attention weights, so they run
    on SDPA (same softmax(QK^T/sqrt(d)+mask)V, fused); the probe keeps eager attention for its
    patterns. A model that cannot switch (no ``set_attn_implementation``, or ``impl`` not
    supported) keeps its own.
    """
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
    """The ``(n, 2L[+1])`` held-out repeat sequences, checked against the model's context."""
    check_fits(build.model.config, build.tokens, settings.L)
    return repeat_tokens(build.tokens, settings.n, settings.L, settings.seed)


def _chunks(ids: torch.Tensor, batch_size: int) -> list[torch.Tensor]:
    if batch_size < 1:
        raise CircuitsError(f"batch size {batch_size} must be at least 1 ({flag('batch-size')})")
    return list(ids.split(batch_size))


def _detach(obj):
    if torch.is_tensor(obj):
        return obj.detach()
    if isinstance(obj, (tuple, list)):
        return type(obj)(_detach(o) for o in obj)
    if isinstance(obj, dict):
        return {k: _detach(v) for k, v in obj.items()}
    return obj


def _forward_logits(model, ids: torch.Tensor, device) -> torch.Tensor:
    return model(input_ids=ids.to(device), use_cache=False).logits


def _copy_losses(build, logits, ids, L) -> torch.Tensor:
    """Per-sequence copy loss from full logits (repeat.py's definition)."""
    return repeat_losses(next_token_losses(logits, ids), L, bos_offset(build.tokens))[1]


def record_stride(build: LoadedBuild, n_tokens: int, record_bytes: int | None = None) -> int:
    """Keep every ``s``-th block's input: the smallest ``s`` whose kept inputs (``n_tokens d_model``
    values of the build's dtype each) fit in ``record_bytes`` (default `RECORD_SHARE` of the
    memory available on the build's device); at most ``n_layers``."""
    from .repeat import available_memory

    geo = build.geometry
    per_block = n_tokens * geo.d_model * getattr(build.model, "dtype", torch.float32).itemsize
    budget = int(RECORD_SHARE * available_memory(build.device)) if record_bytes is None else int(record_bytes)
    kept = max(1, min(geo.n_layers, budget // max(per_block, 1)))
    return max(1, math.ceil(geo.n_layers / kept))


def _without_hidden(args, kwargs) -> tuple[tuple, dict]:
    """A recorded call with its hidden state dropped (recomputed on replay)."""
    if args:
        return (None, *args[1:]), kwargs
    return args, {**kwargs, "hidden_states": None}


@torch.no_grad()
def _intact_pass(
    build: LoadedBuild, ids: torch.Tensor, L: int, batch_size: int, record: bool, record_bytes: int | None = None
):
    """Run the intact model once: per-sequence copy loss, every block's call (``record``; inputs
    kept at every `record_stride`-th block), z means."""
    model, geo, n = build.model, build.geometry, ids.shape[0]
    blocks = layer_modules(model)
    z_means = ZMeans(geo)
    chunks, per_sequence = [], []
    stride = record_stride(build, ids.numel(), record_bytes) if record else 1
    for batch in _chunks(ids, batch_size):
        chunk = _Chunk(batch, stride=stride)
        handles = []
        if record:

            def keep(module, args, kwargs, _calls=chunk.calls, _stride=stride):
                call = (_detach(args), _detach(kwargs))
                _calls.append(call if len(_calls) % _stride == 0 else _without_hidden(*call))

            handles = [b.register_forward_pre_hook(keep, with_kwargs=True) for b in blocks]
        try:
            with z_observed(model, geo.n_layers, z_means.observe):
                per_seq = _plain_copy_losses(model, batch, L, bos_offset(build.tokens), build.device)
        finally:
            for handle in handles:
                handle.remove()
        chunk.copy_losses = per_seq.float().cpu()
        per_sequence.append(per_seq.double().cpu())
        chunks.append(chunk)
    losses = torch.cat(per_sequence)
    return _Intact(copy_loss=float(losses.sum()) / n, chunks=chunks, means=z_means.means(), losses=losses)


def _tile(obj, rows: int, k: int, memo: dict):
    """Stack ``k`` copies of every batch-shaped tensor (leading dim ``rows``, 2-D or more) in a call."""
    if torch.is_tensor(obj):
        if k == 1 or obj.dim() < 2 or obj.shape[0] != rows:
            return obj
        key = id(obj)
        if key not in memo:
            memo[key] = obj.repeat(k, *([1] * (obj.dim() - 1)))
        return memo[key]
    if isinstance(obj, (tuple, list)):
        return type(obj)(_tile(o, rows, k, memo) for o in obj)
    if isinstance(obj, dict):
        return {key: _tile(v, rows, k, memo) for key, v in obj.items()}
    return obj


def _recorded_hidden(args, kwargs) -> torch.Tensor:
    return args[0] if args else kwargs["hidden_states"]


@torch.no_grad()
def _replay(build, chunk: _Chunk, layer: int, k: int, L: int) -> torch.Tensor:
    """Copy loss per sequence of ``k`` stacked copies of ``chunk``, run from block ``layer`` on: ``(k, s)``."""
    blocks = layer_modules(build.model)
    devices = block_devices(build.model)
    rows = chunk.ids.shape[0]
    memo: dict = {}
    start = layer - layer % chunk.stride  # the nearest block at or before ``layer`` whose input was kept
    hidden = _recorded_hidden(*chunk.calls[start])
    for index in range(start, layer):  # the intact blocks in between, recomputed once (not stacked)
        args, kwargs = _call_args(*chunk.calls[index], rows, 1, {}, hidden)
        if devices is not None:
            args, kwargs = _moved(args, devices[index]), _moved(kwargs, devices[index])
        out = blocks[index](*args, **kwargs)
        hidden = out[0] if isinstance(out, (tuple, list)) else out
    hidden = _tile(hidden, rows, k, memo)
    last = len(blocks) - 1
    for index in range(layer, len(blocks)):
        args, kwargs = _call_args(*chunk.calls[index], rows, k, memo, hidden)
        if devices is not None:  # a model spread over devices: the recorded call moves with its block
            args, kwargs = _moved(args, devices[index]), _moved(kwargs, devices[index])
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


def _moved(obj, device: torch.device):
    """``obj`` (tensors, in tuples, lists and dicts) on ``device``."""
    if torch.is_tensor(obj):
        return obj if obj.device == device else obj.to(device)
    if isinstance(obj, (tuple, list)):
        return type(obj)(_moved(o, device) for o in obj)
    if isinstance(obj, dict):
        return {key: _moved(v, device) for key, v in obj.items()}
    return obj


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

    handles = [
        mlp.register_forward_pre_hook(pick, with_kwargs=True),
        mlp.register_forward_hook(place, with_kwargs=True),
    ]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def _call_args(args, kwargs, rows, k, memo, hidden):
    """The recorded call of a block with ``hidden`` as its input and batch tensors stacked ``k`` times."""
    if args:
        return (hidden, *_tile(tuple(args[1:]), rows, k, memo)), _tile(kwargs, rows, k, memo)
    return (), {**_tile(kwargs, rows, k, memo), "hidden_states": hidden}


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


def _replay_gap(build: LoadedBuild, intact: _Intact, L: int) -> str | None:
    """Why replaying the recorded last block and the tail does not reproduce the intact copy losses, or None."""
    chunk = intact.chunks[0]
    assert chunk.copy_losses is not None  # the intact pass records them
    with attention_implementation(build.model):
        replayed = _replay(build, chunk, build.geometry.n_layers - 1, 1, L)[0].float().cpu()
    tol = 1e-4 if next(build.model.parameters()).dtype == torch.float32 else 2e-2
    gap = float((replayed - chunk.copy_losses).abs().max())
    if gap <= tol:
        return None
    return f"replaying the recorded decoder blocks does not reproduce the model's copy loss (gap {gap:.2g} > {tol:g})"


def _groups(items: list, size: int) -> list[list]:
    return [items[i : i + size] for i in range(0, len(items), size)]


def replay_cost(n_layers: int, layer: int) -> int:
    """Blocks a knockout in ``layer`` replays (``n_layers - layer``): the progress bar's cost per head."""
    return n_layers - layer


def _cached_deltas(build, intact: _Intact, pairs, mode, L, knockouts_per_pass, bar) -> dict:
    """Exact per-sequence copy loss ``(n,)`` float64 of every knockout in ``pairs``, replayed from the record, ``k`` at a time."""
    geo = build.geometry
    by_layer: dict[int, list[int]] = {}
    for layer, head in pairs:
        by_layer.setdefault(layer, []).append(head)
    losses = {}
    for layer, heads in sorted(by_layer.items()):
        means = intact.means[layer] if mode == "mean" and intact.means is not None else None
        for group in _groups(heads, knockouts_per_pass):
            parts = []
            for chunk in intact.chunks:
                rows = chunk.ids.shape[0]
                assignments = [(slice(j * rows, (j + 1) * rows), head) for j, head in enumerate(group)]
                with ablated(build.model, layer, geo.d_head, assignments, means):
                    parts.append(_replay(build, chunk, layer, len(group), L).double().cpu())
            per_seq = torch.cat(parts, dim=1)  # (k, n)
            for j, head in enumerate(group):
                losses[(layer, head)] = per_seq[j]
            bar.update(len(group), len(group) * replay_cost(geo.n_layers, layer), head_label(layer, group[-1]))
    return losses


def batch_invariant(build: LoadedBuild) -> bool:
    """False for bitsandbytes LLM.int8(): its outlier columns are picked over the whole batch,
    so stacking knockouts would let one knockout's activations change another's result."""
    return not build.llm_int8


def _auto_per_pass(build, knockouts_per_pass, batch_size, n, tokens_per_row: int) -> int:
    """Knockouts stacked in one replay: ``ROWS_PER_PASS`` rows on an accelerator; on a CPU about
    ``CPU_TOKENS_PER_PASS`` tokens (bigger matmuls there run at a lower rate per knockout: on
    SmolLM2-135M at n 8, L 64 the scan of 27 heads took 10-15% longer stacked 8 high than 1-2 high)."""
    if knockouts_per_pass is not None:
        if knockouts_per_pass < 1:
            raise CircuitsError(f"knockouts_per_pass={knockouts_per_pass} must be at least 1")
        return knockouts_per_pass
    if not batch_invariant(build) or flattens_batch_with_heads(build.model):
        return 1
    rows = min(batch_size, n)
    if torch.device(build.device).type == "cpu":
        return max(1, round(CPU_TOKENS_PER_PASS / (rows * tokens_per_row)))
    return max(1, ROWS_PER_PASS // rows)


def knockout_scan(
    build: LoadedBuild,
    settings: RepeatSettings,
    *,
    mode: str = "zero",
    heads=None,
    screen_top_k: int | None = None,
    screen_method: str = "atp*",
    must_include=(),
    batch_size: int = 8,
    progress: bool = True,
    write=None,
    knockouts_per_pass: int | None = None,
    cached: bool = True,
    layers=None,
    record_bytes: int | None = None,
) -> pd.DataFrame:
    """Knockout delta of every head (or of ``heads``) on the held-out repeat sequences of ``settings``.

    One row per head of the model: ``head``, ``layer``, ``head_index``, ``knockout_delta``
    (NaN where no exact knockout ran), ``knockout_delta_sequences`` (its ``n`` per-sequence
    deltas, which average to it; None where no exact knockout ran) and, when screening ran, ``knockout_estimate`` (signed)
    and ``knockout_screen_score`` (what heads are ranked by). ``screen_top_k``: exact knockouts
    only on the ``k`` top-ranked heads among ``heads`` (default all), plus ``must_include`` (always exact).
    ``screen_method``: ``"atp*"`` (default, `screen.atp_star`: attribution patching with the
    QK fix), ``"atp*gd"`` (and GradDrop) or ``"atp"`` (plain attribution patching).
    ``knockouts_per_pass``: knockouts stacked in one replay (default `_auto_per_pass`: up to
    ``ROWS_PER_PASS`` rows on an accelerator, ``CPU_TOKENS_PER_PASS`` tokens on a CPU; 1 for
    bnb-int8, see `batch_invariant`). ``cached=False`` runs the
    plain loop (one full forward per head); so does a model whose replay is not exact (one warning).
    ``progress``: report heads done, layer and ETA (`progress.Progress`); ``write``: where its
    plain lines go (e.g. the pytest terminal reporter), default a bar on a terminal, else stderr.
    ``layers``: one shard (`layer_shards`): exact knockouts only of the chosen heads in these
    layers (the intact pass and the screen still see the whole model); `merge_knockout_shards`
    joins the shards into the unsharded scan.
    ``record_bytes``: the most the recorded block inputs may hold (default `RECORD_SHARE` of the
    memory available; `record_stride`); fewer kept inputs only add recomputed blocks, same figures.
    ``df.attrs``: ``copy_loss`` (intact), ``mode``, ``settings`` (dict), ``screened``,
    ``screen_top_k``, ``screen_method``, ``exact_heads``, ``cached`` (whether the replay ran),
    ``layers`` (the shard's layers, None for the whole model).
    """
    _check_mode(mode)
    if screen_method not in SCREEN_METHODS:
        raise CircuitsError(f"screen method {screen_method!r} is unknown; use one of: {', '.join(SCREEN_METHODS)}")
    geo = build.geometry
    candidates = parse_heads(heads, geo)
    extra = parse_heads(list(must_include), geo) if must_include else []
    ids = held_out_ids(build, settings)
    screen = screen_top_k is not None
    if screen_top_k is not None and screen_top_k < 0:
        raise CircuitsError(f"screen_top_k={screen_top_k} must be 0 or more ({flag('knockout-screen')})")
    with attention_implementation(build.model), phase(f"knockout intact pass {build.label}", write, enabled=progress):
        intact = _intact_pass(build, ids, settings.L, batch_size, record=cached, record_bytes=record_bytes)
    estimate = score = None
    if screen:
        from .screen import screen_estimate

        chunks = -(-ids.shape[0] // max(batch_size, 1))
        label = f"screen ({screen_method}) {build.label}"
        try:
            with Progress(chunks, label, unit="chunk", enabled=progress, write=write) as bar:
                estimate, score = screen_estimate(
                    build, ids, settings.L, mode, intact.means, screen_method, batch_size, bar
                )
        except (RuntimeError, NotImplementedError, TypeError) as error:
            warnings.warn(
                f"{build.label}: attribution screening needs a backward pass, which failed here "
                f"({str(error).splitlines()[0] if str(error) else type(error).__name__}); "
                "running exact knockouts on every requested head instead",
                stacklevel=2,
            )
            screen = False
    if screen and score is not None:
        ranked = sorted(candidates, key=lambda p: (-score[p], p))
        exact = sorted(set(ranked[:screen_top_k]) | set(extra))
    else:
        exact = sorted(set(candidates) | set(extra))
    shard = None if layers is None else sorted({int(l) for l in layers})
    if shard is not None:
        if not shard or shard[0] < 0 or shard[-1] >= geo.n_layers:
            raise CircuitsError(f"knockout shard layers {shard} must lie in 0..{geo.n_layers - 1}")
        exact = [pair for pair in exact if pair[0] in shard]
    n = ids.shape[0]
    if cached:
        why = _replay_gap(build, intact, settings.L)
        if why is not None:
            warnings.warn(
                f"{build.label}: {why}; running the plain loop (one full forward per head) instead", stacklevel=2
            )
            cached = False
    total_cost = sum(replay_cost(geo.n_layers, l) for l, _ in exact) if cached else len(exact)
    with Progress(len(exact), f"knockout {build.label}", total_cost=total_cost, enabled=progress, write=write) as bar:
        with attention_implementation(build.model):
            if cached:
                per_pass = _auto_per_pass(build, knockouts_per_pass, batch_size, n, ids.shape[1])
                losses = _cached_deltas(build, intact, exact, mode, settings.L, per_pass, bar)
            else:
                losses = _naive_losses(build, ids, settings.L, exact, mode, intact.means, batch_size, bar)
    rows = []
    for layer in range(geo.n_layers):
        for head in range(geo.n_heads):
            row = {"head": head_label(layer, head), "layer": layer, "head_index": head}
            loss = losses.get((layer, head))
            per_sequence = None if loss is None else sequence_deltas(loss, intact)
            row["knockout_delta"] = math.nan if per_sequence is None else mean_delta(per_sequence)
            row[SEQUENCES] = per_sequence
            if screen and estimate is not None and score is not None:
                row["knockout_estimate"] = float(estimate[layer, head])
                row["knockout_screen_score"] = float(score[layer, head])
            rows.append(row)
    df = pd.DataFrame(rows)
    df.attrs.update(
        copy_loss=intact.copy_loss,
        mode=mode,
        settings=settings.as_dict(),
        screened=screen,
        screen_top_k=screen_top_k if screen else None,
        screen_method=screen_method if screen else None,
        exact_heads=[head_label(*p) for p in exact],
        cached=cached,
        layers=shard,
    )
    return df


def sequence_deltas(losses: torch.Tensor, intact: _Intact) -> list[float]:
    """Per-sequence knockout deltas ``copy_loss_i(knocked out) - copy_loss_i(intact)`` (float64)."""
    assert intact.losses is not None  # the intact pass keeps them
    return (losses.double() - intact.losses).tolist()


def mean_delta(per_sequence: list[float]) -> float:
    """The knockout delta: the mean of its per-sequence deltas (so they average back to it)."""
    return math.fsum(per_sequence) / len(per_sequence)


def layer_shards(n_layers: int, shards: int) -> list[list[int]]:
    """Layers ``0..n_layers-1`` in ``shards`` contiguous runs of about equal replay cost.

    A knockout in layer ``l`` replays ``n_layers - l`` blocks (`replay_cost`), so early layers
    cost more: a cut falls where the cumulative cost passes ``j/shards`` of the total. More
    shards than layers gives one layer per shard.
    """
    if shards < 1:
        raise CircuitsError(f"knockout shards {shards} must be at least 1 ({flag('knockout-shards')})")
    shards = min(shards, n_layers)
    costs = [replay_cost(n_layers, layer) for layer in range(n_layers)]
    total, done = sum(costs), 0.0
    runs: list[list[int]] = []
    current: list[int] = []
    for layer, cost in enumerate(costs):
        target = total * (len(runs) + 1) / shards  # where the current run should end
        still_to_open = shards - len(runs) - 1
        closer_without = target - done < done + cost - target
        if current and still_to_open > 0 and (n_layers - layer == still_to_open or closer_without):
            runs.append(current)
            current = []
        current.append(layer)
        done += cost
    runs.append(current)
    return runs


def merge_knockout_shards(frames: list[pd.DataFrame]) -> pd.DataFrame:
    """One scan from its shards (each `knockout_scan(..., layers=...)` of one build and settings):
    each head's ``knockout_delta`` from the shard that owns its layer; the rest (screen columns,
    intact copy loss) is the same in every shard and is checked to be."""
    if not frames:
        raise CircuitsError("no knockout shards to merge")
    first = frames[0]
    owner: dict[int, int] = {}
    for index, frame in enumerate(frames):
        if frame.attrs.get("layers") is None:
            raise CircuitsError("a knockout shard without its layers cannot be merged")
        for layer in frame.attrs["layers"]:
            if layer in owner:
                raise CircuitsError(f"knockout shards {owner[layer]} and {index} both hold layer {layer}")
            owner[layer] = index
        same = ("copy_loss", "mode", "settings", "screened", "screen_top_k", "screen_method")
        if any(frame.attrs.get(key) != first.attrs.get(key) for key in same):
            raise CircuitsError(f"knockout shard {index} was measured with other settings than shard 0")
    merged = first.copy()
    measured = [c for c in first.columns if c.startswith("knockout_delta")]  # the delta, its sequences, ...
    for column in measured:
        merged[column] = [
            frames[owner[layer]].loc[i, column]
            if layer in owner
            else (math.nan if column == "knockout_delta" else None)
            for i, layer in enumerate(first["layer"])
        ]
    exact = sorted({label for frame in frames for label in frame.attrs["exact_heads"]}, key=_label_order)
    merged.attrs = {
        **first.attrs,
        "exact_heads": exact,
        "cached": all(frame.attrs.get("cached") for frame in frames),
        "layers": None,
    }
    return merged


def _label_order(label: str) -> tuple[int, int]:
    from .figures import parse_label

    cell = parse_label(label)
    assert cell is not None  # labels come from head_label
    return cell


def _plain_copy_losses(model, batch: torch.Tensor, L: int, offset: int, device) -> torch.Tensor:
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
def _naive_losses(build, ids, L, pairs, mode, means, batch_size, bar=None) -> dict:
    """The honest plain loop: per head, a pre-hook on its output projection and one full forward
    of every sequence (all in one batch unless ``batch_size`` is smaller), unembedding only the last ``L`` positions."""
    losses, offset = {}, bos_offset(build.tokens)
    for layer, head in pairs:
        layer_means = means[layer] if mode == "mean" else None
        with ablated(build.model, layer, build.geometry.d_head, [(slice(None), head)], layer_means):
            parts = [
                _plain_copy_losses(build.model, batch, L, offset, build.device).double().cpu()
                for batch in _chunks(ids, batch_size)
            ]
        losses[(layer, head)] = torch.cat(parts)
        if bar is not None:
            bar.update(1, 1, head_label(layer, head))
    return losses


def naive_knockout_deltas(
    build: LoadedBuild, settings: RepeatSettings, *, mode: str = "zero", heads=None, batch_size: int = 8
) -> tuple[float, dict[str, float]]:
    """The plain reference: intact copy loss and ``{label: delta}``, one full forward per head."""
    _check_mode(mode)
    pairs = parse_heads(heads, build.geometry)
    ids = held_out_ids(build, settings)
    with attention_implementation(build.model):
        intact = _intact_pass(build, ids, settings.L, batch_size, record=False)
        losses = _naive_losses(build, ids, settings.L, pairs, mode, intact.means, batch_size)
    return intact.copy_loss, {head_label(*p): mean_delta(sequence_deltas(v, intact)) for p, v in losses.items()}


def _matrix_params(module) -> int:
    return sum(p.numel() for p in module.parameters() if p.dim() >= 2)


def knockout_flops(build: LoadedBuild, settings: RepeatSettings, heads=None) -> dict[str, float]:
    """Floating-point operations (multiply-add = 2) counted from the shapes, for ``n`` sequences of ``T`` tokens.

    ``forward``: one forward unembedding the last ``L`` positions, ``n (T sum_j B_j(T) + L 2 d V)``
    with ``B_j = 2 x (block j's matrix parameters) + 4 n_heads d_head (T+1)/2`` per token (causal
    attention reads ``(T+1)/2`` keys on average). ``plain``: the plain loop (its intact forward,
    then one forward per head). ``scan``: the exact cached scan (intact forward, then per head of
    layer ``l`` blocks ``l..end`` on ``T`` tokens, the last block's MLP on the ``L-1`` copy
    positions only, the unembedding on those). Norms, softmax and elementwise ops are not counted.
    """
    geo, model = build.geometry, build.model
    n, L = settings.n, settings.L
    T = 2 * L + bos_offset(build.tokens)
    blocks = layer_modules(model)
    attention = 4 * geo.n_heads * geo.d_head * (T + 1) / 2
    per_token = [2 * _matrix_params(b) + attention for b in blocks]
    head: Any = model  # transformers' PreTrainedModel; torch types its attributes Tensor | Module
    unembed = 2 * weight_of(head.get_output_embeddings()).numel()
    last_mlp = getattr(blocks[-1], "mlp", None)
    mlp_cut = 2 * _matrix_params(last_mlp) * (T - (L - 1)) if last_mlp is not None else 0.0
    forward = n * (T * sum(per_token) + L * unembed)
    pairs = parse_heads(heads, geo)
    scan = forward + sum(n * (T * sum(per_token[l:]) - mlp_cut + (L - 1) * unembed) for l, _ in pairs)
    return {"forward": forward, "plain": forward * (1 + len(pairs)), "scan": scan}


def head_means(build: LoadedBuild, settings: RepeatSettings, batch_size: int = 8) -> torch.Tensor:
    """``(n_layers, n_heads, d_head)``: the mean-ablation ``mu_h``, over every position of every held-out sequence."""
    ids = held_out_ids(build, settings)
    return _intact_pass(build, ids, settings.L, batch_size, record=False).means
