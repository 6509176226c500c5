"""The counted cost of a rung-2 plan (screen + exact knockouts, or every head exactly) and of a
build's whole scan (rung 1, the probe, rung 2), and their time at the rate the build's own forward
reaches in each kind of pass when the plan is made (`calibrated_rate`: a forward, a stacked knockout
replay, the screen's forward and backward; rung 1's float32 products at a float32 matmul's, its
eigenvalues at one head's null's, `eigen_seconds`):
the lines printed before a plan chosen by size starts, and after it ran.

Counts (multiply-add = 2), with ``forward`` = `knockout_flops`'s one forward:

* exact knockouts of named heads (a gate's key heads): ``forward`` plus each head's replay from its
  layer (`replay_flops`), each layer's count filled to a multiple of the stack (`exact_seconds`); a
  screen's top ``k``, not known before it runs, as the ``k`` longest replays (`planned_heads`: layer
  0's heads first, where the largest knockouts sit), so the estimate is at most the work;
* screen ``atp``: one forward and one backward, ``3 forward`` (``4`` where the backward recomputes
  each block, `screen.screen_layout`);
* ``atp*`` adds the QK fix: for every pair of a source layer and a later layer, the later layer's
  attention on ``n_heads`` stacked copies of every token (``n T n_heads x n_layers (n_layers - 1) / 2``
  attention passes of ``2 x`` its matrix parameters ``+ 4 n_heads d_head (T+1)/2`` a token);
* ``atp*gd`` adds ``n_layers - 1`` backward passes (``2 forward`` each).

A `screen.ScreenVariant` scales these: ``sequences`` the screen's ``n``; ``qk_top`` C runs the QK
fix on at most ``C (n_layers - 1)`` (head, later layer) pairs, one copy each, after one more
``atp`` (``3 forward``); ``grad_drop_layers`` counts only the sampled blocks; ``ablation="both"`` doubles it.

The whole scan adds rung 1 (`rung1_flops`, float32 products) and the probe (`probe_flops`, the build's dtype).
"""

from __future__ import annotations

import math
import time
import weakref
from collections import Counter
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import torch

from ..model.builds import LoadedBuild
from ..model.dense import weight_of
from ..model.families import attention_module, layer_modules
from ..model.mixer_memory import scan_rows
from .ablation import parse_heads
from .repeat import bos_offset
from .repeat_settings import RepeatSettings

RATE_ROWS = 512  # rows of the matmul that measures the device's rate
# The most an automatic screen may count, by device type: atp* above it is replaced by atp. A CPU's
# 1e14 FLOP is about 25 min at 65 GFLOP/s (Llama-3.2-1B keeps atp*; at 8B atp* counts 1.4 PFLOP,
# six hours); a GPU has no limit (atp* at 70B counts about 6e16 FLOP: minutes).
SCREEN_BUDGET_FLOP = {"cpu": 1e14}


def _matrix_params(module) -> int:
    return sum(p.numel() for p in module.parameters() if p.dim() >= 2)


