"""The KV cache a server keeps, simulated in one forward: every query reads keys and values that went through it.

`attach_kv_cache` serves a loaded build with a `kv_formats.KvSpec`. The model's attention
implementation becomes ``circuits-kv|eager`` (or ``|sdpa``, which `rungs.replay.attention_implementation`
switches to): a function that quantizes the keys after RoPE and the values, per layer, with
`quantize_keys` / `quantize_values`, then calls the family's own attention on them. Where some
(query, key) pairs read full precision (a ``-rN`` window; a KIVI key block not yet complete),
the keys and values are stacked, ``[K_cache; K]``, and one mask gives each pair exactly one copy:
``softmax`` over the union is then the decode-time softmax, and the pattern handed to hooks is
folded back to ``(T, T)``. Rounding passes gradients straight through (the attribution screen).

Rung 1 reads weights only, so the cache changes no kappa; the self-check of the per-head read
runs on the build before the cache is attached.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import replace

import torch

from ..errors import RecipeError
from .family_modules import attention_module
from .ggml_layout import GgmlLayout, ggml_layout
from .kv_formats import GGML_BLOCK, KIVI_GROUP, KvSpec

PREFIX = "circuits-kv|"
CACHE_ATTR = "_circuits_kv"  # on the model and on each attention module: its `KvCache`
_BUMPS: list[Callable[[torch.Tensor], torch.Tensor]] = []  # set within `one_ulp_bumps` only
IQ4_NL_GRID = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)  # ggml kvalues_iq4nl


# ----- element formats: x -> dequantize(quantize(x)), in float32 -----


def _fp16(x: torch.Tensor) -> torch.Tensor:
    """A ggml block scale as stored: rounded to fp16."""
    return x.to(torch.float16).float()


def fp8_roundtrip(x: torch.Tensor, dtype: torch.dtype, scale: torch.Tensor | float) -> torch.Tensor:
    """``fp8(clamp(x / s, -max, max)) * s`` (vLLM's scaled conversion; saturates, never inf)."""
    fmax = torch.finfo(dtype).max
    return (x / scale).clamp(-fmax, fmax).to(dtype).float() * scale


def kivi_roundtrip(x: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """Asymmetric min-max over ``dim`` (size a multiple of the group): ``q = round((x - min) / s)``,
    ``s = (max - min) / (2^b - 1)``, ``x' = q s + min``."""
    levels = 2**bits - 1
    lo, hi = x.amin(dim=dim, keepdim=True), x.amax(dim=dim, keepdim=True)
    scale = ((hi - lo) / levels).clamp_min(torch.finfo(torch.float32).tiny)
    return ((x - lo) / scale).round().clamp(0, levels) * scale + lo


def q8_0_roundtrip(blocks: torch.Tensor) -> torch.Tensor:
    """Blocks of 32 ``(..., 32)`` through ggml-cpu's ``quantize_row_q8_0`` as its SIMD code (x86 AVX/AVX2,
    ARM NEON) writes a q8_0 cache and quantizes Q: ``d = amax / 127`` stored as fp16, ``q = rne(x *
    (127 / amax))``, ties to even; ``quantize_row_q8_0_ref`` (the scalar build, the gguf package)
    rounds ``x * (1 / d)`` with ``roundf`` instead, ties away from zero."""
    amax = blocks.abs().amax(-1, keepdim=True)
    inverse = torch.where(amax > 0, 127 / torch.where(amax > 0, amax, torch.ones_like(amax)), torch.zeros_like(amax))
    return torch.round(blocks * inverse) * _fp16(amax / 127)


def _signed_absmax(blocks: torch.Tensor) -> torch.Tensor:
    """The element of largest magnitude of each block, with its sign (ggml's ``max``)."""
    return blocks.gather(-1, blocks.abs().argmax(dim=-1, keepdim=True))


def _safe_inverse(d: torch.Tensor) -> torch.Tensor:
    return torch.where(d == 0, torch.zeros_like(d), 1 / torch.where(d == 0, torch.ones_like(d), d))


def _iq4_nl_blocks(blocks: torch.Tensor) -> torch.Tensor:
    """ggml-quants.c ``quantize_row_iq4_nl_ref`` (llama.cpp's CPU writes an iq4_nl cache with it:
    ``quantize_row_iq4_nl_impl`` with ``ntry = -1``, so no scale search), dequantized: codes
    ``l_j`` = the grid value nearest ``x_j / d0``, ``d0 = max / grid[0]`` (``max`` the signed element
    of largest magnitude), then ``d = sum w q x / sum w q^2`` with ``w = x^2`` (summed in order, in
    float32, as there) stored as fp16: ``x' = q fp16(d)``; a block with ``amax < 1e-15`` is zero."""
    grid = torch.tensor(IQ4_NL_GRID, dtype=torch.float32, device=blocks.device)
    mx = _signed_absmax(blocks)
    live = mx.abs() >= 1e-15  # GROUP_MAX_EPS
    d0 = torch.where(live, mx / IQ4_NL_GRID[0], torch.ones_like(mx))
    scaled = (blocks * (1 / d0)).contiguous()
    below = torch.searchsorted(grid, scaled, right=True).clamp(1, 15)  # best_index_int8: ties to the upper
    lower, upper = grid[below - 1], grid[below]
    q = torch.where(scaled - lower < upper - scaled, lower, upper)
    weight = blocks * blocks
    sumqx, sumq2 = torch.zeros_like(mx), torch.zeros_like(mx)
    for j in range(blocks.shape[-1]):  # C's order of float32 additions
        wq = weight[..., j : j + 1] * q[..., j : j + 1]
        sumqx, sumq2 = sumqx + wq * blocks[..., j : j + 1], sumq2 + wq * q[..., j : j + 1]
    d = torch.where(live & (sumq2 > 0), sumqx / torch.where(sumq2 > 0, sumq2, torch.ones_like(sumq2)), 0.0)
    return q * _fp16(d)


def ggml_roundtrip(x: torch.Tensor, kind: str) -> torch.Tensor:
    """llama.cpp's CPU quantizers (ggml-cpu's ``from_float``, which writes its cache) on blocks of 32
    along the last axis, dequantized: `q8_0_roundtrip`; for the others ggml-quants.c's
    ``quantize_row_*_ref`` itself (truncation of ``x / d + 0.5``, fp16 scales and minimums)."""
    shape = x.shape
    blocks = x.reshape(-1, GGML_BLOCK).float()
    if kind == "q8_0":
        out = q8_0_roundtrip(blocks)
    elif kind in ("q4_0", "q5_0"):
        half = 8 if kind == "q4_0" else 16
        d = _signed_absmax(blocks) / -half
        q = torch.trunc(blocks * _safe_inverse(d) + (half + 0.5)).clamp(0, 2 * half - 1)
        out = (q - half) * _fp16(d)
    elif kind in ("q4_1", "q5_1"):
        levels = 15 if kind == "q4_1" else 31
        lo, hi = blocks.amin(-1, keepdim=True), blocks.amax(-1, keepdim=True)
        d = (hi - lo) / levels
        q = torch.trunc((blocks - lo) * _safe_inverse(d) + 0.5).clamp(0, levels)
        out = q * _fp16(d) + _fp16(lo)
    elif kind == "iq4_nl":
        out = _iq4_nl_blocks(blocks)
    else:
        raise RecipeError(f"no llama.cpp cache type {kind!r}")
    return out.reshape(shape)


def _straight_through(x: torch.Tensor, rounded: torch.Tensor) -> torch.Tensor:
    """``rounded`` forward, identity backward (the screen's gradients pass the cache)."""
    rounded = rounded.to(x.dtype)
    return x + (rounded - x).detach() if x.requires_grad else rounded


def quantize_keys(
    k: torch.Tensor, spec: KvSpec, scale: torch.Tensor | float | None = None, stored: GgmlLayout | None = None
) -> torch.Tensor:
    """Keys ``(batch, kv_heads, T, d_head)`` as the cache returns them. KIVI: per channel over
    complete blocks of 32 tokens (a partial last block is returned unchanged: it is never read
    from the cache, `cache_pairs`). ggml: blocks cut as llama.cpp lays the head out (``stored``:
    its key order and rotation, `ggml_layout`; None: the head as it is)."""
    x = k.float()
    layout = spec.format.layout
    if layout == "fp8":
        out = fp8_roundtrip(x, getattr(torch, spec.format.dtype or ""), _scale(x, spec, scale))
    elif layout == "kivi":
        whole = x.shape[-2] // KIVI_GROUP * KIVI_GROUP
        out = x.clone()
        if whole:
            head = x[..., :whole, :]
            blocks = head.reshape(*x.shape[:-2], whole // KIVI_GROUP, KIVI_GROUP, x.shape[-1])
            out[..., :whole, :] = kivi_roundtrip(blocks, spec.format.bits, dim=-2).reshape(head.shape)
    else:
        out = _ggml_blocks(x, spec, stored, keys=True)
    return _straight_through(k, out)


def quantize_values(
    v: torch.Tensor, spec: KvSpec, scale: torch.Tensor | float | None = None, stored: GgmlLayout | None = None
) -> torch.Tensor:
    """Values ``(batch, kv_heads, T, d_head)`` as the cache returns them (KIVI: per token, groups of 32
    channels; ggml: rotated as ``stored`` says)."""
    x = v.float()
    layout = spec.format.layout
    if layout == "fp8":
        out = fp8_roundtrip(x, getattr(torch, spec.format.dtype or ""), _scale(x, spec, scale))
    elif layout == "kivi":
        groups = x.reshape(*x.shape[:-1], -1, KIVI_GROUP)
        out = kivi_roundtrip(groups, spec.format.bits, dim=-1).reshape(x.shape)
    else:
        out = _ggml_blocks(x, spec, stored, keys=False)
    return _straight_through(v, out)


def _ggml_blocks(x: torch.Tensor, spec: KvSpec, layout: GgmlLayout | None, keys: bool) -> torch.Tensor:
    def blocks(y):
        return ggml_roundtrip(y, spec.format.name)

    if layout is None:
        return blocks(x)
    return layout.keys(x, blocks) if keys else layout.values(x, blocks)


def _scale(x: torch.Tensor, spec: KvSpec, scale) -> torch.Tensor | float:
    if spec.dynamic:  # per sequence (a request's own cache), so batching never changes a figure
        amax = x.abs().amax(dim=tuple(range(1, x.dim())), keepdim=True)
        return (amax / torch.finfo(getattr(torch, spec.format.dtype or "")).max).clamp_min(1e-12)
    return 1.0 if scale is None else scale.to(x.device) if torch.is_tensor(scale) else scale


def cache_pairs(spec: KvSpec, T: int, device) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(keys, values)``, each ``(T, T)`` bool: query ``t`` reads key / value ``s`` from the cache
    (else in full precision); None when every pair reads both from it. Full precision: ``t - s <
    window``; and KIVI's keys of a block not complete at ``t`` (``s // 32 >= (t + 1) // 32``), whose
    values are already cached (per token)."""
    t = torch.arange(T, device=device).view(-1, 1)
    s = torch.arange(T, device=device).view(1, -1)
    values = torch.ones(T, T, dtype=torch.bool, device=device)
    if spec.window:
        values &= (t - s) >= spec.window
    keys = values & ((s // KIVI_GROUP) < ((t + 1) // KIVI_GROUP)) if spec.format.layout == "kivi" else values
    return None if bool(keys.all()) else (keys, values)


def check_kv_geometry(spec: KvSpec, d_head: int, what: str) -> None:
    """Refuse a cache whose blocks do not tile the head dimension (ggml and KIVI groups of 32)."""
    if spec.format.layout in ("ggml", "kivi") and d_head % GGML_BLOCK:
        raise RecipeError(
            f"{what}: the {spec.format.name} cache stores blocks of {GGML_BLOCK} along the head dimension, "
            f"but this model's d_head is {d_head}; use an fp8 cache (+kv-fp8-e4m3)"
        )


# ----- the attention function -----


def _inner(module, impl: str) -> Callable:
    if impl == "eager":
        found = getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", None)
        if found is None:
            raise RecipeError(f"{type(module).__name__} has no eager_attention_forward; a KV cache cannot be simulated")
        return found
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    return ALL_ATTENTION_FUNCTIONS[impl]


def _allowed(mask: torch.Tensor | None, B: int, Tq: int, Tk: int, device) -> torch.Tensor:
    """The pairs a mask lets through, ``(B, 1, Tq, Tk)`` bool (None: causal; an additive float mask:
    the entries above half its dtype's minimum, so a bias it carries is kept, not read as masked)."""
    if mask is None:
        causal = torch.ones(Tq, Tk, dtype=torch.bool, device=device).tril(Tk - Tq)
        return causal.expand(B, 1, Tq, Tk)
    if mask.dtype == torch.bool:
        return mask[..., :Tk]
    return mask[..., :Tk] > torch.finfo(mask.dtype).min / 2


def kv_attention(impl: str) -> Callable:
    """The attention function ``circuits-kv|impl``: the family's ``impl`` on cached keys and values."""

    def attention(module, query, key, value, attention_mask, **kwargs):
        cache = cache_of(module)
        assert cache is not None, "circuits-kv attention on a module without a cache"
        inner = _inner(module, impl)
        kq, vq = cached(module, key, value)
        query = quantize_query(query, cache)
        Tq, Tk = query.shape[-2], key.shape[-2]
        pairs = cache_pairs(cache.spec, Tk, key.device)
        if pairs is None:
            return inner(module, query, kq, vq, attention_mask, **kwargs)
        allowed = _allowed(attention_mask, query.shape[0], Tq, Tk, key.device)
        k_cached, v_cached = (p[Tk - Tq :] for p in pairs)
        # each pair reads one copy: both cached, the key in full precision (KIVI), or both in full precision
        copies = [(kq, vq, k_cached), (key, vq, v_cached & ~k_cached), (key, value, ~v_cached)]
        copies = [(k, v, allowed & m) for k, v, m in copies if bool(m.any())]
        both = torch.cat([m.expand_as(allowed) for _, _, m in copies], dim=-1)
        if impl == "eager" or (attention_mask is not None and attention_mask.dtype != torch.bool):
            additive = attention_mask is not None and attention_mask.dtype != torch.bool
            base = attention_mask[..., :Tk] if additive else torch.zeros_like(allowed, dtype=query.dtype)
            floor = torch.finfo(base.dtype).min
            mask = torch.cat([base.expand_as(allowed)] * len(copies), dim=-1).masked_fill(~both, floor)
        else:
            mask = both
        keys = torch.cat([k for k, _, _ in copies], dim=-2)
        values = torch.cat([v for _, v, _ in copies], dim=-2)
        out, weights = inner(module, query, keys, values, mask, **kwargs)
        if weights is not None:
            weights = sum(weights[..., i * Tk : (i + 1) * Tk] for i in range(len(copies)))
        return out, weights

    return attention


def quantize_query(query: torch.Tensor, cache: KvCache) -> torch.Tensor:
    """``query`` as llama.cpp's K.Q dot product reads it with ``-qdot``: ``P^T H dq8(H P q)``, q8_0
    blocks cut in the keys' layout (q8_1 for q4_1 / q5_1 keys rounds Q alike; its fp16 block sum
    ``s``, which the dot product uses for the keys' minimum, is not simulated); else unchanged."""
    if not cache.spec.qdot:
        return query

    def blocks(y: torch.Tensor) -> torch.Tensor:
        return q8_0_roundtrip(y.reshape(-1, GGML_BLOCK)).reshape(y.shape)

    x = query.float()
    return _straight_through(query, blocks(x) if cache.layout is None else cache.layout.keys(x, blocks))


def cached(module, key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(key, value)`` as attention module ``module``'s cache returns them (unchanged without a cache).
    Every pair reads the cache here; `kv_attention` adds the window and KIVI's incomplete block."""
    cache = cache_of(module)
    if cache is None:
        return key, value
    cache.read_by.add(id(module))
    for bump in _BUMPS:  # `one_ulp_bumps`
        key, value = bump(key), bump(value)
    k_scale, v_scale = cache.scales(getattr(module, "layer_idx", 0) or 0)
    keys = quantize_keys(key, cache.spec, k_scale, cache.layout)
    return keys, quantize_values(value, cache.spec, v_scale, cache.layout)


@contextmanager
def one_ulp_bumps(seed: int = 1) -> Iterator[None]:
    """Within it, every key and value is multiplied by ``1 + k 2^-23`` (``k`` drawn from {-1, 0, 1}:
    a move of one or two float32 ulps) before the simulated cache: what another summation order of the same
    arithmetic (llama.cpp's SIMD kernels) does to the simulation's figures, its noise floor."""
    draw = torch.Generator().manual_seed(seed)

    def bump(x: torch.Tensor) -> torch.Tensor:
        return x * (1 + 2.0**-23 * torch.randint(-1, 2, x.shape, generator=draw).to(x.dtype))

    _BUMPS.append(bump)
    try:
        yield
    finally:
        _BUMPS.remove(bump)


def register() -> None:
    """Register ``circuits-kv|eager`` and ``circuits-kv|sdpa`` with transformers (masks as eager's / sdpa's)."""
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    for impl in ("eager", "sdpa"):
        if PREFIX + impl not in ALL_ATTENTION_FUNCTIONS:
            ALL_ATTENTION_FUNCTIONS.register(PREFIX + impl, kv_attention(impl))
            ALL_MASK_ATTENTION_FUNCTIONS.register(PREFIX + impl, ALL_MASK_ATTENTION_FUNCTIONS[impl])


class KvCache:
    """A build's cache: its `KvSpec`, per-layer scales (fp8: the checkpoint's, else 1.0), who declared
    it and, for llama.cpp's blocks, how llama.cpp lays a head out (`ggml_layout.GgmlLayout`)."""

    def __init__(
        self, spec: KvSpec, k_scales=None, v_scales=None, origin: str | None = None, layout: GgmlLayout | None = None
    ):
        self.spec, self.layout = spec, layout
        self.k_scales: dict[int, torch.Tensor] = k_scales or {}
        self.v_scales: dict[int, torch.Tensor] = v_scales or {}
        self.origin = origin
        self.read_by: set[int] = set()  # id() of each attention module that has read through it

    def scales(self, layer: int):
        return self.k_scales.get(layer), self.v_scales.get(layer)

    def describe(self) -> str:
        scales = "from the checkpoint (k_scale, v_scale)" if self.k_scales else "1.0 (none given)"
        declared = f"; declared by {self.origin}" if self.origin else ""
        stored = f"; {self.layout.describe()}" if self.layout is not None else ""
        return f"{self.spec.describe(scales)}{declared}{stored}; simulated in torch"


def cache_of(module) -> KvCache | None:
    """The `KvCache` a model (or one of its attention modules) serves, or None."""
    return getattr(module, CACHE_ATTR, None)


def implementation(model) -> str:
    return str(getattr(model.config, "_attn_implementation", "eager") or "eager")


def served(model, impl: str) -> str:
    """The implementation ``impl`` as ``model`` runs it: ``circuits-kv|impl`` when it serves a KV cache."""
    if cache_of(model) is not None and not impl.startswith(PREFIX):
        return PREFIX + impl
    return impl


@torch.no_grad()
def check_in_path(model, modules, cache: KvCache, what: str) -> None:
    """Refuse a cache that a two-token forward did not read in every layer: a family that computes
    its attention itself, outside transformers' attention interface (BLOOM, GPT-Neo; Falcon before transformers 5.25), would gate as
    if its cache were full precision."""
    device = model.get_input_embeddings().weight.device
    model(input_ids=torch.zeros(1, 2, dtype=torch.long, device=device), use_cache=False)
    missed = [layer for layer, module in enumerate(modules) if id(module) not in cache.read_by]
    if missed:
        raise RecipeError(
            f"{what}: {model.config.model_type} computes the attention of layers {missed[:8]} itself, outside "
            "transformers' attention interface, so a KV cache cannot be put in its path; gate it without +kv-"
        )


def refuse_latent_cache(build, spec: KvSpec) -> None:
    """A latent attention's engines cache the latent ``c`` and the shared RoPE key per token (vLLM, and
    llama.cpp with MLA), not per-head keys and values: ``+kv-`` on one is refused in one line."""
    config = build.model.config
    if build.family.latent_norm is not None:
        raise RecipeError(
            f"build {build.recipe}+kv-{spec.name}: {config.model_type} uses multi-head latent attention, whose "
            f"cache holds the latent c (kv_lora_rank {config.kv_lora_rank}) and the RoPE key shared by the heads "
            f"(qk_rope_head_dim {config.qk_rope_head_dim}) per token, not the per-head keys and values +kv- "
            "quantizes; gate it without +kv- (docs/families.md, latent attention)"
        )


def attach_kv_cache(build, spec: KvSpec, k_scales=None, v_scales=None, origin: str | None = None, rename=True):
    """``build`` served with the cache ``spec``: a new `LoadedBuild` whose identity names it (and,
    with ``rename``, whose recipe is ``NAME+kv-SPEC``; a checkpoint's own cache keeps its NAME).

    Refuses a second cache on a build that already serves one (its checkpoint declares it), a
    cache whose blocks do not tile the head dimension, and a build without a switchable attention
    implementation (the cache could not be put in its path), and a latent attention (`refuse_latent_cache`)."""
    refuse_latent_cache(build, spec)
    if spec.decode:  # transformers' own QuantizedCache: run in decode mode, not simulated
        from .quantized_cache import attach_quantized_cache

        return attach_quantized_cache(build, spec)
    what = f"build {build.recipe}+kv-{spec.name}" if rename else f"build {build.recipe}"
    if build.identity.kv_cache:
        raise RecipeError(
            f"{what}: {build.recipe} already serves a KV cache ({build.identity.kv_cache.partition(';')[0]}, declared by "
            f"its checkpoint); gate it without +kv-{spec.name}"
        )
    check_kv_geometry(spec, build.geometry.d_head, what)
    model = build.model
    if not hasattr(model, "set_attn_implementation"):
        raise RecipeError(f"build {build.recipe}: its model cannot switch attention; a KV cache cannot be simulated")
    register()
    layout = ggml_layout(model.config.model_type, build.geometry.d_head) if spec.format.layout == "ggml" else None
    cache = KvCache(spec, k_scales, v_scales, origin, layout)
    setattr(model, CACHE_ATTR, cache)
    modules = [attention_module(model, layer) for layer in range(build.geometry.n_layers)]
    for module in modules:
        setattr(module, CACHE_ATTR, cache)
    model.set_attn_implementation(served(model, implementation(model)))
    check_in_path(model, modules, cache, what)
    recipe = f"{build.identity.recipe}+kv-{spec.name}" if rename else build.identity.recipe
    identity = replace(build.identity, recipe=recipe, kv_cache=cache.describe())
    return replace(build, identity=identity)
