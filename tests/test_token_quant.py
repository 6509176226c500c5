"""The fast forward of the layers that quantize their input per token (model/token_quant.py, issue #55):
int8 codes multiplied in int32, float8 codes fused into compressed-tensors' own float32 arithmetic.
Each is checked against the formula computed apart and against compressed-tensors' reference
forward, and the gate's verdicts on the embedded model are the same on either forward."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytest.importorskip("compressed_tensors")

from pytest_circuits.model import token_quant  # noqa: E402
from pytest_circuits.testing import requires_embedded_model  # noqa: E402

pytestmark = requires_embedded_model()
RECIPES = ("int8-w8a8", "fp8-e4m3-dyn")


@pytest.fixture(scope="module")
def builds():
    from pytest_circuits.model.builds import load_build
    from pytest_circuits.model.loading import resolve_model

    source = resolve_model("tiny-induction")
    return {recipe: load_build(source, recipe, "cpu") for recipe in RECIPES}


def fast_layers(build) -> list[torch.nn.Linear]:
    return [m for m in build.model.modules() if getattr(m, token_quant.FAST, None) is not None]


def inputs(d_in: int, seed: int = 0) -> torch.Tensor:
    """``(3, 11, d_in)`` activations with a zero token (the scale's zero guard) and an outlier."""
    x = torch.randn(3, 11, d_in, generator=torch.Generator().manual_seed(seed)) * 4
    x[0, 2] = 0
    x[1, 3, 0] = 1e4
    return x


def test_every_layer_that_quantizes_its_input_runs_the_fast_forward(builds):
    for recipe, build in builds.items():
        quantized = [m for m in build.model.modules() if getattr(m, "quantization_scheme", None) is not None]
        assert quantized and fast_layers(build) == quantized, recipe
    assert "torch._int_mm" in builds["int8-w8a8"].identity.forward
    assert "torch._int_mm" not in builds["fp8-e4m3-dyn"].identity.forward


def test_int8_layers_are_the_integer_product_of_the_codes_in_float64(builds):
    """``y = s_x s_w (q_x q_w^T) + b`` in float64, from the stored scales and the formula's codes:
    ``s_x = max|x_t| / 127.5`` per token, ``q_x = round(clamp(x / s_x, -128, 127))``; and compressed-tensors'
    reference within its float32 summation's bound."""
    for layer in fast_layers(builds["int8-w8a8"]):
        x = inputs(layer.in_features)
        s_w = layer.weight_scale.detach().reshape(-1).double()
        q_w = torch.round(layer.weight.detach().double() / s_w[:, None])
        assert q_w.abs().max() <= 128
        s_x = x.abs().amax(-1, keepdim=True) / 127.5
        s_x = torch.where(s_x == 0, torch.finfo(torch.float32).eps, s_x)
        q_x = torch.round(torch.clamp(x / s_x, -128, 127)).double()
        expected = (q_x @ q_w.T) * s_x.double() * s_w
        if layer.bias is not None:
            expected = expected + layer.bias.double()
        with torch.no_grad():
            got, reference = layer(x), getattr(layer, token_quant.FAST).reference(x)
        # Bounds from the arithmetic, per output (u: float32's unit roundoff). The fast path's integer sum is
        # exact and below 2^24, so its float32 value too; then two scalings and the bias add round once
        # each. The reference rounds each product's factor and sums d_in products in float32 (in any order:
        # |error| <= (d_in + 2) u sum|terms|).
        u = 2.0**-24
        magnitude = (q_x.abs() @ q_w.abs().T) * s_x.double() * s_w
        assert (q_x.abs() @ q_w.abs().T).max() < 2**24
        assert ((got.double() - expected).abs() <= 3 * u * expected.abs()).all()
        slack = (layer.in_features + 2) * u * magnitude + u * expected.abs()
        assert ((reference.double() - expected).abs() <= slack).all()  # the reference's float32 sums


def test_float8_layers_are_compressed_tensors_own_arithmetic_bit_for_bit(builds):
    for layer in fast_layers(builds["fp8-e4m3-dyn"]):
        x = inputs(layer.in_features, seed=1)
        with torch.no_grad():
            assert torch.equal(layer(x), getattr(layer, token_quant.FAST).reference(x))


def test_inputs_the_fast_forward_does_not_take_run_the_reference(builds):
    """A 2-D input (compressed-tensors quantizes it per tensor, not per token), another dtype, or
    quantization switched off: the layer's own reference forward, unchanged."""
    for build in builds.values():
        layer = fast_layers(build)[0]
        reference = getattr(layer, token_quant.FAST).reference
        flat = inputs(layer.in_features, seed=2)[0]
        with torch.no_grad():
            assert torch.equal(layer(flat), reference(flat))
            layer.quantization_enabled = False
            try:
                x = inputs(layer.in_features, seed=3)
                assert torch.equal(layer(x), reference(x))
            finally:
                del layer.quantization_enabled


def test_an_int8_layer_whose_weight_is_edited_runs_the_reference_with_the_new_weight():
    """Codes are cached at load; a weight edited in place afterwards (a test's sabotage) must not be
    multiplied with the stale codes: the layer falls back to compressed-tensors' forward."""
    from pytest_circuits.model.builds import load_build
    from pytest_circuits.model.loading import resolve_model

    layer = fast_layers(load_build(resolve_model("tiny-induction"), "int8-w8a8", "cpu"))[0]
    x = inputs(layer.in_features, seed=4)
    with torch.no_grad():
        before = layer(x)
        layer.weight.mul_(-1)
        after = layer(x)
        assert torch.equal(after, getattr(layer, token_quant.FAST).reference(x))
    torch.testing.assert_close(after, -before, rtol=1e-5, atol=1e-5 * before.abs().max().item())


def test_an_int8_gate_has_the_same_verdicts_on_either_forward():
    """#55: the int8-w8a8 build of the embedded model, gated against the shipped fp32 baseline and
    its own shipped baseline, on the fast forward and on compressed-tensors' reference: the same
    verdict for every built-in invariant."""
    from pytest_circuits.gate.invariants import per_build_invariants
    from pytest_circuits.gate.tolerances import Tolerances
    from pytest_circuits.run.flow import gate_build
    from pytest_circuits.run.run import Run
    from pytest_circuits.settings import build_settings

    verdicts = {}
    for fast in (True, False):
        run = Run(build_settings({"builds": "int8-w8a8", "reference": "fp32", "baselines": None}, Path("baselines")))
        build = run.loaded.build("int8-w8a8")
        if not fast:
            assert token_quant.remove(build.model) == 14 and not token_quant.installed(build.model)
        fixes = {"own": "OWN", "reference": "REF"}
        verdicts[fast] = {
            name: [
                (r.against, r.status)
                for r in gate_build(run.records, run.baselines, "int8-w8a8", name, Tolerances(), fixes).results
            ]
            for name in per_build_invariants()
        }
    assert verdicts[True] == verdicts[False]
    assert all(results for results in verdicts[True].values())  # every invariant compared something


@pytest.mark.parametrize("vnni", [True, False], ids=["torch int8 kernel", "float32 blocks"])
def test_the_int8_product_is_exact_with_or_without_vnni(vnni, monkeypatch):
    """`int8_product` equals the int64 product of the codes, extremes included, with more columns than
    one exact float32 block holds (without VNNI: float32 GEMMs of `EXACT_K` columns, added in int32)."""
    monkeypatch.setattr(token_quant, "int8_kernels", lambda: vnni)
    generator = torch.Generator().manual_seed(0)
    k = 2 * token_quant.EXACT_K + 300
    a = torch.randint(-128, 128, (33, k), dtype=torch.int8, generator=generator)
    b = torch.randint(-128, 128, (k, 40), dtype=torch.int8, generator=generator)
    a[0], b[:, 0] = -128, -128  # the largest products: a row whose every partial sum is 128^2 x its columns
    got = token_quant.int8_product(a, b.t().contiguous().t())  # column-major, as the layers hold their codes
    want = a.to(torch.int64) @ b.to(torch.int64)
    assert got.dtype == torch.int32
    assert torch.equal(got.to(torch.int64), want)
    assert int(want[0, 0]) == 128 * 128 * k  # beyond float32's exact integers: the blocks kept it exact
