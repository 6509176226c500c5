"""The self-checking weight read: the per-head decomposition must reproduce the attention output.

On one short forward (``n_tokens`` seeded ids, one sequence) hooks capture, per layer, the
attention module's input ``X`` (already through the pre-attention norm), the pattern ``A_h``
it used (eager attention returns it) and its output ``Y``. From the weights as
`weights.layer_weights` reads them, unfolded, the check recomputes

    Y_hat = sum_h A_h (X W_V^{g(h)} + b_V^{g(h)}) W_O^h + b_O  (+ the residual, where the
    family's attention module adds it: BLOOM)

in float64 and compares ``||Y_hat - Y|| / ||Y||`` (Frobenius, per layer) with a tolerance set
by the build's compute dtype. It also checks the norm scales the fold uses: the pre-attention
norm's output against ``(r - mean r) / sqrt(var r + eps) * g + b`` (LayerNorm) or
``r / sqrt(mean r^2 + eps) * g`` (RMSNorm), ``g = offset + w``, and likewise a norm on the
attention output (sandwich norm). On a mismatch it refuses with one line naming the model
type, the first layer that disagrees and the error; no figure is computed from a read that
may be wrong.

Tolerances (relative, Frobenius), from what each compute path guarantees:
- float32: the module and the float64 recomputation differ by float32 rounding of sums of
  ``d_model`` or ``T`` products, about 1e-6 relative; 1e-4 leaves two orders of margin.
  With TF32 matmuls enabled on CUDA (10-bit mantissa inputs) the module's error is about
  1e-3: 5e-3 then.
- float16 (unit roundoff 2^-11 = 4.9e-4): the module rounds V, A, z and the projection
  output, each about 5e-4 relative; 1e-2 covers their accumulation.
- bfloat16 (unit roundoff 2^-8 = 3.9e-3): the same four roundings, about 1e-2 in the worst
  case; 3e-2.
- LLM.int8() (bitsandbytes 8-bit) also quantizes each input row of a layer to int8 (step
  max|x|/127 over the non-outlier entries; columns holding an ``|x| >= threshold`` stay exact),
  which alone moves SmolLM2-135M's attention output by up to 0.28 relative. So, where the V
  (fused QKV) or output projection is int8, the recomputation feeds it what it really
  multiplies and rounds the product as it does (`llm_int8.Int8Layer`, with the layer's own
  ``state.threshold``): X, and the concatenated head outputs z, cast to float16 and quantized
  row by row with the same codes and outlier columns; bitsandbytes' dequantization constant;
  float16 output on CUDA. On a CPU this leaves float32 rounding (SmolLM2: 8e-8; without the
  constant, 1.8e-5 high, z's float16 values move and 4-15 codes per layer flip: 1.7e-3). On CUDA the
  V and output products are float16-rounded (4.9e-4 each) and where our float64 V and the
  module's float32 V round to neighbouring float16 values, z and then a code of o_proj's input
  can differ by one step, ``max|z_i| / 127`` in one entry: float16's 1e-2, or the compute
  dtype's where that is looser. A compressed-tensors layer with dynamic per-token input
  quantization (FP8 or int8 W8A8, `compressed.ActivationQuant`), or torchao's int8 one
  (`serialized.TorchaoActivationQuant`), is recomputed the same way, with
  its own quantizer, under the same 1e-2. 4-bit bitsandbytes and RTN layers compute with
  exactly the dequantized weights the read returns, so their compute dtype decides; on a CPU
  with AVX512-BF16, bitsandbytes computes 4-bit matmuls in bfloat16 (`dense.bnb_4bit_compute_dtype`).
A wrong read (wrong Q/K/V layout, swapped heads, a missed bias or residual) leaves an error
of order 1, far above every tolerance.
"""

from __future__ import annotations

import inspect
import math
from dataclasses import dataclass, field
from typing import Any

import torch

from ..errors import CircuitsError
from .compressed import quantizes_activations
from .dense import bnb_4bit_compute_dtype, bnb_kind
from .families import (
    Family,
    attn_norm_module,
    family_of,
    geometry_of,
    get_module,
    modules_at,
    post_attn_norm_module,
)
from .llm_int8 import Int8Layer, int8_layer
from .serialized import torchao_activation_quant
from .weights import _layer_weights

TOLERANCES = {torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 3e-2}
TF32_TOLERANCE = 5e-3
INT8_TOLERANCE = TOLERANCES[torch.float16]
N_TOKENS = 16


