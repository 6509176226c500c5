"""The self-check of LLM.int8() builds recomputes bitsandbytes' activation quantization, so its
tolerance is float16's, and a wrong read of an int8 build is still refused."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from pytest_circuits.model import selfcheck
from pytest_circuits.model.builds import load_build
from pytest_circuits.model.dense import dense_weight
from pytest_circuits.model.families import attention_module, get_module
from pytest_circuits.model.llm_int8 import int8_layer
from pytest_circuits.model.loading import resolve_model
from pytest_circuits.model.selfcheck import TOLERANCES, DecompositionError, check_decomposition, measure_decomposition
from pytest_circuits.testing import make_tiny_model

from .conftest import FAMILIES, needs_smollm2, read_v_heads_rolled

bnb = pytest.importorskip("bitsandbytes")


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def _int8_linear(threshold: float, seed: int = 0):
    torch.manual_seed(seed)
    layer = bnb.nn.Linear8bitLt(96, 64, bias=True, has_fp16_weights=False, threshold=threshold)
    layer.weight = bnb.nn.Int8Params(torch.randn(64, 96), requires_grad=False, has_fp16_weights=False)
    with torch.no_grad():
        layer.bias.copy_(torch.randn(64))
    return layer.to("cpu").eval()  # quantizes the weight


def _input(rows: int, outliers: bool, dtype: torch.dtype) -> torch.Tensor:
    x = torch.randn(1, rows, 96, generator=torch.Generator().manual_seed(rows))
    x[..., 7] *= 0.2  # a small entry that the outlier column keeps exact
    if outliers:
        x[..., 5] *= 10  # a whole outlier dimension, as SmolLM2 has
        x[0, 0, 40] = -7.5  # and a single outlier entry: its column stays exact in every row
    return x.to(dtype)


@pytest.mark.parametrize("dtype, agree", [(torch.float32, 1e-6), (torch.float16, 1e-3)])
@pytest.mark.parametrize("rows", [16, 1])
@pytest.mark.parametrize("outliers", [False, True])
@pytest.mark.parametrize("threshold", [6.0, 0.0])
def test_simulated_quantization_reproduces_linear8bitlt(threshold, outliers, rows, dtype, agree):
    """`Int8Layer` applied to the dense read reproduces ``Linear8bitLt``'s output to the rounding of
    its dtype, while the exact product ``X W^T + b`` is off by the quantization (far more)."""
    layer = _int8_linear(threshold)
    x = _input(rows, outliers, dtype)
    with torch.no_grad():
        y = layer(x)
    path, bias = int8_layer(layer), layer.bias.detach()
    assert path is not None and path.threshold == threshold
    weight = dense_weight(layer).double()
    quantized, outlier = path.split(x)
    assert (outlier is not None) == (outliers and threshold > 0)
    if outlier is not None:  # the outlier columns are 5 and 40, exact (and only they)
        assert torch.equal(outlier[0, :, [5, 40]], x[0, :, [5, 40]].double())
        assert torch.count_nonzero(outlier[..., [c for c in range(96) if c not in (5, 40)]]) == 0
    simulated = path.output(
        F.linear(quantized, weight), None if outlier is None else F.linear(outlier, weight), bias, dtype
    )
    assert simulated.dtype == torch.float64 and simulated.shape == y.shape
    assert _relative(simulated, y) <= agree
    exact = F.linear(x.double(), weight, bias.double())
    assert _relative(exact, y) > 2 * agree  # the quantization is visible above the rounding


@pytest.mark.parametrize("threshold", [6.0, 0.0])
def test_codes_are_bitsandbytes_codes(threshold):
    """The quantized part equals bitsandbytes' own ``int8_vectorwise_quant`` codes times ``SCA / 127``."""
    import bitsandbytes.functional as bnbf

    x = _input(16, True, torch.float32)[0]
    codes, scales, columns = bnbf.int8_vectorwise_quant(x.half(), threshold=threshold)
    quantized, _ = int8_layer(_int8_linear(threshold)).split(x)
    expected = codes.double() * scales.double()[:, None] / 127
    if columns is not None and columns.numel():
        expected[:, columns] = 0.0
    torch.testing.assert_close(quantized, expected, atol=1e-12, rtol=1e-12)


