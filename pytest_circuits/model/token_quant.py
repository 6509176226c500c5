"""The fast forward of compressed-tensors layers that quantize their input per token (issue #55).

compressed-tensors' reference forward of a ``W8A8`` or ``FP8_DYNAMIC`` layer computes, per token
``t`` of an input ``x`` of shape ``(batch, tokens, d_in)``::

    s_t = max(max_i |x_ti|, 0) / (R / 2)        (R = q_max - q_min: 255 for int8, 896 for float8 e4m3)
    q_t = Q(clamp(x_t / s_t, q_min, q_max))     (Q: round half to even for int8, the cast for e4m3)
    y_t = (s_t q_t) W^T + b                     (W = s_w q_w decompressed once, float32 matmul)

in about a dozen tensor ops per layer. `install` replaces it on every such layer:

* **int8 codes** (``int8-w8a8``): ``y_t = s_t s_w^T * (q_t q_w^T) + b`` with the integer product in
  int32 (`int8_product`: `torch._int_mm` on a CPU with VNNI, else exact float32 GEMMs of 1024
  columns; exact, as vLLM's int8 kernel computes it). It equals the reference but for the
  reference's float32 summation (about ``1e-7`` relative per output), and runs at the cost of a
  bfloat16 matmul on a CPU with VNNI, of a float32 one without (docs/speed.md).
* **float8 codes** (``fp8-e4m3-dyn``): the same ``s_t`` and ``q_t`` in three fused ops, then the
  reference's float32 matmul: bit for bit the reference. The CPU has no float8 kernel, so the
  matmul stays float32.

A layer whose scheme is anything else (static scales, groups, asymmetric inputs) keeps the
reference forward, and so does an input that is not ``(batch, tokens, d_in)``.
"""

from __future__ import annotations

from types import MethodType
from typing import Any

import torch
import torch.nn.functional as F

FAST = "token_quant"  # the attribute holding a layer's `Int8Linear` or `Float8Linear` once installed
EPS = torch.finfo(torch.float32).eps  # compressed-tensors' replacement for a zero scale (float32 scales)


def _word(value: Any) -> str:
    return str(getattr(value, "value", value))  # compressed-tensors' str enums, or their values


def kind(module: torch.nn.Module) -> str | None:
    """``"int"`` or ``"float"``: the codes of a layer with 8-bit channel weights and 8-bit dynamic
    per-token inputs of that type, both symmetric; None for any other layer."""
    scheme = getattr(module, "quantization_scheme", None)
    weights = getattr(scheme, "weights", None)
    inputs = getattr(scheme, "input_activations", None)
    if weights is None or inputs is None or getattr(scheme, "output_activations", None) is not None:
        return None
    if _word(inputs.dynamic) != "True" or getattr(inputs, "scale_dtype", None) is not None:
        return None
    shapes = {(_word(a.type), a.num_bits, _word(a.strategy), bool(a.symmetric)) for a in (weights, inputs)}
    code = _word(inputs.type)
    return (
        code if code in ("int", "float") and shapes == {(code, 8, "channel", True), (code, 8, "token", True)} else None
    )


def _token_scale(x: torch.Tensor, half_range: float) -> torch.Tensor:
    """``s_t = max_i |x_ti| / (R/2)`` per token, a zero scale replaced as compressed-tensors does
    (``max(max_i x_ti, -min_i x_ti)`` is ``max_i |x_ti|`` without a copy of ``x``)."""
    low, high = torch.aminmax(x, dim=-1, keepdim=True)
    scale = torch.maximum(high, low.neg_()).div_(half_range)
    return scale.masked_fill_(scale == 0, EPS)


def _stamp(module: torch.nn.Module) -> tuple[int, int, int, int]:
    """The weight's and its scale's storage and in-place-edit counters: changed by any edit through torch."""
    layer: Any = module
    return (
        layer.weight.data_ptr(),
        layer.weight._version,
        layer.weight_scale.data_ptr(),
        layer.weight_scale._version,
    )


