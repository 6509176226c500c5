"""compressed-tensors: the checkpoint format llm-compressor writes and vLLM and transformers read.

A checkpoint's ``quantization_config`` names, per group of target modules, a scheme: its weights
(``int4``/``int8``/``float8``, strategy ``channel``/``group``/``tensor``, group size, symmetric or
not) and its input activations (``dynamic`` per ``token``: scales computed from each token's
``max|x|`` at run time). It stores, per quantized ``Linear``, the codes (``pack-quantized``: eight
int4 or four int8 codes per int32; ``int-quantized``: int8; ``float-quantized``: float8_e4m3fn)
and ``weight_scale`` (and ``weight_zero_point`` if asymmetric). The format defines
``W = (q - z) * s``, ``s`` broadcast over the row (channel), its group of ``group_size`` columns
or the whole tensor.

On a CPU neither vLLM's fused FP8/int8 kernels nor Marlin's int4 kernels exist. A build loads
the way transformers reads the checkpoint: compressed-tensors' own decompressor turns each layer's
codes into ``W`` once (float32; the per-head read is exactly this ``W``), and its forward is
compressed-tensors' own reference path: ``x -> Q(x)`` (the dynamic per-token fake quantization
it defines, where the scheme quantizes activations) then ``Q(x) W^T``: the dequantize-then-matmul
reference that the serving kernels approximate up to their accumulation order.

The recipes ``fp8-e4m3``, ``fp8-e4m3-dyn`` and ``int8-w8a8`` make such a build in memory: the
scheme applied by compressed-tensors, weight scales from each channel's min and max (the
``minmax`` observer llm-compressor uses for these schemes, no calibration data), compressed and
decompressed by compressed-tensors: what saving the checkpoint and loading it would give.
`write_checkpoint` saves one (tests write theirs with it at test time).
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from ..errors import RecipeError
from . import token_quant
from .hooks import hooked

FORMATS_EXTRA = 'pip install "pytest-circuits[formats]"'
PACKAGE = "compressed-tensors"
FP8_WEIGHTS = (
    "FP8_WEIGHT_ONLY"  # float8 per-channel weights, activations left in float (no preset of its own; recipes.FP8W)
)
IGNORED = ("lm_head",)  # llm-compressor's examples leave the unembedding dense; so do the recipes


def require(module: str, package: str, what: str) -> None:
    """Import ``module`` (of ``package``) or refuse ``what`` in one line naming the extra."""
    import importlib

    try:
        importlib.import_module(module)
    except ImportError:
        raise RecipeError(f"{what} needs {package}: {FORMATS_EXTRA}") from None


def require_compressed_tensors(what: str) -> None:
    """Import compressed-tensors or refuse ``what`` in one line naming the extra."""
    require("compressed_tensors", PACKAGE, what)


@contextmanager
def quiet() -> Iterator[None]:
    """compressed-tensors' own progress bars (applying, compressing, decompressing) off; ours stay."""
    import importlib

    from tqdm import tqdm

    def silent(*args, **kwargs):
        return tqdm(*args, **(kwargs | {"disable": True}))

    names = ("compressors.model_compressors.model_compressor", "quantization.lifecycle.apply", "offload.dispatch")
    modules: list[Any] = [importlib.import_module(f"compressed_tensors.{name}") for name in names]
    saved = [module.tqdm for module in modules]
    for module in modules:
        module.tqdm = silent
    try:
        yield
    finally:
        for module, bar in zip(modules, saved):
            module.tqdm = bar


def is_compressed_tensors(quant: dict | None) -> bool:
    """True for a ``quantization_config`` written by compressed-tensors."""
    return bool(quant) and str(quant.get("quant_method")) == "compressed-tensors"  # type: ignore[union-attr]


# ---------------------------------------------------------------- what the checkpoint says


def describe_args(args: dict | None) -> str:
    """``"int4 group 128 symmetric"``, ``"float8 token dynamic"``: one quantizer's arguments."""
    if not args:
        return "none"
    kind = "float" if args.get("type") == "float" else "int"
    strategy = str(args.get("strategy") or "tensor")
    words = [f"{kind}{args.get('num_bits')}", strategy]
    if strategy in ("group", "tensor_group") and args.get("group_size"):
        words.append(str(args["group_size"]))
    words.append("symmetric" if args.get("symmetric", True) else "asymmetric")
    if args.get("scale_dtype"):  # NVFP4: float8 group scales under one float32 global scale
        words.append(f"{str(args['scale_dtype']).removeprefix('torch.')} scales")
    dynamic = args.get("dynamic")
    if dynamic not in (None, False, "false"):
        words.append("dynamic" if dynamic in (True, "true") else f"dynamic-{dynamic}")
    return " ".join(words)


