"""KV-cache precisions: the cache a server keeps, a build dimension typed after ``+kv-``.

``bf16+kv-fp8-e4m3`` is the bf16 build served with an fp8 cache; ``gptq-int4+kv-q4_0-r128`` the
GPTQ build with llama.cpp's q4_0 cache and the last 128 tokens kept in full precision. Every
query reads keys (after RoPE, as engines store them) and values that went through the cache:
the decode-time numerics, simulated in one forward (`kv_cache`).

Three layouts, each named by the engine or paper that defines it:

- ``fp8-e4m3``, ``fp8-e5m2`` (vLLM ``--kv-cache-dtype fp8``): one scale per layer for the keys
  and one for the values, ``x -> fp8(clamp(x / s)) * s``; ``s`` is the checkpoint's
  ``k_scale``/``v_scale`` where it has them, else 1.0 as vLLM does. ``-dyn``: ``s`` is each
  sequence's ``amax / fp8_max`` in each layer (calibrated on the probe itself).
- ``int8``, ``int4``, ``int2`` (KIVI, Liu et al. 2024): asymmetric min-max; keys per channel over
  blocks of 32 tokens, values per token over groups of 32 channels. A block of keys is quantized
  when it is complete: until then its tokens are read in full precision (KIVI's residual).
- ``q8_0``, ``q4_0``, ``q4_1``, ``q5_0``, ``q5_1``, ``iq4_nl`` (llama.cpp ``--cache-type-k/-v``):
  blocks of 32 along the head dimension, per token, ggml's own rounding (fp16 block scales).
  ``-qdot``: Q too is quantized, to q8_0 (q8_1 for q4_1, q5_1) blocks, as llama.cpp's CPU kernel
  converts it before its K.Q dot product.

A fourth layout runs transformers' own ``QuantizedCache`` (`quantized_cache`), not a simulation:

- ``quanto-int4``, ``quanto-int2`` (optimum-quanto backend), ``hqq-int8``, ``hqq-int4``,
  ``hqq-int2`` (HQQ backend): the probe runs in decode mode, one token at a time through the
  cache, so every query reads what the cache stores.

``-rN`` keeps the last ``N`` tokens before each query in full precision (transformers'
``QuantizedCache`` ``residual_length``; for its own layout ``-rN`` is that argument, and without
it the cache keeps `QUANTIZED_CACHE_RESIDUAL`, its own default). Light: no torch, so option
parsing can use it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from ..errors import RecipeError

KV_SEPARATOR = "+kv-"
KIVI_GROUP = 32  # KIVI's group: tokens per key block, channels per value group
GGML_BLOCK = 32  # QK8_0 = QK4_0 = QK4_1 = QK5_0 = QK5_1 = QK4_NL
QUANTIZED_CACHE_RESIDUAL = 128  # transformers' QuantizedLayer residual_length default (tests check it)


@dataclass(frozen=True)
class KvFormat:
    """One cache element format: its layout (``fp8``, ``kivi`` or ``ggml``) and what it stores."""

    name: str
    layout: str
    summary: str
    bits: int
    dtype: str | None = None  # fp8: torch's float8 dtype name
    backend: str | None = None  # transformers' QuantizedCache backend (layout "transformers")


KV_FORMATS: dict[str, KvFormat] = {
    f.name: f
    for f in (
        KvFormat("fp8-e4m3", "fp8", "float8 e4m3, one scale per layer (vLLM --kv-cache-dtype fp8)", 8, "float8_e4m3fn"),
        KvFormat("fp8-e5m2", "fp8", "float8 e5m2, one scale per layer (vLLM fp8_e5m2)", 8, "float8_e5m2"),
        KvFormat("int8", "kivi", "int8, keys per channel, values per token (KIVI)", 8),
        KvFormat("int4", "kivi", "int4, keys per channel, values per token (KIVI)", 4),
        KvFormat("int2", "kivi", "int2, keys per channel, values per token (KIVI)", 2),
        KvFormat("q8_0", "ggml", "llama.cpp q8_0 blocks of 32", 8),
        KvFormat("q5_1", "ggml", "llama.cpp q5_1 blocks of 32", 5),
        KvFormat("q5_0", "ggml", "llama.cpp q5_0 blocks of 32", 5),
        KvFormat("q4_1", "ggml", "llama.cpp q4_1 blocks of 32", 4),
        KvFormat("q4_0", "ggml", "llama.cpp q4_0 blocks of 32", 4),
        KvFormat("iq4_nl", "ggml", "llama.cpp iq4_nl blocks of 32 (non-linear 4-bit grid)", 4),
        KvFormat(
            "quanto-int4", "transformers", "transformers QuantizedCache, quanto backend, 4 bits", 4, None, "quanto"
        ),
        KvFormat(
            "quanto-int2", "transformers", "transformers QuantizedCache, quanto backend, 2 bits", 2, None, "quanto"
        ),
        KvFormat("hqq-int8", "transformers", "transformers QuantizedCache, HQQ backend, 8 bits", 8, None, "hqq"),
        KvFormat("hqq-int4", "transformers", "transformers QuantizedCache, HQQ backend, 4 bits", 4, None, "hqq"),
        KvFormat("hqq-int2", "transformers", "transformers QuantizedCache, HQQ backend, 2 bits", 2, None, "hqq"),
    )
}

_SPEC = re.compile(
    r"(?P<format>[a-z0-9_]+(?:-e[45]m[23]|-int[248])?)(?P<dyn>-dyn)?(?P<qdot>-qdot)?(?:-r(?P<window>\d+))?"
)
QDOT = "-qdot"  # llama.cpp's blocks: Q quantized as the engine's K.Q dot product takes it (`KvSpec.qdot`)


@dataclass(frozen=True)
class KvSpec:
    """A cache precision as typed after ``+kv-``: its format, ``dynamic`` (fp8 scales from each
    forward's amax) and ``window`` (tokens before each query read in full precision)."""

    format: KvFormat
    dynamic: bool = False
    window: int = 0
    qdot: bool = False  # ggml: Q through the type's vec_dot type (q8_0 / q8_1 blocks), as llama.cpp's CPU kernel

    @property
    def name(self) -> str:
        dyn, qdot = "-dyn" if self.dynamic else "", QDOT if self.qdot else ""
        return self.format.name + dyn + qdot + (f"-r{self.window}" if self.window else "")

    @property
    def decode(self) -> bool:
        """Run by transformers' own ``QuantizedCache``, one token at a time (not simulated in one forward)."""
        return self.format.layout == "transformers"

    @property
    def full_window(self) -> int:
        """Tokens before a query that may read full precision: ``-rN``, else QuantizedCache's own default."""
        return self.window or (QUANTIZED_CACHE_RESIDUAL if self.decode else 0)

    def describe(self, scales: str | None = None) -> str:
        """The identity's ``kv_cache`` line: ``"fp8-e4m3: float8 e4m3, ...; scales 1.0 (none in the checkpoint)"``."""
        parts = [f"{self.name}: {self.format.summary}"]
        if self.format.layout == "fp8":
            parts.append("scales each sequence's amax / fp8 max" if self.dynamic else f"scales {scales or '1.0'}")
        if self.qdot:
            parts.append(
                f"Q quantized to {vec_dot_type(self.format.name)} blocks of 32 before the K.Q dot product "
                "(llama.cpp's CPU flash attention)"
            )
        if self.window:
            parts.append(f"the last {self.window} tokens before each query in full precision")
        return "; ".join(parts)


def vec_dot_type(name: str) -> str:
    """The block type llama.cpp's CPU converts Q to for a dot product with keys of type ``name``
    (ggml-cpu.c ``type_traits_cpu[...].vec_dot_type``): q8_1 for q4_1 and q5_1, else q8_0."""
    return "q8_1" if name in ("q4_1", "q5_1") else "q8_0"


def known_formats() -> str:
    return "; ".join(f"{f.name} ({f.summary})" for f in KV_FORMATS.values())


MAX_WINDOW_DIGITS = 9  # a window of a billion tokens is past any probe; more digits is a typo (or worse)


def shown(text: str, most: int = 60) -> str:
    """``repr(text)``, its middle elided past ``most`` characters: a 5000-digit window stays readable."""
    said = repr(text)
    return said if len(said) <= most else f"{said[: most // 2]}...{said[-most // 4 :]} ({len(text)} characters)"


def parse_kv(text: str, build: str = "") -> KvSpec:
    """``"q4_0-r128"`` -> `KvSpec`; one-line errors naming the build typed and the known formats."""
    where = f"build {shown(build)}: " if build else ""
    match = _SPEC.fullmatch(text.strip())
    kv_format = KV_FORMATS.get(match.group("format")) if match else None
    if match is None or kv_format is None:
        raise RecipeError(
            f"{where}unknown KV-cache precision {shown(text)}; write BUILD+kv-FORMAT[-dyn][-qdot][-rN] with FORMAT one of: "
            f"{known_formats()}"
        )
    dynamic = match.group("dyn") is not None
    if dynamic and kv_format.layout != "fp8":
        raise RecipeError(
            f"{where}'-dyn' (scales from each sequence) applies to the fp8 caches only, not {shown(text)}"
        )
    qdot = match.group("qdot") is not None
    if qdot and kv_format.layout != "ggml":
        raise RecipeError(
            f"{where}'{QDOT}' (Q quantized as llama.cpp's dot product takes it) applies to llama.cpp's caches only "
            f"(q8_0, q5_1, q5_0, q4_1, q4_0, iq4_nl), not {shown(text)}"
        )
    digits = match.group("window")
    if digits is not None and len(digits.lstrip("0")) > MAX_WINDOW_DIGITS:
        raise RecipeError(
            f"{where}the full-precision window of {shown(text)} has {len(digits)} digits, past any probe; "
            "give tokens before each query, e.g. -r128"
        )
    window = int(digits or 0)
    if digits is not None and window < 1:
        raise RecipeError(f"{where}the full-precision window of {shown(text)} must be at least 1 token, e.g. -r128")
    return KvSpec(kv_format, dynamic, window, qdot)


def split_kv(name: str) -> tuple[str, KvSpec | None]:
    """``"bf16+kv-fp8-e4m3"`` -> ``("bf16", KvSpec(fp8-e4m3))``; a name without ``+kv-`` -> ``(name, None)``."""
    base, sep, kv = name.partition(KV_SEPARATOR)
    if not sep:
        return name, None
    if not base:
        raise RecipeError(f"build {shown(name)} names a cache but no weights; write e.g. bf16{KV_SEPARATOR}{kv[:40]}")
    return base, parse_kv(kv, name)


def check_window_fits(spec, positions: int, length_flag: str) -> None:
    """Refuse a build (`recipes.BuildSpec`) whose full-precision window covers every position of the
    probe: no query would read a key from the cache, so the cache would not be gated."""
    kv: KvSpec | None = getattr(spec, "kv", None)
    if kv is not None and kv.full_window >= positions:
        raise RecipeError(
            f"build {spec.name!r}: its full-precision window of {kv.full_window} tokens covers every position of the "
            f"probe ({positions} tokens), so nothing would be read from the cache; use -r{max(1, positions // 4)} "
            f"or a longer probe ({length_flag})"
        )


def decode_only(build: str, cache: str, what: str) -> RecipeError:
    """The one line refusing ``what`` (one forward over whole sequences) on a build whose ``cache`` is
    read in decode mode only (transformers' ``QuantizedCache``)."""
    from ..options import FRONT_END

    alone = "--no-knockout" if FRONT_END.get() == "cli" else "pytest: deselect its knockout test, -k 'not knockout'"
    return RecipeError(
        f"build {build}: {what} runs one forward over whole sequences, but its {cache} cache "
        f"(transformers' QuantizedCache) is read in decode mode only; run the probe alone ({alone}) or "
        "use a simulated cache (+kv-int4, +kv-q4_0)"
    )


def refuse_decode_knockouts(spec) -> None:
    """Refuse the knockouts of a build (`recipes.BuildSpec`) with a decode-only cache before any work:
    the probe alone takes minutes in decode mode, and the knockout scan would refuse it after."""
    kv: KvSpec | None = getattr(spec, "kv", None)
    if kv is not None and kv.decode:
        raise decode_only(spec.name, kv.name, "the knockout scan")
