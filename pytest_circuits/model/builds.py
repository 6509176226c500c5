"""Build recipes: the precisions a user gates, each a name typed on the command line.

``fp32``/``bf16``/``fp16`` cast the weights; ``bnb-*`` quantize through
transformers' ``BitsAndBytesConfig``; ``rtn-int8``/``rtn-int4`` simulate symmetric
per-output-channel round-to-nearest of every attention and MLP weight:
``w <- s * clamp(round(w / s), -2^(b-1), 2^(b-1) - 1)`` with ``s = max|w_row| / (2^(b-1) - 1)``;
``fp8-*`` and ``int8-w8a8`` apply a compressed-tensors scheme (`compressed`). A model that is
itself a compressed-tensors release is decompressed by its own decompressor.
"""

from __future__ import annotations

import logging
import warnings
from contextlib import nullcontext
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from ..errors import CircuitsError, RecipeError, first_line
from ..options import flag
from .checkpoint_keys import check_loading_info
from .compressed import (
    decompress,
    identity_fields,
    is_compressed_tensors,
    quantize_in_memory_,
    quiet,
    require_compressed_tensors,
    scheme_config,
)
from .dense import is_projection, weight_of
from .families import Family, Geometry, bind_family, family_and_geometry, geometry_for, modules_at
from .half_products import float32_products
from .loading import ModelSource, check_finite_weights, nonfinite_line, nonfinite_of, quiet_transformers, read_config
from .mixer_memory import lean_heap
from .recipes import CT, EXTERNAL_KEYS, LLMC, RECIPES, BuildSpec, Recipe, get_recipe, parse_builds  # noqa: F401  (re-exported)
from .selfcheck import check_decomposition
from .vocab import TokenInfo, token_info


@dataclass(frozen=True)
class BuildIdentity:
    """What travels with every figure: recipe (an external build: its NAME), dtype, backend and
    its version, device; an external build adds the file it came from, its format, sha256 and
    how many tensors of each stored type it holds (`external.external_identity`); a quantized
    format (compressed-tensors) adds its scheme, its quantized and dense modules and its forward path."""

    recipe: str
    dtype: str
    backend: str
    backend_version: str
    device: str
    source: str | None = None  # external builds only (recipes.EXTERNAL_KEYS)
    format: str | None = None
    sha256: str | None = None
    tensor_types: dict[str, int] | None = None
    quantization: str | None = None  # a quantized format's scheme and modules (`compressed.identity_fields`)
    forward: str | None = None  # which forward it runs: the format's own kernel or a reference
    kv_cache: str | None = None  # the KV-cache precision it is served with (`kv_cache.attach_kv_cache`)
    engine: str | None = None  # what ran its probe when not torch (`llama_engine.engine_line`)

    def as_dict(self) -> dict:
        """The identity as stored; a recipe build's keeps the five keys older baselines hold."""
        return {k: v for k, v in asdict(self).items() if v is not None or k not in EXTERNAL_KEYS}


@dataclass
class LoadedBuild:
    """One build of one model, ready to probe."""

    model: torch.nn.Module
    source: ModelSource
    identity: BuildIdentity
    family: Family
    geometry: Geometry
    tokens: TokenInfo
    llm_int8: bool = False  # bitsandbytes LLM.int8(): outlier columns picked per batch

    @property
    def recipe(self) -> str:
        return self.identity.recipe

    @property
    def label(self) -> str:
        """``model:recipe``, as shown in test ids and messages."""
        return f"{self.source.name}:{self.identity.recipe}"

    @property
    def device(self) -> torch.device:
        return torch.device(self.identity.device)


def torch_dtype(recipe: Recipe) -> torch.dtype:
    """The torch dtype a recipe's float parameters and compute use."""
    return getattr(torch, recipe.dtype)


