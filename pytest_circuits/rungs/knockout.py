"""Rung 2: the head knockout scan (docs/definitions.md, "Rung 2, interventions: knockout"), exact and fast.

``knockout_delta(h) = copy_loss(model with h knocked out) - copy_loss(intact model)`` on
held-out repeat sequences (``settings`` carries a seed other than the probe's). Copy loss
is the mean next-token cross-entropy over positions ``L+1 .. 2L-1`` (shifted by one with
BOS) and over the ``n`` sequences. Knockout = zero or mean ablation of the head's ``z``
(`ablation.py`). Mean ablation uses ``mu_h`` = the mean of ``z_h`` over every position
(BOS included) of every one of the ``n`` held-out sequences, from the intact forward.

Fast and exact: the intact model runs once, with forward pre-hooks recording each decoder
block's call (the residual stream entering it and the kwargs it gets: attention mask,
position embeddings, ...). A knockout in layer ``l`` replays only blocks ``l..end`` from
that record, then the final norm and the unembedding on the copy positions only; ``k``
knockouts share one replay as ``k`` copies stacked on the batch axis, copy ``j`` with its
own head knocked out. Nothing here is per family beyond the family table.

Screening (big models): attribution patching ranks every head from one forward and one
backward, ``estimate_h = sum over sequences, positions of (z_h^ablated - z_h) . dL/dz_h``
(zero ablation: ``-z_h . dL/dz_h``); exact knockouts then run only on the ``screen_top_k``
heads with the largest ``|estimate_h|`` plus ``must_include``. Gates use exact deltas only.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, field

import numpy as np
import pandas as pd
import torch

from ..errors import CircuitsError
from ..model.builds import LoadedBuild, get_recipe
from ..model.families import flattens_batch_with_heads, head_label, layer_modules, tail_logits
from .ablation import ZMeans, ablated, parse_heads, z_differentiable, z_observed
from .repeat import RepeatSettings, bos_offset, check_fits, copy_slices, next_token_losses, repeat_losses, repeat_tokens

MODES = ("zero", "mean")
ROWS_PER_PASS = 64  # default cap on sequences x knockouts in one replay


@dataclass
class _Chunk:
    """One batch of held-out sequences and every block's recorded call on it."""

    ids: torch.Tensor
    calls: list[tuple[tuple, dict]] = field(default_factory=list)
    copy_losses: torch.Tensor | None = None  # intact, per sequence


@dataclass
class _Intact:
    copy_loss: float
    chunks: list[_Chunk]
    means: torch.Tensor | None  # (n_layers, n_heads, d_head)
    zg: np.ndarray | None = None  # (n_layers, n_heads): sum over sequences, positions of z_h . dL/dz_h
    g: torch.Tensor | None = None  # (n_layers, n_heads, d_head): sum of dL/dz_h


def _check_mode(mode: str) -> None:
    if mode not in MODES:
        raise CircuitsError(f"knockout mode {mode!r} is unknown; use zero or mean (--circuits-knockout-mode)")


def held_out_ids(build: LoadedBuild, settings: RepeatSettings) -> torch.Tensor:
    """The ``(n, 2L[+1])`` held-out repeat sequences, checked against the model's context."""
    check_fits(build.model.config, build.tokens, settings.L)
    return repeat_tokens(build.tokens, settings.n, settings.L, settings.seed)


def _chunks(ids: torch.Tensor, batch_size: int) -> list[torch.Tensor]:
    if batch_size < 1:
        raise CircuitsError(f"batch size {batch_size} must be at least 1 (--circuits-batch-size)")
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


