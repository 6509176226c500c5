"""A half-precision build's matrix products on a CPU without half-precision kernels.

A bfloat16 or float16 build multiplies half-precision operands, accumulates in float32 and rounds each
result once to its dtype: what a GPU's half GEMM and oneDNN's do. Where oneDNN has no such kernel for
the dtype on this CPU (``torch.ops.mkldnn._is_mkldnn_bf16_supported()`` False: no AVX512-BF16 or AMX,
e.g. an AVX2 EPYC, as many CI runners are), torch falls back to a loop that reached 2-17 GFLOP/s in
bfloat16 on 2 cores where float32 reached 160, and a bfloat16 forward of SmolLM2-135M took 15 s for 8
sequences. There `float32_products` runs the build's products (``F.linear``, ``matmul``/``@``, ``mm``,
``bmm``, ``addmm``, ``baddbmm``, ``einsum``) as float32 GEMMs of its half operands, each result rounded
once to the half dtype: the same arithmetic, since a product of two bfloat16 or float16 values is exact
in float32, in another summation order (as between two CPUs). The figures move by rounding only
(tests/test_half_products.py); the build's identity does not change.

Scope: a function mode (`Float32Products`) entered by the forward of the outermost call of any of the
build's modules that holds half parameters (each such module's ``forward`` is wrapped, as
`token_quant.install` wraps a layer's), so everything a forward runs, the rungs' direct calls of
blocks, norms and projections and their hooks included, and left when that call returns or raises.
Gradients (the screen's backward) go through `_Float32Product`, which keeps the half operands and
recomputes the float32 product in the backward, so no float32 copy of a weight is kept; without
gradients a large weight is converted in slices of `SLICE_BYTES`, so a float32 copy of an 8B model's
unembedding (2.1 GB) is never held.
"""

from __future__ import annotations

import threading
import weakref
from functools import cache, wraps
from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from torch.utils import _pytree as pytree

HALF = (torch.bfloat16, torch.float16)
SLICE_BYTES = 256 << 20  # the most float32 of one weight converted at once without gradients
PRODUCTS = frozenset(
    {
        F.linear,
        torch.matmul,
        torch.Tensor.matmul,
        torch.Tensor.__matmul__,
        torch.Tensor.__rmatmul__,
        torch.mm,
        torch.Tensor.mm,
        torch.bmm,
        torch.Tensor.bmm,
        torch.addmm,
        torch.Tensor.addmm,
        torch.baddbmm,
        torch.Tensor.baddbmm,
        torch.einsum,
    }
)


@cache
def native_half_products(dtype: torch.dtype) -> bool:
    """Whether this CPU's oneDNN multiplies ``dtype`` (bfloat16, float16) natively; float32 always."""
    if dtype == torch.bfloat16:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    if dtype == torch.float16:
        return bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())
    return True


def _plain(x: Any) -> bool:
    return type(x) in (torch.Tensor, torch.nn.Parameter)


def half_of(args: Any) -> torch.dtype | None:
    """The half dtype of a product's operands when every tensor among them is a plain CPU tensor of that one
    half dtype (what `Float32Products` takes over), else None (mixed dtypes fail or pass as torch has them)."""
    tensors = [x for x in pytree.tree_leaves(args) if isinstance(x, torch.Tensor)]
    if not tensors or not all(_plain(t) and t.device.type == "cpu" for t in tensors):
        return None
    dtypes = {t.dtype for t in tensors}
    return dtypes.pop() if len(dtypes) == 1 and next(iter(dtypes)) in HALF else None


def _float32(x: Any) -> Any:
    return x.float() if isinstance(x, torch.Tensor) else x


def float32_product(func, args: tuple, kwargs: dict, dtype: torch.dtype) -> torch.Tensor:
    """``func(*args, **kwargs)`` with every half operand in float32, rounded once to ``dtype``."""
    leaves, spec = pytree.tree_flatten((args, kwargs))
    where = [i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor)]
    if torch.is_grad_enabled() and any(leaves[i].requires_grad for i in where):
        return _Float32Product.apply(func, spec, leaves, where, dtype, *[leaves[i] for i in where])
    with torch.no_grad():
        if func is F.linear and not kwargs:
            return _sliced_linear(*args)
        floats, float_kwargs = pytree.tree_unflatten([_float32(x) for x in leaves], spec)
        return func(*floats, **float_kwargs).to(dtype)