def auto_device(cuda_count: int, worker: str | None = None) -> str:
    """``auto``: pytest-xdist worker ``gw<i>`` gets ``cuda:(i mod cuda_count)``, one process
    ``cuda:0``, and with no GPU everything runs on ``cpu``. ``cuda_count`` is
    ``torch.cuda.device_count()``, which counts only the devices ``CUDA_VISIBLE_DEVICES`` shows."""
    if cuda_count < 1:
        return "cpu"
    index = 0
    if worker and worker.startswith("gw") and worker[2:].isdigit():
        index = int(worker[2:]) % cuda_count
    return f"cuda:{index}"


def resolve_device(spec: str = "auto", worker: str | None = None) -> torch.device:
    """``auto`` -> `auto_device` (``worker``: the xdist worker id, default ``$PYTEST_XDIST_WORKER``);
    ``cuda``/``cuda:N`` checked against the devices present."""
    spec = (spec or "auto").strip()
    if spec == "auto":
        import os

        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        return torch.device(auto_device(count, worker or os.environ.get("PYTEST_XDIST_WORKER")))
    try:
        device = torch.device(spec)
    except RuntimeError:
        raise CircuitsError(f"unknown device {spec!r}; use auto, cpu, cuda or cuda:N") from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise CircuitsError(f"device {spec!r}: no CUDA device is available here; use {flag('device')} cpu")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise CircuitsError(
                f"device {spec!r}: only {torch.cuda.device_count()} CUDA device(s) here; use cuda:0..cuda:{torch.cuda.device_count() - 1}"
            )
    elif device.type != "cpu":
        raise CircuitsError(f"device {spec!r} is not supported; use auto, cpu, cuda or cuda:N")
    return device


OFFLINE_TRUST_LINE = "Skipping publisher trust check for "
"""The start of what the ``kernels`` package logs (logger `KERNELS_HUB_LOGGER`) each time bitsandbytes
asks it for a Hub kernel while HF_HUB_OFFLINE is set, as this package always runs: it downloads nothing,
so there is no publisher to trust; the line is dropped (`quiet_bitsandbytes`)."""
KERNELS_HUB_LOGGER = "kernels._internals.hf_hub"


def _not_the_offline_trust_line(record: logging.LogRecord) -> bool:
    return not str(record.msg).startswith(OFFLINE_TRUST_LINE)


def quiet_bitsandbytes() -> None:
    """Before bitsandbytes is imported: on CPUs its backend logs, at import, that it could not fetch a
    kernel from the Hub (we never download), and int8 matmuls warn on every cast; ``kernels`` logs the
    offline trust line. Idempotent."""
    logging.getLogger("bitsandbytes").setLevel(logging.ERROR)
    hub = logging.getLogger(KERNELS_HUB_LOGGER)
    if _not_the_offline_trust_line not in hub.filters:
        hub.addFilter(_not_the_offline_trust_line)


def require_bitsandbytes(recipe_name: str) -> None:
    """Import bitsandbytes (its Hub-kernel lines quieted, `quiet_bitsandbytes`), or refuse the recipe in
    one line naming the install."""
    quiet_bitsandbytes()
    try:
        with warnings.catch_warnings():  # bitsandbytes decorates with torch.jit.script_method (deprecated in torch)
            warnings.filterwarnings(
                "ignore", message="`torch.jit.script_method` is deprecated", category=DeprecationWarning
            )
            import bitsandbytes  # noqa: F401
    except ImportError:
        raise RecipeError(f"recipe {recipe_name} needs bitsandbytes: pip install bitsandbytes") from None


def _bnb_config(recipe: Recipe):
    require_bitsandbytes(recipe.name)
    from transformers import BitsAndBytesConfig

    if recipe.bits == 8:
        return BitsAndBytesConfig(load_in_8bit=True)
    return BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type=recipe.quant_type,
        bnb_4bit_compute_dtype=torch_dtype(recipe),
    )