class DecompositionError(CircuitsError):
    """The per-head read does not reproduce the model's own attention output."""


@dataclass
class DecompositionCheck:
    """Per-layer relative errors of the per-head decomposition (and of the norm scales the fold uses)."""

    model_type: str
    layout: str
    dtype: str
    tolerance: float
    errors: list[float]  # attention output, per layer
    norm_errors: list[float] = field(default_factory=list)  # pre-attention norm, per layer (where there is one)
    post_norm_errors: list[float] = field(default_factory=list)  # sandwich norm, per layer

    @property
    def worst(self) -> float:
        return max([*self.errors, *self.norm_errors, *self.post_norm_errors], default=0.0)

    @property
    def ok(self) -> bool:
        return self.worst <= self.tolerance


def tolerance_for(model, dtype: torch.dtype) -> float:
    """The relative tolerance of the check for a model computing in ``dtype`` (see the module docstring)."""
    kinds = {bnb_kind(m) for m in model.modules()}
    on_cuda = any(p.is_cuda for p in model.parameters())
    if "4bit" in kinds:
        dtype = bnb_4bit_compute_dtype(dtype, torch.device("cuda" if on_cuda else "cpu"))
    tol = TOLERANCES.get(dtype, TOLERANCES[torch.bfloat16])
    if dtype == torch.float32 and on_cuda and torch.backends.cuda.matmul.allow_tf32:
        tol = TF32_TOLERANCE
    if "int8" in kinds:  # its activation quantization is recomputed: float16's rounding is left
        tol = max(tol, INT8_TOLERANCE)
    if quantizes_activations(model) or any(
        map(torchao_activation_quant, model.modules())
    ):  # likewise; a code of o_proj's input may flip on z's float64 rounding
        tol = max(tol, INT8_TOLERANCE)
    return tol


def _bound(module, args, kwargs) -> dict:
    try:
        bound = inspect.signature(module.forward).bind_partial(*args, **kwargs)
        return dict(bound.arguments)
    except TypeError:
        return {"hidden_states": args[0] if args else kwargs.get("hidden_states")}


def _first_tensor(args, kwargs) -> torch.Tensor:
    if args and torch.is_tensor(args[0]):
        return args[0]
    for value in kwargs.values():
        if torch.is_tensor(value):
            return value
    raise DecompositionError("self-check: a hooked module got no tensor input")


def _model_of(build_or_model) -> torch.nn.Module:
    """The CausalLM of a `LoadedBuild`, or the model itself (a CausalLM has its own ``.model``: not that)."""
    return build_or_model if isinstance(build_or_model, torch.nn.Module) else build_or_model.model


def _probe_ids(build_or_model, n_tokens: int, seed: int) -> torch.Tensor:
    model = _model_of(build_or_model)
    generator = torch.Generator().manual_seed(seed)
    tokens = None if isinstance(build_or_model, torch.nn.Module) else getattr(build_or_model, "tokens", None)
    if tokens is not None:
        ordinary = torch.as_tensor(tokens.ordinary_ids())
        if ordinary.numel():
            return ordinary[torch.randint(0, ordinary.numel(), (1, n_tokens), generator=generator)]
    config: Any = model.config  # the transformers config (torch types a module attribute Tensor | Module)
    return torch.randint(0, config.vocab_size, (1, n_tokens), generator=generator)


def _eps(module, fam: Family) -> float:
    for name in ("eps", "variance_epsilon", "epsilon"):
        value = getattr(module, name, None)
        if isinstance(value, (int, float)):
            return float(value)
    return fam.norm_eps or 0.0


def _norm_error(module, fam: Family, scale: torch.Tensor, r: torch.Tensor, out: torch.Tensor) -> float:
    """Relative error of ``norm(r)`` recomputed from the scale ``g`` the fold uses."""
    r, kind, eps = r.double(), fam.norm_kind, _eps(module, fam)
    if kind == "layernorm":
        centred = r - r.mean(dim=-1, keepdim=True)
        expected = centred / (centred.pow(2).mean(dim=-1, keepdim=True) + eps).sqrt()
    else:
        expected = r / (r.pow(2).mean(dim=-1, keepdim=True) + eps).sqrt()
    expected = expected * scale.to(r.device).double()
    bias = getattr(module, "bias", None)
    if kind == "layernorm" and bias is not None:
        expected = expected + bias.detach().double()
    return _relative(expected, out)


def _relative(expected: torch.Tensor, actual: torch.Tensor) -> float:
    actual = actual.double()
    denom = actual.norm().clamp_min(1e-30)
    return float((expected.to(actual.device) - actual).norm() / denom)


