"""A checkpoint's own KV cache: compressed-tensors' ``kv_cache_scheme`` and its ``k_scale`` / ``v_scale``.

llm-compressor writes ``quantization_config.kv_cache_scheme`` (`QuantizationArgs`) and, for a
static scheme, one ``k_scale`` and one ``v_scale`` per attention module (``model.layers.3.self_attn.k_scale``).
vLLM serves such a checkpoint with an fp8 e4m3 cache at those scales. A build of it is served
the same way (`kv_cache.attach_kv_cache`); a scheme that is not fp8 per tensor is refused in
one line, never ignored, since the build shipped would not be the build gated.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import torch

from ..errors import RecipeError
from .kv_formats import KvSpec, parse_kv

SCALE_NAMES = ("k_scale", "v_scale")


@dataclass(frozen=True)
class CheckpointCache:
    """What the checkpoint declares: the cache precision, and per layer its key and value scales (static)."""

    spec: KvSpec
    k_scales: dict[int, torch.Tensor]
    v_scales: dict[int, torch.Tensor]
    scheme: str  # as written, for the identity


def scheme_of(quant: dict | None) -> dict | None:
    """The ``kv_cache_scheme`` of a compressed-tensors ``quantization_config``, or None."""
    scheme = (quant or {}).get("kv_cache_scheme")
    return scheme if scheme else None


def _described(scheme: dict) -> str:
    keys = ("num_bits", "type", "strategy", "dynamic", "symmetric")
    return ", ".join(f"{k} {scheme.get(k)}" for k in keys if k in scheme)


def cache_spec(scheme: dict, what: str) -> KvSpec:
    """fp8 e4m3 per tensor (static: the checkpoint's scales; dynamic: each sequence's), or a one-line refusal."""
    if not isinstance(scheme, dict):
        raise RecipeError(f"{what}: its kv_cache_scheme is not a mapping ({scheme!r}); re-save the checkpoint")
    fp8 = scheme.get("type") == "float" and scheme.get("num_bits") == 8
    per_tensor = str(scheme.get("strategy") or "tensor") == "tensor" and scheme.get("symmetric", True) is True
    if not (fp8 and per_tensor and scheme.get("dynamic", False) in (True, False)):
        raise RecipeError(
            f"{what}: its kv_cache_scheme ({_described(scheme)}) cannot be applied: pytest-circuits serves a "
            "checkpoint's cache as vLLM does, fp8 e4m3 with one scale per tensor (num_bits 8, type float, strategy "
            "tensor, symmetric); gate it with that scheme, or remove kv_cache_scheme from its config.json to gate "
            "the weights alone"
        )
    return parse_kv("fp8-e4m3-dyn" if scheme.get("dynamic") is True else "fp8-e4m3")


def read_scales(folder: Path, layers_path: str, n_layers: int, what: str) -> tuple[dict, dict]:
    """Each layer's ``k_scale`` and ``v_scale`` from the safetensors files (one positive finite value each)."""
    from safetensors import safe_open

    from .loading import weight_files

    pattern = re.compile(rf"{re.escape(layers_path)}\.(\d+)\..*\b({'|'.join(SCALE_NAMES)})$")
    found: dict[str, dict[int, torch.Tensor]] = {name: {} for name in SCALE_NAMES}
    for file in weight_files(folder):
        with safe_open(str(file), framework="pt") as handle:
            for key in handle.keys():
                match = pattern.search(key)
                if match:
                    value = handle.get_tensor(key).float().reshape(-1)
                    if value.numel() != 1 or not torch.isfinite(value).all() or value.item() <= 0:
                        raise RecipeError(
                            f"{what}: {key} must be one positive finite scale, got {value.tolist()[:4]}; "
                            "re-save the checkpoint"
                        )
                    found[match.group(2)][int(match.group(1))] = value.reshape(())
    for name, scales in found.items():
        beyond = sorted(layer for layer in scales if layer >= n_layers)
        if beyond:
            raise RecipeError(
                f"{what}: it holds a {name} for layers {beyond[:8]}, but the model has {n_layers} layers "
                f"(0..{n_layers - 1}); re-save the checkpoint with the scales of its own layers"
            )
        missing = [layer for layer in range(n_layers) if layer not in scales]
        if missing:
            raise RecipeError(
                f"{what}: its static kv_cache_scheme needs a {name} in every layer, but layers {missing[:8]} have none; "
                "re-save the checkpoint with its calibrated scales"
            )
    return found["k_scale"], found["v_scale"]


def checkpoint_cache(quant: dict | None, folder: Path, layers_path: str, n_layers: int, what: str):
    """The `CheckpointCache` a checkpoint declares, or None when it declares none."""
    scheme = scheme_of(quant)
    if scheme is None:
        return None
    spec = cache_spec(scheme, what)
    k_scales, v_scales = ({}, {}) if spec.dynamic else read_scales(folder, layers_path, n_layers, what)
    return CheckpointCache(spec, k_scales, v_scales, _described(scheme))


def is_scale_key(name: str) -> bool:
    """A checkpoint tensor that is a cache scale, not a weight of the architecture."""
    return name.rsplit(".", 1)[-1] in SCALE_NAMES
