"""The self-checking weight read: the per-head decomposition must reproduce the attention output.

On one short forward (``n_tokens`` seeded ids, one sequence) hooks capture, per layer, the
attention module's input ``X`` (already through the pre-attention norm), the pattern ``A_h``
it used (eager attention returns it) and its output ``Y``. From the weights as
`weights.layer_weights` reads them, unfolded, the check recomputes

    Y_hat = sum_h A_h (X W_V^{g(h)} + b_V^{g(h)}) W_O^h + b_O  (+ the residual, where the
    family's attention module adds it: BLOOM)

(latent attention: ``v_h = norm_c(X W_DKV) W_UV^h``, the latent norm recomputed with the ``g_c``
and ``eps`` the read folds, `latent.py`)

in float64 and compares ``||Y_hat - Y|| / ||Y||`` (Frobenius, per layer) with a tolerance set
by the build's compute dtype. It also checks the norm scales the fold uses: the pre-attention
norm's output against ``(r - mean r) / sqrt(var r + eps) * g + b`` (LayerNorm) or
``r / sqrt(mean r^2 + eps) * g`` (RMSNorm), ``g = offset + w``, and likewise a norm on the
attention output (sandwich norm), and what the attention sublayer adds to the residual stream,
``resid_mid - resid_pre``, read back from a sum the model rounded in its dtype: that rounding
(``u ||resid_mid||``, ``u`` the unit roundoff) is allowed on top of the tolerance, since in
bfloat16 it alone reaches 0.18 of a small write (`_relative_after_add`). On a mismatch it refuses with one line naming the model
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

from ..errors import CircuitsError, first_line
from .compressed import activation_quant, quantizes_activations
from .dense import bnb_4bit_compute_dtype, bnb_kind, dense_bias, dense_weight, weight_of
from .families import (
    Family,
    attn_norm_module,
    family_of,
    final_norm_module,
    geometry_of,
    get_module,
    logit_factor_of,
    post_attn_norm_module,
)
from .family_table import ADD_FAMILY
from .hooks import Hook, hooked
from .llm_int8 import Int8Layer, int8_layer
from .serialized import torchao_activation_quant
from .unembedding import row_major_unembedding
from .weights import attention_blocks_of, block_weights, embedding_matrix, norm_scale

TOLERANCES = {torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 3e-2}
TF32_TOLERANCE = 5e-3
INT8_TOLERANCE = TOLERANCES[torch.float16]
N_TOKENS = 16
PER_LAYER = ("attention output", "pre-attention norm", "residual write (resid_mid - resid_pre)")
TAIL_TOKENS = 4  # per sequence, two sequences: the embedding and tail check


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
    norm_errors: list[float] = field(default_factory=list)  # pre-attention norm (or raw residual), per layer
    write_errors: list[float] = field(default_factory=list)  # resid_mid - resid_pre, per layer
    embed_error: float = 0.0  # W_E rows against the residual the model starts from
    logit_error: float = 0.0  # the tail: final norm, W_U, logit factor, soft cap

    @property
    def worst(self) -> float:
        return max([*self.errors, *self.norm_errors, *self.write_errors, self.embed_error, self.logit_error])

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


def centred(fam: Family, r: torch.Tensor) -> torch.Tensor:
    """``r C``: ``r`` less its mean over the last axis for LayerNorm families, ``r`` for RMSNorm."""
    return r - r.mean(dim=-1, keepdim=True) if fam.norm_kind == "layernorm" else r


def norm_divisor(module, fam: Family, r: torch.Tensor) -> torch.Tensor:
    """The positive factor a norm divides each position of ``r`` by: ``sqrt(mean (r C)^2 + eps)``
    (float64, last axis kept as 1)."""
    return (centred(fam, r.double()).pow(2).mean(dim=-1, keepdim=True) + _eps(module, fam)).sqrt()


def _normalize(module, fam: Family, r: torch.Tensor) -> torch.Tensor:
    """``(r - mean r) / sqrt(var r + eps)`` (LayerNorm) or ``r / sqrt(mean r^2 + eps)`` (RMSNorm), float64."""
    return centred(fam, r.double()) / norm_divisor(module, fam, r)


def _apply_norm(module, fam: Family, scale: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
    """The norm as the read assumes it: normalised, times ``g`` (the fold's scale), plus a LayerNorm's bias."""
    out = _normalize(module, fam, r) * scale.to(r.device).double()
    bias = getattr(module, "bias", None)
    if fam.norm_kind == "layernorm" and bias is not None:
        out = out + bias.detach().double().to(r.device)
    return out


def _norm_error(module, fam: Family, scale: torch.Tensor, r: torch.Tensor, out: torch.Tensor) -> float:
    """Relative error of ``norm(r)`` recomputed from the scale ``g`` the fold uses."""
    return _relative(_apply_norm(module, fam, scale, r), out)


def _relative(expected: torch.Tensor, actual: torch.Tensor) -> float:
    actual = actual.double()
    denom = actual.norm().clamp_min(1e-30)
    return float((expected.to(actual.device) - actual).norm() / denom)


def _relative_after_add(expected: torch.Tensor, actual: torch.Tensor, total: torch.Tensor, adds: int = 1) -> float:
    """`_relative` of a write read back from a residual sum, less what rounding the sum allows.

    ``actual = total - stream`` with ``total = round(stream + write)`` in ``total``'s dtype: each
    entry of ``actual`` is off by up to ``u |total_i|`` per rounded add (``u`` the dtype's unit
    roundoff; ``adds``: 2 for a parallel block's ``pre + attn + mlp``), so
    ``||actual - write|| <= adds u ||total||`` for a right read, however small the write is against
    the stream it joins (SmolLM2-135M in bfloat16: ``||mid|| / ||mid - pre||`` up to about 45 in
    its later layers, 0.18 relative). Reports ``max(0, ||expected - actual|| - adds u ||total||) /
    ||actual||``; in float32 the allowance is under 1e-7 of the stream."""
    u = adds * torch.finfo(total.dtype).eps / 2 if total.dtype.is_floating_point else 0.0
    allowed = u * float(total.double().norm()) / max(float(actual.double().norm()), 1e-30)
    return max(_relative(expected, actual) - allowed, 0.0)


def _head_sum(
    lw, geo, x: torch.Tensor, pattern: torch.Tensor, v_int8: Int8Layer | None = None, o_int8: Int8Layer | None = None
) -> torch.Tensor:
    """``sum_h A_h (X W_V^{g(h)} + b_V) W_O^h + b_O`` in float64: ``(batch, T, d_model)``; for latent
    attention ``A_h norm_c(X W_DKV) W_UV^h W_O^h`` (`latent.LatentRead.values`).

    ``v_int8`` / ``o_int8``: the V (or fused QKV) / output projection is LLM.int8(). ``X``, and
    the heads' outputs ``z = [z_0 | ... | z_{H-1}]`` concatenated per token, are then split into
    what the layer quantizes and its exact outlier columns, and the products are rounded as the
    layer rounds them (`llm_int8.Int8Layer`).
    """
    device, dtype = x.device, x.dtype
    W_V, W_O = lw.W_V.double().to(device), lw.W_O.double().to(device)
    b_V = None if lw.b_V is None else lw.b_V.double().to(device)[None, :, None, :]
    b_O = None if lw.b_O is None else lw.b_O.double().to(device)
    if lw.latent is not None:  # v_h = norm_c(x W_DKV) W_UV^h: the latent norm's divisor applied (latent.py)
        if v_int8 is not None:
            raise ValueError("a latent attention whose projections quantize their input is not recomputed yet")
        values = lw.latent.values(x)
    elif v_int8 is None:
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
    if lw.W_G is not None:  # Qwen3-Next's output gate: each query's head output times sigmoid(x W_G^h + b_G^h)
        gate = torch.einsum("btd,hde->bhte", x.double(), lw.W_G.double().to(device))
        gate = gate if lw.b_G is None else gate + lw.b_G.double().to(device)[None, :, None, :]
        z = z * torch.sigmoid(gate)
    if o_int8 is None:
        out = torch.einsum("bhte,hed->btd", z, W_O)
        return out if b_O is None else out + b_O
    batch, heads, tokens, d_head = z.shape
    concatenated = z.transpose(1, 2).reshape(batch, tokens, heads * d_head)  # o_proj's input, head-major

    def per_head(part: torch.Tensor) -> torch.Tensor:
        return torch.einsum("bthe,hed->btd", part.reshape(batch, tokens, heads, d_head), W_O)

    quantized, outlier = o_int8.split(concatenated)
    return o_int8.output(per_head(quantized), None if outlier is None else per_head(outlier), b_O, dtype)


class _Captured(dict):
    """What the hooks saw in one block: ``pre`` (its input, the residual stream), ``x`` and
    ``y`` (the attention's input and output), ``pattern``, ``residual`` (BLOOM), ``mid`` (the
    residual after the attention sublayer), ``out`` and ``mlp`` (a parallel block's output and
    its MLP's), ``norm`` (the pre-attention norm's input and output)."""


def _hooks(block, fam: Family, parallel: bool, seen: _Captured) -> list[Hook]:
    """The capturing hooks of one block (for `hooks.hooked`)."""

    def keep(key, value):
        if key not in seen:
            seen[key] = value

    def block_pre(module, args, kwargs):
        keep("pre", _bound(module, args, kwargs).get("hidden_states", _first_tensor(args, kwargs)))

    def attn_pre(module, args, kwargs):
        if "x" not in seen:
            named = _bound(module, args, kwargs)
            seen["x"] = named.get("hidden_states", _first_tensor(args, kwargs))
            if fam.attn_adds_residual:
                seen["residual"] = named.get(fam.attn_adds_residual)

    def attn_post(module, args, kwargs, output):
        if "y" not in seen:
            seen["y"] = _tensor_of(output)
            seen["pattern"] = output[1] if isinstance(output, (tuple, list)) and len(output) > 1 else None

    def saver(key, what):
        def hook(module, args, kwargs, output=None):
            # an output is cloned: Falcon adds the attention output into its MLP's output in place
            keep(key, _first_tensor(args, kwargs) if what == "input" else _tensor_of(output).clone())

        return hook

    attn = get_module(block, fam.attn)
    hooks: list[Hook] = [
        (block, "pre_kwargs", block_pre),
        (attn, "pre_kwargs", attn_pre),
        (attn, "forward_kwargs", attn_post),
    ]
    if parallel:
        hooks.append((block, "forward_kwargs", saver("out", "output")))
        hooks.append((get_module(block, fam.mlp_out), "forward_kwargs", saver("mlp", "output")))
    elif fam.resid_mid is None:  # a block of attention alone: its output is the residual after it
        hooks.append((block, "forward_kwargs", saver("mid", "output")))
    else:
        hooks.append((get_module(block, fam.resid_mid), "pre_kwargs", saver("mid", "input")))
    if fam.beside is not None:
        hooks.append((get_module(block, fam.beside), "forward_kwargs", saver("beside", "output")))
    norm = attn_norm_module(block, fam)
    if norm is not None:

        def norm_io(module, args, kwargs, output):
            keep("norm", (_first_tensor(args, kwargs), output))

        hooks.append((norm, "forward_kwargs", norm_io))
    return hooks


def _tensor_of(output) -> torch.Tensor:
    return output[0] if isinstance(output, (tuple, list)) else output


MLP_NAMES = ("mlp", "feed_forward", "ffn", "block_sparse_moe", "moe")
"""Names of a block's MLP sublayer: after the residual the attention writes, so outside the read."""


def unread_module(block, fam: Family) -> str | None:
    """A block child holding parameters that ``fam``'s read never uses (a norm, a scale), or None.

    Known: the attention, its pre-norm, the norm on its output, the module reading the residual
    after it (``resid_mid``), the MLP (`MLP_NAMES`, ``mlp_out``). A parameter on the block itself
    counts as unread too.
    """
    names = (fam.attn_norm,) if isinstance(fam.attn_norm, str) else (fam.attn_norm or ())
    known = {fam.attn, fam.post_attn_norm, fam.resid_mid, fam.mlp_out, fam.beside, *names, *MLP_NAMES}
    for name, _ in block.named_parameters(recurse=False):
        return f"{name} (a parameter of {type(block).__name__})"
    for name, child in block.named_children():
        if name.split(".")[0] not in known and next(child.parameters(), None) is not None:
            return f"{name} ({type(child).__name__})"
    return None


def _unembed(u: torch.Tensor, module, chunk: int = 16384) -> torch.Tensor:
    """``u W_U^T (+ b)`` in float32 over the vocabulary in chunks (no full float copy of a large head)."""
    weight = weight_of(module)
    if not weight.dtype.is_floating_point or bnb_kind(module) is not None:
        out = u.float() @ dense_weight(module).to(u.device).T
    else:
        out = torch.cat([u.float() @ part.float().T for part in weight.detach().split(chunk)], dim=-1)
    bias = dense_bias(module)
    return out if bias is None else out + bias.to(out.device)


def _tail_errors(model, fam: Family, ids: torch.Tensor) -> tuple[float, float]:
    """``(embedding error, logit error)`` of two short sequences run through the model with no blocks.

    The decoder stack is swapped for an empty one for this forward, so the final norm reads the
    embedding as the model computes it (scale, positions, embedding norm). Embedding: the two
    sequences share positions, so their residuals differ by ``W_E[ids_1] - W_E[ids_2]`` (the
    read's `embedding_matrix`). Tail: the logits equal ``norm(r) g W_U * factor`` (+ the norm's
    bias and the head's), soft-capped, with ``g``, the factor and the cap the read's.
    """
    parent_path, _, attr = fam.layers.rpartition(".")
    parent = model.get_submodule(parent_path) if parent_path else model
    stack = getattr(parent, attr)
    final = final_norm_module(model, fam)
    seen: dict = {}

    def keep(module, args, kwargs):  # the last call: a model may run the same norm on its embedding first
        seen["r"] = _first_tensor(args, kwargs)

    hooks: list[Hook] = [] if final is None else [(final, "pre_kwargs", keep)]
    setattr(parent, attr, torch.nn.ModuleList())
    try:
        with hooked(*hooks):
            logits = model(input_ids=ids, use_cache=False).logits
    finally:
        setattr(parent, attr, stack)
    if "r" not in seen:
        raise DecompositionError(f"{model.config.model_type}: the final norm never ran in the self-check forward")
    r = seen["r"].double()
    W_E = embedding_matrix(model, fam, rows=ids.flatten().cpu()).double().reshape(*ids.shape, -1)
    embed_error = _relative((W_E[0] - W_E[1]).to(r.device), r[0] - r[1])
    geo_d = r.shape[-1]
    scale = norm_scale(final, geo_d, fam.norm_weight_offset).double().to(r.device)
    normed = _normalize(final, fam, r) * scale
    bias = getattr(final, "bias", None) if fam.norm_kind == "layernorm" else None
    if bias is not None:
        normed = normed + bias.detach().double()
    expected = _unembed(normed, model.get_output_embeddings()).double() * logit_factor_of(model.config, fam)
    cap = getattr(model.config, fam.logit_softcap, None) if fam.logit_softcap else None
    if cap:
        expected = torch.tanh(expected / cap) * cap
    return embed_error, _relative(expected, logits)


@torch.no_grad()
def measure_decomposition(
    build_or_model, *, n_tokens: int = N_TOKENS, seed: int = 0, family: Family | None = None
) -> DecompositionCheck:
    """Run the probe forward and return every layer's error (no refusal; see `check_decomposition`)."""
    model = _model_of(build_or_model)
    fam = family or family_of(model)
    geo = geometry_of(model) if family is None else _geometry(model, fam)
    model_type = str(getattr(model.config, "model_type", "?"))
    blocks = attention_blocks_of(model, fam, geo)  # on a hybrid stack, the attention layers' blocks
    if fam.assumed:
        unread = unread_module(blocks[0], fam)
        if unread is not None:
            raise DecompositionError(
                f"model type {model_type!r}: its blocks hold {unread}, which the assumed {fam.name!r} layout never "
                f"reads; refusing a read that may miss it ({ADD_FAMILY})"
            )
    parallel = fam.is_parallel(model.config)
    captured = [_Captured() for _ in blocks]
    try:
        hooks = [hook for block, seen in zip(blocks, captured) for hook in _hooks(block, fam, parallel, seen)]
    except AttributeError as error:
        raise DecompositionError(
            f"model type {model_type!r} ({fam.name} layout): {first_line(error)}; the family entry names a module "
            "its blocks do not have"
        ) from None
    causal_lm: Any = model  # its transformers methods (get_input_embeddings) are not on torch.nn.Module
    ids = _probe_ids(build_or_model, n_tokens, seed).to(causal_lm.get_input_embeddings().weight.device)
    extra = {"logits_to_keep": 1} if "logits_to_keep" in inspect.signature(model.forward).parameters else {}
    with hooked(*hooks), row_major_unembedding(model):  # the last position's slice, row-major (model/unembedding.py)
        model(input_ids=ids, use_cache=False, **extra)  # logits of one position: the check needs none
    dtype = captured[0]["x"].dtype if captured and "x" in captured[0] else torch.float32
    check = DecompositionCheck(
        model_type=model_type,
        layout=fam.name,
        dtype=str(dtype).removeprefix("torch."),
        tolerance=tolerance_for(model, dtype),
        errors=[],
    )
    for layer, (block, seen) in enumerate(zip(blocks, captured)):
        _check_layer(check, layer, block, seen, fam, geo, model.config, parallel)
    if ids.shape[-1] >= 2 * TAIL_TOKENS:
        check.embed_error, check.logit_error = _tail_errors(model, fam, ids[0, : 2 * TAIL_TOKENS].reshape(2, -1))
    return check


def _check_layer(check: DecompositionCheck, layer: int, block, seen, fam: Family, geo, config, parallel: bool) -> None:
    """Append one layer's errors: attention output, pre-attention norm, residual write."""
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
    try:
        lw = block_weights(block, fam, geo, False, config, x.device, qk=False)
        attn = get_module(block, fam.attn)
        v_proj = get_module(attn, fam.qkv[-1])  # the module that computes V (the fused QKV, or v_proj)
        heads = _head_sum(
            lw, geo, x, seen["pattern"], _input_quant(v_proj), _input_quant(get_module(attn, fam.out_proj))
        )
    except (RuntimeError, ValueError, IndexError, AttributeError, TypeError) as error:
        raise DecompositionError(
            f"model type {check.model_type!r} ({check.layout} layout): the per-head read of layer {layer} fails: "
            f"{first_line(error)}; fix its entry in pytest_circuits/model/family_table.py"
        ) from None
    residual = seen["residual"].double() if fam.attn_adds_residual else 0.0
    check.errors.append(_relative(heads + residual, seen["y"]))
    if "norm" in seen:
        norm_in, norm_out = seen["norm"]
        # the norm must be what the attention reads (a post-norm model has its "ln_1" after it) ...
        feeds = _relative(norm_out.double() * _config_factor(config, fam.attn_in_multiplier), x)
        # ... and must scale by the g the fold uses
        check.norm_errors.append(
            max(feeds, _norm_error(attn_norm_module(block, fam), fam, lw.norm_scale, norm_in, norm_out))
        )
    elif fam.attn_norm is not None:
        raise DecompositionError(
            f"{check.model_type}: the pre-attention norm of layer {layer} did not run in the self-check forward; "
            "the family entry names the wrong module"
        )
    else:  # no pre-attention norm: the attention reads the residual stream itself
        check.norm_errors.append(_relative(seen["pre"].double(), x))
    # what the sublayer adds to the residual stream: norm on the output (g_post), multiplier
    write = heads
    post = post_attn_norm_module(block, fam)
    if post is not None:
        assert lw.post_norm_scale is not None, "a post-attention norm has a scale in the read"
        write = _apply_norm(post, fam, lw.post_norm_scale, write)
    write = write * lw.out_multiplier
    total = seen["out"] if parallel else seen["mid"]
    actual = total.double() - seen["pre"].double() - (seen["mlp"].double() if parallel else 0.0)
    if fam.beside is not None:  # what the module beside the attention adds (Falcon-H1's Mamba, times its multiplier)
        actual = actual - seen["beside"].double() * _config_factor(config, fam.beside_multiplier)
    check.write_errors.append(_relative_after_add(write, actual, total, adds=2 if parallel else 1))


def _config_factor(config, attr: str | None) -> float:
    """The positive scalar a config attribute holds (1 without one)."""
    return float(getattr(config, attr, 1.0)) if attr else 1.0


def _input_quant(module):
    """What quantizes a projection's input: LLM.int8(), or a compressed-tensors or torchao dynamic quantizer."""
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
        ("residual write (resid_mid - resid_pre)", check.write_errors),
        ("embedding rows (W_E)", [check.embed_error]),
        ("tail (final norm, W_U, logit scale, soft cap)", [check.logit_error]),
    ):
        bad = [(layer, err) for layer, err in enumerate(errors) if not err <= check.tolerance]
        if bad:
            layer, err = bad[0]
            where = f"{what} of layer {layer}" if what in PER_LAYER else f"{what}"
            if not math.isfinite(err):
                raise DecompositionError(
                    f"model type {check.model_type!r} ({check.dtype}): the {where} is not finite in a "
                    f"{n_tokens}-token forward; the build overflows (use a dtype with more range: bf16 or fp32)"
                )
            raise DecompositionError(
                f"model type {check.model_type!r} ({check.layout} layout, {check.dtype}): the per-head weight read does "
                f"not reproduce the {where} (relative error {err:.2g} > {check.tolerance:g}); "
                "refusing to report figures from weights that may be read wrong (fix its entry in "
                "pytest_circuits/model/family_table.py)"
            )
    return check