def describe_scheme(quant: dict) -> str:
    """The checkpoint's scheme from its ``quantization_config``, one group after another:
    ``"pack-quantized [Linear]: weights int4 group 128 symmetric, input none; ignore lm_head"``."""
    groups = []
    for group in (quant.get("config_groups") or {}).values():
        fmt = group.get("format") or quant.get("format") or "?"
        targets = ",".join(group.get("targets") or [])
        weights, inputs = describe_args(group.get("weights")), describe_args(group.get("input_activations"))
        groups.append(f"{fmt} [{targets}]: weights {weights}, input {inputs}")
    ignore = ",".join(quant.get("ignore") or []) or "none"
    return "; ".join([*groups, f"ignore {ignore}"])


# ---------------------------------------------------------------- the loaded model


def _pattern(name: str) -> str:
    return re.sub(r"\.\d+\.", ".*.", name)


def module_split(model: torch.nn.Module) -> tuple[Counter, Counter]:
    """``(quantized, dense)``: the model's ``Linear`` layers with a compressed-tensors scheme and
    those without, counted per name pattern (``model.layers.*.self_attn.q_proj``)."""
    quantized: Counter = Counter()
    dense: Counter = Counter()
    for name, module in model.named_modules():
        if not isinstance(module, torch.nn.Linear):
            continue
        scheme = getattr(module, "quantization_scheme", None)
        (quantized if scheme is not None and scheme.weights is not None else dense)[_pattern(name)] += 1
    return quantized, dense


def quantizes_activations(model: torch.nn.Module) -> bool:
    """True where some layer fake-quantizes its input at run time."""
    return any(_input_args(m) is not None for m in model.modules())


def describe_modules(model: torch.nn.Module) -> str:
    """``"quantized 14 Linear (q_proj x2, ...); dense: lm_head"``."""
    quantized, dense = module_split(model)
    short = ", ".join(f"{p.rsplit('.', 1)[-1]} x{n}" for p, n in sorted(quantized.items()))
    return f"quantized {sum(quantized.values())} Linear ({short}); dense: {', '.join(sorted(dense)) or 'none'}"


def forward_path(model: torch.nn.Module) -> str:
    """Which forward the build runs: on a CPU compressed-tensors' reference, its per-token input
    quantization fused and, for int8 codes, the product in int32 (`token_quant`; no vLLM kernel runs here)."""
    inputs = next((a for a in map(_input_args, model.modules()) if a is not None), None)
    acts = ""
    if inputs is not None and inputs.strategy == "tensor_group":  # NVFP4
        acts = f"input fake-quantized per {inputs.group_size} values at run time (float8 scales, static global scale), "
    elif inputs is not None:
        acts = "input fake-quantized per token at run time, "
    nvfp4 = any(getattr(w, "strategy", None) == "tensor_group" for w in map(_weight_args, model.modules()))
    weights = "to bfloat16 (its NVFP4 decompressor's dtype), held as float32" if nvfp4 else "to float32"
    product = "a float32 matmul"  # the float8 fast forward is this one, fused: its arithmetic is the reference's
    if "Int8Linear" in token_quant.installed(model):
        acts = "input quantized per token to int8 at run time, "
        product = "an int8 x int8 -> int32 matmul (torch._int_mm, exact) scaled in float32"
    return (
        "compressed-tensors reference on "
        f"{next(model.parameters()).device.type}: weights decompressed once {weights} by compressed-tensors, "
        f"{acts}then {product} (vLLM's fused kernels are not used)"
    )


def decompress(model: torch.nn.Module) -> torch.nn.Module:
    """Decompress a compressed-tensors model in place with its own decompressor (what its first
    forward would do), so every read sees ``W = (q - z) * s``."""
    from compressed_tensors.compressors import ModelCompressor

    quantizer: Any = getattr(model, "hf_quantizer", None)
    compressor = getattr(quantizer, "compressor", None)
    if compressor is None:
        compressor = ModelCompressor.from_pretrained_model(model)
    with quiet():
        compressor.decompress_model(model)
    token_quant.install(model)
    embedding: Any = model.get_input_embeddings()  # type: ignore[operator]
    dtype = embedding.weight.dtype
    module: Any
    for module in model.modules():  # NVFP4's decompressor returns W in bfloat16; the forward needs one dtype
        if getattr(module, "quantization_scheme", None) is not None and module.weight.dtype != dtype:
            module.weight.data = module.weight.data.to(dtype)
    return model