def _backend_version(recipe: Recipe) -> str:
    if recipe.backend == "bitsandbytes":
        import bitsandbytes

        return f"bitsandbytes {bitsandbytes.__version__}"
    if recipe.backend == CT:
        import compressed_tensors

        return f"compressed-tensors {compressed_tensors.__version__}"
    if recipe.backend == LLMC:
        from .calibrated import llmc_python, llmc_version

        return llmc_version(llmc_python(recipe.name))
    return f"torch {torch.__version__}"


def rtn_quantize_(weight: torch.Tensor, bits: int, out_dim: int = 0) -> torch.Tensor:
    """Round-to-nearest per output channel, in place: ``s * clamp(round(w/s), -2^(b-1), 2^(b-1)-1)``."""
    qmax = 2 ** (bits - 1) - 1
    reduce_dim = 1 - out_dim
    w = weight.detach().float()
    scale = w.abs().amax(dim=reduce_dim, keepdim=True).clamp_min(1e-12) / qmax
    quantized = (w / scale).round().clamp(-qmax - 1, qmax) * scale
    weight.data.copy_(quantized.to(weight.dtype))
    return weight


@torch.no_grad()
def apply_rtn_(model, family: Family, bits: int) -> int:
    """Simulate RTN on every projection of every decoder block; returns how many layers changed."""
    count = 0
    for block in modules_at(model, family.layers):
        for module in block.modules():
            if is_projection(module) and weight_of(module).dim() == 2:
                out_dim = 1 if type(module).__name__ == "Conv1D" else 0
                rtn_quantize_(weight_of(module), bits, out_dim)
                count += 1
    return count


@torch.no_grad()
def check_cast_finite(model, what: str) -> None:
    """Refuse a build whose cast made a float parameter non-finite (float16 overflows above 65504)."""
    counts = ((name, nonfinite_of(p.detach())) for name, p in model.named_parameters())
    bad = [(name, *found) for name, found in counts if found is not None]
    if bad:
        name, n_nan, n_inf = bad[0]
        fix = "the weights exceed this dtype's range: gate fp32 or bf16 instead"
        raise RecipeError(nonfinite_line(f"{what} (after the cast)", name, n_nan, n_inf, len(bad) - 1, fix))


DEVICE_MAP_NONE = "none"


def check_device_map(device_map: str, device: torch.device) -> None:
    """A ``device_map`` strategy spreads the model over the visible GPUs (or, with none, places it on
    the CPU); it cannot be combined with a device named by hand."""
    from ..options import DEVICE_MAPS

    if device_map not in DEVICE_MAPS:
        raise CircuitsError(f"device map {device_map!r} is unknown; use one of: {', '.join(DEVICE_MAPS)}")
    if device_map != DEVICE_MAP_NONE and device.type == "cuda" and device.index not in (None, 0):
        raise CircuitsError(
            f"{flag('device-map')} {device_map} places the model over every visible GPU itself; "
            f"drop {flag('device')} {device} (or choose the GPUs with CUDA_VISIBLE_DEVICES)"
        )


def check_not_offloaded(model, what: str) -> None:
    """Refuse a placement that offloads weights to the CPU or disk next to GPUs: accelerate keeps
    them on the meta device then, and rung 1 reads every weight."""
    placed = {str(v) for v in (getattr(model, "hf_device_map", None) or {}).values()}
    gpus = {v for v in placed if v not in ("cpu", "disk")}
    offloaded = sorted(placed - gpus) if gpus else []
    if offloaded:
        raise RecipeError(
            f"{what} does not fit the visible GPUs: accelerate offloaded part of it to {' and '.join(offloaded)}; "
            "make more GPUs visible (CUDA_VISIBLE_DEVICES) or gate a 4-bit recipe"
        )