def _intact_pass(build: LoadedBuild, ids: torch.Tensor, L: int, batch_size: int, record: bool, screen: bool):
    """Run the intact model once: copy loss, block calls (``record``), z means, attribution (``screen``)."""
    model, geo, n = build.model, build.geometry, ids.shape[0]
    blocks = layer_modules(model)
    z_means = ZMeans(geo)
    chunks, total = [], 0.0
    grad_g = torch.zeros(geo.n_layers, geo.n_heads, geo.d_head, dtype=torch.float64)  # sum dL/dz_h
    grad_zg = torch.zeros(geo.n_layers, geo.n_heads, dtype=torch.float64)  # sum z_h . dL/dz_h
    for batch in _chunks(ids, batch_size):
        chunk = _Chunk(batch)
        handles = []
        if record:
            def keep(module, args, kwargs, _calls=chunk.calls):
                _calls.append((_detach(args), _detach(kwargs)))

            handles = [b.register_forward_pre_hook(keep, with_kwargs=True) for b in blocks]
        try:
            with z_observed(model, geo.n_layers, z_means.observe):
                if screen:
                    with torch.enable_grad(), z_differentiable(model, geo.n_layers) as leaves:
                        per_seq = _copy_losses(build, _forward_logits(model, batch, build.device), batch, L)
                        (per_seq.sum() / n).backward()
                    for layer, z, delta in leaves:
                        g = delta.grad.double().reshape(-1, geo.n_heads, geo.d_head).cpu()
                        zz = z.double().reshape(-1, geo.n_heads, geo.d_head).cpu()
                        grad_g[layer] += g.sum(dim=0)
                        grad_zg[layer] += (zz * g).sum(dim=(0, 2))
                else:
                    with torch.no_grad():
                        per_seq = _copy_losses(build, _forward_logits(model, batch, build.device), batch, L)
        finally:
            for handle in handles:
                handle.remove()
        chunk.copy_losses = per_seq.detach().float().cpu()
        total += float(per_seq.detach().double().sum())
        chunks.append(chunk)
    means = z_means.means()
    intact = _Intact(copy_loss=total / n, chunks=chunks, means=means)
    if screen:
        intact.zg, intact.g = grad_zg.numpy(), grad_g
    return intact


def attribution_estimate(intact: _Intact, mode: str) -> np.ndarray:
    """``(n_layers, n_heads)``: ``sum (z_abl - z) . g`` = ``mu_h . sum g - sum z . g`` (mean) or ``-sum z . g`` (zero)."""
    if mode == "zero":
        return -intact.zg
    return (intact.means.double() * intact.g).sum(dim=2).numpy() - intact.zg


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
    rows = chunk.ids.shape[0]
    memo: dict = {}
    args, kwargs = chunk.calls[layer]
    hidden = _tile(_recorded_hidden(args, kwargs), rows, k, memo)
    for index in range(layer, len(blocks)):
        args, kwargs = _call_args(*chunk.calls[index], rows, k, memo, hidden)
        out = blocks[index](*args, **kwargs)
        hidden = out[0] if isinstance(out, (tuple, list)) else out
    return _tail_copy_losses(build, hidden, chunk.ids.repeat(k, 1), L).reshape(k, rows)


def _call_args(args, kwargs, rows, k, memo, hidden):
    """The recorded call of a block with ``hidden`` as its input and batch tensors stacked ``k`` times."""
    if args:
        return (hidden, *_tile(tuple(args[1:]), rows, k, memo)), _tile(kwargs, rows, k, memo)
    return (), {**_tile(kwargs, rows, k, memo), "hidden_states": hidden}


def _tail_copy_losses(build, hidden, ids, L) -> torch.Tensor:
    """Per-sequence copy loss from the last block's output: norm and unembed the copy positions only."""
    predict = copy_slices(L, bos_offset(build.tokens))[1]
    logits = tail_logits(build.model, hidden[:, predict], build.family).float()
    targets = ids[:, predict.start + 1 : predict.stop + 1].to(logits.device)
    losses = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), reduction="none")
    return losses.reshape(targets.shape).mean(dim=1)


def _check_replay(build: LoadedBuild, intact: _Intact, L: int) -> None:
    """Replaying the last block and the tail must reproduce the intact copy losses, else refuse."""
    chunk = intact.chunks[0]
    replayed = _replay(build, chunk, build.geometry.n_layers - 1, 1, L)[0].float().cpu()
    tol = 1e-4 if next(build.model.parameters()).dtype == torch.float32 else 2e-2
    gap = float((replayed - chunk.copy_losses).abs().max())
    if not gap <= tol:
        raise CircuitsError(
            f"{build.label}: replaying the recorded decoder blocks does not reproduce the model's copy loss "
            f"(gap {gap:.2g}); run knockout_scan(..., cached=False)"
        )