def identity_fields(model: torch.nn.Module, quant: dict) -> dict[str, str]:
    """The identity a compressed-tensors build adds: its scheme and modules, and its forward."""
    return {
        "quantization": f"{describe_scheme(quant)}; {describe_modules(model)}",
        "forward": forward_path(model),
    }


# ---------------------------------------------------------------- the dynamic activation quantizer


def _input_args(module: torch.nn.Module):
    scheme = getattr(module, "quantization_scheme", None)
    return None if scheme is None else scheme.input_activations


def _weight_args(module: torch.nn.Module):
    scheme = getattr(module, "quantization_scheme", None)
    return None if scheme is None else scheme.weights


class ActivationQuant:
    """A compressed-tensors layer's input quantizer, for the self-check (`selfcheck._head_sum`):
    the same ``split``/``output`` a bitsandbytes `llm_int8.Int8Layer` offers."""

    def __init__(self, module: torch.nn.Module):
        self.module = module
        self.args = _input_args(module)
        self.dtype = module.weight.dtype if isinstance(module.weight, torch.Tensor) else torch.float32

    def split(self, x: torch.Tensor) -> tuple[torch.Tensor, None]:
        """``(Q(x), None)`` in float64: ``x`` in the layer's dtype, fake-quantized as the layer does."""
        from compressed_tensors.quantization.lifecycle.forward import forward_quantize

        return forward_quantize(self.module, x.to(self.dtype), "input", self.args).double(), None

    def output(self, product: torch.Tensor, outlier: None, bias: torch.Tensor | None, dtype: torch.dtype):
        """``Q(x) W^T + b`` rounded to the layer's output dtype, back in float64."""
        out = product if bias is None else product + bias.double().to(product.device)
        return out.to(dtype).double()


def activation_quant(module: torch.nn.Module) -> ActivationQuant | None:
    """The input quantizer of a compressed-tensors layer that quantizes its input, else None."""
    return ActivationQuant(module) if _input_args(module) is not None else None


# ---------------------------------------------------------------- recipes and test checkpoints


def scheme_for(name: str, group_size: int | None = None):
    """The compressed-tensors `QuantizationScheme` a recipe or test names: a preset (``W4A16``,
    ``W8A16``, ``W8A8``, ``FP8_DYNAMIC``) or `FP8_WEIGHTS`; ``group_size`` for a group strategy."""
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme, preset_name_to_scheme

    if name == FP8_WEIGHTS:
        weights = QuantizationArgs(num_bits=8, type="float", strategy="channel", symmetric=True, dynamic=False)
        scheme = QuantizationScheme(targets=["Linear"], weights=weights)
    else:
        scheme = preset_name_to_scheme(name, ["Linear"])
    if group_size is not None:
        if scheme.weights is None or scheme.weights.strategy != "group":
            raise RecipeError(f"scheme {name}: a group size needs group-wise weight scales (e.g. W4A16)")
        scheme.weights.group_size = group_size
    return scheme


FUSED = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))  # vLLM runs each set as one GEMM


def fused_global_weights(model: torch.nn.Module) -> dict[torch.nn.Module, torch.Tensor]:
    """Per NVFP4 layer of a set vLLM fuses (`FUSED`), the weights of the whole set: the set shares
    one global scale, from their joint max, as llm-compressor writes it."""
    out: dict[torch.nn.Module, torch.Tensor] = {}
    for parent in model.modules():
        for names in FUSED:
            layers = [getattr(parent, name, None) for name in names]
            args = [getattr(getattr(m, "quantization_scheme", None), "weights", None) for m in layers]
            if all(a is not None and a.strategy == "tensor_group" for a in args):
                joint = torch.cat([m.weight.detach().flatten() for m in layers])  # type: ignore[union-attr]
                out.update({m: joint for m in layers})  # type: ignore[misc]
    return out


@torch.no_grad()
def input_ranges(model: torch.nn.Module, ids: torch.Tensor) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """``(min, max)`` of each ``Linear``'s input over the float model's forward on ``ids``."""
    ranges: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}

    def hook(name):
        def record(module, inputs):
            x = inputs[0].detach()
            low, high = ranges.get(name, (x.amin(), x.amax()))
            ranges[name] = (torch.minimum(low, x.amin()), torch.maximum(high, x.amax()))

        return record

    with hooked(*[(m, "pre", hook(n)) for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]):
        for row in ids:
            model(input_ids=row[None], use_cache=False)
    return ranges


