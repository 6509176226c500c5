"""Build recipes: the precisions a user gates, each a name typed on the command line.

``fp32``/``bf16``/``fp16`` cast the weights; ``bnb-*`` quantize through transformers'
``BitsAndBytesConfig``; ``rtn-int8``/``rtn-int4`` simulate symmetric per-output-channel
round-to-nearest of every attention and MLP weight (`builds.rtn_quantize_`); ``fp8-e4m3``,
``fp8-e4m3-dyn`` and ``int8-w8a8`` are compressed-tensors schemes applied in memory
(`compressed.quantize_in_memory_`); ``gptq-int4`` and ``awq-int4`` (``-g<N>``: group size N)
are made by llm-compressor out of process (`calibrated`).

A build typed on the command line is a `BuildSpec`: a recipe name, or ``NAME=PATH`` for an
external build (a GGUF file or checkpoint someone else produced), parsed once here.

Light: the table names dtypes as strings, so option parsing needs no torch.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from ..errors import RecipeError, did_you_mean
from .kv_formats import KV_SEPARATOR, MAX_WINDOW_DIGITS, KvSpec, shown, split_kv


@dataclass(frozen=True)
class Recipe:
    """How to turn the float32 checkpoint into one build."""

    name: str
    backend: str  # "torch", "bitsandbytes", "rtn" or "compressed-tensors"
    dtype: str  # torch dtype name of the float parameters / compute
    summary: str  # shown in the option's help and in errors
    bits: int | None = None
    quant_type: str | None = None  # bitsandbytes 4-bit: "nf4" or "fp4"; compressed-tensors: the scheme
    method: str | None = None  # llm-compressor: "gptq" or "awq"
    group_size: int | None = None  # llm-compressor: input columns per weight scale


CT = "compressed-tensors"
LLMC = "llm-compressor"
GROUP_SIZE = 128  # the calibrated recipes' default; ``gptq-int4-g64`` sets another
CALIBRATED = re.compile(r"(gptq|awq)-int4(?:-g(\d+))?")
FP8W = "FP8_WEIGHT_ONLY"  # compressed.FP8_WEIGHTS

RECIPES: dict[str, Recipe] = {
    r.name: r
    for r in (
        Recipe("fp32", "torch", "float32", "float32 reference"),
        Recipe("bf16", "torch", "bfloat16", "bfloat16 weights and compute"),
        Recipe("fp16", "torch", "float16", "float16 weights and compute"),
        Recipe("bnb-int8", "bitsandbytes", "float32", "bitsandbytes LLM.int8()", 8),
        Recipe("bnb-nf4", "bitsandbytes", "float32", "bitsandbytes 4-bit NF4", 4, "nf4"),
        Recipe("bnb-fp4", "bitsandbytes", "float32", "bitsandbytes 4-bit FP4", 4, "fp4"),
        Recipe("rtn-int8", "rtn", "float32", "simulated per-channel round-to-nearest int8", 8),
        Recipe("rtn-int4", "rtn", "float32", "simulated per-channel round-to-nearest int4", 4),
        Recipe("fp8-e4m3", CT, "float32", "float8 e4m3 weights, per-channel scales (compressed-tensors)", 8, FP8W),
        Recipe(
            "fp8-e4m3-dyn",
            CT,
            "float32",
            "float8 e4m3 weights per channel, activations per token at run time (compressed-tensors FP8_DYNAMIC)",
            8,
            "FP8_DYNAMIC",
        ),
        Recipe(
            "int8-w8a8",
            CT,
            "float32",
            "int8 weights per channel, activations per token at run time (compressed-tensors W8A8)",
            8,
            "W8A8",
        ),
        Recipe(
            "gptq-int4",
            LLMC,
            "float32",
            "GPTQ int4, group 128 (llm-compressor; -g<N> for group N)",
            4,
            None,
            "gptq",
            128,
        ),
        Recipe(
            "awq-int4", LLMC, "float32", "AWQ int4, group 128 (llm-compressor; -g<N> for group N)", 4, None, "awq", 128
        ),
    )
}


def build_syntax() -> tuple[tuple[str, str], ...]:
    """What a build typed on the command line may be, ``(form, meaning)`` rows made from the recipe and
    KV-format tables: pytest's ``--help``, ``circuits --help`` and docs/options.md say it with these."""
    from .kv_formats import KV_FORMATS

    return (
        ("RECIPE", f"{', '.join(RECIPES)} (gptq-int4-gN, awq-int4-gN: group size N)"),
        ("NAME=PATH", "an external build: a .gguf file or a checkpoint folder, e.g. q8=dist/model-Q8_0.gguf"),
        (
            f"BUILD{KV_SEPARATOR}FORMAT[-dyn][-rN]",
            "the build served with a quantized KV cache, e.g. bf16+kv-fp8-e4m3, q8+kv-q4_0=FILE; FORMAT: "
            f"{', '.join(KV_FORMATS)}; -dyn: fp8 scales from each sequence; -rN: the last N tokens before each "
            "query read in full precision",
        ),
    )


