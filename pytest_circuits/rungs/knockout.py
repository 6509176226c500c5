"""Rung 2: the head knockout scan (docs/definitions.md, "Rung 2, interventions: knockout"), exact and fast.

``knockout_delta(h) = copy_loss(model with h knocked out) - copy_loss(intact model)`` on
held-out repeat sequences (``settings`` carries a seed other than the probe's). Copy loss
is the mean next-token cross-entropy over positions ``L+1 .. 2L-1`` (shifted by one with
BOS) and over the ``n`` sequences. Knockout = zero or mean ablation of the head's ``z``
(`ablation.py`). Per sequence ``i``, ``delta_i(h) = copy_loss_i(h knocked out) -
copy_loss_i(intact)``; the stored delta is their mean (a difference of means is the mean of
the differences), and the ``n`` values are kept for its interval. Mean ablation uses ``mu_h`` = the mean of ``z_h`` over every position
(BOS included) of every one of the ``n`` held-out sequences, from the intact forward.

Fast and exact: the intact model runs once and every block's call is traced; a knockout in layer
``l`` replays blocks ``l..end`` only, ``k`` knockouts stacked on the batch axis (`replay.py`, which
also bounds the trace). Shards of one scan: `knockout_shards.py`; the plain loop it is checked and
timed against: `plain_loops.py`; its FLOP count: `plan.knockout_flops`.

Screening (big models): attribution patching ranks every head from one forward and one
backward, ``estimate_h = sum over sequences, positions of (z_h^ablated - z_h) . dL/dz_h``
(zero ablation: ``-z_h . dL/dz_h``); exact knockouts then run only on the ``screen_top_k``
heads with the largest ``|estimate_h|`` plus ``must_include``. Gates use exact deltas only.

``atp=True`` stores that plain estimate of every head (``knockout_atp``), from the same intact
pass; ``confirm`` (a gate's change screen, gate/change_screen.py) reads it and names the heads that
are knocked out exactly.
"""

from __future__ import annotations

import math
import warnings

import numpy as np
import pandas as pd
import torch

from ..errors import CircuitsError, CircuitsWarning
from ..model.builds import LoadedBuild
from ..model.families import flattens_batch_with_heads, head_label
from ..model.mixer_memory import scan_rows
from ..model.quantized_cache import refuse_decode_only
from ..options import KNOCKOUT_MODES, SCREEN_METHODS, flag
from ..progress import Progress, phase
from ..record.figures import sequences_key
from .ablation import ablated, check_mode, parse_heads
from .plain_loops import plain_knockout_losses
from .query_blocks import query_block
from .repeat import KNOCKOUT_CPU_TOKENS, check_probe_memory, cpu_stack
from .repeat_settings import RepeatSettings
from .replay import (
    Intact,
    attention_implementation,
    batch_invariant,
    held_out_ids,
    intact_pass,
    mean_delta,
    replay_chunk,
    replay_cost,
    replay_gap,
    sequence_deltas,
)

MODES = KNOCKOUT_MODES
ROWS_PER_PASS = 64  # default cap on sequences x knockouts in one replay on an accelerator
CPU_TOKENS_PER_PASS = KNOCKOUT_CPU_TOKENS  # on a CPU, a replay stacks at most this many tokens (`repeat.cpu_stack`)
SEQUENCES = sequences_key("knockout_delta")  # the frame's column of per-sequence deltas


def _groups(items: list, size: int) -> list[list]:
    return [items[i : i + size] for i in range(0, len(items), size)]


def _replayed_deltas(build, intact: Intact, pairs, mode, L, knockouts_per_pass, bar) -> dict:
    """Exact per-sequence copy loss ``(n,)`` float64 of every knockout in ``pairs``, replayed from the
    trace, ``k`` at a time. Every replay stacks exactly ``k`` (a layer's last group is filled with
    copies of its last head, whose rows are dropped): a matmul's rounding depends on its row count
    (bf16 SmolLM2: up to 0.04 nats a sequence between 1 and 2 stacked), so a head's figures are the
    same whatever other heads the scan measures (a gate's key heads, a look's undecided ones)."""
    geo = build.geometry
    by_layer: dict[int, list[int]] = {}
    for layer, head in pairs:
        by_layer.setdefault(layer, []).append(head)
    losses = {}
    for layer, heads in sorted(by_layer.items()):
        means = intact.means[layer] if mode == "mean" and intact.means is not None else None
        for group in _groups(heads, knockouts_per_pass):
            stacked = group + group[-1:] * (knockouts_per_pass - len(group))
            parts = []
            for chunk in intact.chunks:
                rows = chunk.ids.shape[0]
                assignments = [(slice(j * rows, (j + 1) * rows), head) for j, head in enumerate(stacked)]
                with ablated(build.model, layer, geo.d_head, assignments, means):
                    parts.append(replay_chunk(build, chunk, layer, len(stacked), L).double().cpu())
            per_seq = torch.cat(parts, dim=1)  # (k, n)
            for j, head in enumerate(group):
                losses[(layer, head)] = per_seq[j]
            bar.update(len(group), len(group) * replay_cost(geo.n_layers, layer), head_label(layer, group[-1]))
    return losses


