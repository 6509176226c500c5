"""llama.cpp in the loop: the repeat probe run by llama.cpp itself on a GGUF build.

``--circuits-engine llama.cpp`` (``circuits gate --engine llama.cpp``) measures the copy loss and
copy gain of a GGUF build (``NAME=FILE.gguf``, or ``--circuits-model FILE.gguf``) from the logits
llama.cpp computes (llama-cpp-python, ``logits_all``): the file's own kernels, which quantize
activations (Q8_0, Q8_1 or Q8_K blocks, by weight type) before a quantized matmul, and llama.cpp's own KV cache, ``f16`` by
default or ``+kv-q8_0`` etc. as ``type_k`` / ``type_v`` (flash attention on, which llama.cpp needs
for a quantized V cache). The tokens are the torch probe's (`repeat.repeat_tokens`), so each
sequence's figures pair with the torch builds'.

Routing scores come from llama.cpp's own attention patterns (`llama_attention`, its eval callback)
where it forms them: with its f16 cache, without flash attention. With a quantized cache (flash
attention) it forms none, so `induction_heads` is skipped; path factors and knockouts are never
measured (`NOT_MEASURED`), so `knockout_deltas` is skipped. Kappa is weights-only and is read from
the torch dequantisation of the same file.

Light at import: llama_cpp is imported only to run.
"""

from __future__ import annotations

import importlib.metadata
from pathlib import Path

from ..errors import RecipeError
from ..options import ENGINES, flag

TORCH, LLAMA_CPP = ENGINES
INSTALL = (
    'pip install "pytest-circuits[llama]" (llama-cpp-python, built from its source distribution: '
    "a C++ compiler and cmake, about 10 min on 2 cores)"
)
CACHE_TYPES = {  # a +kv- format -> llama.cpp's ggml type constant (llama_cpp.GGML_TYPE_*)
    "q8_0": "GGML_TYPE_Q8_0",
    "q5_1": "GGML_TYPE_Q5_1",
    "q5_0": "GGML_TYPE_Q5_0",
    "q4_1": "GGML_TYPE_Q4_1",
    "q4_0": "GGML_TYPE_Q4_0",
    "iq4_nl": "GGML_TYPE_IQ4_NL",
}
DEFAULT_CACHE = "f16"  # llama.cpp's cache without +kv-
NOT_MEASURED = "path factors and knockouts are not measured (llama.cpp runs no per-head intervention)"
NO_PATTERN = (
    "routing scores are not measured either: with flash attention, which a quantized V cache needs, "
    "llama.cpp never forms the attention pattern"
)


def routed(kv) -> bool:
    """True when llama.cpp forms the attention pattern (its f16 cache, no flash attention) for the routing scores."""
    return kv is None


class EngineError(RecipeError):
    """An engine that cannot run a build: not installed, not a GGUF build, a cache it does not take."""


def require_llama_cpp():
    """The ``llama_cpp`` module, or a one-line error naming the extra that installs it."""
    try:
        import llama_cpp
    except ImportError:
        raise EngineError(f"{flag('engine')} {LLAMA_CPP} needs llama-cpp-python: {INSTALL}") from None
    return llama_cpp


def llama_cpp_version() -> str:
    try:
        return importlib.metadata.version("llama-cpp-python")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def gguf_path(spec, model: str) -> Path:
    """The GGUF file build ``spec`` runs on (its NAME=PATH; the model's own .gguf file for ``fp32``, the
    file as stored), or a one-line refusal: llama.cpp runs GGUF files as they are, and only its own
    cache types (a recipe that casts or quantizes the weights in torch is not the file)."""
    path = Path(str(spec.path if spec.external else model)).expanduser()
    if path.suffix.lower() != ".gguf" or not (spec.external or spec.weights.name == "fp32"):
        what = f"{spec.name}={spec.path}" if spec.external else f"{spec.name} (a recipe of {model})"
        raise EngineError(
            f"{flag('engine')} {LLAMA_CPP} runs GGUF files only, and build {what} is not one; "
            f"give an external build NAME=FILE.gguf, or gate {spec.name} without {flag('engine')} {LLAMA_CPP}"
        )
    check_cache(spec)
    return path


def runs(spec, model: str) -> bool:
    """True when llama.cpp can run build ``spec`` (`gguf_path` refuses it otherwise)."""
    try:
        gguf_path(spec, model)
    except EngineError:
        return False
    return True