def knockout_flops(build: LoadedBuild, settings: RepeatSettings, heads=None) -> dict[str, float]:
    """Floating-point operations (multiply-add = 2) counted from the shapes, for ``n`` sequences of ``T`` tokens.

    ``forward``: one forward unembedding the last ``L`` positions, ``n (T sum_j B_j(T) + L 2 d V)``
    with ``B_j = 2 x (block j's matrix parameters) + 4 n_heads d_head (T+1)/2`` per token (causal
    attention reads ``(T+1)/2`` keys on average). ``plain``: the plain loop (its intact forward,
    then one forward per head). ``scan``: the exact replayed scan (intact forward, then per head of
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
    scan = forward + sum(n * (T * sum(per_token[geo.block(l) :]) - mlp_cut + (L - 1) * unembed) for l, _ in pairs)
    return {"forward": forward, "plain": forward * (1 + len(pairs)), "scan": scan}


def replay_flops(build: LoadedBuild, settings: RepeatSettings) -> list[float]:
    """The counted FLOPs of one head's exact replay (`knockout_flops`'s ``scan`` less its forward), by layer."""
    forward = knockout_flops(build, settings, heads=[])["forward"]
    return [knockout_flops(build, settings, heads=[(l, 0)])["scan"] - forward for l in range(build.geometry.n_layers)]


def screen_flops(build, settings: RepeatSettings, method: str, variant=None) -> float:
    """Counted FLOPs of the screen ``method`` over every head (module docstring); ``variant``: a
    `screen.ScreenVariant` (None: today's screen)."""
    from .screen import TODAY, grad_drop_blocks, screen_layout

    variant = TODAY if variant is None else variant
    geo = build.geometry
    n = settings.n if variant.sequences is None else min(variant.sequences, settings.n)
    forward = knockout_flops(build, settings, heads=[])["forward"] * n / settings.n
    flops = (4 if screen_layout(build, n, settings.L).recompute else 3) * forward
    if method.startswith("atp*"):
        T = 2 * settings.L + bos_offset(build.tokens)
        attn = attention_module(build.model, geo.n_layers - 1)
        params = sum(p.numel() for p in attn.parameters() if p.dim() >= 2)
        per_token = 2 * params + 4 * geo.n_heads * geo.d_head * (T + 1) / 2
        if variant.qk_top is None or variant.qk_top >= geo.n_layers * geo.n_heads:
            copies = geo.n_heads * geo.n_layers * (geo.n_layers - 1) / 2
        else:  # at most: the heads AtP picks are not known before it runs
            flops += 3 * forward
            copies = min(variant.qk_top, geo.n_layers * geo.n_heads) * (geo.n_layers - 1)
        flops += n * T * copies * per_token
    if method == "atp*gd":
        flops += 2 * forward * len(grad_drop_blocks(geo.n_layers, variant.grad_drop_layers))
    return flops * (2 if variant.ablation == "both" else 1)


def automatic_screen_method(build, settings: RepeatSettings, variant=None) -> tuple[str, str]:
    """``(method, why)``: ``atp*`` when its counted FLOPs (`screen_flops`, with ``variant``) fit the
    build's device's `SCREEN_BUDGET_FLOP`, else ``atp`` and the line saying why. Counted, not timed,
    so every job of a sharded scan on the same kind of device picks the same method."""
    budget = SCREEN_BUDGET_FLOP.get(build.device.type)
    counted = screen_flops(build, settings, "atp*", variant)
    if budget is None or counted <= budget:
        return "atp*", ""
    return "atp", (
        f"circuits: the atp* screen of {build.label} counts {counted / 1e12:.3g} TFLOP, over the "
        f"{build.device.type} budget of {budget / 1e12:.3g} TFLOP: screening with atp (one forward and "
        f"one backward, {screen_flops(build, settings, 'atp', variant) / 1e12:.3g} TFLOP); "
        "--knockout-screen-method atp* to screen with it anyway"
    )


def exact_flops(build, settings: RepeatSettings, heads: Sequence | None = None) -> float:
    """Counted FLOPs of exact knockouts of ``heads`` (labels or ``(layer, head)``; None: every head,
    the full exact scan)."""
    return knockout_flops(build, settings, heads=None if heads is None else list(heads))["scan"]


def planned_heads(build, settings: RepeatSettings, top_k: int, key_heads: Sequence = ()) -> list[tuple[int, int]]:
    """The heads a screened plan counts exactly: ``key_heads`` and ``top_k`` others at the longest
    replays (`replay_flops`; layer 0's heads first). The screen's picks are not known before it runs,
    and the largest knockouts sit early: SmolLM2-135M's 12 largest replay 23 of its 30 blocks on
    average (every head: 15.5), and the screen's top 12 of a random Llama-3.2-1B shape were all of
    layer 0, where a mean replay had counted them at 1.9x too little. So the plan is at most the work."""
    geo = build.geometry
    named = set(parse_heads(list(key_heads), geo)) if key_heads else set()
    by_layer = replay_flops(build, settings)
    others = sorted((pair for pair in parse_heads(None, geo) if pair not in named), key=lambda p: (-by_layer[p[0]], p))
    return sorted(named | set(others[:top_k]))


def measured_rate(build, repeats: int = 3, dtype=None) -> float:
    """FLOP/s of a ``RATE_ROWS x d_model`` by ``d_model x d_model`` matmul on the build's device, in
    ``dtype`` (None: the build's own, float32 unless it is a float16/bfloat16 model)."""
    d = build.geometry.d_model
    if dtype is None:
        dtype = getattr(build.model, "dtype", torch.float32)
        dtype = dtype if dtype in (torch.float32, torch.float16, torch.bfloat16) else torch.float32
    a = torch.randn(RATE_ROWS, d, dtype=dtype, device=build.device)
    b = torch.randn(d, d, dtype=dtype, device=build.device)
    a @ b  # warm up

    def run():
        for _ in range(repeats):
            a @ b

    return 2 * RATE_ROWS * d * d * repeats / max(_wall(build.device, run), 1e-9)


def _wall(device: torch.device, run) -> float:
    """Seconds ``run()`` takes on ``device`` (a CUDA device synchronised before and after, so its queue counts)."""
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    run()
    if cuda:
        torch.cuda.synchronize(device)
    return time.perf_counter() - start


CALIBRATION_ROWS = 8  # sequences of the timed forward: the knockout pass's default batch
# A timed pass shorter than this runs twice and the faster counts: the first pass of a shape sets up
# its kernels (oneDNN compiles its bfloat16 ones per shape), which a scan of many passes pays once.
# SmolLM2 bf16's stacked replay, timed once, gave 284 GFLOP/s where its replays ran at about 482.
RETIME_BELOW_S = 5.0
KINDS = ("forward", "replay", "screen")
_CALIBRATED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> {(kind, T): FLOP/s}


def calibrated_rate(build, settings: RepeatSettings, kind: str = "forward", rows: int = CALIBRATION_ROWS) -> float:
    """FLOP/s the build reaches now in one pass of the ``kind`` rung 2 runs, its counted FLOPs over its
    wall time, timed once per build, kind and probe length, after an untimed forward of one sequence:

    * ``forward``: a forward of ``rows`` of the probe's sequences (`probe_flops`): the intact pass, the probe
      (this and ``replay`` timed twice, the faster kept, when one pass takes under `RETIME_BELOW_S`);
    * ``replay``: a forward of the sequences one stacked knockout replay holds (``rows`` times the
      knockouts `knockout.auto_per_pass` stacks; the ``forward`` pass where it stacks none): the exact knockouts;
    * ``screen``: the atp screen's forward and backward of one sequence (`screen.atp`, counted as
      `screen_flops` counts it), after an untimed one: the screen.

    Unlike a matmul's rate (`measured_rate`) each runs what rung 2 runs: the build's dtype and
    quantization, its attention, norms and elementwise work and the Python between them, at the
    machine's present load."""
    from .replay import attention_implementation, held_out_ids

    model = build.model
    rates = _CALIBRATED.setdefault(model, {})
    T = 2 * settings.L + bos_offset(build.tokens)
    if (kind, T) in rates:
        return rates[kind, T]
    rows = scan_rows(model, max(1, min(rows, settings.n)), T, build.device)
    stacked = replay_stack(build, settings, rows) if kind == "replay" else 1
    timed = replace(settings, n=rows)
    ids = held_out_ids(build, timed).to(build.device)
    with attention_implementation(model):
        if not rates:
            with torch.no_grad():
                model(input_ids=ids[:1], use_cache=False)  # warm-up: kernels chosen, buffers allocated
        if kind == "screen":
            rates[kind, T] = _screen_rate(build, settings, ids[:1])
        else:
            tiled = ids.repeat(stacked, 1)
            with torch.no_grad():
                took = _wall(build.device, lambda: model(input_ids=tiled, use_cache=False))
                if took < RETIME_BELOW_S:  # a first pass of a shape sets up its kernels: the second is the rate
                    took = min(took, _wall(build.device, lambda: model(input_ids=tiled, use_cache=False)))
            rates[kind, T] = probe_flops(build, replace(settings, n=rows * stacked)) / max(took, 1e-9)
    return rates[kind, T]


def _screen_rate(build, settings: RepeatSettings, ids: torch.Tensor) -> float:
    """FLOP/s of the atp screen on the one sequence ``ids``; the forward's rate where the build's
    kernels run outside autograd (no screen runs there)."""
    from .screen import atp, screen_layout

    one = replace(settings, n=1)
    recompute = screen_layout(build, 1, one.L).recompute
    try:  # a first backward of a shape sets up its kernels (SmolLM2: 9.6 s, then 1.3 s): untimed
        atp(build, ids, one.L, "zero", None, 1, recompute=recompute)
        took = _wall(build.device, lambda: atp(build, ids, one.L, "zero", None, 1, recompute=recompute))
    except (RuntimeError, NotImplementedError, TypeError):  # as `knockout_scan` falls back from the screen
        return calibrated_rate(build, settings, "forward")
    return screen_flops(build, one, "atp") / max(took, 1e-9)


def rung1_flops(geometry, n_rotations: int) -> float:
    """Counted FLOPs of rung 1 (float32 products): ``W_U W_E`` (``2 d^2 V``), the reduced OV stack of
    every KV group and head (``2 d^2 d_head`` a group, ``2 d_head^2 d`` a head), and the eigenvalues
    (`eigen_flops`)."""
    d, V, dh = geometry.d_model, geometry.vocab, geometry.d_head
    heads, kv = geometry.n_layers * geometry.n_heads, geometry.n_layers * geometry.n_kv_heads
    reduced = kv * 2 * d * d * dh + heads * 2 * dh * d * dh
    return 2 * d * d * V + reduced + eigen_flops(geometry, n_rotations)


def eigen_flops(geometry, n_rotations: int) -> float:
    """Rung 1's eigenvalues, about ``27 d_head^3`` each: every head's two spectra and its
    ``n_rotations`` null draws."""
    return geometry.n_layers * geometry.n_heads * (2 + n_rotations) * 27 * geometry.d_head**3


_EIGEN: dict[tuple[int, int, torch.dtype], float] = {}  # (d_head, n_rotations, dtype) -> seconds of one head's null


def eigen_seconds(geometry, n_rotations: int, null_dtype: torch.dtype) -> float:
    """Rung 1's eigenvalues' time at the rate they run here: one head's null (`kappa_null.rotation_null`,
    ``n_rotations`` eigenvalue problems of ``d_head x d_head`` in ``null_dtype``, which LAPACK solves
    far below a matmul's rate: 3.2 ms for one float32 128 x 128 matrix on this CPU) timed once per
    shape after an untimed one, for every head over the null's threads (`kappa_null.default_workers`),
    and the heads' own two spectra each at the null's time per matrix."""
    from .kappa_null import default_workers, haar_rotations, rotation_null

    dh, key = geometry.d_head, (geometry.d_head, n_rotations, null_dtype)
    if key not in _EIGEN:
        generator = torch.Generator().manual_seed(0)
        M = torch.randn(dh, dh, dtype=torch.float64, generator=generator)
        rotations = haar_rotations(n_rotations, dh, generator)
        rotation_null(M, rotations, null_dtype)  # warm-up
        _EIGEN[key] = _wall(torch.device("cpu"), lambda: rotation_null(M, rotations, null_dtype))
    heads = geometry.n_layers * geometry.n_heads
    return heads * _EIGEN[key] * (1 + 2 / n_rotations) / default_workers()


def probe_flops(build, settings: RepeatSettings) -> float:
    """One forward of the repeat probe, every position unembedded (`knockout_flops`'s forward unembeds
    the last ``L``; the probe reads the other ``T - L`` too)."""
    counted = knockout_flops(build, settings, heads=[])["forward"]
    T, L, n = 2 * settings.L + bos_offset(build.tokens), settings.L, settings.n
    return counted + n * (T - L) * 2 * build.geometry.d_model * build.geometry.vocab


def _duration(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


def plan_line(build, settings: RepeatSettings, top_k: int, key_heads: Sequence, method: str, variant=None) -> str:
    """``circuits: rung 2 of L:bf16 (1024 heads, more than 300): the atp screen ... about 16 min ...``."""
    return plan_estimate(build, settings, top_k, key_heads, method, variant)[0]


def took_line(build, planned_s: float, took_s: float, what: str = "rung 2", before_s: float | None = None) -> str:
    """The line said after a plan chosen by size ran: ``what``'s wall time beside the plan's estimate;
    ``before_s`` given (a run that knocked heads out): ``planned_s`` is the estimate for the heads it
    knocked out (`replanned`) and ``before_s`` the one before a screen chose them, said where it reads otherwise."""
    said = f"circuits: {build.label}: {what} took {_duration(took_s)} of wall time; the plan estimated "
    said += f"{_duration(planned_s)} ({took_s / max(planned_s, 1e-9):.2f}x)"
    if before_s is None:
        return said
    said += " for the heads knocked out"
    return (
        said
        if _duration(before_s) == _duration(planned_s)
        else f"{said}; {_duration(before_s)} before the screen chose them"
    )


def replanned(
    build,
    settings: RepeatSettings,
    planned_s: float,
    ran: Sequence,
    key_heads: Sequence = (),
    top_k: int | None = None,
    must_include: Sequence = (),
) -> float:
    """The estimate ``planned_s`` with the exact knockouts of the heads that ran (``ran``: a screen's
    picks, the key heads a change screen did not clear) in place of those it counted: ``key_heads``
    (a gate's) when given, else a screen's ``top_k`` and ``must_include`` at the longest replays
    (`planned_heads`); ``planned_s`` itself for a scan of every head (``top_k`` None)."""
    if key_heads:
        counted = list(key_heads)
    elif top_k is not None:
        counted = planned_heads(build, settings, top_k, must_include)
    else:
        return planned_s
    return planned_s + exact_seconds(build, settings, ran) - exact_seconds(build, settings, counted)


def screened_flops(
    build, settings: RepeatSettings, top_k: int, key_heads: Sequence, method: str, variant=None
) -> float:
    """Counted FLOPs of a screened rung 2: the ``method`` screen, then `planned_heads` exactly."""
    exact = exact_flops(build, settings, planned_heads(build, settings, top_k, key_heads))
    return screen_flops(build, settings, method, variant) + exact


def rung2_seconds(
    build, settings: RepeatSettings, top_k: int | None, key_heads: Sequence, method: str, variant=None
) -> float:
    """Rung 2's time, each kind of pass at its own rate (`calibrated_rate`): the ``method`` screen at
    the screen's, then the exact knockouts of `planned_heads` (``top_k`` None: every head, no
    screen; `exact_seconds`)."""
    if top_k is None:
        return exact_seconds(build, settings, parse_heads(None, build.geometry))
    screen = screen_flops(build, settings, method, variant) / calibrated_rate(build, settings, "screen")
    return screen + exact_seconds(build, settings, planned_heads(build, settings, top_k, key_heads))


def exact_seconds(build, settings: RepeatSettings, heads: Sequence) -> float:
    """The time of exact knockouts of ``heads`` (``L3H7`` or ``(layer, head)``): the intact forward
    at a forward's rate, then each head's replay from its own layer (`replay_flops`) at a stacked
    replay's, each layer's count filled to a multiple of the knockouts one replay stacks, as
    `knockout._replayed_deltas` fills it."""
    forward = knockout_flops(build, settings, heads=[])["forward"]
    per_layer = Counter(layer for layer, _ in parse_heads(list(heads), build.geometry))
    k = replay_stack(build, settings)
    by_layer = replay_flops(build, settings)
    replays = sum(math.ceil(c / k) * k * by_layer[layer] for layer, c in per_layer.items())
    return forward / calibrated_rate(build, settings) + replays / calibrated_rate(build, settings, "replay")


def replay_stack(build, settings: RepeatSettings, rows: int = CALIBRATION_ROWS) -> int:
    """The knockouts one exact replay stacks for ``settings``' probe (`knockout.auto_per_pass` at
    ``rows`` sequences a chunk, as the scan and `calibrated_rate` run it)."""
    from .knockout import auto_per_pass

    T = 2 * settings.L + bos_offset(build.tokens)
    rows = scan_rows(build.model, max(1, min(rows, settings.n)), T, build.device)
    return auto_per_pass(build, None, rows, settings.n, T)


def _gflops(rate: float) -> str:
    return f"{rate / 1e9:.0f}" if rate >= 1e10 else f"{rate / 1e9:.2g}"


def _rates(build, settings: RepeatSettings, kinds=KINDS) -> str:
    return ", ".join(f"{kind} {_gflops(calibrated_rate(build, settings, kind))}" for kind in kinds) + " GFLOP/s"


def plan_estimate(
    build, settings: RepeatSettings, top_k: int, key_heads: Sequence, method: str, variant=None
) -> tuple[str, float]:
    """``(plan_line's line, its estimate in seconds)``: counted FLOPs, each kind of pass at the rate
    the build reaches in it now (`rung2_seconds`)."""
    heads = build.geometry.n_layers * build.geometry.n_heads
    planned = screened_flops(build, settings, top_k, key_heads, method, variant)
    seconds = rung2_seconds(build, settings, top_k, key_heads, method, variant)
    full = exact_flops(build, settings)
    line = (
        f"circuits: rung 2 of {build.label} ({heads} heads): the {method} screen over every head, then the top "
        f"{top_k} (counted at the longest replays) and {len(key_heads)} key head(s) of the baselines exactly: counted "
        f"{planned / 1e12:.3g} TFLOP, about "
        f"{_duration(seconds)} ({_rates(build, settings)}, one pass of each timed here); the full exact scan "
        f"would be {full / 1e12:.3g} TFLOP, about {_duration(rung2_seconds(build, settings, None, (), method))}"
    )
    return line, seconds


def scan_estimate(build, probe: RepeatSettings, method, rung2: tuple[float, float] | None) -> tuple[str, float]:
    """``(line, seconds)`` of a build's whole scan: rung 1's products at a float32 matmul's rate and its
    eigenvalues at theirs (`eigen_seconds`, ``method``'s `KappaMethod` null), the probe at the rate of
    the build's own forward (`calibrated_rate`), each measured now, and ``rung2``'s ``(counted FLOPs,
    seconds)`` (`rung2_seconds`; None: no knockouts)."""
    geo = build.geometry
    float32 = measured_rate(build, dtype=torch.float32)
    own = calibrated_rate(build, probe)
    rung1, forward = rung1_flops(geo, method.n_rotations), probe_flops(build, probe)
    eigen = eigen_seconds(geo, method.n_rotations, getattr(torch, method.null_dtype))
    rung1_s = (rung1 - eigen_flops(geo, method.n_rotations)) / float32 + eigen
    seconds = rung1_s + forward / own + (rung2[1] if rung2 else 0.0)
    said = "" if rung2 is None else f"; rung 2 {rung2[0] / 1e12:.3g} TFLOP, {_duration(rung2[1])} (its passes timed)"
    line = (
        f"circuits: the scan of {build.label}: rung 1 counts {rung1 / 1e12:.3g} TFLOP, {_duration(rung1_s)} "
        f"(products in float32 at {_gflops(float32)} GFLOP/s, eigenvalues {_duration(eigen)}), the probe "
        f"{forward / 1e12:.3g} TFLOP ({_gflops(own)} GFLOP/s){said}: about {_duration(seconds)} (a float32 "
        "matmul, one head's null and the build's passes timed here)"
    )
    return line, seconds