def _groups(items: list, size: int) -> list[list]:
    return [items[i : i + size] for i in range(0, len(items), size)]


def _progress(total: int, enabled: bool, label: str):
    from tqdm.auto import tqdm

    # disable=None: off when stderr is not a terminal
    return tqdm(total=total, unit="head", desc=f"knockout {label}", disable=None if enabled else True, leave=False)


def _cached_deltas(build, intact: _Intact, pairs, mode, L, n, knockouts_per_pass, bar) -> dict:
    """Exact copy loss of every knockout in ``pairs``, replayed from the record, ``k`` at a time."""
    geo = build.geometry
    by_layer: dict[int, list[int]] = {}
    for layer, head in pairs:
        by_layer.setdefault(layer, []).append(head)
    losses = {}
    for layer, heads in sorted(by_layer.items()):
        means = intact.means[layer] if mode == "mean" else None
        for group in _groups(heads, knockouts_per_pass):
            total = torch.zeros(len(group), dtype=torch.float64)
            for chunk in intact.chunks:
                rows = chunk.ids.shape[0]
                assignments = [(slice(j * rows, (j + 1) * rows), head) for j, head in enumerate(group)]
                with ablated(build.model, layer, geo.d_head, assignments, means):
                    per_seq = _replay(build, chunk, layer, len(group), L)
                total += per_seq.double().sum(dim=1).cpu()
            for head, value in zip(group, (total / n).tolist()):
                losses[(layer, head)] = value
            bar.update(len(group))
    return losses


def batch_invariant(build: LoadedBuild) -> bool:
    """False for bitsandbytes LLM.int8(): its outlier columns are picked over the whole batch,
    so stacking knockouts would let one knockout's activations change another's result."""
    recipe = get_recipe(build.recipe)
    return not (recipe.backend == "bitsandbytes" and recipe.bits == 8)