def _sliced_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear`` in float32, rounded to ``x``'s dtype, the weight converted a slice of rows at a time."""
    rows = max(1, SLICE_BYTES // (4 * max(1, weight.shape[-1])))
    x32 = x.float()
    if weight.shape[0] <= rows:
        return F.linear(x32, weight.float(), None if bias is None else bias.float()).to(x.dtype)
    out = x.new_empty(*x.shape[:-1], weight.shape[0])
    for start in range(0, weight.shape[0], rows):
        part = slice(start, start + rows)
        b = None if bias is None else bias[part].float()
        out[..., part] = F.linear(x32, weight[part].float(), b)
    return out


class _Float32Product(torch.autograd.Function):
    """A product with gradients: float32 forward rounded once; the backward recomputes the float32
    product from the kept half operands and returns each operand's gradient in its dtype."""

    @staticmethod
    def forward(ctx, func, spec, leaves, where, dtype, *tensors):
        ctx.func, ctx.spec, ctx.leaves, ctx.where = func, spec, leaves, where
        ctx.save_for_backward(*tensors)
        args, kwargs = pytree.tree_unflatten([_float32(x) for x in leaves], spec)
        return func(*args, **kwargs).to(dtype)

    @staticmethod
    def backward(ctx, grad):
        tensors = ctx.saved_tensors
        needs = ctx.needs_input_grad[5:]
        floats = [t.detach().float().requires_grad_(need) for t, need in zip(tensors, needs, strict=True)]
        leaves = list(ctx.leaves)
        for i, f in zip(ctx.where, floats, strict=True):
            leaves[i] = f
        with torch.enable_grad():
            args, kwargs = pytree.tree_unflatten(leaves, ctx.spec)
            out = ctx.func(*args, **kwargs)
            wanted = [f for f in floats if f.requires_grad]
            found = iter(torch.autograd.grad(out, wanted, grad.float(), allow_unused=True))
        grads = [next(found) if need else None for need in needs]
        return (None,) * 5 + tuple(None if g is None else g.to(t.dtype) for g, t in zip(grads, tensors, strict=True))


class Float32Products(TorchFunctionMode):
    """Takes over the products of plain CPU half tensors (`PRODUCTS`, `half_of`); every other call passes."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in PRODUCTS and "out" not in kwargs:
            dtype = half_of((args, kwargs))
            if dtype is not None:
                return float32_product(func, args, kwargs, dtype)
        return func(*args, **kwargs)


_MODE = Float32Products()
_TAKEN: weakref.WeakKeyDictionary[torch.nn.Module, torch.dtype] = weakref.WeakKeyDictionary()
_INSIDE = threading.local()  # set while an outermost call of a taken-over module runs


def _scoped(own):
    """``own`` (a module's forward), run inside `Float32Products` unless an outer call entered it; its
    signature kept (``inspect.signature(model.forward)``, which transformers and the self-check read)."""

    @wraps(own)
    def forward(*args, **kwargs):
        if getattr(_INSIDE, "on", False):
            return own(*args, **kwargs)
        _INSIDE.on = True
        try:
            with _MODE:
                return own(*args, **kwargs)
        finally:
            _INSIDE.on = False

    return forward


def float32_products(model: torch.nn.Module, force: bool = False) -> torch.dtype | None:
    """Run ``model``'s products as float32 GEMMs rounded to its half dtype (module docstring) when it
    holds bfloat16 or float16 parameters on a CPU whose oneDNN has no kernel for that dtype (``force``:
    whatever the CPU); returns that dtype, or None where the model keeps its own products. Idempotent."""
    if model in _TAKEN:
        return _TAKEN[model]
    halves = {p.dtype for p in model.parameters() if p.dtype in HALF and p.device.type == "cpu" and _plain(p)}
    if len(halves) != 1:
        return None
    dtype = halves.pop()
    if native_half_products(dtype) and not force:
        return None
    for module in model.modules():
        if any(p.dtype == dtype for p in module.parameters()):
            module.forward = _scoped(module.forward)
    _TAKEN[model] = dtype
    return dtype


def taken_over(model: torch.nn.Module) -> torch.dtype | None:
    """The half dtype whose products `float32_products` takes over in ``model``, else None."""
    return _TAKEN.get(model)