def build_syntax_text() -> str:
    """`build_syntax` as one sentence, for an option's help."""
    return "a build is " + "; ".join(f"{form}: {meaning}" for form, meaning in build_syntax())


def get_recipe(name: str) -> Recipe:
    """The recipe called ``name``, or a one-line error listing the known ones."""
    recipe = RECIPES.get(name.strip())
    calibrated = CALIBRATED.fullmatch(name.strip())
    if recipe is None and calibrated and calibrated.group(2):
        base = RECIPES[f"{calibrated.group(1)}-int4"]
        if len(calibrated.group(2).lstrip("0")) > MAX_WINDOW_DIGITS:
            raise RecipeError(f"recipe {shown(name)}: the group size has {len(calibrated.group(2))} digits; e.g. -g64")
        group = int(calibrated.group(2))
        if group < 1:
            raise RecipeError(f"recipe {name!r}: the group size must be a positive number of columns, e.g. -g64")
        summary = base.summary.replace(f"group {GROUP_SIZE}", f"group {group}")
        recipe = Recipe(name.strip(), LLMC, "float32", summary, 4, None, base.method, group)
    if recipe is None:
        known = "; ".join(f"{r.name} ({r.summary})" for r in RECIPES.values())
        raise RecipeError(
            f"unknown build recipe {shown(name)}{_kv_hint(name) or did_you_mean(name, RECIPES)}; known recipes: {known}; "
            "or an external build NAME=PATH (a .gguf file or folder)"
        )
    return recipe


def _kv_hint(name: str) -> str:
    """``" (did you mean 'bf16+kv-q4_0'?)"`` for a cache written without its ``+`` (``bf16-kv-q4_0``), else ""."""
    base, sep, cache = name.strip().partition(KV_SEPARATOR.replace("+", "-"))
    if not sep or not (base in RECIPES or CALIBRATED.fullmatch(base)):
        return ""
    return f" (did you mean {base + KV_SEPARATOR + cache!r}? a KV cache follows {KV_SEPARATOR})"


BUILD_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._+]*(?:-[A-Za-z0-9._+]+)*")
"""An external build's NAME: it becomes a test id and a baseline file name, so letters, digits,
``.``, ``_``, ``+`` and single ``-`` (``--`` separates the model from the build in file names)."""


@dataclass(frozen=True)
class BuildSpec:
    """One build as typed: a recipe name (``bnb-nf4``) or an external build ``NAME=PATH``, either
    served with a KV-cache precision (``bf16+kv-fp8-e4m3``, `kv_formats`).

    ``name`` is the test id and the baseline file name; ``path`` (external builds only) is
    anything ``--circuits-model`` accepts: a .gguf file, a save_pretrained folder, a cache id.
    """

    name: str
    path: str | None = None
    kv: KvSpec | None = None

    @property
    def external(self) -> bool:
        return self.path is not None

    @property
    def weights(self) -> BuildSpec:
        """The same weights with the full-precision cache: what is loaded before the cache is applied."""
        if self.kv is None:
            return self
        return BuildSpec(self.name.partition(KV_SEPARATOR)[0], self.path)

    def __str__(self) -> str:
        return self.name if self.path is None else f"{self.name}={self.path}"