def from_pretrained(
    folder, what: str, device, trust_remote_code: bool = False, cache_scales: bool = False, **kwargs
) -> torch.nn.Module:
    """``AutoModelForCausalLM.from_pretrained``: offline, safetensors, eager attention; one line on failure,
    and on a checkpoint with missing or unexpected tensors (`checkpoint_keys.check_loading_info`).
    ``cache_scales``: the checkpoint's ``k_scale`` / ``v_scale`` are expected (`kv_checkpoint`), read apart."""
    from transformers import AutoModelForCausalLM

    kwargs = (
        dict(
            local_files_only=True,
            trust_remote_code=trust_remote_code,
            attn_implementation="eager",
            use_safetensors=True,
        )
        | kwargs
    )
    try:
        # typed as the Module it is: transformers' functools.wraps on .to hides the bound self from mypy
        loaded: Any = AutoModelForCausalLM.from_pretrained(folder, output_loading_info=True, **kwargs)
        model: torch.nn.Module
        model, info = loaded
    except CircuitsError:
        raise
    except Exception as error:
        raise RecipeError(f"build {what} failed to load on {device}: {first_line(error)}") from None
    if cache_scales:
        from .kv_checkpoint import is_scale_key

        info = info | {"unexpected_keys": [k for k in info.get("unexpected_keys") or () if not is_scale_key(str(k))]}
    check_loading_info(info, f"build {what} ({folder})")
    return model


def finish_build(model, source: ModelSource, identity: BuildIdentity, family: Family, tokens: TokenInfo, **extra):
    """Eval mode, no gradients, the `LoadedBuild`, checked by `check_decomposition`."""
    model.eval()
    model.requires_grad_(False)
    float32_products(model)  # bf16/fp16 on a CPU with no kernel for it: float32 GEMMs, rounded once
    bind_family(model, family)  # the entry the config resolved to, not a second inference from the modules
    build = LoadedBuild(
        model=model,
        source=source,
        identity=identity,
        family=family,
        geometry=geometry_for(model.config, family),
        tokens=tokens,
        **extra,
    )
    check_decomposition(build)  # refuses a build whose per-head read does not reproduce its attention
    return build