@torch.no_grad()
def quantize_(
    model: torch.nn.Module, scheme, ignore: tuple[str, ...] = IGNORED, calibration: torch.Tensor | None = None
):
    """Apply ``scheme`` to every ``Linear`` but ``ignore`` with min-max weight scales and compress
    the model in memory (compressed-tensors' own compressors); returns the `ModelCompressor`.
    A scheme with a static input scale (NVFP4's global one) takes it from the min and max of
    each layer's input on the float model's forward over ``calibration`` (token ids, ``(n, L)``)."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (
        QuantizationConfig,
        QuantizationStatus,
        apply_quantization_config,
    )
    from compressed_tensors.quantization.utils import calculate_qparams, generate_gparam

    static_input = scheme.input_activations is not None and scheme.input_activations.dynamic is not True
    if static_input and calibration is None:
        raise RecipeError("a scheme with a static input scale (NVFP4) needs calibration token ids")
    ranges = input_ranges(model, calibration) if static_input and calibration is not None else {}
    with quiet():
        apply_quantization_config(model, QuantizationConfig(config_groups={"group_0": scheme}, ignore=list(ignore)))
    for name, module in model.named_modules():
        if name in ranges and hasattr(module, "input_global_scale"):
            module.input_global_scale.data.copy_(generate_gparam(*ranges[name]))
    fused_weights = fused_global_weights(model)
    layer: Any  # a compressed-tensors layer: its qparams are attributes torch types Tensor | Module
    for layer in model.modules():
        args = getattr(getattr(layer, "quantization_scheme", None), "weights", None)
        if args is None:
            continue
        w = layer.weight.detach()
        if args.strategy in ("group", "tensor_group"):  # a last group narrower than group_size where it does not divide
            groups = w.split(args.group_size, dim=1)
            low, high = torch.stack([g.amin(1) for g in groups], 1), torch.stack([g.amax(1) for g in groups], 1)
        elif args.strategy == "channel":
            low, high = w.amin(-1, keepdim=True), w.amax(-1, keepdim=True)
        else:
            low, high = w.amin().reshape(1), w.amax().reshape(1)
        global_scale = None
        if args.strategy == "tensor_group":  # NVFP4: float8 group scales under one global scale
            fused = fused_weights.get(layer, w)
            global_scale = generate_gparam(fused.amin(), fused.amax())
            layer.weight_global_scale.data.copy_(global_scale)
        scale, zero_point = calculate_qparams(low, high, args, global_scale=global_scale)
        layer.weight_scale.data.copy_(scale.reshape(layer.weight_scale.shape))
        if hasattr(layer, "weight_zero_point"):
            layer.weight_zero_point.data.copy_(zero_point.reshape(layer.weight_zero_point.shape))
        layer.quantization_status = QuantizationStatus.FROZEN
    compressor = ModelCompressor.from_pretrained_model(model)
    with quiet():
        compressor.compress_model(model)
    return compressor


def scheme_config(model: torch.nn.Module) -> dict:
    """The ``quantization_config`` a checkpoint of this in-memory quantized model would carry."""
    from compressed_tensors.quantization import QuantizationConfig

    config = QuantizationConfig.from_pretrained(model)
    return {} if config is None else config.model_dump(mode="json")


def quantize_in_memory_(model: torch.nn.Module, scheme_name: str, group_size: int | None = None) -> torch.nn.Module:
    """A recipe build: `quantize_` then decompress, as loading the saved checkpoint would."""
    compressor = quantize_(model, scheme_for(scheme_name, group_size))
    with quiet():
        compressor.decompress_model(model)
    token_quant.install(model)
    return model


def write_checkpoint(
    folder: Path | str,
    out: Path | str,
    scheme_name: str,
    group_size: int | None = None,
    calibration: torch.Tensor | None = None,
) -> Path:
    """Write the float32 model in ``folder`` as a compressed-tensors checkpoint at ``out``
    (safetensors, config.json with its ``quantization_config``, the tokenizer files);
    ``calibration``: token ids for a static input scale (`quantize_`)."""
    import shutil

    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, local_files_only=True)
    compressor = quantize_(model, scheme_for(scheme_name, group_size), calibration=calibration)
    out = Path(out)
    model.save_pretrained(out)
    compressor.update_config(str(out))
    for file in Path(folder).iterdir():
        if file.name.startswith(("tokenizer", "special_tokens", "vocab", "merges")) and not (out / file.name).exists():
            shutil.copy(file, out / file.name)
    return out