def _head_sum(
    lw, geo, x: torch.Tensor, pattern: torch.Tensor, v_int8: Int8Layer | None = None, o_int8: Int8Layer | None = None
) -> torch.Tensor:
    """``sum_h A_h (X W_V^{g(h)} + b_V) W_O^h + b_O`` in float64: ``(batch, T, d_model)``.

    ``v_int8`` / ``o_int8``: the V (or fused QKV) / output projection is LLM.int8(). ``X``, and
    the heads' outputs ``z = [z_0 | ... | z_{H-1}]`` concatenated per token, are then split into
    what the layer quantizes and its exact outlier columns, and the products are rounded as the
    layer rounds them (`llm_int8.Int8Layer`).
    """
    device, dtype = x.device, x.dtype
    W_V, W_O = lw.W_V.double().to(device), lw.W_O.double().to(device)
    b_V = None if lw.b_V is None else lw.b_V.double().to(device)[None, :, None, :]
    b_O = None if lw.b_O is None else lw.b_O.double().to(device)
    if v_int8 is None:
        values = torch.einsum("btd,gde->bgte", x.double(), W_V)  # per K/V group
        values = values if b_V is None else values + b_V
    else:
        quantized, outlier = v_int8.split(x)
        values = v_int8.output(
            torch.einsum("btd,gde->bgte", quantized, W_V),
            None if outlier is None else torch.einsum("btd,gde->bgte", outlier, W_V),
            b_V,
            dtype,
        )
    values = values.repeat_interleave(geo.group_size, dim=1)  # query head h reads group h // group_size
    z = torch.einsum("bhts,bhse->bhte", pattern.double().to(device), values)
    if o_int8 is None:
        out = torch.einsum("bhte,hed->btd", z, W_O)
        return out if b_O is None else out + b_O
    batch, heads, tokens, d_head = z.shape
    concatenated = z.transpose(1, 2).reshape(batch, tokens, heads * d_head)  # o_proj's input, head-major

    def per_head(part: torch.Tensor) -> torch.Tensor:
        return torch.einsum("bthe,hed->btd", part.reshape(batch, tokens, heads, d_head), W_O)

    quantized, outlier = o_int8.split(concatenated)
    return o_int8.output(per_head(quantized), None if outlier is None else per_head(outlier), b_O, dtype)


