"""KV-cache precisions (model/kv_formats.py, model/kv_cache.py): each element format against the
library or paper that defines it, the one-forward simulation against a real token-by-token decode
through a transformers cache, and the cache as a build dimension of the gate."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pytest_circuits.errors import RecipeError
from pytest_circuits.model.kv_cache import (
    IQ4_NL_GRID,
    attach_kv_cache,
    cache_of,
    cache_pairs,
    ggml_roundtrip,
    quantize_keys,
    quantize_values,
)
from pytest_circuits.model.kv_formats import KV_FORMATS, parse_kv, split_kv
from pytest_circuits.model.recipes import parse_build_spec, parse_build_specs

from .conftest import needs_smollm2


def _sample(shape, seed=0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * torch.exp(torch.randn(shape[:-1] + (1,), generator=g))
    x[0, :32] = 0.0  # an all-zero block
    x[1, 5] = 40.0  # an outlier
    return x


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q5_0", "Q5_1"])
def test_ggml_blocks_are_the_gguf_packages_quantizers_bit_for_bit(kind):
    from gguf import GGMLQuantizationType, quants

    x = _sample((6, 64))
    qtype = GGMLQuantizationType[kind]
    expected = quants.dequantize(quants.quantize(x.numpy(), qtype), qtype)
    got = ggml_roundtrip(x, kind.lower()).numpy()
    np.testing.assert_array_equal(got, expected.astype(np.float32))


def _with_ties() -> torch.Tensor:
    """Blocks whose scaled values land on k + 1/2: a crafted block (max 127, so ``1/d`` is 1) and
    bf16-rounded rows (few mantissa bits: ties are common in real caches)."""
    g = torch.Generator().manual_seed(5)
    crafted = torch.tensor([127.0, 0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 3.5, 4.5, -126.5] + [0.25, -0.75] * 11)
    rows = (torch.randn(3, 32, generator=g) * 4).to(torch.bfloat16).float()
    rows[:, 0] = 127.0
    return torch.cat([crafted.view(1, 32), rows]).view(2, 64)


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q5_0", "Q5_1"])
def test_ggml_blocks_round_ties_as_ggml_does(kind):
    """q4_0 .. q5_1 truncate ``x / d + 0.5`` (llama.cpp's CPU writes its cache with ggml-quants.c's
    ``quantize_row_*_ref`` for them), as the gguf package does, on rows with ties too."""
    from gguf import GGMLQuantizationType, quants

    x = _with_ties()
    qtype = GGMLQuantizationType[kind]
    expected = quants.dequantize(quants.quantize(x.numpy(), qtype), qtype)
    got = ggml_roundtrip(x, kind.lower()).numpy()
    np.testing.assert_array_equal(got, expected.astype(np.float32))


def test_q8_0_blocks_round_as_the_cpus_simd_quantizer():
    """q8_0 is written by ggml-cpu's SIMD ``quantize_row_q8_0`` (x86 AVX/AVX2, ARM NEON): codes
    ``rne(x * (127 / amax))``, ties to even, scale ``fp16(amax / 127)``; written out here in numpy
    float32. The gguf package (``quantize_row_q8_0_ref``, the scalar build's) rounds ties away from
    zero instead: on the crafted block (``amax`` 127, so the codes are the values) they differ."""
    from gguf import GGMLQuantizationType, quants

    x = _with_ties()
    blocks = x.numpy().reshape(-1, 32).astype(np.float32)
    amax = np.abs(blocks).max(axis=1, keepdims=True)
    codes = np.rint(blocks * (np.float32(127) / amax).astype(np.float32))
    expected = codes * (amax / np.float32(127)).astype(np.float16).astype(np.float32)
    got = ggml_roundtrip(x, "q8_0").numpy().reshape(-1, 32)
    np.testing.assert_array_equal(got, expected)
    assert list(got[0, :10]) == [127.0, 0.0, 2.0, 2.0, -0.0, -2.0, -2.0, 4.0, 4.0, -126.0]
    ref = quants.dequantize(quants.quantize(x.numpy(), GGMLQuantizationType.Q8_0), GGMLQuantizationType.Q8_0)
    assert list(ref.reshape(-1, 32)[0, 1:4]) == [1.0, 2.0, 3.0]  # roundf: ties away from zero


def _iq4_nl_reference(block: np.ndarray) -> np.ndarray:
    """ggml-quants.c quantize_row_iq4_nl_ref for one block of 32 (quantize_row_iq4_nl_impl with
    ntry -1: no scale search), scalar, in float32, dequantized."""
    grid = IQ4_NL_GRID
    f32 = np.float32

    def best(x):
        if x <= grid[0]:
            return 0
        if x >= grid[-1]:
            return 15
        lo, hi = 0, 15
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if x < grid[mid]:
                hi = mid
            else:
                lo = mid
        return hi - 1 if x - grid[hi - 1] < grid[hi] - x else hi

    x = block.astype(f32)
    amax, mx = f32(0), f32(0)
    for v in x:
        if abs(v) > amax:
            amax, mx = abs(v), v
    if amax < 1e-15:
        return np.zeros_like(x)
    d = f32(mx / f32(grid[0]))  # ntry <= 0: max / values[0]
    idd = f32(f32(1) / d)
    q = [f32(grid[best(f32(idd * v))]) for v in x]
    sumqx = sumq2 = f32(0)
    for v, qi in zip(x, q):
        w = f32(v * v)
        sumqx = f32(sumqx + f32(f32(w * qi) * v))
        sumq2 = f32(sumq2 + f32(f32(w * qi) * qi))
    d16 = f32(np.float16(sumqx / sumq2 if sumq2 > 0 else 0))
    return np.array([qi * d16 for qi in q], dtype=f32)  # the codes of the first pass, the fitted scale


def test_iq4_nl_blocks_are_ggmls_reference_quantizer():
    x = _sample((4, 64), seed=3)
    got = ggml_roundtrip(x, "iq4_nl").numpy().reshape(-1, 32)
    expected = np.stack([_iq4_nl_reference(b) for b in x.numpy().reshape(-1, 32)])
    np.testing.assert_array_equal(got, expected)


def test_fp8_per_tensor_is_compressed_tensors_fake_quantize():
    from compressed_tensors.quantization import QuantizationArgs
    from compressed_tensors.quantization.lifecycle.forward import fake_quantize

    x = _sample((240, 32)).reshape(2, 3, 40, 32)
    scale = torch.tensor([0.02])
    args = QuantizationArgs(num_bits=8, type="float", strategy="tensor", symmetric=True)
    expected = fake_quantize(x, scale, torch.zeros(1, dtype=torch.float8_e4m3fn), args)
    got = quantize_keys(x, parse_kv("fp8-e4m3"), scale)
    torch.testing.assert_close(got, expected, rtol=0, atol=0)


def test_kivi_keys_per_channel_in_token_blocks_and_values_per_token():
    x = _sample((70, 64), seed=5).reshape(1, 1, 70, 64)
    spec = parse_kv("int4")
    k, v = quantize_keys(x, spec).numpy()[0, 0], quantize_values(x, spec).numpy()[0, 0]
    a = x.numpy()[0, 0]

    def roundtrip(group):
        lo, hi = group.min(), group.max()
        s = max((hi - lo) / 15, np.finfo(np.float32).tiny)
        return np.clip(np.round((group - lo) / s), 0, 15) * s + lo

    for block in range(2):  # two complete blocks of 32 tokens; tokens 64..69 are not yet a block
        for c in range(64):
            rows = slice(32 * block, 32 * block + 32)
            np.testing.assert_allclose(k[rows, c], roundtrip(a[rows, c]), rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(k[64:], a[64:])
    for t in (0, 33, 69):
        for g in range(2):
            cols = slice(32 * g, 32 * g + 32)
            np.testing.assert_allclose(v[t, cols], roundtrip(a[t, cols]), rtol=1e-5, atol=1e-5)


def test_which_pairs_read_the_cache():
    window = cache_pairs(parse_kv("q8_0-r3"), 6, "cpu")
    assert window is not None and window[0][5].tolist() == window[1][5].tolist() == [True] * 3 + [False] * 3
    assert cache_pairs(parse_kv("q8_0"), 6, "cpu") is None
    kivi = cache_pairs(parse_kv("int8"), 70, "cpu")
    assert kivi is not None and kivi[1].all()  # values: per token, cached at once
    keys = kivi[0]
    assert not keys[30, :32].any() and keys[31, :32].all() and not keys[31, 32:].any()  # block 0 complete at t=31


class _QuantizingCache:
    """A real transformers DynamicCache whose reads go through the cache precision: decode one token
    at a time, store full precision, return what a server's cache would hold at this step."""

    def __new__(cls, spec, config):
        from transformers import DynamicCache

        class Quantizing(DynamicCache):
            def update(self, key_states, value_states, layer_idx, *args, **kwargs):
                keys, values = super().update(key_states, value_states, layer_idx, *args, **kwargs)
                T = keys.shape[-2]
                kq, vq = quantize_keys(keys, spec), quantize_values(values, spec)
                old = torch.arange(T) <= T - 1 - spec.window if spec.window else torch.ones(T, dtype=torch.bool)
                key_old = old.clone()
                if spec.format.layout == "kivi":  # a key block is read from the cache once complete
                    key_old &= torch.arange(T) < T // 32 * 32
                keys = torch.where(key_old.view(1, 1, T, 1), kq, keys)
                values = torch.where(old.view(1, 1, T, 1), vq, values)
                return keys, values

        return Quantizing(config=config)


@pytest.mark.parametrize("kv", ["q4_0", "int2", "int4-r16", "fp8-e4m3-r5", "q5_1-r40"])
def test_one_forward_is_the_decode_loop_of_a_real_cache(kv, tiny_build):
    """Logits of the simulated cache in one forward equal a token-by-token decode through a
    transformers DynamicCache that returns quantized keys and values (eager and sdpa)."""
    import copy

    spec = parse_kv(kv)
    double = copy.deepcopy(tiny_build)  # float64: batched and one-token matmuls round alike, so no
    double.model.double()  # key lands on the other side of a quantization step in one path only
    build = attach_kv_cache(copy.deepcopy(double), spec)
    ids = torch.randint(0, 500, (2, 75), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        simulated = build.model(input_ids=ids, use_cache=False).logits
        reference_model = copy.deepcopy(double.model)
        cache = _QuantizingCache(spec, reference_model.config)
        steps = [reference_model(input_ids=ids[:, t : t + 1], cache=cache).logits for t in range(75)]
        from pytest_circuits.rungs.replay import attention_implementation

        with attention_implementation(build.model):
            assert build.model.config._attn_implementation == "circuits-kv|sdpa"
            fused = build.model(input_ids=ids, use_cache=False).logits
    decoded = torch.cat(steps, dim=1)
    torch.testing.assert_close(simulated, decoded, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(fused, decoded, rtol=1e-4, atol=1e-4)
    assert (simulated - double.model(input_ids=ids).logits).abs().max() > 1e-3  # the cache did something


@pytest.fixture(scope="module")
def tiny_build():
    from pytest_circuits.model.builds import load_build
    from pytest_circuits.model.loading import resolve_model

    return load_build(resolve_model("tiny-induction"), "fp32", "cpu")


def test_the_identity_says_how_llama_cpp_lays_the_head_out(tiny_build, monkeypatch):
    import copy

    said = attach_kv_cache(copy.deepcopy(tiny_build), parse_kv("q4_0")).identity.kv_cache
    assert "llama.cpp 0c1e570" in said and "no Hadamard rotation (head size not a multiple of 64)" in said
    assert "rotated" not in attach_kv_cache(copy.deepcopy(tiny_build), parse_kv("int4")).identity.kv_cache
    monkeypatch.setenv("LLAMA_ATTN_ROT_DISABLE", "1")
    said = attach_kv_cache(copy.deepcopy(tiny_build), parse_kv("q8_0")).identity.kv_cache
    assert "LLAMA_ATTN_ROT_DISABLE set" in said


def test_build_names_with_a_cache():
    spec = parse_build_spec("bf16+kv-q4_0-r128")
    assert (spec.name, spec.weights.name, spec.kv.name, spec.kv.window) == (
        "bf16+kv-q4_0-r128",
        "bf16",
        "q4_0-r128",
        128,
    )
    ext = parse_build_spec("q8+kv-fp8-e4m3=dist/m.gguf")
    assert (ext.name, ext.path, ext.weights.name, ext.weights.path) == (
        "q8+kv-fp8-e4m3",
        "dist/m.gguf",
        "q8",
        "dist/m.gguf",
    )
    assert [s.name for s in parse_build_specs("fp32, fp32+kv-int4")] == ["fp32", "fp32+kv-int4"]
    assert split_kv("fp32") == ("fp32", None)
    assert set(KV_FORMATS) >= {"fp8-e4m3", "fp8-e5m2", "int8", "int4", "q8_0", "q4_0", "q4_1", "q5_0", "q5_1", "iq4_nl"}


@pytest.mark.parametrize(
    "typed, said",
    [
        ("bf16+kv-q3_0", "unknown KV-cache precision 'q3_0'"),
        ("bf16+kv-int4-dyn", "applies to the fp8 caches only"),
        ("bf16+kv-q8_0-r0", "at least 1 token"),
        ("+kv-q8_0", "names a cache but no weights"),
        ("bf17+kv-q8_0", "unknown build recipe 'bf17'"),
    ],
)
def test_bad_cache_names_are_one_line(typed, said):
    with pytest.raises(RecipeError, match=said) as error:
        parse_build_spec(typed)
    assert "\n" not in str(error.value)


def test_a_cache_whose_blocks_do_not_tile_the_head_is_refused(tiny_build):
    import dataclasses

    narrow = dataclasses.replace(tiny_build, geometry=dataclasses.replace(tiny_build.geometry, d_head=48))
    with pytest.raises(RecipeError, match="d_head is 48"):
        attach_kv_cache(narrow, parse_kv("q4_0"))


# ----- a checkpoint that declares its cache (compressed-tensors kv_cache_scheme)

FP8_STATIC = {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False, "symmetric": True}


def _with_cache_scheme(folder, scheme: dict, scales: dict[str, float] | None):
    """The checkpoint at ``folder`` with ``scheme`` as its kv_cache_scheme and, per layer, the scales
    as llm-compressor stores them (``model.layers.L.self_attn.k_scale``, one value)."""
    import json

    from safetensors.torch import load_file, save_file

    config_file = folder / "config.json"
    config = json.loads(config_file.read_text())
    config["quantization_config"]["kv_cache_scheme"] = scheme
    config_file.write_text(json.dumps(config))
    if scales:
        weights = load_file(folder / "model.safetensors")
        for layer in range(config["num_hidden_layers"]):
            for name, value in scales.items():
                weights[f"model.layers.{layer}.self_attn.{name}"] = torch.tensor([value * (layer + 1)])
        save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    return folder


@pytest.fixture(scope="module")
def fp8_checkpoint(tmp_path_factory):
    pytest.importorskip(
        "compressed_tensors", reason='compressed-tensors is not installed: pip install "pytest-circuits[formats]"'
    )
    from pytest_circuits.model.compressed import write_checkpoint
    from pytest_circuits.model.loading import resolve_model

    return write_checkpoint(
        resolve_model("tiny-induction").folder, tmp_path_factory.mktemp("kv") / "fp8", "FP8_DYNAMIC"
    )


def _copy(folder, tmp_path):
    import shutil

    return shutil.copytree(folder, tmp_path / "ckpt")


def _load(folder, name="served"):
    from pytest_circuits.model.external import load_external_build
    from pytest_circuits.model.loading import resolve_model

    return load_external_build(resolve_model("tiny-induction"), parse_build_spec(f"{name}={folder}"), "cpu")


def test_a_static_fp8_cache_scheme_loads_with_the_checkpoints_scales(fp8_checkpoint, tmp_path):
    folder = _with_cache_scheme(_copy(fp8_checkpoint, tmp_path), FP8_STATIC, {"k_scale": 0.01, "v_scale": 0.002})
    build = _load(folder)
    cache = cache_of(build.model)
    assert [float(cache.k_scales[l]) for l in (0, 1)] == pytest.approx([0.01, 0.02])
    assert [float(cache.v_scales[l]) for l in (0, 1)] == pytest.approx([0.002, 0.004])
    assert build.identity.recipe == "served" and "fp8-e4m3" in build.identity.kv_cache
    assert "scales from the checkpoint" in build.identity.kv_cache and "kv_cache_scheme" in build.identity.kv_cache
    plain = _load(fp8_checkpoint, "weights")
    ids = torch.randint(0, 500, (2, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        moved = (build.model(input_ids=ids).logits - plain.model(input_ids=ids).logits).abs().max()
    assert moved > 1e-3  # the keys went through fp8 at these scales (448 x 0.01 saturates some)
    with pytest.raises(RecipeError, match="already serves a KV cache") as error:
        attach_kv_cache(build, parse_kv("q4_0"))
    assert "\n" not in str(error.value)


@pytest.mark.parametrize(
    "scheme, scales, said",
    [
        (
            {"num_bits": 4, "type": "int", "strategy": "tensor", "dynamic": True, "symmetric": True},
            None,
            "cannot be applied",
        ),
        ({**FP8_STATIC, "strategy": "channel"}, None, "cannot be applied"),
        (FP8_STATIC, {"k_scale": 0.01}, "needs a v_scale in every layer"),
        (FP8_STATIC, {"k_scale": -1.0, "v_scale": 0.01}, "must be one positive finite scale"),
    ],
)
def test_a_cache_scheme_that_cannot_be_served_is_refused_in_one_line(fp8_checkpoint, tmp_path, scheme, scales, said):
    folder = _with_cache_scheme(_copy(fp8_checkpoint, tmp_path), scheme, scales)
    with pytest.raises(RecipeError, match=said) as error:
        _load(folder)
    assert "\n" not in str(error.value)


def test_a_scale_of_a_layer_the_model_lacks_is_refused(fp8_checkpoint, tmp_path):
    """A ``k_scale`` of layer 7 in a 2-layer checkpoint was ignored silently: whoever made the file
    calibrated another model, so its scales are not this model's."""
    from safetensors.torch import load_file, save_file

    folder = _with_cache_scheme(_copy(fp8_checkpoint, tmp_path), FP8_STATIC, {"k_scale": 0.01, "v_scale": 0.002})
    weights = load_file(folder / "model.safetensors")
    weights["model.layers.7.self_attn.k_scale"] = torch.tensor([0.01])
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(RecipeError, match=r"holds a k_scale for layers \[7\], but the model has 2 layers") as error:
        _load(folder)
    assert "\n" not in str(error.value)


def test_a_dynamic_fp8_scheme_needs_no_scales(fp8_checkpoint, tmp_path):
    folder = _with_cache_scheme(_copy(fp8_checkpoint, tmp_path), {**FP8_STATIC, "dynamic": True}, None)
    assert _load(folder).identity.kv_cache.startswith("fp8-e4m3-dyn")


@pytest.mark.slow
@pytest.mark.skipif(
    "PYTEST_CIRCUITS_LLMCOMPRESSOR_PYTHON" not in __import__("os").environ,
    reason="llm-compressor runs in its own environment: set PYTEST_CIRCUITS_LLMCOMPRESSOR_PYTHON",
)
def test_llm_compressors_kv_cache_scheme_checkpoint_loads_with_its_scales(tmp_path):
    """llm-compressor's own FP8_DYNAMIC + static fp8 kv_cache_scheme (calibrated on seeded ids) on the
    embedded model: the build serves an fp8 cache at exactly the scales llm-compressor stored."""
    import os
    import subprocess
    from pathlib import Path

    from safetensors import safe_open
    from safetensors.torch import save_file

    import pytest_circuits.model.llmc_worker as worker
    from pytest_circuits.model.loading import resolve_model

    ids = torch.randint(0, 500, (16, 64), generator=torch.Generator().manual_seed(0))
    save_file({"input_ids": ids}, tmp_path / "ids.safetensors")
    out = tmp_path / "llmc"
    python = os.environ["PYTEST_CIRCUITS_LLMCOMPRESSOR_PYTHON"]
    folder = str(resolve_model("tiny-induction").folder)
    run = [python, str(Path(worker.__file__)), "fp8-kv", folder, str(out), str(tmp_path / "ids.safetensors"), "0"]
    subprocess.run(run, check=True, capture_output=True, env=os.environ | {"HF_HUB_OFFLINE": "1"})
    build = _load(out)
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        for layer in range(2):
            for name, read in (
                ("k_scale", cache_of(build.model).k_scales),
                ("v_scale", cache_of(build.model).v_scales),
            ):
                assert float(read[layer]) == f.get_tensor(f"model.layers.{layer}.self_attn.{name}").item()
    assert "fp8-e4m3" in build.identity.kv_cache and "scales from the checkpoint" in build.identity.kv_cache


# ----- the cache as a build of the gate (the embedded model against its shipped fp32 baseline)


def _gate(build: str, capsys) -> tuple[int, str]:
    from pytest_circuits.cli import main

    code = main(["gate", "tiny-induction", "--build", build, "--baseline", "baselines/tiny-induction--fp32.json"])
    return code, capsys.readouterr().out


def test_an_int2_cache_breaks_the_embedded_models_copying_and_the_gate_says_so(capsys):
    """KIVI int2 moves the knockout delta of L0H3 (measured: +0.26 -> +0.52, tolerance 0.13); the
    weights are untouched, so every rung-1 invariant holds; the identity names the cache."""
    code, out = _gate("fp32+kv-int2", capsys)
    assert code == 1
    assert "build fp32+kv-int2 serves a KV cache: int2: int2, keys per channel, values per token (KIVI)" in out
    assert "note: the KV cache differs from the baseline's (baseline: full precision, this build: int2)" in out
    assert "FAIL knockout_deltas" in out and "PASS copying_heads" in out and "PASS kappa_distribution" in out


def test_an_fp8_cache_passes_the_gate(capsys):
    code, out = _gate("bf16+kv-fp8-e4m3", capsys)
    assert code == 0, out
    assert "gate passed (6 of 6 invariants hold)" in out and "scales 1.0 (none given)" in out


def test_a_window_covering_the_probe_is_refused_before_any_figure(capsys):
    from pytest_circuits.cli import main

    code = main(
        ["gate", "tiny-induction", "--build", "fp32+kv-q8_0-r128", "--baseline", "baselines/tiny-induction--fp32.json"]
    )
    err = capsys.readouterr().err
    assert code == 2 and "covers every position of the probe (128 tokens)" in err and err.count("\n") == 1


def test_dynamic_fp8_scales_are_per_sequence_so_batching_changes_nothing():
    spec = parse_kv("fp8-e4m3-dyn")
    x = torch.randn(3, 2, 40, 32, generator=torch.Generator().manual_seed(2)) * torch.tensor([1.0, 30.0, 0.01]).view(
        3, 1, 1, 1
    )
    together = quantize_keys(x, spec)
    alone = torch.cat([quantize_keys(x[i : i + 1], spec) for i in range(3)])
    torch.testing.assert_close(together, alone, rtol=0, atol=0)
    rel = (together - x).abs().amax(dim=(1, 2, 3)) / x.abs().amax(dim=(1, 2, 3))
    assert (rel < 0.07).all()  # each sequence at its own scale: e4m3's 3 mantissa bits, at most 1/16 off


@pytest.mark.parametrize("method", ["atp", "atp*"])
def test_the_screen_ranks_heads_through_the_cache(method, tiny_build):
    """The attribution screen reads keys and values through the cache: its estimates move under an
    int2 cache, and the build's cached attention is back in place after it."""
    import copy

    from pytest_circuits.rungs.repeat import repeat_tokens
    from pytest_circuits.rungs.screen import screen_estimate

    ids = repeat_tokens(tiny_build.tokens, 4, 32, seed=3)
    cached = attach_kv_cache(copy.deepcopy(tiny_build), parse_kv("int2"))
    plain, _ = screen_estimate(tiny_build, ids, 32, "zero", None, method, batch_size=4)
    served, _ = screen_estimate(cached, ids, 32, "zero", None, method, batch_size=4)
    assert np.abs(served - plain).max() > 1e-2 * np.abs(plain).max()
    assert cached.model.config._attn_implementation == "circuits-kv|eager"  # restored after the screen


QUIRKY = ("gpt2", "gemma2", "gemma3_text", "gpt_oss", "phi", "cohere", "qwen3", "mixtral")
OWN_ATTENTION = ("bloom", "falcon", "gpt_neo")  # computed attention outside transformers' interface


def computes_its_own_attention(model_type: str) -> bool:
    """Whether the installed transformers' modeling file of ``model_type`` never calls its attention
    interface (read from its source, independently of the cache's own check: Falcon moved onto the
    interface in transformers 5.25)."""
    import importlib
    import inspect

    module = importlib.import_module(f"transformers.models.{model_type}.modeling_{model_type}")
    return "ALL_ATTENTION_FUNCTIONS" not in inspect.getsource(module)


@pytest.mark.parametrize("model_type", QUIRKY)
def test_every_pair_in_full_precision_is_the_families_own_attention(model_type):
    """A window covering every position puts all pairs through the rebuilt mask (alibi biases,
    sliding windows, softcaps, sinks kept): the logits are the family's own; with no window, an fp8
    cache moves them (it is in the path)."""
    import dataclasses

    from pytest_circuits.model.builds import BuildIdentity, LoadedBuild
    from pytest_circuits.model.families import family_and_geometry
    from pytest_circuits.testing import make_tiny_model, tiny_model_types

    if model_type not in tiny_model_types():
        pytest.skip(f"no tiny {model_type} here")
    model = make_tiny_model(model_type, seed=11)
    family, geometry = family_and_geometry(model.config)
    identity = BuildIdentity("fp32", "float32", "torch", "torch", "cpu")
    build = LoadedBuild(model, None, identity, family, geometry, None)  # type: ignore[arg-type]
    ids = torch.randint(0, geometry.vocab, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        plain = model(input_ids=ids).logits
        for window, moved in ((24, False), (0, True)):
            served = attach_kv_cache(
                dataclasses.replace(build, identity=identity), parse_kv(f"fp8-e4m3-r{window}" if window else "fp8-e4m3")
            )
            logits = served.model(input_ids=ids).logits
            assert bool((logits - plain).abs().max() > 1e-4) is moved, model_type
            if not moved:
                torch.testing.assert_close(logits, plain, rtol=1e-5, atol=1e-5)
            delattr(model, "_circuits_kv")


@pytest.mark.parametrize("model_type", OWN_ATTENTION)
def test_a_family_whose_attention_a_cache_cannot_enter_is_refused(model_type):
    """BLOOM, Falcon and GPT-Neo computed attention themselves: a cache attached there would never be
    read, so the build is refused in one line instead of gating as if the cache were full precision
    (the other tiny families take it: test_every_pair_in_full_precision_is_the_families_own_attention).
    A family the installed transformers has moved onto its attention interface takes the cache, and
    an fp8 cache then moves its logits (it is in the path)."""
    from pytest_circuits.model.builds import BuildIdentity, LoadedBuild
    from pytest_circuits.model.families import family_and_geometry
    from pytest_circuits.testing import make_tiny_model, tiny_model_types

    if model_type not in tiny_model_types():
        pytest.skip(f"no tiny {model_type} here")
    model = make_tiny_model(model_type, seed=11)
    family, geometry = family_and_geometry(model.config)
    build = LoadedBuild(model, None, BuildIdentity("fp32", "float32", "torch", "torch", "cpu"), family, geometry, None)  # type: ignore[arg-type]
    if computes_its_own_attention(model_type):
        with pytest.raises(RecipeError, match="outside transformers' attention interface") as error:
            attach_kv_cache(build, parse_kv("fp8-e4m3"))
        assert "\n" not in str(error.value)
        return
    ids = torch.randint(0, geometry.vocab, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        plain = model(input_ids=ids).logits
        served = attach_kv_cache(build, parse_kv("fp8-e4m3")).model(input_ids=ids).logits
    assert (served - plain).abs().max() > 1e-4, model_type


@pytest.mark.slow
@pytest.mark.real
@needs_smollm2
@pytest.mark.parametrize("kv, verdict", [("q8_0", "PASS copy_loss"), ("q4_0", "FAIL copy_loss")])
def test_smollm2_served_with_a_cache_gates_against_its_fp32_baseline(kv, verdict, capsys):
    """SmolLM2-135M's bf16 weights with llama.cpp's q8_0 cache keep copying; with q4_0 they lose it
    (measured +1.5 nats of copy loss at 64 tokens, docs/kv-cache.md), and the gate says so."""
    from pytest_circuits.cli import main

    code = main(
        ["gate", "smollm2-135m", "--build", f"bf16+kv-{kv}", "--baseline", "smollm2-135m--fp32", "--no-knockout"]
    )
    out = capsys.readouterr().out
    assert f"build bf16+kv-{kv} serves a KV cache: {kv}: llama.cpp {kv} blocks of 32" in out
    assert verdict in out and "PASS copying_heads" in out
    assert code == (0 if verdict.startswith("PASS") else 1)
    assert "1 skipped (knockout_deltas)" in out  # no knockouts: skipped, and said


# ----- transformers' own QuantizedCache, the probe in decode mode (model/quantized_cache.py)


def test_a_quantized_cache_without_a_window_keeps_transformers_own_default():
    import inspect

    from transformers.cache_utils import QuantizedLayer

    from pytest_circuits.model.kv_formats import QUANTIZED_CACHE_RESIDUAL

    default = inspect.signature(QuantizedLayer.__init__).parameters["residual_length"].default
    assert QUANTIZED_CACHE_RESIDUAL == default
    assert parse_kv("quanto-int4").full_window == default and parse_kv("quanto-int2-r32").full_window == 32
    assert parse_kv("hqq-int4-r8").decode and not parse_kv("int4").decode
    assert split_kv("bf16+kv-quanto-int2-r16")[1].name == "quanto-int2-r16"  # type: ignore[union-attr]


@pytest.fixture(scope="module")
def decode_probes(tiny_build):
    """The embedded model's probe (L = 64, n = 8) in fp32 and through quanto's int4 and int2
    caches with a 32-token window, each counting the calls of transformers' own quanto layer."""
    import copy

    from transformers.cache_utils import QuantoQuantizedLayer

    from pytest_circuits.rungs.probe import run_repeat_probe
    from pytest_circuits.rungs.repeat_settings import RepeatSettings

    settings = RepeatSettings(seed=0, n=8, L=64)
    probes, calls = {"fp32": run_repeat_probe(tiny_build, settings)}, {}
    real = QuantoQuantizedLayer._dequantize
    for kv in ("quanto-int4-r32", "quanto-int2-r32"):
        build = attach_kv_cache(copy.deepcopy(tiny_build), parse_kv(kv))
        count = [0]

        def spy(self, qtensor, count=count):
            count[0] += 1
            return real(self, qtensor)

        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(QuantoQuantizedLayer, "_dequantize", spy)
            probes[kv] = run_repeat_probe(build, settings)
        calls[kv] = count[0]
        probes[kv + " identity"] = build.identity.kv_cache
    return probes, calls


def test_a_quanto_cache_is_read_through_transformers_own_code(decode_probes):
    probes, calls = decode_probes
    steps = 2 * 64 - 1  # decode steps after the one-token prefill, 2 keys + values reads per layer each
    sequences = 8  # each sequence runs alone, through its own cache (`run_repeat_probe`)
    assert calls["quanto-int4-r32"] == calls["quanto-int2-r32"] == steps * 2 * 2 * sequences
    identity = probes["quanto-int4-r32 identity"]
    assert identity.startswith("quanto-int4-r32: transformers QuantizedCache, quanto backend, 4 bits (optimum-quanto ")
    assert "residual_length 32" in identity and "run in decode mode" in identity


def test_quanto_int4_with_a_window_changes_copying_little_and_int2_measurably(decode_probes):
    """Measured: +0.006 (int4) and +0.51 (int2) nats on fp32's 0.078; prefix matching 0.861 and
    0.778 against 0.864. (quanto stores 2 or 4 bits only: there is no quanto int8.)"""
    probes, _ = decode_probes
    fp32, int4, int2 = probes["fp32"], probes["quanto-int4-r32"], probes["quanto-int2-r32"]
    assert abs(int4.copy_loss - fp32.copy_loss) < 0.03
    assert int2.copy_loss - fp32.copy_loss > 0.2
    assert (int2.copy_losses > fp32.copy_losses).all()  # every sequence copies worse
    top = fp32.heads.prefix_matching.idxmax()
    assert fp32.heads.prefix_matching[top] - int2.heads.prefix_matching[top] > 0.03
    assert abs(fp32.heads.prefix_matching[top] - int4.heads.prefix_matching[top]) < 0.01


def test_a_decode_only_cache_refuses_the_knockout_scan_and_the_screen_in_one_line(tiny_build):
    import copy

    from pytest_circuits.rungs.knockout import knockout_scan
    from pytest_circuits.rungs.repeat_settings import RepeatSettings
    from pytest_circuits.rungs.screen import screen_estimate

    build = attach_kv_cache(copy.deepcopy(tiny_build), parse_kv("quanto-int4-r8"))
    settings = RepeatSettings(seed=0, n=2, L=16)
    for run in (
        lambda: knockout_scan(build, settings, progress=False),
        lambda: screen_estimate(build, None, 16, "zero", None, "atp", 2),
    ):
        with pytest.raises(RecipeError) as info:
            run()
        said = str(info.value)  # the way out as pytest takes it (circuits: --no-knockout)
        assert (
            "\n" not in said and "decode mode only" in said and "deselect its knockout test, -k 'not knockout'" in said
        )


def test_hqq_without_its_package_is_refused_naming_the_install(tiny_build):
    import copy
    import importlib.util

    if importlib.util.find_spec("hqq") is not None:
        pytest.skip("hqq is installed here")
    with pytest.raises(RecipeError) as info:
        attach_kv_cache(copy.deepcopy(tiny_build), parse_kv("hqq-int4-r16"))
    assert "\n" not in str(info.value) and "pip install hqq" in str(info.value)


def test_a_quantized_cache_whose_default_window_covers_the_probe_is_refused(capsys):
    from pytest_circuits.cli import main

    argv = [
        "gate",
        "tiny-induction",
        "--build",
        "fp32+kv-quanto-int4",
        "--baseline",
        "baselines/tiny-induction--fp32.json",
    ]
    code = main([*argv, "--no-knockout"])
    err = capsys.readouterr().err
    assert code == 2 and "window of 128 tokens covers every position of the probe (128 tokens)" in err
    assert err.count("\n") == 1


def test_the_decode_loop_through_a_plain_dynamic_cache_is_the_one_forward_probe(decode_probes, tiny_build):
    """The independent check of decode mode: the same loop with a full-precision ``DynamicCache``
    (one query per step) gives the one-forward figures, per sequence."""
    from pytest_circuits.rungs.probe import SCORES, run_repeat_probe

    probes, _ = decode_probes
    whole = probes["fp32"]
    step = run_repeat_probe(tiny_build, whole.settings, block=1)
    np.testing.assert_allclose(step.copy_losses, whole.copy_losses, rtol=0, atol=1e-5)
    np.testing.assert_allclose(step.first_copy_losses, whole.first_copy_losses, rtol=0, atol=1e-5)
    np.testing.assert_allclose(step.heads[list(SCORES)], whole.heads[list(SCORES)], rtol=0, atol=1e-5)


@pytest.mark.parametrize("kv", ["int4-r8", "q4_0"])
def test_a_simulated_cache_gives_the_same_figures_in_blocks_of_queries(kv, tiny_build):
    """A long probe runs in blocks through a DynamicCache (`rungs.query_blocks`): the simulated
    cache then quantizes the past keys with the block's, as one forward does."""
    import copy

    from pytest_circuits.rungs.probe import SCORES, run_repeat_probe
    from pytest_circuits.rungs.repeat_settings import RepeatSettings

    build = attach_kv_cache(copy.deepcopy(tiny_build), parse_kv(kv))
    settings = RepeatSettings(seed=0, n=4, L=40)
    whole, part = run_repeat_probe(build, settings), run_repeat_probe(build, settings, block=24)
    np.testing.assert_allclose(part.copy_losses, whole.copy_losses, rtol=0, atol=1e-5)
    np.testing.assert_allclose(part.heads[list(SCORES)], whole.heads[list(SCORES)], rtol=0, atol=1e-6)


def test_batch_size_changes_no_figure_through_a_cache(tmp_path):
    """bf16 matmuls round differently with the number of rows they multiply (a random Llama of width 256
    here; SmolLM2 too) and a quantized cache amplifies one flipped rounding; the probe runs each
    sequence alone, so ``--batch-size`` changes no figure, bit for bit."""
    from pytest_circuits.model.builds import load_build
    from pytest_circuits.model.loading import resolve_model
    from pytest_circuits.rungs.probe import SCORES, run_repeat_probe
    from pytest_circuits.rungs.repeat_settings import RepeatSettings
    from pytest_circuits.testing import save_tiny_model

    wide = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2, head_dim=64)
    folder = save_tiny_model("llama", tmp_path / "wide", **wide)
    build = attach_kv_cache(load_build(resolve_model(str(folder)), "bf16", "cpu"), parse_kv("q4_0"))
    assert "GGUF's interleaved rotary order; Q and K rotated by a 64x64 Walsh-Hadamard" in build.identity.kv_cache
    settings = RepeatSettings(seed=0, n=4, L=40)
    alone, together = (run_repeat_probe(build, settings, batch_size=b) for b in (1, 4))
    np.testing.assert_array_equal(together.copy_losses, alone.copy_losses)
    np.testing.assert_array_equal(together.heads[list(SCORES)], alone.heads[list(SCORES)])


def test_qdot_is_parsed_for_llama_cpps_blocks_only_and_named_in_the_identity():
    from pytest_circuits.model.kv_cache import KvCache, quantize_query

    spec = parse_kv("q4_1-qdot-r16")
    assert (spec.qdot, spec.window, spec.name) == (True, 16, "q4_1-qdot-r16")
    assert "Q quantized to q8_1 blocks of 32" in spec.describe() and "q8_0 blocks" in parse_kv("q4_0-qdot").describe()
    assert not parse_kv("q4_0").qdot and "Q quantized" not in parse_kv("q4_0").describe()
    for text in ("fp8-e4m3-qdot", "int4-qdot"):
        with pytest.raises(RecipeError, match="applies to llama.cpp's caches only") as err:
            parse_kv(text)
        assert "\n" not in str(err.value)
    g = torch.Generator().manual_seed(4)
    q = torch.randn(1, 2, 3, 64, generator=g)
    blocks = q.numpy().reshape(-1, 32)
    amax = np.abs(blocks).max(axis=1, keepdims=True)
    expected = np.rint(blocks * (np.float32(127) / amax)) * (amax / np.float32(127)).astype(np.float16).astype(
        np.float32
    )
    got = quantize_query(q, KvCache(parse_kv("q8_0-qdot")))  # no layout: the blocks of the head as it is
    np.testing.assert_array_equal(got.numpy().reshape(-1, 32), expected)
    assert torch.equal(quantize_query(q, KvCache(parse_kv("q8_0"))), q)


def test_one_ulp_bumps_move_keys_by_one_ulp_and_only_within():
    """`one_ulp_bumps` (the noise floor of scripts/measure_formats.py's llama tables): within it a
    cache reads every key times ``1 + k 2^-23`` (at most ``|x| 2^-22`` away), some moved; outside, unchanged.
    KIVI keys of an incomplete block come back as given, so the bump is all that changes them."""
    from pytest_circuits.model.kv_cache import CACHE_ATTR, KvCache, cached, one_ulp_bumps

    module = torch.nn.Module()
    setattr(module, CACHE_ATTR, KvCache(parse_kv("int8")))
    x = torch.randn(1, 1, 5, 32, generator=torch.Generator().manual_seed(0))
    assert torch.equal(cached(module, x, x)[0], x)
    with one_ulp_bumps():
        keys = cached(module, x, x)[0]
    moved = (keys - x).abs()
    assert bool((moved <= x.abs() * 2.0**-22).all()) and bool((moved > 0).any())
    assert torch.equal(cached(module, x, x)[0], x)