def check_cache(spec) -> None:
    """Refuse a ``+kv-`` precision llama.cpp has no cache type for (fp8, KIVI, a window), in one line."""
    kv = getattr(spec, "kv", None)
    if kv is not None and not takes(kv):
        raise EngineError(
            f"build {spec.name}: llama.cpp has no cache type {kv.name}; with {flag('engine')} {LLAMA_CPP} use "
            f"+kv-{', +kv-'.join(CACHE_TYPES)} (or none: its f16 cache), or drop {flag('engine')} to simulate "
            f"{kv.name} in torch"
        )


def takes(kv) -> bool:
    """True when llama.cpp has a cache type for `kv_formats.KvSpec` ``kv`` (no window, no dynamic scale)."""
    return kv.format.name in CACHE_TYPES and not kv.window and not kv.dynamic


def cache_name(kv) -> str:
    return DEFAULT_CACHE if kv is None else kv.name


def engine_line(kv) -> str:
    """The identity's ``engine`` line: what ran, with which cache, and what it cannot measure."""
    if routed(kv):
        how = "attention without flash; copy loss and gain from its logits, routing scores from its attention "
        how += f"patterns (its eval callback); {NOT_MEASURED}"
    else:
        how = f"flash attention; copy loss and gain from its logits; {NOT_MEASURED}; {NO_PATTERN}"
    return (
        f"{LLAMA_CPP} (llama-cpp-python {llama_cpp_version()}, CPU): the file's own kernels, KV cache "
        f"{cache_name(kv)} (type_k = type_v), {how}"
    )


def served_by_llama(build, spec, model: str):
    """``build`` (loaded by torch from the same GGUF file, for its weights) with the identity of a
    llama.cpp run: the engine line and llama.cpp's cache (its f16 default without ``+kv-``)."""
    from dataclasses import replace

    gguf_path(spec, model)
    kv = spec.kv
    cache = f"{DEFAULT_CACHE}: llama.cpp's default" if kv is None else f"{kv.name}: {kv.format.summary}"
    identity = replace(
        build.identity,
        recipe=spec.name,
        kv_cache=f"{cache}; llama.cpp's own cache",
        engine=engine_line(kv),
    )
    return replace(build, identity=identity)


def threads() -> int:
    """Threads llama.cpp computes with: torch's (``OMP_NUM_THREADS`` where set)."""
    import torch

    return max(1, torch.get_num_threads())


class LlamaRunner:
    """One llama.cpp context on a GGUF file, with logits for every position of a sequence."""

    def __init__(self, path: Path, n_ctx: int, kv=None, threads: int = 1, reader=None):
        from contextlib import nullcontext

        from .llama_attention import with_eval_callback

        llama_cpp = require_llama_cpp()
        if kv is not None and not takes(kv):
            raise EngineError(f"llama.cpp has no cache type {kv.name}; it takes {', '.join(CACHE_TYPES)}")
        kwargs: dict = {}
        if kv is not None:
            kind = getattr(llama_cpp, CACHE_TYPES[kv.format.name])
            kwargs = dict(type_k=kind, type_v=kind, flash_attn=True)  # a quantized V cache needs flash attention
        self.n_ctx, self.reader = n_ctx, reader
        with with_eval_callback(llama_cpp, reader) if reader is not None else nullcontext() as callback:
            self.callback = callback  # the context calls it: it lives as long as the runner
            self.llm = llama_cpp.Llama(
                model_path=str(path),
                n_ctx=n_ctx,
                n_batch=n_ctx,
                n_ubatch=n_ctx,  # one sequence, one micro-batch: every query reads keys and values from the cache
                logits_all=True,
                n_threads=threads,
                n_threads_batch=threads,
                n_gpu_layers=0,
                verbose=False,
                **kwargs,
            )

    @property
    def n_vocab(self) -> int:
        return int(self.llm.n_vocab())

    def logits(self, ids):
        """``(T, vocab)`` float32 logits of one sequence of token ids, from an empty cache."""
        import numpy as np

        tokens = [int(t) for t in ids]
        self.llm.reset()
        self.llm.eval(tokens)
        if self.reader is not None and self.reader.error:
            raise EngineError(f"reading llama.cpp's attention pattern failed: {self.reader.error}")
        return np.array(self.llm.scores[: len(tokens)], dtype=np.float32)

    def close(self) -> None:
        self.llm.close()