def _auto_per_pass(build, knockouts_per_pass, batch_size, n) -> int:
    if knockouts_per_pass is not None:
        if knockouts_per_pass < 1:
            raise CircuitsError(f"knockouts_per_pass={knockouts_per_pass} must be at least 1")
        return knockouts_per_pass
    if not batch_invariant(build) or flattens_batch_with_heads(build.model):
        return 1
    return max(1, ROWS_PER_PASS // min(batch_size, n))


def knockout_scan(
    build: LoadedBuild,
    settings: RepeatSettings,
    *,
    mode: str = "zero",
    heads=None,
    screen_top_k: int | None = None,
    must_include=(),
    batch_size: int = 8,
    progress: bool = True,
    knockouts_per_pass: int | None = None,
    cached: bool = True,
) -> pd.DataFrame:
    """Knockout delta of every head (or of ``heads``) on the held-out repeat sequences of ``settings``.

    One row per head of the model: ``head``, ``layer``, ``head_index``, ``knockout_delta``
    (NaN where no exact knockout ran) and, when screening ran, ``knockout_estimate``.
    ``screen_top_k``: exact knockouts only on the ``k`` heads with the largest
    ``|attribution estimate|`` among ``heads`` (default all), plus ``must_include``.
    ``knockouts_per_pass``: knockouts stacked in one replay (default: up to
    ``ROWS_PER_PASS`` rows; 1 for bnb-int8, see `batch_invariant`). ``cached=False`` runs the plain loop (one full forward per head).
    ``df.attrs``: ``copy_loss`` (intact), ``mode``, ``settings`` (dict), ``screened``,
    ``screen_top_k``, ``exact_heads``.
    """
    _check_mode(mode)
    geo = build.geometry
    candidates = parse_heads(heads, geo)
    extra = parse_heads(list(must_include), geo) if must_include else []
    ids = held_out_ids(build, settings)
    screen = screen_top_k is not None
    if screen and screen_top_k < 0:
        raise CircuitsError(f"screen_top_k={screen_top_k} must be 0 or more (--circuits-knockout-screen)")
    intact = None
    if screen:
        try:
            intact = _intact_pass(build, ids, settings.L, batch_size, record=cached, screen=True)
        except (RuntimeError, NotImplementedError, TypeError) as error:
            warnings.warn(
                f"{build.label}: attribution screening needs a backward pass, which failed here "
                f"({str(error).splitlines()[0] if str(error) else type(error).__name__}); "
                "running exact knockouts on every requested head instead",
                stacklevel=2,
            )
            screen = False
    if intact is None:
        intact = _intact_pass(build, ids, settings.L, batch_size, record=cached, screen=False)
    estimate = attribution_estimate(intact, mode) if screen else None
    exact = candidates
    if screen:
        ranked = sorted(candidates, key=lambda p: (-abs(estimate[p]), p))
        exact = sorted(set(ranked[:screen_top_k]) | set(extra))
    else:
        exact = sorted(set(candidates) | set(extra))
    n = ids.shape[0]
    with _progress(len(exact), progress, build.label) as bar:
        if cached:
            _check_replay(build, intact, settings.L)
            per_pass = _auto_per_pass(build, knockouts_per_pass, batch_size, n)
            losses = _cached_deltas(build, intact, exact, mode, settings.L, n, per_pass, bar)
        else:
            losses = _naive_losses(build, ids, settings.L, exact, mode, intact.means, batch_size, bar)
    rows = []
    for layer in range(geo.n_layers):
        for head in range(geo.n_heads):
            row = {"head": head_label(layer, head), "layer": layer, "head_index": head}
            loss = losses.get((layer, head))
            row["knockout_delta"] = math.nan if loss is None else loss - intact.copy_loss
            if screen:
                row["knockout_estimate"] = float(estimate[layer, head])
            rows.append(row)
    df = pd.DataFrame(rows)
    df.attrs.update(
        copy_loss=intact.copy_loss,
        mode=mode,
        settings=settings.as_dict(),
        screened=screen,
        screen_top_k=screen_top_k if screen else None,
        exact_heads=[head_label(*p) for p in exact],
    )
    return df


@torch.no_grad()
def _naive_losses(build, ids, L, pairs, mode, means, batch_size, bar=None) -> dict:
    """Copy loss with each head knocked out: one full forward of every sequence per head."""
    n, losses = ids.shape[0], {}
    for layer, head in pairs:
        total = 0.0
        layer_means = means[layer] if mode == "mean" else None
        with ablated(build.model, layer, build.geometry.d_head, [(slice(None), head)], layer_means):
            for batch in _chunks(ids, batch_size):
                logits = _forward_logits(build.model, batch, build.device)
                total += float(_copy_losses(build, logits, batch, L).double().sum())
        losses[(layer, head)] = total / n
        if bar is not None:
            bar.update(1)
    return losses


def naive_knockout_deltas(
    build: LoadedBuild, settings: RepeatSettings, *, mode: str = "zero", heads=None, batch_size: int = 8
) -> tuple[float, dict[str, float]]:
    """The plain reference: intact copy loss and ``{label: delta}``, one full forward per head."""
    _check_mode(mode)
    pairs = parse_heads(heads, build.geometry)
    ids = held_out_ids(build, settings)
    intact = _intact_pass(build, ids, settings.L, batch_size, record=False, screen=False)
    losses = _naive_losses(build, ids, settings.L, pairs, mode, intact.means, batch_size)
    return intact.copy_loss, {head_label(*p): v - intact.copy_loss for p, v in losses.items()}


def head_means(build: LoadedBuild, settings: RepeatSettings, batch_size: int = 8) -> torch.Tensor:
    """``(n_layers, n_heads, d_head)``: the mean-ablation ``mu_h``, over every position of every held-out sequence."""
    ids = held_out_ids(build, settings)
    return _intact_pass(build, ids, settings.L, batch_size, record=False, screen=False).means
