"""A half-precision build's products as float32 GEMMs rounded once (`model.half_products`): each product
against an exact float64 one, gradients against float64 autograd, and a whole build against its own
native products, whatever this CPU has (the takeover is forced where the CPU has half kernels)."""

from __future__ import annotations

import inspect

import pytest
import torch
import torch.nn.functional as F

from pytest_circuits.model import half_products as hp
from pytest_circuits.testing import requires_embedded_model

HALVES = [torch.bfloat16, torch.float16]
ULP = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}  # half a unit in the last place, relative


def _rand(*shape, dtype, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def _products(dtype):
    a, b = _rand(5, 48, dtype=dtype), _rand(48, 7, dtype=dtype, seed=1)
    bias = _rand(7, dtype=dtype, seed=2)
    a3, b3 = _rand(3, 5, 48, dtype=dtype, seed=3), _rand(3, 48, 7, dtype=dtype, seed=4)
    base3 = _rand(3, 5, 7, dtype=dtype, seed=5)
    return {
        "linear": (lambda: F.linear(a, b.T, bias), lambda: a.double() @ b.double() + bias.double()),
        "@": (lambda: a @ b, lambda: a.double() @ b.double()),
        "matmul": (lambda: torch.matmul(a3, b3), lambda: a3.double() @ b3.double()),
        "mm": (lambda: torch.mm(a, b), lambda: a.double() @ b.double()),
        "bmm": (lambda: torch.bmm(a3, b3), lambda: a3.double() @ b3.double()),
        "addmm": (lambda: torch.addmm(bias, a, b), lambda: bias.double() + a.double() @ b.double()),
        "baddbmm": (lambda: torch.baddbmm(base3, a3, b3), lambda: base3.double() + a3.double() @ b3.double()),
        "einsum": (lambda: torch.einsum("bik,bkj->bij", a3, b3), lambda: a3.double() @ b3.double()),
        "einsum list": (lambda: torch.einsum("ik,kj->ij", [a, b]), lambda: a.double() @ b.double()),
    }


@pytest.mark.parametrize("dtype", HALVES, ids=str)
@pytest.mark.parametrize("name", list(_products(torch.bfloat16)))
def test_each_product_is_the_exact_product_rounded_once(dtype, name, monkeypatch):
    taken = []
    real = hp.float32_product
    monkeypatch.setattr(hp, "float32_product", lambda *a: taken.append(a[0]) or real(*a))
    product, exact = _products(dtype)[name]
    with hp.Float32Products():
        out = product()
    assert taken, f"{name} was not taken over"
    assert out.dtype == dtype
    want = exact()
    # one rounding of a float32 sum (exact products, float32 accumulation): within half an ulp of the
    # exact value, plus float32's accumulation error over 48 terms
    err = (out.double() - want).abs()
    allowed = ULP[dtype] * want.abs() + 48 * 2.0**-24 * (exact().abs() + 1)
    assert (err <= allowed).all(), float((err - allowed).max())


def test_mixed_dtypes_float32_and_out_pass_through(monkeypatch):
    taken = []
    monkeypatch.setattr(hp, "float32_product", lambda *a: taken.append(a) or None)
    a16, a32 = _rand(2, 3, dtype=torch.bfloat16), _rand(3, 2, dtype=torch.float32)
    out = torch.empty(2, 2, dtype=torch.bfloat16)
    with hp.Float32Products():
        assert (a32.T @ a32).dtype == torch.float32
        torch.mm(a16, a16.T, out=out)
        with pytest.raises(RuntimeError):
            a16 @ a32
    assert taken == []


@pytest.mark.parametrize("dtype", HALVES, ids=str)
def test_gradients_match_float64_and_keep_only_half_operands(dtype):
    x = _rand(6, 32, dtype=dtype).requires_grad_(True)
    w = _rand(16, 32, dtype=dtype, seed=1)
    v = _rand(16, 8, dtype=dtype, seed=2).requires_grad_(True)
    with hp.Float32Products():
        out = F.linear(x, w) @ v
    assert out.dtype == dtype and out.requires_grad
    for node in (out.grad_fn, out.grad_fn.next_functions[0][0]):
        assert all(t.dtype == dtype for t in node.saved_tensors), "a float32 copy was kept for the backward"
    out.float().sum().backward()
    x64, v64 = x.detach().double().requires_grad_(True), v.detach().double().requires_grad_(True)
    (F.linear(x64, w.double()) @ v64).sum().backward()
    for got, want in ((x.grad, x64.grad), (v.grad, v64.grad)):
        assert got.dtype == dtype
        torch.testing.assert_close(got.double(), want, rtol=8 * ULP[dtype], atol=8 * ULP[dtype] * want.abs().max())


def test_a_large_weight_is_converted_in_slices(monkeypatch):
    x, w, b = (
        _rand(4, 24, dtype=torch.bfloat16),
        _rand(40, 24, dtype=torch.bfloat16, seed=1),
        _rand(40, dtype=torch.bfloat16),
    )
    whole = hp._sliced_linear(x, w, b)
    widths = []
    real = F.linear
    monkeypatch.setattr(hp, "SLICE_BYTES", 4 * 24 * 7)  # 7 rows a slice
    monkeypatch.setattr(hp.F, "linear", lambda *a: widths.append(a[1].shape[0]) or real(*a))
    sliced = hp._sliced_linear(x, w, b)
    assert widths == [7, 7, 7, 7, 7, 5]
    assert torch.equal(sliced, whole) and sliced.dtype == torch.bfloat16


@requires_embedded_model()
@pytest.mark.parametrize("recipe", ["bf16", "fp16"])
def test_a_build_computes_through_float32_products_and_stays_within_its_rounding(recipe, monkeypatch):
    from pytest_circuits.model.builds import load_build
    from pytest_circuits.model.loading import resolve_model
    from pytest_circuits.rungs.probe import run_repeat_probe
    from pytest_circuits.rungs.repeat_settings import RepeatSettings

    source = resolve_model("tiny-induction")
    monkeypatch.setattr(hp, "native_half_products", lambda dtype: True)
    native = load_build(source, recipe, "cpu")
    assert hp.taken_over(native.model) is None
    taken = load_build(source, recipe, "cpu")
    dtype = getattr(torch, {"bf16": "bfloat16", "fp16": "float16"}[recipe])
    assert hp.float32_products(taken.model, force=True) == dtype
    assert inspect.signature(taken.model.forward) == inspect.signature(native.model.forward)
    assert hp.float32_products(load_build(source, "fp32", "cpu").model, force=True) is None

    calls = []
    real = hp.float32_product
    monkeypatch.setattr(hp, "float32_product", lambda *a: calls.append(a[0]) or real(*a))
    ids = torch.randint(0, taken.geometry.vocab, (2, 33), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = taken.model(input_ids=ids).logits
    assert len(calls) >= taken.geometry.n_layers * 4 + 1  # W_Q, W_K, W_V, W_O a layer, the unembedding at least
    assert torch.overrides._get_current_function_mode_stack() == [], "the mode outlived the forward"
    before = len(calls)
    torch.randn(3, 3, dtype=dtype) @ torch.randn(3, 3, dtype=dtype)
    assert len(calls) == before, "a product outside the build's modules was taken over"

    fp32 = load_build(source, "fp32", "cpu")
    with torch.no_grad():
        ref, own = fp32.model(input_ids=ids).logits, native.model(input_ids=ids).logits
    assert logits.dtype == dtype
    # the half dtype's own error against float32 is as large either way, and summation order moves the
    # logits by well under it (bf16: mean 0.00000 against 0.0074; fp16: 0.0004 against 0.0010)
    error, moved = (own.float() - ref).abs().mean(), (logits.float() - own.float()).abs().mean()
    assert (logits.float() - ref).abs().mean() <= 1.1 * error
    assert moved <= 0.5 * error

    probe = RepeatSettings(seed=0, n=4, L=16)
    a, b = run_repeat_probe(taken, probe), run_repeat_probe(native, probe)
    assert (
        abs(a.copy_loss - b.copy_loss)
        < 0.05 * max(abs(b.copy_loss - run_repeat_probe(fp32, probe).copy_loss), 0.01) + 1e-3
    )


@requires_embedded_model()
def test_the_mode_is_left_when_a_forward_raises():
    from pytest_circuits.model.builds import load_build
    from pytest_circuits.model.loading import resolve_model

    build = load_build(resolve_model("tiny-induction"), "bf16", "cpu")
    hp.float32_products(build.model, force=True)
    with pytest.raises(IndexError):
        build.model(input_ids=torch.tensor([[build.geometry.vocab + 5]]))
    assert torch.overrides._get_current_function_mode_stack() == []
