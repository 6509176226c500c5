"""Pre-quantized serving formats: compressed-tensors checkpoints written here at test time with
compressed-tensors' own compressors (W4A16 / W8A16 pack-quantized, FP8 and int8 W8A8 with
dynamic per-token activations), loaded as external builds and as the model itself, and the
``fp8-e4m3``, ``fp8-e4m3-dyn`` and ``int8-w8a8`` recipes.

The per-head read is checked against the stored codes and scales unpacked by hand from the
safetensors file and against compressed-tensors' own dequantiser; the run-time activation
quantization against a per-token float8 quantization computed here.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from pytest_circuits.errors import RecipeError
from pytest_circuits.settings import build_settings

from .conftest import needs_embedded, needs_smollm2

pytest.importorskip(
    "compressed_tensors", reason='compressed-tensors is not installed: pip install "pytest-circuits[formats]"'
)

pytestmark = needs_embedded

# scheme written -> (group size, stored code dtype, format named in the identity)
SCHEMES = {
    "W4A16": (32, "I32", "pack-quantized"),
    "W8A16": (64, "I32", "pack-quantized"),
    "W8A8": (None, "I8", "int-quantized"),
    "FP8_DYNAMIC": (None, "F8_E4M3", "float-quantized"),
}


def one_line(error) -> str:
    text = str(error.value)
    assert "\n" not in text and "Traceback" not in text, text
    return text


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    from pytest_circuits.model.compressed import write_checkpoint
    from pytest_circuits.model.loading import resolve_model

    folder = resolve_model("tiny-induction").folder
    root = tmp_path_factory.mktemp("ct")
    return {name: write_checkpoint(folder, root / name, name, gs) for name, (gs, _, _) in SCHEMES.items()}


@pytest.fixture(scope="module")
def session(checkpoints):
    from pytest_circuits.run.run import Run

    builds = ",".join(
        ["fp32", "fp8-e4m3-dyn", "int8-w8a8", *(f"{k.lower().replace('_', '-')}={v}" for k, v in checkpoints.items())]
    )
    raw = {"builds": builds, "reference": "fp32", "baselines": None}  # the shipped fp32 baseline's probe settings
    return Run(build_settings(raw, Path("baselines"), device="cpu"))


def build_name(scheme: str) -> str:
    return scheme.lower().replace("_", "-")


def stored(folder: Path) -> tuple[dict[str, torch.Tensor], dict]:
    from safetensors.torch import load_file

    return load_file(folder / "model.safetensors"), json.loads((folder / "config.json").read_text())


def assert_W_O_read(build, layer: int, o_proj: torch.Tensor) -> None:
    """The per-head read of ``layer`` (`layer_weights`) is ``o_proj``'s columns, head by head, bit for bit."""
    from pytest_circuits.model.weights import layer_weights

    lw, d = layer_weights(build.model, layer), build.geometry.d_head
    for h in range(build.geometry.n_heads):
        torch.testing.assert_close(lw.W_O[h], o_proj[:, h * d : (h + 1) * d].T, rtol=0, atol=0)