class Int8Linear:
    """``y = s_x s_w^T * (q_x q_w^T) + b``, the integer product exact in int32."""

    reference: Any = None  # the layer's compressed-tensors forward, for inputs this one does not take

    def __init__(self, module: torch.nn.Linear):
        weight = module.weight.detach()
        layer: Any = module  # compressed-tensors' layer: torch types its added parameters Tensor | Module
        scale = layer.weight_scale.detach().reshape(-1, 1).to(weight.dtype)
        codes = torch.round(weight / scale)
        in_range = bool(codes.min() >= -128 and codes.max() <= 127)
        self.exact = in_range and bool(torch.equal(codes * scale, weight))  # W = s_w q_w, q_w int8
        self.codes_t = codes.to(torch.int8).t()  # (d_in, d_out), column-major: _int_mm's faster layout
        self.scale_row = scale.reshape(1, -1)
        self.stamp = _stamp(module)

    def usable(self, module: torch.nn.Linear, x: torch.Tensor) -> bool:
        """Not once the weight was edited in place or replaced (its codes would be stale)."""
        return x.device == self.codes_t.device and _stamp(module) == self.stamp

    def __call__(self, module: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
        scale = _token_scale(x, 127.5)
        codes = (x / scale).clamp_(-128, 127).round_().to(torch.int8)  # in place: one float copy of x, not three
        product = int8_product(codes.reshape(-1, x.shape[-1]), self.codes_t).reshape(*x.shape[:-1], -1)
        out = product.to(x.dtype).mul_(scale).mul_(self.scale_row)
        return out if module.bias is None else out.add_(module.bias)


EXACT_K = 1 << 10  # float32 holds every integer up to 2^24: a sum of 1024 products of int8 codes (|q| <= 128)


def int8_kernels() -> bool:
    """Whether this CPU has VNNI, which torch's int8 matmul needs for its speed."""
    return bool(torch.cpu._is_vnni_supported())


def int8_product(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` of int8 codes in int32, exact: `torch._int_mm` off a CPU or on one with VNNI; else float32
    GEMMs of at most `EXACT_K` columns, each partial sum an integer below 2^24 and so exact, added in
    int32. Without VNNI torch's int8 matmul ran 80x slower than a float32 one (466 vs 6 ms, 260 x 576 by
    576 x 1536, one thread, an AVX2 EPYC)."""
    if a.device.type != "cpu" or int8_kernels():
        return torch._int_mm(a, b)
    out = torch.zeros(a.shape[0], b.shape[1], dtype=torch.int32, device=a.device)
    for k in range(0, a.shape[1], EXACT_K):
        out.add_((a[:, k : k + EXACT_K].float() @ b[k : k + EXACT_K].float()).to(torch.int32))
    return out


class Float8Linear:
    """``y = (s_x q_x) W^T + b`` with ``q_x`` the e4m3 cast of ``x / s_x``: compressed-tensors' own arithmetic."""

    reference: Any = None  # the layer's compressed-tensors forward, for inputs this one does not take

    def usable(self, module: torch.nn.Linear, x: torch.Tensor) -> bool:
        return True

    def __call__(self, module: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
        scale = _token_scale(x, 448.0)
        codes = (x / scale).clamp_(-448.0, 448.0).to(torch.float8_e4m3fn)
        return F.linear(codes.to(x.dtype).mul_(scale), module.weight, module.bias)


def _forward(self: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    fast = getattr(self, FAST)
    usable = x.ndim == 3 and x.dtype == self.weight.dtype and x.device.type == "cpu" and fast.usable(self, x)
    if not usable or not getattr(self, "quantization_enabled", True):
        return fast.reference(x)  # compressed-tensors' own forward
    return fast(self, x)


def install(model: torch.nn.Module) -> int:
    """Give every layer of ``model`` that quantizes its input per token the fast forward above;
    returns how many layers got it."""
    count = 0
    for module in model.modules():
        if not isinstance(module, torch.nn.Linear) or getattr(module, FAST, None) is not None:
            continue
        code = kind(module)
        if code is None:
            continue
        fast: Int8Linear | Float8Linear = Int8Linear(module) if code == "int" else Float8Linear()
        if isinstance(fast, Int8Linear) and not fast.exact:  # W is not s_w times int8 codes: keep the reference
            continue
        fast.reference = module.forward
        setattr(module, FAST, fast)
        module.forward = MethodType(_forward, module)  # type: ignore[method-assign]
        count += 1
    return count


def installed(model: torch.nn.Module) -> set[str]:
    """The fast forwards ``model``'s layers run (``{"Int8Linear"}``, ...)."""
    return {type(fast).__name__ for fast in (getattr(m, FAST, None) for m in model.modules()) if fast is not None}


def remove(model: torch.nn.Module) -> int:
    """Put compressed-tensors' own forward back on every layer `install` changed (a benchmark's and
    a test's reference); returns how many layers."""
    count = 0
    for module in model.modules():
        fast = getattr(module, FAST, None)
        if fast is not None:
            module.forward = fast.reference
            delattr(module, FAST)
            count += 1
    return count