def auto_per_pass(build, knockouts_per_pass, batch_size, n, tokens_per_row: int) -> int:
    """Knockouts stacked in one replay: ``ROWS_PER_PASS`` rows on an accelerator; on a CPU at most
    ``CPU_TOKENS_PER_PASS`` tokens (`repeat.cpu_stack`: one knockout a pass at the default probe)."""
    if knockouts_per_pass is not None:
        if knockouts_per_pass < 1:
            raise CircuitsError(f"knockouts_per_pass={knockouts_per_pass} must be at least 1")
        return knockouts_per_pass
    if not batch_invariant(build) or flattens_batch_with_heads(build.model):
        return 1
    rows = min(batch_size, n)
    if torch.device(build.device).type == "cpu":
        stacked = cpu_stack(rows, tokens_per_row)
    else:
        stacked = max(1, ROWS_PER_PASS // rows)
    # a stacked pass is rows x stacked sequences to a hybrid stack's reference Mamba-2 scan: capped as one forward's
    return max(1, scan_rows(build.model, rows * stacked, tokens_per_row, build.device) // rows)


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
    replay: bool = True,
    layers=None,
    trace_bytes: int | None = None,
    screen_variant=None,
    atp: bool = False,
    confirm=None,
) -> pd.DataFrame:
    """Knockout delta of every head (or of ``heads``) on the held-out repeat sequences of ``settings``.

    One row per head of the model: ``head``, ``layer``, ``head_index``, ``knockout_delta``
    (NaN where no exact knockout ran), ``knockout_delta_sequences`` (its ``n`` per-sequence
    deltas, which average to it; None where no exact knockout ran) and, when screening ran, ``knockout_estimate`` (signed)
    and ``knockout_screen_score`` (what heads are ranked by). ``screen_top_k``: exact knockouts
    only on the ``k`` top-ranked heads among ``heads`` (default all), plus ``must_include`` (always exact).
    ``screen_method``: ``"atp*"`` (default, `screen.atp_star`: attribution patching with the
    QK fix), ``"atp*gd"`` (and GradDrop) or ``"atp"`` (plain attribution patching).
    ``knockouts_per_pass``: knockouts stacked in one replay (default `auto_per_pass`: up to
    ``ROWS_PER_PASS`` rows on an accelerator, at most ``CPU_TOKENS_PER_PASS`` tokens on a CPU; 1 for
    bnb-int8, see `batch_invariant`). ``replay=False`` runs the
    plain loop (one full forward per head); so does a model whose replay is not exact (one warning).
    ``progress``: report heads done, layer and ETA (`progress.Progress`); ``write``: where its
    plain lines go (e.g. the pytest terminal reporter), default a bar on a terminal, else stderr.
    ``layers``: one shard (`layer_shards`): exact knockouts only of the chosen heads in these
    layers (the intact pass and the screen still see the whole model); `merge_knockout_shards`
    joins the shards into the unsharded scan.
    ``trace_bytes``: the most the traced block inputs may hold (default `TRACE_SHARE` of the
    memory available; `trace_stride`); fewer kept inputs only add recomputed blocks, same figures.
    ``screen_variant``: a `screen.ScreenVariant` (cheaper screens; default today's).
    ``atp``: also the plain AtP estimate of every head, column ``knockout_atp`` (`every_head_atp`: None
    where the backward pass fails), where it is free or cheap: a screen of plain AtP over every
    sequence is reused; a scan of every head exactly adds one forward and backward; a scan screened
    by AtP* leaves it unmeasured (a later change screen then knocks out every key head exactly).
    ``confirm``: ``{label: knockout_atp} -> labels`` (the change screen,
    `gate.change_screen.ChangeScreen.confirm`, implies ``atp``): of the chosen heads only those it
    names are knocked out exactly; all of them when the estimate failed.
    ``df.attrs``: ``copy_loss`` (intact), ``mode``, ``settings`` (dict), ``screened``,
    ``screen_top_k``, ``screen_method``, ``exact_heads``, ``replayed`` (whether the replay ran),
    ``layers`` (the shard's layers, None for the whole model).
    """
    refuse_decode_only(build, "the knockout scan")
    T = 2 * settings.L + (build.tokens.bos_id is not None)
    batch_size = scan_rows(build.model, batch_size, T, build.device)  # a hybrid stack's reference Mamba-2 scan
    if query_block(build.geometry, min(batch_size, settings.n), T) < T:  # a long probe: preflight left this out
        check_probe_memory(build.geometry, settings.n, settings.L, batch_size, knockout=True, device=str(build.device))
    check_mode(mode)
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
        intact = intact_pass(build, ids, settings.L, batch_size, trace=replay, trace_bytes=trace_bytes)
    from .screen import TODAY

    estimate = score = None
    variant = TODAY if screen_variant is None else screen_variant
    if screen:
        from .screen import screen_estimate, screen_layout

        variant.check()
        screened_n = ids.shape[0] if variant.sequences is None else min(variant.sequences, ids.shape[0])
        passes = 2 if variant.ablation == "both" else 1
        chunks = passes * -(-screened_n // screen_layout(build, max(batch_size, 1), settings.L).rows)  # its own rows
        label = f"screen ({screen_method}) {build.label}"
        try:
            with Progress(chunks, label, unit="chunk", enabled=progress, write=write) as bar:
                estimate, score = screen_estimate(
                    build, ids, settings.L, mode, intact.means, screen_method, batch_size, bar, variant
                )
        except (RuntimeError, NotImplementedError, TypeError) as error:
            warn_no_backward(
                build, "attribution screening", error, "running exact knockouts on every requested head instead"
            )
            screen = False
    plain = None
    if estimate is not None and screen_method == "atp" and variant.sequences is None and variant.ablation == "scan":
        plain = estimate  # the screen was plain AtP of every head on every sequence: the same figures
    elif confirm is not None or (atp and not screen):  # a scan screened by AtP* leaves the column unmeasured
        plain = every_head_atp(
            build, ids, settings.L, mode, intact.means, batch_size, progress, write, confirm is not None
        )
    if screen and score is not None:
        ranked = sorted(candidates, key=lambda p: (-score[p], p))
        exact = sorted(set(ranked[:screen_top_k]) | set(extra))
    else:
        exact = sorted(set(candidates) | set(extra))
    if confirm is not None and plain is not None:
        confirmed = set(confirm({head_label(l, h): float(plain[l, h]) for l, h in np.ndindex(plain.shape)}))
        exact = [pair for pair in exact if head_label(*pair) in confirmed]
    shard = None if layers is None else sorted({int(l) for l in layers})
    if shard is not None:
        if not shard or shard[0] < 0 or shard[-1] >= geo.n_layers:
            raise CircuitsError(f"knockout shard layers {shard} must lie in 0..{geo.n_layers - 1}")
        exact = [pair for pair in exact if pair[0] in shard]
    n = ids.shape[0]
    if replay:
        why = replay_gap(build, intact, settings.L)
        if why is not None:
            warnings.warn(
                f"{build.label}: {why}; running the plain loop (one full forward per head) instead",
                CircuitsWarning,
                stacklevel=2,
            )
            replay = False
    total_cost = sum(replay_cost(geo.n_layers, l) for l, _ in exact) if replay else len(exact)
    with Progress(len(exact), f"knockout {build.label}", total_cost=total_cost, enabled=progress, write=write) as bar:
        with attention_implementation(build.model):
            if replay:
                per_pass = auto_per_pass(build, knockouts_per_pass, batch_size, n, ids.shape[1])
                losses = _replayed_deltas(build, intact, exact, mode, settings.L, per_pass, bar)
            else:
                losses = plain_knockout_losses(build, ids, settings.L, exact, mode, intact.means, batch_size, bar)
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
            if atp or confirm is not None:
                row["knockout_atp"] = None if plain is None else float(plain[layer, head])
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
        replayed=replay,
        layers=shard,
    )
    return df


def every_head_atp(
    build: LoadedBuild, ids, L: int, mode: str, means, batch_size: int, progress=True, write=None, warn=True
):
    """``(n_layers, n_heads)`` plain AtP (`screen.atp`) of every head's knockout on ``ids``, one forward
    and one backward per chunk; None where the build has no backward pass, with one warning that
    names why when ``warn`` (a change screen asked: it then knocks out every key head exactly; a
    recording leaves the column unmeasured, which a later screen reads as "knock out")."""
    from .screen import atp as atp_of
    from .screen import screen_layout

    layout = screen_layout(build, max(batch_size, 1), L)
    chunks = -(-ids.shape[0] // layout.rows)
    try:
        with (
            Progress(chunks, f"plain AtP {build.label}", unit="chunk", enabled=progress, write=write) as bar,
            warnings.catch_warnings(),
        ):  # torch warns of kernels outside autograd (bitsandbytes 4-bit); `screen._reached` then refuses
            warnings.filterwarnings("ignore", ".*an autograd kernel was not registered", UserWarning)
            return atp_of(build, ids, L, mode, means, layout.rows, bar, recompute=layout.recompute)
    except (RuntimeError, NotImplementedError, TypeError) as error:
        if warn:
            warn_no_backward(
                build,
                "the plain AtP estimate of each knockout",
                error,
                "knockout_atp is not measured, so no change screen reads it",
            )
        return None


def warn_no_backward(build: LoadedBuild, what: str, error: BaseException, instead: str) -> None:
    """One warning that ``what`` needs a backward pass the build failed (its error's first line) and what runs ``instead``."""
    why = str(error).splitlines()[0] if str(error) else type(error).__name__
    warnings.warn(
        f"{build.label}: {what} needs a backward pass, which failed here ({why}); {instead}",
        CircuitsWarning,
        stacklevel=3,
    )


def head_means(build: LoadedBuild, settings: RepeatSettings, batch_size: int = 8) -> torch.Tensor:
    """``(n_layers, n_heads, d_head)``: the mean-ablation ``mu_h``, over every position of every held-out sequence."""
    refuse_decode_only(build, "the mean-ablation pass")
    ids = held_out_ids(build, settings)
    return intact_pass(build, ids, settings.L, batch_size, trace=False).means