def unpack_by_hand(packed: torch.Tensor, bits: int, columns: int) -> torch.Tensor:
    """Codes of a pack-quantized row: element i sits at bits ``[i*b, (i+1)*b)`` of the row's
    int32 words, stored unsigned with offset ``2^(b-1)``."""
    words = packed.to(torch.int64) & 0xFFFFFFFF
    i = torch.arange(columns)
    codes = (words[:, (i * bits) // 32] >> ((i * bits) % 32)) & ((1 << bits) - 1)  # no code spans two words for b=4,8
    return codes - (1 << (bits - 1))


def dequantized_by_hand(tensors: dict, prefix: str, scheme: str) -> torch.Tensor:
    """``W = q * s`` from the stored codes and scales (symmetric: no zero point)."""
    group, _, _ = SCHEMES[scheme]
    scale = tensors[f"{prefix}.weight_scale"].float()
    if f"{prefix}.weight_packed" in tensors:
        out, columns = tensors[f"{prefix}.weight_shape"].tolist()
        codes = unpack_by_hand(tensors[f"{prefix}.weight_packed"], 4 if scheme == "W4A16" else 8, columns).float()
        return codes * scale.repeat_interleave(group, dim=1)[:, :columns]
    return tensors[f"{prefix}.weight"].float() * scale  # int8 or float8 codes, per-channel scales


def dequantized_by_compressed_tensors(tensors: dict, config: dict, prefix: str) -> torch.Tensor:
    from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32
    from compressed_tensors.quantization import QuantizationArgs
    from compressed_tensors.quantization.lifecycle.forward import dequantize

    args = QuantizationArgs(**config["quantization_config"]["config_groups"]["group_0"]["weights"])
    codes = tensors.get(f"{prefix}.weight")
    if codes is None:
        shape = torch.Size(tensors[f"{prefix}.weight_shape"].tolist())
        codes = unpack_from_int32(tensors[f"{prefix}.weight_packed"], args.num_bits, shape)
    return dequantize(codes, tensors[f"{prefix}.weight_scale"], None, args, dtype=torch.float32)


# ---------------------------------------------------------------- the per-head read is the format's W


@pytest.mark.parametrize("scheme", list(SCHEMES))
def test_per_head_read_is_the_formats_dequantization(session, checkpoints, scheme):
    from pytest_circuits.model.dense import dense_weight
    from pytest_circuits.model.weights import layer_weights

    tensors, config = stored(checkpoints[scheme])
    build = session.loaded.build(build_name(scheme))
    geo = build.geometry
    for layer in range(geo.n_layers):
        attn = build.model.model.layers[layer].self_attn
        for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
            prefix = f"model.layers.{layer}.self_attn.{proj}"
            by_hand = dequantized_by_hand(tensors, prefix, scheme)
            theirs = dequantized_by_compressed_tensors(tensors, config, prefix)
            torch.testing.assert_close(by_hand, theirs, rtol=0, atol=0)
            torch.testing.assert_close(dense_weight(getattr(attn, proj)), by_hand, rtol=0, atol=0)
        lw = layer_weights(build.model, layer)
        v = dequantized_by_hand(tensors, f"model.layers.{layer}.self_attn.v_proj", scheme)
        o = dequantized_by_hand(tensors, f"model.layers.{layer}.self_attn.o_proj", scheme)
        d = geo.d_head
        for g in range(geo.n_kv_heads):
            torch.testing.assert_close(lw.W_V[g], v[g * d : (g + 1) * d].T, rtol=0, atol=0)
        assert_W_O_read(build, layer, o)
    fp32 = session.loaded.build("fp32").model.model.layers[0].self_attn.q_proj.weight
    assert not torch.equal(dense_weight(build.model.model.layers[0].self_attn.q_proj), fp32)  # really quantized


@pytest.mark.parametrize("scheme", list(SCHEMES))
def test_identity_names_format_scheme_modules_and_forward(session, checkpoints, scheme):
    group, code_type, fmt = SCHEMES[scheme]
    build = session.loaded.build(build_name(scheme)).identity.as_dict()
    assert build["format"] == f"compressed-tensors-{fmt}" and build["backend"] == "compressed-tensors"
    assert build["tensor_types"][code_type] == 14  # the 14 projections' codes, stored quantized
    quantization = build["quantization"]
    assert f"{fmt} [Linear]: weights " in quantization and "ignore lm_head" in quantization
    assert "quantized 14 Linear" in quantization and "dense: lm_head" in quantization
    if group:
        assert f"group {group} symmetric" in quantization
    dynamic = scheme in ("W8A8", "FP8_DYNAMIC")
    assert ("token symmetric dynamic" in quantization) == dynamic
    per_token = {
        "W8A8": "input quantized per token to int8 at run time",
        "FP8_DYNAMIC": "input fake-quantized per token",
    }
    assert ("per token" in build["forward"]) == dynamic and (not dynamic or per_token[scheme] in build["forward"])
    assert ("torch._int_mm" in build["forward"]) == (scheme == "W8A8")  # model/token_quant.py's int8 product
    assert "compressed-tensors reference on cpu" in build["forward"]
    assert quantization in session.identity_lines(build_name(scheme))[0]


# ---------------------------------------------------------------- the forward: dynamic per-token activations


def test_fp8_dynamic_forward_quantizes_each_token_as_the_format_defines(session):
    """``Q(x) = fp8_e4m3(x / s) * s`` with ``s = max_j |x_j| / 448`` per token, then ``Q(x) W^T``."""
    q_proj = session.loaded.build("fp8-dynamic").model.model.layers[0].self_attn.q_proj
    x = torch.randn(2, 5, q_proj.in_features, generator=torch.Generator().manual_seed(0)) * 3
    s = x.abs().amax(dim=-1, keepdim=True) / torch.finfo(torch.float8_e4m3fn).max
    quantized = (x / s).clamp(-448, 448).to(torch.float8_e4m3fn).float() * s
    expected = quantized @ q_proj.weight.detach().T
    with torch.no_grad():
        torch.testing.assert_close(q_proj(x), expected, rtol=1e-6, atol=1e-6)
        assert (q_proj(x) - x @ q_proj.weight.T).abs().max() > 1e-3  # the quantization is really applied


def test_self_check_recomputes_the_activation_quantization(session):
    """The decomposition check feeds V and O what they multiply; without the quantizer it misses."""
    from pytest_circuits.model import selfcheck

    build = session.loaded.build("fp8-dynamic")
    check = selfcheck.measure_decomposition(build)
    assert check.worst < 1e-4 and check.tolerance == selfcheck.INT8_TOLERANCE
    original = selfcheck._input_quant
    try:
        selfcheck._input_quant = selfcheck.int8_layer  # the read as if activations were not quantized
        blind = selfcheck.measure_decomposition(build)
    finally:
        selfcheck._input_quant = original
    assert max(blind.errors) > 10 * check.worst


# ---------------------------------------------------------------- recipes, and the release as the model


@pytest.mark.parametrize("recipe, scheme", [("fp8-e4m3-dyn", "FP8_DYNAMIC"), ("int8-w8a8", "W8A8")])
def test_recipe_is_the_checkpoint_loaded(session, recipe, scheme):
    """A recipe quantizes in memory exactly as its checkpoint, saved and loaded, reads."""
    ours, theirs = (
        session.measured.repeat_probe(recipe).model_figures(),
        session.measured.repeat_probe(build_name(scheme)).model_figures(),
    )
    assert (
        ours["copy_loss"] == theirs["copy_loss"] != session.measured.repeat_probe("fp32").model_figures()["copy_loss"]
    )
    a, b = session.loaded.build(recipe).identity, session.loaded.build(build_name(scheme)).identity
    assert a.quantization == b.quantization and a.backend_version.startswith("compressed-tensors ")


def test_fp8_weight_only_recipe_rounds_weights_to_float8_per_channel(session):
    """``fp8-e4m3``: ``W = fp8(W / s) * s``, ``s = max|W_row| / 448``; the input is not quantized."""
    from pytest_circuits.run.run import Run

    s = build_settings({"builds": "fp8-e4m3", "baselines": None}, Path("baselines"), device="cpu")
    build = Run(s).loaded.build("fp8-e4m3")
    w = session.loaded.build("fp32").model.model.layers[1].mlp.down_proj.weight.detach()
    scale = w.abs().amax(dim=1, keepdim=True) / 448
    expected = (w / scale).to(torch.float8_e4m3fn).float() * scale
    torch.testing.assert_close(build.model.model.layers[1].mlp.down_proj.weight, expected, rtol=0, atol=1e-9)
    assert "input none" in build.identity.quantization and "fake-quantized" not in build.identity.forward


def test_compressed_release_as_the_model(checkpoints):
    """``--circuits-model DIR`` where DIR is itself a compressed-tensors release."""
    from pytest_circuits.model.builds import load_build
    from pytest_circuits.model.loading import resolve_model

    build = load_build(resolve_model(str(checkpoints["W4A16"])), "fp32", "cpu")
    assert "int4 group 32" in build.identity.quantization
    tensors, _ = stored(checkpoints["W4A16"])
    prefix = "model.layers.1.mlp.up_proj"
    torch.testing.assert_close(
        build.model.model.layers[1].mlp.up_proj.weight, dequantized_by_hand(tensors, prefix, "W4A16"), rtol=0, atol=0
    )


def test_gate_runs_on_a_checkpoint_against_fp32(session):
    from pytest_circuits.gate.tolerances import Tolerances
    from pytest_circuits.record.schema import Record
    from pytest_circuits.run.flow import gate_build

    outcome = gate_build(
        session.records, session.baselines, "fp8-dynamic", "copying_heads", Tolerances(), {"own": "F", "reference": "F"}
    )
    assert outcome.passed and outcome.results[0].against == "fp32 baseline", outcome.message()
    record = session.records.record("fp8-dynamic", knockout=False).data
    Record.model_validate(json.loads(json.dumps(record)))  # the identity's new fields validate
    assert "float-quantized" in record["build"]["quantization"]


def test_missing_library_is_one_line_naming_the_extra(checkpoints, monkeypatch):
    import sys

    from pytest_circuits.model.external import load_external_build
    from pytest_circuits.model.loading import resolve_model
    from pytest_circuits.model.recipes import BuildSpec

    monkeypatch.setitem(sys.modules, "compressed_tensors", None)  # import fails as if not installed
    with pytest.raises(RecipeError) as error:
        load_external_build(resolve_model("tiny-induction"), BuildSpec("w4", str(checkpoints["W4A16"])), "cpu")
    text = one_line(error)
    assert text.startswith("external build w4=") and 'pip install "pytest-circuits[formats]"' in text


# ---------------------------------------------------------------- NVFP4: float4 weights, float8 group scales

FP4_E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # code & 7 -> magnitude; bit 3: sign


@pytest.fixture(scope="module")
def nvfp4(tmp_path_factory) -> dict[str, Path]:
    """NVFP4A16 (weights only) and NVFP4 (W4A4: the input's global scale from a calibration forward)."""
    from pytest_circuits.model.compressed import write_checkpoint
    from pytest_circuits.model.loading import resolve_model

    folder, root = resolve_model("tiny-induction").folder, tmp_path_factory.mktemp("nvfp4")
    ids = torch.randint(0, 512, (8, 64), generator=torch.Generator().manual_seed(0))
    return {name: write_checkpoint(folder, root / name, name, calibration=ids) for name in ("NVFP4A16", "NVFP4")}


def nvfp4_by_hand(tensors: dict, prefix: str) -> torch.Tensor:
    """``W = e2m1(code) * s / g``: two codes a byte (low nibble first), a float8 scale ``s`` per
    16 columns, one float32 global scale ``g``; rounded to bfloat16 as the decompressor returns it."""
    packed = tensors[f"{prefix}.weight_packed"].to(torch.int64)
    codes = torch.stack([packed & 0xF, packed >> 4], dim=-1).flatten(1)
    magnitude = torch.tensor(FP4_E2M1)[codes & 7]
    values = torch.where(codes >= 8, -magnitude, magnitude)
    scale = tensors[f"{prefix}.weight_scale"].float().repeat_interleave(16, dim=1)
    return (values * (scale / tensors[f"{prefix}.weight_global_scale"])).to(torch.bfloat16).float()


@pytest.mark.parametrize("scheme", ["NVFP4A16", "NVFP4"])
def test_nvfp4_checkpoint_loads_and_reads_the_formats_dequantization(nvfp4, scheme):
    from compressed_tensors.compressors.nvfp4 import NVFP4PackedCompressor
    from compressed_tensors.quantization import QuantizationScheme

    from pytest_circuits.model.external import load_external_build
    from pytest_circuits.model.loading import resolve_model
    from pytest_circuits.model.recipes import BuildSpec
    from pytest_circuits.model.weights import layer_weights

    build = load_external_build(resolve_model("tiny-induction"), BuildSpec("nv", str(nvfp4[scheme])), "cpu")
    tensors, config = stored(nvfp4[scheme])
    group = config["quantization_config"]["config_groups"]["group_0"]
    theirs_scheme = QuantizationScheme(**group)
    for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
        prefix = f"model.layers.1.self_attn.{proj}"
        mine = nvfp4_by_hand(tensors, prefix)
        local = {k.removeprefix(prefix + "."): v for k, v in tensors.items() if k.startswith(prefix + ".")}
        theirs = NVFP4PackedCompressor.decompress(local, theirs_scheme)["weight"].float()
        torch.testing.assert_close(mine, theirs, rtol=0, atol=0)
        torch.testing.assert_close(build.model.get_submodule(prefix).weight, mine, rtol=0, atol=0)
    d, o = build.geometry.d_head, nvfp4_by_hand(tensors, "model.layers.1.self_attn.o_proj")
    torch.testing.assert_close(layer_weights(build.model, 1).W_O[1], o[:, d : 2 * d].T, rtol=0, atol=0)
    identity = build.identity
    assert identity.format == "compressed-tensors-nvfp4-pack-quantized" and identity.tensor_types["U8"] == 14
    assert "weights float4 tensor_group 16 symmetric float8_e4m3fn scales" in identity.quantization
    assert "to bfloat16 (its NVFP4 decompressor's dtype)" in identity.forward
    w4a4 = scheme == "NVFP4"
    assert ("input fake-quantized per 16 values at run time" in identity.forward) == w4a4
    shared = {tensors[f"model.layers.0.self_attn.{p}.weight_global_scale"].item() for p in ("q_proj", "k_proj")}
    assert len(shared) == 1  # q, k, v share one global scale (vLLM fuses them)


def test_nvfp4_forward_quantizes_the_input_per_16_values(nvfp4):
    """``s = fp8(g max|x_16| / 6)``, ``Q(x) = e2m1(x g / s) s / g`` with the layer's static global
    input scale ``g``, then ``Q(x) W^T``."""
    from pytest_circuits.model.external import load_external_build
    from pytest_circuits.model.loading import resolve_model
    from pytest_circuits.model.recipes import BuildSpec

    build = load_external_build(resolve_model("tiny-induction"), BuildSpec("nv", str(nvfp4["NVFP4"])), "cpu")
    layer = build.model.model.layers[0].mlp.down_proj
    g = layer.input_global_scale.float()
    x = torch.randn(3, layer.in_features, generator=torch.Generator().manual_seed(1))
    blocks = x.reshape(3, -1, 16)
    s = (blocks.abs().amax(-1, keepdim=True) * g / 6).to(torch.float8_e4m3fn).float()
    scaled = (blocks * g / s).clamp(-6, 6)
    grid = torch.tensor(FP4_E2M1)
    nearest = grid[(scaled.abs()[..., None] - grid).abs().argmin(-1)] * scaled.sign()
    expected = (nearest * s / g).reshape(3, -1) @ layer.weight.detach().T
    with torch.no_grad():
        torch.testing.assert_close(layer(x), expected, rtol=1e-5, atol=1e-5)
        assert (layer(x) - x @ layer.weight.T).abs().max() > 1e-2  # the input is really quantized


# ---------------------------------------------------------------- SmolLM2-135M (real, slow)


@pytest.mark.slow
@pytest.mark.real
@needs_smollm2
def test_smollm2_w4a16_checkpoint_loads_as_a_build(tmp_path):
    from pytest_circuits.model.compressed import write_checkpoint
    from pytest_circuits.model.loading import resolve_model
    from pytest_circuits.run.run import Run

    folder = write_checkpoint(resolve_model("smollm2-135m").folder, tmp_path / "w4", "W4A16", 64)
    s = build_settings(
        {"model": "smollm2-135m", "builds": f"fp32,w4={folder}", "baselines": None}, Path("baselines"), device="cpu"
    )
    session = Run(s)
    build = session.loaded.build("w4")
    assert "int4 group 64" in build.identity.quantization and "quantized 210 Linear" in build.identity.quantization
    tensors, _ = stored(folder)
    prefix = "model.layers.7.self_attn.o_proj"
    codes = unpack_by_hand(tensors[f"{prefix}.weight_packed"], 4, 576).float()
    expected = codes * tensors[f"{prefix}.weight_scale"].float().repeat_interleave(64, dim=1)
    torch.testing.assert_close(build.model.model.layers[7].self_attn.o_proj.weight, expected, rtol=0, atol=0)


@pytest.mark.slow
@pytest.mark.real
@needs_smollm2
@pytest.mark.parametrize("scheme", ["W8A16", "W8A8", "FP8_DYNAMIC"])
def test_smollm2_compressed_checkpoints_load_and_read_the_formats_dequantization(tmp_path, scheme):
    """SmolLM2 written by compressed-tensors at each other scheme loads as a build whose per-head
    read of a layer is compressed-tensors' own dequantization, bit for bit."""
    from pytest_circuits.model.compressed import write_checkpoint
    from pytest_circuits.model.loading import resolve_model
    from pytest_circuits.run.run import Run

    group, _, fmt = SCHEMES[scheme]
    folder = write_checkpoint(resolve_model("smollm2-135m").folder, tmp_path / "ct", scheme, group)
    raw = {"model": "smollm2-135m", "builds": f"fp32,ct={folder}", "baselines": None}
    build = Run(build_settings(raw, Path("baselines"), device="cpu")).loaded.build("ct")
    identity = build.identity.as_dict()
    assert identity["format"] == f"compressed-tensors-{fmt}" and "quantized 210 Linear" in identity["quantization"]
    tensors, config = stored(folder)
    o = dequantized_by_compressed_tensors(tensors, config, "model.layers.7.self_attn.o_proj")
    torch.testing.assert_close(
        o, dequantized_by_hand(tensors, "model.layers.7.self_attn.o_proj", scheme), rtol=0, atol=0
    )
    assert_W_O_read(build, 7, o)


@pytest.mark.slow
@pytest.mark.real
@needs_smollm2
def test_smollm2_nvfp4_checkpoint_reads_the_formats_dequantization(tmp_path):
    from pytest_circuits.model.compressed import write_checkpoint
    from pytest_circuits.model.loading import resolve_model
    from pytest_circuits.run.run import Run

    ids = torch.randint(0, 49152, (8, 64), generator=torch.Generator().manual_seed(0))
    folder = write_checkpoint(resolve_model("smollm2-135m").folder, tmp_path / "nv", "NVFP4", calibration=ids)
    raw = {"model": "smollm2-135m", "builds": f"fp32,nv={folder}", "baselines": None}
    build = Run(build_settings(raw, Path("baselines"), device="cpu")).loaded.build("nv")
    assert "quantized 210 Linear" in build.identity.quantization
    tensors, _ = stored(folder)
    assert_W_O_read(build, 7, nvfp4_by_hand(tensors, "model.layers.7.self_attn.o_proj"))


# ---------------------------------------------------------------- gptq-int4 / awq-int4 (llm-compressor)


def test_calibrated_recipe_names_carry_method_and_group_size():
    from pytest_circuits.model.recipes import get_recipe

    assert (get_recipe("gptq-int4").method, get_recipe("gptq-int4").group_size) == ("gptq", 128)
    awq = get_recipe("awq-int4-g64")
    assert (awq.name, awq.method, awq.group_size, awq.backend) == ("awq-int4-g64", "awq", 64, "llm-compressor")
    assert "group 64" in awq.summary
    for bad in ("gptq-int4-g0", "gptq-int8", "awq-int4-gx"):
        with pytest.raises(RecipeError) as error:
            get_recipe(bad)
        one_line(error)


def test_calibrated_recipe_without_llmcompressor_is_one_line(monkeypatch, capsys):
    from pytest_circuits.cli import main
    from pytest_circuits.model.calibrated import LLMC_PYTHON

    monkeypatch.delenv(LLMC_PYTHON, raising=False)
    assert main(["scan", "tiny-induction", "--build", "gptq-int4", "--no-knockout", "--device", "cpu"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and LLMC_PYTHON in err and "llmcompressor==" in err


def test_calibration_data_is_made_here_and_is_not_the_probe():
    """Seeded ids for a model without a tokenizer (same every time); ordinary text otherwise,
    disjoint from the held-out text."""
    from pytest_circuits.model.builds import read_config
    from pytest_circuits.model.calibrated import CALIBRATION_MODULES, HELD_OUT_MODULES, calibration_ids, stdlib_text
    from pytest_circuits.model.loading import resolve_model

    source = resolve_model("tiny-induction")
    (a, what), (b, _) = (
        calibration_ids(source, read_config(source.folder)),
        calibration_ids(source, read_config(source.folder)),
    )
    assert torch.equal(a, b) and a.shape == (32, 256) and "seeded uniform token ids" in what and "sha256" in what
    assert not set(CALIBRATION_MODULES) & set(HELD_OUT_MODULES)
    text, held_out = stdlib_text(CALIBRATION_MODULES), stdlib_text(HELD_OUT_MODULES)
    assert len(text.split()) > 15_000 and text[:2000] not in held_out


needs_llmc = pytest.mark.skipif(
    "PYTEST_CIRCUITS_LLMCOMPRESSOR_PYTHON" not in __import__("os").environ,
    reason="gptq-int4/awq-int4 run llm-compressor in its own environment: set PYTEST_CIRCUITS_LLMCOMPRESSOR_PYTHON",
)


@pytest.mark.slow
@needs_llmc
def test_gptq_recipe_is_llm_compressors_checkpoint_read_exactly(tmp_path, monkeypatch):
    """gptq-int4-g64 loads llm-compressor's checkpoint: the read is its codes times its scales,
    and GPTQ's weights are not round-to-nearest's on the same grid."""
    from pytest_circuits.model.builds import load_build, read_config
    from pytest_circuits.model.calibrated import calibrated_checkpoint
    from pytest_circuits.model.compressed import write_checkpoint
    from pytest_circuits.model.loading import resolve_model

    monkeypatch.setenv("PYTEST_CIRCUITS_CACHE", str(tmp_path / "cache"))
    source = resolve_model("tiny-induction")
    build = load_build(source, "gptq-int4-g64", "cpu")
    assert "int4 group 64" in build.identity.quantization and "calibration 32 x 256" in build.identity.quantization
    folder, _ = calibrated_checkpoint(source, read_config(source.folder), "gptq", 64, "gptq-int4-g64")  # cached
    tensors, _ = stored(folder)
    rtn, _ = stored(write_checkpoint(source.folder, tmp_path / "rtn", "W4A16", 64))
    prefix = "model.layers.0.self_attn.v_proj"
    codes = unpack_by_hand(tensors[f"{prefix}.weight_packed"], 4, 128).float()
    expected = codes * tensors[f"{prefix}.weight_scale"].float().repeat_interleave(64, dim=1)
    torch.testing.assert_close(build.model.model.layers[0].self_attn.v_proj.weight, expected, rtol=0, atol=0)
    assert not torch.equal(tensors[f"{prefix}.weight_packed"], rtn[f"{prefix}.weight_packed"])


# ---------------------------------------------------------------- torchao and optimum-quanto checkpoints


@pytest.fixture(scope="module")
def other_formats(tmp_path_factory) -> dict[str, Path]:
    """torchao (int8 weight-only, int8 dynamic) and optimum-quanto (int8, int4) checkpoints of the
    embedded model, each saved by its own library."""
    pytest.importorskip("torchao", reason='torchao is not installed: pip install "pytest-circuits[formats]"')
    pytest.importorskip(
        "optimum.quanto", reason='optimum-quanto is not installed: pip install "pytest-circuits[formats]"'
    )
    from optimum.quanto import QuantizedModelForCausalLM, qint4, qint8
    from torchao.quantization import Int8DynamicActivationInt8WeightConfig, Int8WeightOnlyConfig
    from transformers import AutoModelForCausalLM, TorchAoConfig

    from pytest_circuits.model.loading import resolve_model

    folder, root = resolve_model("tiny-induction").folder, tmp_path_factory.mktemp("formats")
    for name, config in (("ao8", Int8WeightOnlyConfig()), ("ao8dyn", Int8DynamicActivationInt8WeightConfig())):
        quantization = TorchAoConfig(quant_type=config)
        AutoModelForCausalLM.from_pretrained(
            folder, dtype=torch.float32, quantization_config=quantization
        ).save_pretrained(root / name)
    for name, qtype in (("quanto8", qint8), ("quanto4", qint4)):
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
        QuantizedModelForCausalLM.quantize(model, weights=qtype, exclude="lm_head").save_pretrained(root / name)
    return {name: root / name for name in ("ao8", "ao8dyn", "quanto8", "quanto4")}


def by_hand(folder: Path, prefix: str) -> torch.Tensor:
    """The weight as each format stores it: torchao ``qdata * scale``; quanto int8 ``data * scale``,
    int4 ``q * scale - shift`` with two codes per byte (rows of the first half in the low nibble)."""
    from safetensors.torch import load_file

    t = load_file(folder / "model.safetensors")
    if f"{prefix}._weight_qdata" in t:
        return t[f"{prefix}._weight_qdata"].float() * t[f"{prefix}._weight_scale"]
    if f"{prefix}.weight._data._data" in t:
        packed = t[f"{prefix}.weight._data._data"]
        codes = torch.cat([packed & 0xF, packed >> 4], dim=0).float()
        return codes * t[f"{prefix}.weight._scale"] - t[f"{prefix}.weight._shift"]
    return t[f"{prefix}.weight._data"].float() * t[f"{prefix}.weight._scale"]


@pytest.mark.parametrize(
    "name, fmt, says",
    [
        ("ao8", "torchao", "float x int8 matmul"),
        ("ao8dyn", "torchao", "input quantized per token to int8"),
        ("quanto8", "optimum-quanto", "QLinear forward"),
        ("quanto4", "optimum-quanto", "QLinear forward"),
    ],
)
def test_torchao_and_quanto_checkpoints_load_and_read_exactly(other_formats, name, fmt, says):
    from pytest_circuits.model.external import load_external_build
    from pytest_circuits.model.loading import resolve_model
    from pytest_circuits.model.recipes import BuildSpec
    from pytest_circuits.model.selfcheck import measure_decomposition

    build = load_external_build(resolve_model("tiny-induction"), BuildSpec(name, str(other_formats[name])), "cpu")
    identity = build.identity
    assert identity.format == fmt and says in identity.forward and "quantized 14 Linear" in identity.quantization
    assert_W_O_read(build, 1, by_hand(other_formats[name], "model.layers.1.self_attn.o_proj"))
    assert measure_decomposition(build).worst < 1e-3  # torchao's dynamic int8 input is recomputed too


@pytest.mark.parametrize("drop", ["model.layers.1.self_attn.v_proj.weight._scale", "model.norm.weight"])
def test_quanto_checkpoint_missing_a_tensor_is_refused(other_formats, tmp_path, drop):
    """quanto's own requantize loads with strict=False and would leave the tensor uninitialised."""
    import shutil

    from safetensors.torch import load_file, save_file

    from pytest_circuits.errors import ModelLoadError
    from pytest_circuits.model.external import load_external_build
    from pytest_circuits.model.loading import resolve_model
    from pytest_circuits.model.recipes import BuildSpec

    folder = shutil.copytree(other_formats["quanto8"], tmp_path / "q")
    tensors = load_file(folder / "model.safetensors")
    save_file({k: v for k, v in tensors.items() if k != drop}, str(folder / "model.safetensors"), {"format": "pt"})
    with pytest.raises(ModelLoadError) as error:
        load_external_build(resolve_model("tiny-induction"), BuildSpec("q", str(folder)), "cpu")
    text = one_line(error)
    assert text.startswith("external build q=") and "1 tensor missing from the checkpoint" in text
    assert text.endswith(
        f"(first: {drop}); refusing to read figures from an incomplete or foreign checkpoint "
        "(re-save it with save_pretrained, or re-convert the file)"
    )


@pytest.mark.parametrize("name, module", [("ao8", "torchao"), ("quanto8", "optimum.quanto")])
def test_missing_format_library_is_one_line(other_formats, monkeypatch, name, module):
    import sys

    from pytest_circuits.model.external import load_external_build
    from pytest_circuits.model.loading import resolve_model
    from pytest_circuits.model.recipes import BuildSpec

    monkeypatch.setitem(sys.modules, module, None)
    with pytest.raises(RecipeError) as error:
        load_external_build(resolve_model("tiny-induction"), BuildSpec(name, str(other_formats[name])), "cpu")
    assert 'pip install "pytest-circuits[formats]"' in one_line(error)


# ---------------------------------------------------------------- on a GPU


@pytest.mark.cuda
@pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason="the formats' CUDA path (decompression and torchao's int8 kernels on the GPU) needs a CUDA device; none here",
)
@pytest.mark.parametrize("name", ["fp8-dynamic", "w4a16"])
def test_compressed_checkpoint_on_cuda_matches_the_cpu(session, checkpoints, name):
    """The same checkpoint on the GPU: the read is the same W, and the copy loss moves only by float32 noise."""
    from pytest_circuits.model.external import load_external_build
    from pytest_circuits.model.loading import resolve_model
    from pytest_circuits.model.recipes import BuildSpec
    from pytest_circuits.rungs.probe import run_repeat_probe

    scheme = {"fp8-dynamic": "FP8_DYNAMIC", "w4a16": "W4A16"}[name]
    gpu = load_external_build(resolve_model("tiny-induction"), BuildSpec(name, str(checkpoints[scheme])), "cuda")
    assert gpu.identity.device.startswith("cuda") and "reference on cuda" in gpu.identity.forward
    cpu = session.loaded.build(name)
    q = "model.layers.0.self_attn.q_proj"
    assert torch.equal(gpu.model.get_submodule(q).weight.cpu(), cpu.model.get_submodule(q).weight)
    ours = run_repeat_probe(gpu, session.settings.probe).model_figures()["copy_loss"]
    assert ours == pytest.approx(session.measured.repeat_probe(name).model_figures()["copy_loss"], abs=1e-3)


@pytest.mark.slow
@pytest.mark.real
@needs_smollm2
@pytest.mark.parametrize("name", ["torchao-int8", "torchao-int8-dyn", "quanto-int8", "quanto-int4"])
def test_smollm2_torchao_and_quanto_checkpoints_load_as_builds(tmp_path, name):
    pytest.importorskip("torchao", reason='torchao is not installed: pip install "pytest-circuits[formats]"')
    pytest.importorskip(
        "optimum.quanto", reason='optimum-quanto is not installed: pip install "pytest-circuits[formats]"'
    )
    from transformers import AutoModelForCausalLM

    from pytest_circuits.model.external import load_external_build
    from pytest_circuits.model.loading import resolve_model
    from pytest_circuits.model.recipes import BuildSpec

    source = resolve_model("smollm2-135m")
    model = AutoModelForCausalLM.from_pretrained(source.folder, dtype=torch.float32)
    if name.startswith("torchao"):
        from torchao.quantization import Int8DynamicActivationInt8WeightConfig, Int8WeightOnlyConfig
        from transformers import TorchAoConfig

        kind = Int8DynamicActivationInt8WeightConfig() if name.endswith("dyn") else Int8WeightOnlyConfig()
        config = TorchAoConfig(quant_type=kind)
        model = AutoModelForCausalLM.from_pretrained(source.folder, dtype=torch.float32, quantization_config=config)
        model.save_pretrained(tmp_path / name)
    else:
        from optimum.quanto import QuantizedModelForCausalLM, qint4, qint8

        qtype = qint4 if name.endswith("int4") else qint8
        QuantizedModelForCausalLM.quantize(model, weights=qtype, exclude="lm_head").save_pretrained(tmp_path / name)
    build = load_external_build(source, BuildSpec(name, str(tmp_path / name)), "cpu")
    assert "quantized 210 Linear" in build.identity.quantization
    prefix = "model.layers.29.self_attn.o_proj"
    o = build.model.get_submodule(prefix).weight.dequantize()  # the format's own dequantizer
    if name != "quanto-int4":  # by_hand knows the embedded model's int4 layout, not SmolLM2's groups
        torch.testing.assert_close(o, by_hand(tmp_path / name, prefix), rtol=0, atol=0)
    assert_W_O_read(build, 29, o)