def test_int8_layer_only_for_int8_layers_in_eval():
    assert int8_layer(torch.nn.Linear(4, 4)) is None
    layer = _int8_linear(6.0)
    assert int8_layer(layer.train()) is None  # on CPU, training multiplies by the dequantized weight
    assert int8_layer(layer.eval()) is not None


@pytest.mark.parametrize("family", FAMILIES)
def test_int8_build_passes_float16_tolerance(tiny_folder, family, monkeypatch):
    """A tiny int8 build passes at float16's tolerance, at float32 rounding on a CPU; the same
    recomputation without the simulated quantization is off by far more."""
    build = load_build(resolve_model(tiny_folder(family)), "bnb-int8", "cpu")
    attn = attention_module(build.model, 0)
    assert int8_layer(get_module(attn, build.family.out_proj)) is not None
    check = measure_decomposition(build)
    assert check.tolerance == TOLERANCES[torch.float16]
    assert check.worst <= 1e-5, check.errors
    monkeypatch.setattr(selfcheck, "int8_layer", lambda module: None)
    unsimulated = measure_decomposition(build)
    assert max(unsimulated.errors) > 100 * max(check.errors)


def test_int8_build_with_outlier_dimensions_passes(tmp_path):
    """Dimensions of X and z above the threshold 6.0 (kept in float16 by the layer) are reproduced."""
    model = make_tiny_model("llama", seed=4)
    with torch.no_grad():
        for block in model.model.layers:
            block.input_layernorm.weight[[3, 17]] = 25.0  # outlier dimensions of X
            block.self_attn.v_proj.weight[:2] *= 30.0  # and of z (head 0's first two dimensions)
    model.save_pretrained(tmp_path / "m", safe_serialization=True)
    build = load_build(resolve_model(str(tmp_path / "m")), "bnb-int8", "cpu")
    seen: dict[str, torch.Tensor] = {}
    attn = attention_module(build.model, 0)

    def keep_input(name):
        def hook(module, args, output):
            seen.setdefault(name, args[0])

        return hook

    hooks = [get_module(attn, name).register_forward_hook(keep_input(name)) for name in ("v_proj", "o_proj")]
    check = measure_decomposition(build)
    for hook in hooks:
        hook.remove()
    for name in ("v_proj", "o_proj"):
        _, outlier = int8_layer(get_module(attn, name)).split(seen[name])
        assert outlier is not None, name
    assert check.worst <= 1e-5, check.errors


@pytest.fixture(scope="module")
def int8_llama(tiny_folder):
    return load_build(resolve_model(tiny_folder("llama")), "bnb-int8", "cpu")


def test_wrong_read_of_int8_build_is_refused(int8_llama):
    wrong = dataclasses.replace(int8_llama.family, qkv=("q_proj", "v_proj", "k_proj"))  # K read as V
    assert min(measure_decomposition(int8_llama, family=wrong).errors) > 10 * TOLERANCES[torch.float16]
    with pytest.raises(DecompositionError, match=r"'llama'.*layer 0.*relative error"):
        check_decomposition(int8_llama, family=wrong)


def test_swapped_heads_of_int8_build_are_refused(int8_llama, monkeypatch):
    assert check_decomposition(int8_llama).ok
    read_v_heads_rolled(monkeypatch)
    with pytest.raises(DecompositionError, match=r"'llama'.*layer 0"):
        check_decomposition(int8_llama)


@pytest.mark.real
@pytest.mark.slow
@needs_smollm2
def test_smollm2_int8_build_passes_the_check(monkeypatch):
    """SmolLM2-135M's activations have dimensions near 6: unsimulated, LLM.int8() moves its attention
    output by up to 0.28 relative (layer 8); simulated, every layer agrees to float32 rounding."""
    build = load_build(resolve_model("smollm2-135m"), "bnb-int8", "cpu")  # runs the check
    check = measure_decomposition(build)
    assert check.ok and check.worst <= 1e-5, check.errors
    monkeypatch.setattr(selfcheck, "int8_layer", lambda module: None)
    assert max(measure_decomposition(build).errors) > 10 * check.tolerance
