#!/usr/bin/env python
"""Bisect a gap between llama.cpp's own quantized cache and the torch simulation (#56): per-sequence
copy losses of SmolLM2's Q8_0 file through llama.cpp and through the simulation, with K and V of
different types and the rotation on or off.

Each CONFIG is ``KTYPE/VTYPE/rot`` or ``KTYPE/VTYPE/norot`` (``LLAMA_ATTN_ROT_DISABLE=1`` on both
sides); a type is ``f16`` or one of llama.cpp's cache types. llama.cpp runs with flash attention
(``type_k`` and ``type_v`` may then differ), but for ``f16/f16``, which runs as the tool's engine and
the tables' f16 rows run it: without (flash attention's CPU kernel sums V in fp16). The simulation
quantizes the quantized side as `kv_cache` does and rounds the f16 side to fp16 (and, for f16 keys, Q too, as flash attention
converts it); a side in f16 is not rotated, as in llama.cpp. Prints the mean of llama.cpp minus the
simulation with its standard error and appends every per-sequence figure to ``--out`` (JSON lines);
after an ``f16/f16`` config, each later one's part too (its difference less the f16 one's, per sequence).

``--activations``: the simulation also quantizes every Linear's input to Q8_0 blocks of 32 as
llama.cpp's CPU does before a matmul with Q8_0 weights (`kv_cache.q8_0_roundtrip`; every matrix of
this file is Q8_0): the engine's own activations, which the tool's run of a GGUF file leaves out.

    OMP_NUM_THREADS=1 python scripts/llama_cache_split.py --n 64 --seed 1 q4_1/q4_1/rot,q4_1/f16/rot,f16/q4_1/rot
    OMP_NUM_THREADS=1 python scripts/llama_cache_split.py --n 256 --activations f16/f16/rot,q4_1/q4_1/rot
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import time
from pathlib import Path

import numpy as np
import torch

from pytest_circuits.gate.stats import mean_interval
from pytest_circuits.model import kv_cache
from pytest_circuits.model.external import load_external_build
from pytest_circuits.model.ggml_layout import ROTATION_SWITCH, GgmlLayout
from pytest_circuits.model.gguf_quant import cached_gguf
from pytest_circuits.model.kv_formats import parse_kv
from pytest_circuits.model.loading import resolve_model
from pytest_circuits.model.recipes import parse_build_spec
from pytest_circuits.rungs.probe import run_repeat_probe
from pytest_circuits.rungs.repeat import bos_offset, next_token_losses, repeat_losses, repeat_tokens
from pytest_circuits.rungs.repeat_settings import RepeatSettings


def llama_copy_losses(path: Path, ids: torch.Tensor, L: int, offset: int, k_type: str, v_type: str) -> list[float]:
    """Per-sequence copy losses through llama.cpp with ``type_k`` / ``type_v`` (flash attention unless both
    are f16, 1 thread)."""
    import llama_cpp

    kwargs: dict = {"flash_attn": not k_type == v_type == "f16"}
    for name, kind in (("type_k", k_type), ("type_v", v_type)):
        if kind != "f16":
            kwargs[name] = getattr(llama_cpp, f"GGML_TYPE_{kind.upper()}")
    T = ids.shape[1]
    llm = llama_cpp.Llama(
        model_path=str(path), n_ctx=T, n_batch=T, n_ubatch=T, logits_all=True, n_threads=1, n_threads_batch=1,
        n_gpu_layers=0, verbose=False, **kwargs,
    )  # fmt: skip
    out = []
    try:
        for row in ids:
            llm.reset()
            llm.eval([int(t) for t in row])
            logits = torch.from_numpy(np.array(llm.scores[:T], dtype=np.float32)).unsqueeze(0)
            out.append(float(repeat_losses(next_token_losses(logits, row.unsqueeze(0)), L, offset)[1][0]))
    finally:
        llm.close()
    return out


def _fp16(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.float16).to(x.dtype)


def simulated_copy_losses(build, settings: RepeatSettings, k_type: str, v_type: str) -> list[float]:
    """Per-sequence copy losses of the simulation with the quantized side's format, the other side in fp16
    (both sides f16: a q8_0 cache whose every rounding is fp16's, unrotated)."""
    quantized = next((kind for kind in (k_type, v_type) if kind != "f16"), "q8_0")
    loaded = kv_cache.attach_kv_cache(copy.deepcopy(build), parse_kv(quantized))
    cache = kv_cache.cache_of(loaded.model)
    assert cache is not None and cache.layout is not None
    lay = cache.layout
    saved = kv_cache.quantize_keys, kv_cache.quantize_values, kv_cache.quantize_query
    if k_type == "f16":  # f16 keys, not rotated; flash attention converts Q to f16 for them
        cache.layout = GgmlLayout(lay.interleaved, 0, lay.value_block, lay.disabled)
        kv_cache.quantize_keys = lambda k, *_, **__: _fp16(k)  # type: ignore[assignment]
        kv_cache.quantize_query = lambda q, _: _fp16(q)  # type: ignore[assignment]
    if v_type == "f16":
        cache.layout = GgmlLayout(lay.interleaved, cache.layout.key_block, 0, lay.disabled)
        kv_cache.quantize_values = lambda v, *_, **__: _fp16(v)  # type: ignore[assignment]
    try:
        return [float(x) for x in run_repeat_probe(loaded, settings).copy_losses]
    finally:
        kv_cache.quantize_keys, kv_cache.quantize_values, kv_cache.quantize_query = saved


def q8_0_inputs(module: torch.nn.Module, args: tuple) -> tuple:
    """A forward pre-hook: the Linear's input through Q8_0 blocks of 32 along its last dimension."""
    x = args[0]
    return (kv_cache.q8_0_roundtrip(x.reshape(*x.shape[:-1], x.shape[-1] // 32, 32)).reshape(x.shape), *args[1:])


def interval(diff: np.ndarray) -> str:
    """``mean [95% interval]`` of per-sequence differences (`gate.stats.mean_interval`)."""
    low, high = mean_interval(diff) or (float("nan"), float("nan"))
    return f"{diff.mean():+.3f} [{low:+.3f}, {high:+.3f}]"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("configs", help="comma list of KTYPE/VTYPE/rot|norot")
    parser.add_argument("--L", type=int, default=64)
    parser.add_argument("--n", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path("/tmp/llama-cache-split.jsonl"))
    parser.add_argument("--activations", action="store_true", help="Q8_0 blocks before every Linear (module doc)")
    args = parser.parse_args()
    path = cached_gguf("smollm2-135m", "Q8_0")
    build = load_external_build(resolve_model("smollm2-135m"), parse_build_spec(f"g={path}"), "cpu")
    if args.activations:
        for module in build.model.modules():
            if isinstance(module, torch.nn.Linear):
                module.register_forward_pre_hook(q8_0_inputs)
    f16_diff: dict[str, np.ndarray] = {}  # by rot: the f16/f16 config's per-sequence difference
    settings = RepeatSettings(seed=args.seed, n=args.n, L=args.L)
    ids = repeat_tokens(build.tokens, args.n, args.L, args.seed)
    for config in args.configs.split(","):
        k_type, v_type, rot = config.split("/")
        if rot == "norot":
            os.environ[ROTATION_SWITCH] = "1"
        else:
            os.environ.pop(ROTATION_SWITCH, None)
        start = time.perf_counter()
        ours = llama_copy_losses(path, ids, args.L, bos_offset(build.tokens), k_type, v_type)
        theirs = simulated_copy_losses(build, settings, k_type, v_type)
        diff = np.array(ours) - np.array(theirs)
        se = diff.std(ddof=1) / np.sqrt(len(diff))
        print(
            f"{config} L {args.L} n {args.n} seed {args.seed}: llama.cpp {np.mean(ours):.4f}, simulation "
            f"{np.mean(theirs):.4f}, difference {diff.mean():+.4f} (se {se:.3f}, sd per sequence "
            f"{diff.std(ddof=1):.3f}; {time.perf_counter() - start:.0f} s); 95%: {interval(diff)}"
            + (f"; its part (less f16's): {interval(diff - f16_diff[rot])}" if rot in f16_diff else ""),
            flush=True,
        )
        if k_type == v_type == "f16":
            f16_diff[rot] = diff
        record = {"config": config, "activations": args.activations, **settings.as_dict()}
        with args.out.open("a") as f:
            f.write(json.dumps({**record, "llama": ours, "simulation": theirs}) + "\n")


if __name__ == "__main__":
    main()