def parse_build_spec(text: str) -> BuildSpec:
    """``"bnb-nf4"`` or ``"q8=dist/model-Q8_0.gguf"`` -> a checked `BuildSpec` (one-line errors)."""
    text = text.strip()
    name, sep, path = text.partition("=")
    name, path = name.strip(), path.strip()
    base, kv = split_kv(name)
    if kv is not None:
        weights = parse_build_spec(f"{base}={path}" if sep else base)
        return BuildSpec(f"{weights.name}{KV_SEPARATOR}{kv.name}", weights.path, kv)
    if not sep:
        return BuildSpec(get_recipe(name).name)
    if not path:
        raise RecipeError(f"external build {text!r} names no path; write NAME=PATH, e.g. q8=dist/model-Q8_0.gguf")
    if name in RECIPES:
        raise RecipeError(
            f"external build {text!r}: {name!r} is a recipe name; call the file something else, e.g. {name}-file={path}"
        )
    if not BUILD_NAME.fullmatch(name):
        raise RecipeError(
            f"external build {text!r}: the name {name!r} must be file-name safe (letters, digits, '.', '_', '+', "
            "single '-'; starting with a letter or digit), e.g. q8=dist/model-Q8_0.gguf"
        )
    return BuildSpec(name, path)


def parse_build_specs(text: str | list[str] | list[BuildSpec]) -> list[BuildSpec]:
    """``"fp32, q8=model-Q8_0.gguf"`` -> checked `BuildSpec` s; a repeated recipe is dropped, a
    NAME used twice for different builds is refused."""
    items: list = text.split(",") if isinstance(text, str) else list(text)
    specs: dict[str, BuildSpec] = {}
    for item in items:
        if not str(item).strip():
            continue
        spec = item if isinstance(item, BuildSpec) else parse_build_spec(str(item))
        known = specs.get(spec.name)
        if known is not None and known != spec:
            raise RecipeError(
                f"build name {spec.name!r} is given twice ({known} and {spec}); give each build its own name"
            )
        specs[spec.name] = spec
    if not specs:
        raise RecipeError("no build recipe given; pass e.g. --circuits-builds fp32,bnb-int8")
    return list(specs.values())


def parse_builds(text: str | list[str]) -> list[str]:
    """``"fp32, bnb-int8, q8=model-Q8_0.gguf"`` -> the build names ``["fp32", "bnb-int8", "q8"]``."""
    return [spec.name for spec in parse_build_specs(text)]


def reference_spec(text: str, builds: list[BuildSpec]) -> BuildSpec:
    """The reference build: a recipe, ``NAME=PATH``, or the NAME of an external build in ``builds``."""
    text = text.strip()
    named = {spec.name: spec for spec in builds if spec.external}
    if "=" not in text and text in named:
        return named[text]
    spec = parse_build_spec(text)
    parse_build_specs([*builds, spec])  # the same NAME for another file: one line
    return spec


EXTERNAL_KEYS = ("source", "format", "sha256", "tensor_types", "quantization", "forward", "kv_cache", "engine")
"""What the build identity of an external build adds (record/schema.py `BuildInfo` types them);
``quantization`` and ``forward`` also on a recipe build of a quantized format, ``kv_cache`` on a
build served with a KV-cache precision; absent elsewhere."""


def describe_identity(build: dict) -> str | None:
    """``"external build q8 = model-Q8_0.gguf (gguf, sha256 1a2b3c4d5e6f, tensors Q8_0 x12, F32 x5)"``
    for an external build's identity (a record's ``build``); ``"build bf16+kv-q4_0 serves a KV cache:
    ..."`` for a recipe build with a KV cache; None for a recipe build."""
    cache = build.get("kv_cache")
    if not build.get("format"):
        return f"build {build.get('recipe')} serves a KV cache: {cache}" if cache else None
    types = build.get("tensor_types") or {}
    counts = ", ".join(f"{kind} x{n}" for kind, n in sorted(types.items(), key=lambda kv: (-kv[1], kv[0])))
    digest = str(build.get("sha256") or "?").removeprefix("sha256:")[:12]
    scheme = f"; {build['quantization']}" if build.get("quantization") else ""
    served = f"; KV cache {cache}" if cache else ""
    engine = f"; probe run by {build['engine'].partition(':')[0]}" if build.get("engine") else ""
    return (
        f"external build {build.get('recipe')} = {build.get('source')} "
        f"({build['format']}, sha256 {digest}, tensors {counts or '?'}{scheme}{served}{engine})"
    )