def load_build(
    source: ModelSource,
    recipe_name: str = "fp32",
    device: str | torch.device = "cpu",
    trust_remote_code: bool = False,
    device_map: str = DEVICE_MAP_NONE,
) -> LoadedBuild:
    """Load one build of ``source`` on ``device``, eager attention, in eval mode, offline.

    ``device_map`` (``auto``, ``balanced``, ...): accelerate places the blocks over the visible
    GPUs (a model too big for one), loading each weight at the recipe's dtype onto its device;
    token ids go to the input embedding's device, and every rung follows each block's device.
    """
    quiet_transformers()
    recipe = get_recipe(recipe_name)
    device = device if isinstance(device, torch.device) else resolve_device(device)
    check_device_map(device_map, device)
    spread = device_map != DEVICE_MAP_NONE
    config = read_config(source.folder, trust_remote_code, source.spec)
    family, _ = family_and_geometry(config)
    tokens = token_info(source.folder, config, trust_remote_code)
    check_finite_weights(source)  # NaN/inf in the float checkpoint: one line naming the tensor, before any figure
    kwargs: dict[str, Any]
    if recipe.backend == "bitsandbytes":
        placement = device_map if spread else {"": str(device)}
        kwargs = dict(quantization_config=_bnb_config(recipe), dtype=torch_dtype(recipe), device_map=placement)
    elif spread:  # each weight loads at the recipe's dtype straight onto its GPU (rtn rounds there)
        kwargs = dict(dtype=torch_dtype(recipe), device_map=device_map)
    elif recipe.backend == "rtn":  # rounds each weight in float32 from the checkpoint's values
        kwargs = dict(dtype=torch.float32)
    else:  # straight to the recipe's dtype: a bf16 build never holds a float32 copy (same bits as casting after)
        kwargs = dict(dtype=torch_dtype(recipe))
    folder, calibration = source.folder, None
    if recipe.backend == LLMC:  # llm-compressor's checkpoint of the float weights, made out of process
        from .calibrated import calibrated_checkpoint

        if recipe.method is None or recipe.group_size is None:
            raise RecipeError(f"build {recipe.name}: an llm-compressor recipe needs its method and group size")
        folder, calibration = calibrated_checkpoint(source, config, recipe.method, recipe.group_size, recipe.name)
        config = read_config(folder, trust_remote_code, recipe.name)
    quant = getattr(config, "quantization_config", None)
    released = quant if isinstance(quant, dict) else None if quant is None else quant.to_dict()
    if recipe.backend == CT or is_compressed_tensors(released):
        require_compressed_tensors(f"build {recipe.name} of {source.name} (compressed-tensors)")
    what = f"{recipe.name} of {source.name}"
    cache = served_cache(released, folder, config, what)
    with quiet() if is_compressed_tensors(released) else nullcontext():
        model = from_pretrained(folder, what, device, trust_remote_code, cache_scales=cache is not None, **kwargs)
    quantized: dict[str, str] = {}
    if is_compressed_tensors(released) and released is not None:  # a compressed-tensors release or llm-compressor's
        quantized = identity_fields(decompress(model), released)
    if calibration is not None:
        quantized["quantization"] += f"; calibration {calibration}"
    if recipe.backend == CT:
        if recipe.quant_type is None:
            raise RecipeError(
                f"build {recipe.name}: a compressed-tensors recipe needs its scheme; set Recipe.quant_type"
            )
        quantize_in_memory_(model, recipe.quant_type)
        quantized = identity_fields(model, scheme_config(model))
    if recipe.backend == "rtn":
        if recipe.bits is None:
            raise RecipeError(f"build {recipe.name}: an rtn recipe needs its bits (e.g. 8 or 4); set Recipe.bits")
        apply_rtn_(model, family, recipe.bits)
    if recipe.backend != "bitsandbytes":
        if not spread:
            model = model.to(device=device, dtype=torch_dtype(recipe))
        check_cast_finite(model, f"build {recipe.name} of {source.name}")
    lean_heap(model, device)  # a large hybrid stack on the reference Mamba-2 scan: freed blocks go back
    if spread:  # token ids go where the embedding is; each block's own device is in hf_device_map
        check_not_offloaded(model, f"build {recipe.name} of {source.name}")
        causal_lm: Any = model  # transformers' PreTrainedModel; torch types its attributes Tensor | Module
        device = causal_lm.get_input_embeddings().weight.device
    identity = BuildIdentity(
        recipe=recipe.name,
        dtype=recipe.dtype,
        backend=recipe.backend,
        backend_version=_backend_version(recipe),
        device=str(device),
        quantization=quantized.get("quantization"),
        forward=quantized.get("forward"),
    )
    llm_int8 = recipe.backend == "bitsandbytes" and recipe.bits == 8
    return with_cache(finish_build(model, source, identity, family, tokens, llm_int8=llm_int8), cache)


def served_cache(quant: dict | None, folder, config, what: str):
    """The KV cache a checkpoint declares (`kv_checkpoint.CheckpointCache`), or None; refuses one it cannot serve."""
    from .kv_checkpoint import checkpoint_cache, scheme_of

    if scheme_of(quant) is None:
        return None
    family, geometry = family_and_geometry(config)
    return checkpoint_cache(quant, Path(folder), family.layers, geometry.n_layers, f"build {what}")


def with_cache(build: LoadedBuild, cache) -> LoadedBuild:
    """``build`` served with its checkpoint's cache (after the self-check, which reads the weights)."""
    if cache is None:
        return build
    from .kv_cache import attach_kv_cache

    origin = f"the checkpoint's kv_cache_scheme ({cache.scheme})"
    return attach_kv_cache(build, cache.spec, cache.k_scales, cache.v_scales, origin=origin, rename=False)