@torch.no_grad()
def measure_decomposition(
    build_or_model, *, n_tokens: int = N_TOKENS, seed: int = 0, family: Family | None = None
) -> DecompositionCheck:
    """Run the probe forward and return every layer's error (no refusal; see `check_decomposition`)."""
    model = _model_of(build_or_model)
    fam = family or family_of(model)
    geo = geometry_of(model) if family is None else _geometry(model, fam)
    blocks = modules_at(model, fam.layers)
    captured: list[dict] = [{} for _ in blocks]
    handles = []

    def attn_pre(layer):
        def hook(module, args, kwargs):
            if "x" not in captured[layer]:
                named = _bound(module, args, kwargs)
                captured[layer]["x"] = named.get("hidden_states", _first_tensor(args, kwargs))
                if fam.attn_adds_residual:
                    captured[layer]["residual"] = named.get(fam.attn_adds_residual)

        return hook

    def attn_post(layer):
        def hook(module, args, kwargs, output):
            if "y" not in captured[layer]:
                captured[layer]["y"] = output[0] if isinstance(output, (tuple, list)) else output
                pattern = output[1] if isinstance(output, (tuple, list)) and len(output) > 1 else None
                captured[layer]["pattern"] = pattern

        return hook

    def norm_io(layer, key):
        def hook(module, args, kwargs, output):
            if key not in captured[layer]:
                captured[layer][key] = (_first_tensor(args, kwargs), output)

        return hook

    for layer, block in enumerate(blocks):
        attn = get_module(block, fam.attn)
        handles.append(attn.register_forward_pre_hook(attn_pre(layer), with_kwargs=True))
        handles.append(attn.register_forward_hook(attn_post(layer), with_kwargs=True))
        for key, norm in (("pre", attn_norm_module(block, fam)), ("post", post_attn_norm_module(block, fam))):
            if norm is not None:
                handles.append(norm.register_forward_hook(norm_io(layer, key), with_kwargs=True))
    causal_lm: Any = model  # its transformers methods (get_input_embeddings) are not on torch.nn.Module
    ids = _probe_ids(build_or_model, n_tokens, seed).to(causal_lm.get_input_embeddings().weight.device)
    extra = {"logits_to_keep": 1} if "logits_to_keep" in inspect.signature(model.forward).parameters else {}
    try:
        model(input_ids=ids, use_cache=False, **extra)  # logits of one position: the check needs none
    finally:
        for handle in handles:
            handle.remove()
    dtype = captured[0]["x"].dtype if captured and "x" in captured[0] else torch.float32
    check = DecompositionCheck(
        model_type=str(getattr(model.config, "model_type", "?")),
        layout=fam.name,
        dtype=str(dtype).removeprefix("torch."),
        tolerance=tolerance_for(model, dtype),
        errors=[],
    )
    for layer, block in enumerate(blocks):
        seen = captured[layer]
        if "y" not in seen:
            raise DecompositionError(
                f"{check.model_type}: the attention of layer {layer} never ran in the self-check forward; "
                "is this a decoder-only LM?"
            )
        if seen["pattern"] is None:
            raise DecompositionError(
                f"{check.model_type}: layer {layer}'s attention returned no weights; load the model with "
                "attn_implementation='eager' (load_build does)"
            )
        x = seen["x"]
        lw = _layer_weights(block, fam, geo, False, model.config, x.device, qk=False)
        attn = get_module(block, fam.attn)
        v_proj = get_module(attn, fam.qkv[-1])  # the module that computes V (the fused QKV, or v_proj)
        o_proj = get_module(attn, fam.out_proj)
        expected = _head_sum(lw, geo, x, seen["pattern"], _input_quant(v_proj), _input_quant(o_proj))
        if fam.attn_adds_residual:
            expected = expected + seen["residual"].double()
        check.errors.append(_relative(expected, seen["y"]))
        if "pre" in seen:
            norm_in, norm_out = seen["pre"]
            # the norm must be what the attention reads (a post-norm model has its "ln_1" after it) ...
            feeds = _relative(norm_out.double(), x)
            # ... and must scale by the g the fold uses
            check.norm_errors.append(
                max(feeds, _norm_error(attn_norm_module(block, fam), fam, lw.norm_scale, norm_in, norm_out))
            )
        elif fam.attn_norm is not None:
            raise DecompositionError(
                f"{check.model_type}: the pre-attention norm of layer {layer} did not run in the self-check forward; "
                "the family entry names the wrong module"
            )
        if "post" in seen:
            post = post_attn_norm_module(block, fam)
            assert lw.post_norm_scale is not None, "a hooked post-attention norm has a scale in the read"
            check.post_norm_errors.append(_norm_error(post, fam, lw.post_norm_scale, *seen["post"]))
    return check


def _input_quant(module):
    """What quantizes a projection's input: LLM.int8(), or a compressed-tensors or torchao dynamic quantizer."""
    from .compressed import activation_quant
    from .serialized import torchao_activation_quant

    return int8_layer(module) or activation_quant(module) or torchao_activation_quant(module)


def _geometry(model, fam: Family):
    from .families import geometry_for

    return geometry_for(model.config, fam)


def check_decomposition(
    build_or_model, *, n_tokens: int = N_TOKENS, seed: int = 0, family: Family | None = None
) -> DecompositionCheck:
    """`measure_decomposition`, then refuse with one line if any layer's error exceeds the tolerance.

    ``build_or_model``: a `LoadedBuild` (its ordinary token ids are used) or a CausalLM.
    ``family``: check this family's read instead of the model's own (tests corrupt it).
    """
    check = measure_decomposition(build_or_model, n_tokens=n_tokens, seed=seed, family=family)
    for what, errors in (
        ("attention output", check.errors),
        ("pre-attention norm", check.norm_errors),
        ("post-attention norm", check.post_norm_errors),
    ):
        bad = [(layer, err) for layer, err in enumerate(errors) if not err <= check.tolerance]
        if bad:
            layer, err = bad[0]
            if not math.isfinite(err):
                raise DecompositionError(
                    f"model type {check.model_type!r} ({check.dtype}): the {what} of layer {layer} is not finite in a "
                    f"{n_tokens}-token forward; the build overflows (use a dtype with more range: bf16 or fp32)"
                )
            raise DecompositionError(
                f"model type {check.model_type!r} ({check.layout} layout, {check.dtype}): the per-head weight read does "
                f"not reproduce the {what} of layer {layer} (relative error {err:.2g} > {check.tolerance:g}); "
                "refusing to report figures from weights that may be read wrong (fix its entry in "
                "pytest_circuits/model/families.py)"
            )
    return check
