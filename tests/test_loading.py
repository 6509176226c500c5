"""Loading is offline and safe, and every bad input is one clear line."""

from __future__ import annotations

import json

import pytest
import torch

from pytest_circuits.errors import CircuitsError, ModelLoadError, RecipeError, UnknownFamilyError
from pytest_circuits.model.builds import get_recipe, load_build, parse_builds, resolve_device
from pytest_circuits.model.families import family_for_config, supported_model_types
from pytest_circuits.model.loading import check_gguf, resolve_model, weight_fingerprint
from pytest_circuits.testing import make_tiny_model

from .conftest import needs_smollm2


def _one_line(error: pytest.ExceptionInfo) -> str:
    text = str(error.value)
    assert "\n" not in text, text
    return text


def test_missing_folder_is_one_line(tmp_path):
    with pytest.raises(ModelLoadError) as error:
        resolve_model(str(tmp_path / "nowhere"))
    assert "nowhere" in _one_line(error)


def test_pickle_only_folder_is_refused(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    torch.save({"w": torch.zeros(1)}, tmp_path / "pytorch_model.bin")
    with pytest.raises(ModelLoadError) as error:
        resolve_model(str(tmp_path))
    line = _one_line(error)
    assert "pickle" in line and "pytorch_model.bin" in line and "safe_serialization" in line


def test_folder_without_config_is_refused(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(ModelLoadError, match="config.json"):
        resolve_model(str(tmp_path))


def test_unknown_family_lists_supported(tmp_path):
    from transformers import OpenAIGPTConfig, OpenAIGPTLMHeadModel

    config = OpenAIGPTConfig(n_layer=1, n_embd=16, n_head=2, vocab_size=32, n_positions=32)
    OpenAIGPTLMHeadModel(config).save_pretrained(tmp_path)
    with pytest.raises(UnknownFamilyError) as error:
        load_build(resolve_model(str(tmp_path)), "fp32", "cpu")
    line = _one_line(error)
    assert "'openai-gpt'" in line
    for model_type in supported_model_types():
        assert model_type in line


def test_unknown_recipe_lists_known():
    with pytest.raises(RecipeError) as error:
        get_recipe("int3")
    line = _one_line(error)
    assert "int3" in line and "bnb-nf4" in line and "rtn-int4" in line


def test_parse_builds():
    assert parse_builds(" fp32, bnb-int8 ,fp32") == ["fp32", "bnb-int8"]
    with pytest.raises(RecipeError):
        parse_builds("fp32,fp33")
    with pytest.raises(RecipeError):
        parse_builds(" , ")


def test_not_a_gguf_file(tmp_path):
    fake = tmp_path / "model.gguf"
    fake.write_bytes(b"PK\x03\x04 not gguf")
    with pytest.raises(ModelLoadError) as error:
        resolve_model(str(fake))
    assert "not a GGUF file" in _one_line(error)
    with pytest.raises(ModelLoadError):
        check_gguf(tmp_path / "absent.gguf")


def test_unknown_spec_names_what_was_tried():
    with pytest.raises(ModelLoadError) as error:
        resolve_model("no-such-org/no-such-model-xyz")
    line = _one_line(error)
    assert "tiny-induction" in line and "cache" in line


def test_cuda_device_without_cuda_is_one_line():
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present: the refusal only applies without one")
    with pytest.raises(CircuitsError) as error:
        resolve_device("cuda")
    assert "--circuits-device cpu" in _one_line(error)
    assert resolve_device("auto") == torch.device("cpu")
    with pytest.raises(CircuitsError):
        resolve_device("tpu")


def test_fingerprint_follows_the_weights(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    make_tiny_model("gpt2", seed=0).save_pretrained(a)
    make_tiny_model("gpt2", seed=0).save_pretrained(b)
    assert weight_fingerprint(a) == weight_fingerprint(b)
    make_tiny_model("gpt2", seed=1).save_pretrained(b)
    assert weight_fingerprint(a) != weight_fingerprint(b)


def test_trust_remote_code_is_off_by_default(tmp_path):
    """A config that needs remote code is refused with the option's name, not executed."""
    config = {
        "model_type": "custom_thing",
        "auto_map": {"AutoConfig": "custom.CustomConfig", "AutoModelForCausalLM": "custom.CustomModel"},
        "architectures": ["CustomModel"],
    }
    (tmp_path / "config.json").write_text(json.dumps(config))
    (tmp_path / "custom.py").write_text("raise SystemExit('remote code ran')\n")
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(CircuitsError) as error:
        load_build(resolve_model(str(tmp_path)), "fp32", "cpu")
    assert "trust-remote-code" in _one_line(error)


def test_build_identity_travels(tiny_folder):
    build = load_build(resolve_model(tiny_folder("llama")), "bnb-nf4", "cpu")
    assert build.identity.recipe == "bnb-nf4"
    assert build.identity.backend == "bitsandbytes"
    assert build.identity.backend_version.startswith("bitsandbytes ")
    assert build.label.endswith(":bnb-nf4")
    assert build.geometry.n_kv_heads == 2


def test_family_for_config_of_each_family():
    for family in ("gpt2", "gpt_neox", "llama"):
        assert family_for_config(make_tiny_model(family).config).name == family


@needs_smollm2
@pytest.mark.real
def test_gguf_named_model_loads_offline_from_cache(monkeypatch):
    """SmolLM2-135M's GGUF is converted once; the cached float32 folder then loads offline."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    source = resolve_model("smollm2-135m")
    assert source.kind == "named" and source.origin.suffix == ".gguf"
    build = load_build(source, "fp32", "cpu")
    geo = build.geometry
    assert (geo.n_layers, geo.n_heads, geo.n_kv_heads, geo.d_head, geo.vocab) == (30, 9, 3, 64, 49152)
    assert next(build.model.parameters()).dtype == torch.float32
    assert resolve_model("smollm2-135m").folder == source.folder


def test_hub_cache_id_resolves_offline(tmp_path, monkeypatch):
    """A model id already in the local Hugging Face cache loads with the hub forced offline."""
    import huggingface_hub.constants as hub_constants

    snapshot = tmp_path / "models--acme--tiny-gpt2" / "snapshots" / "0123abcd"
    make_tiny_model("gpt2").save_pretrained(snapshot)
    (tmp_path / "models--acme--tiny-gpt2" / "refs").mkdir()
    (tmp_path / "models--acme--tiny-gpt2" / "refs" / "main").write_text("0123abcd")
    monkeypatch.setattr(hub_constants, "HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    source = resolve_model("acme/tiny-gpt2")
    assert source.kind == "cache" and source.folder == snapshot
    assert load_build(source, "fp32", "cpu").geometry.n_heads == 4
    with pytest.raises(ModelLoadError):
        resolve_model("acme/not-cached")


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (--circuits-device cuda); none here")
@pytest.mark.parametrize("recipe", ["fp32", "bnb-int8", "bnb-nf4"])
def test_cuda_builds_match_cpu(tiny_folder, recipe):
    """The CUDA path (bitsandbytes on GPU included) gives the CPU's figures within the recipe's noise."""
    from pytest_circuits.rungs.probe import run_repeat_probe
    from pytest_circuits.rungs.repeat_settings import RepeatSettings

    source = resolve_model(tiny_folder("llama"))
    settings = RepeatSettings(seed=0, n=4, L=16)
    cpu = run_repeat_probe(load_build(source, "fp32", "cpu"), settings)
    gpu_build = load_build(source, recipe, "cuda")
    assert gpu_build.identity.device.startswith("cuda")
    gpu = run_repeat_probe(gpu_build, settings)
    tolerance = 1e-3 if recipe == "fp32" else 0.1
    assert gpu.copy_loss == pytest.approx(cpu.copy_loss, abs=tolerance * max(1.0, cpu.copy_loss))


# ---------------------------------------------------------------- issue 16: the files that load, finite weights, probe size


def _shard(folder, tiny_state, names, file):
    from safetensors.torch import save_file

    save_file({n: tiny_state[n].contiguous() for n in names}, folder / file, metadata={"format": "pt"})
    return {n: file for n in names}


def _sharded_llama(folder):
    """A tiny llama saved as two safetensors shards and an index."""
    from safetensors.torch import load_file

    from pytest_circuits.testing import save_tiny_model

    save_tiny_model("llama", folder)
    state = load_file(folder / "model.safetensors")
    (folder / "model.safetensors").unlink()
    names = sorted(state)
    weight_map = {
        **_shard(folder, state, names[::2], "model-00001-of-00002.safetensors"),
        **_shard(folder, state, names[1::2], "model-00002-of-00002.safetensors"),
    }
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return folder


def test_weight_files_are_the_files_transformers_reads(tmp_path):
    """The index's shards, in name order; a stray pickle beside model.safetensors is never unpickled."""
    import pickle
    from pathlib import Path

    from pytest_circuits.model.loading import weight_files

    folder = _sharded_llama(tmp_path / "sharded")
    assert [f.name for f in weight_files(folder)] == [
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
    ]
    build = load_build(resolve_model(str(folder)), "fp32", "cpu")
    assert build.geometry.n_layers == 2

    single = tmp_path / "single"
    make_tiny_model("llama").save_pretrained(single)
    marker = tmp_path / "unpickled"

    class Touch:
        def __reduce__(self):
            return (Path.touch, (marker,))

    (single / "pytorch_model.bin").write_bytes(pickle.dumps(Touch()))
    assert weight_files(single) == [single / "model.safetensors"]
    load_build(resolve_model(str(single)), "fp32", "cpu")
    assert not marker.exists()


def test_fingerprint_covers_exactly_the_loaded_files(tmp_path):
    """Changing a loaded shard moves the fingerprint; a file that is not loaded does not; one file: the old formula."""
    import hashlib

    from pytest_circuits.model.loading import weight_fingerprint

    single = tmp_path / "single"
    make_tiny_model("gpt2").save_pretrained(single)
    file_hash = hashlib.sha256((single / "model.safetensors").read_bytes()).hexdigest()
    expected = hashlib.sha256(b"model.safetensors" + file_hash.encode()).hexdigest()
    assert weight_fingerprint(single) == "sha256:" + expected  # shipped baselines keep their fingerprint

    folder = _sharded_llama(tmp_path / "sharded")
    before = weight_fingerprint(folder)
    (folder / "unused.safetensors").write_bytes((folder / "model-00001-of-00002.safetensors").read_bytes())
    assert weight_fingerprint(folder) == before
    shard = folder / "model-00002-of-00002.safetensors"
    data = bytearray(shard.read_bytes())
    data[-1] ^= 1
    shard.write_bytes(bytes(data))
    assert weight_fingerprint(folder) != before


def test_nonfinite_counts_match_an_independent_count(tmp_path):
    from safetensors.torch import load_file, save_file

    from pytest_circuits.model.loading import nonfinite_counts

    folder = tmp_path / "m"
    make_tiny_model("gpt2").save_pretrained(folder)
    state = load_file(folder / "model.safetensors")
    generator = torch.Generator().manual_seed(3)
    name = "transformer.h.1.attn.c_proj.weight"
    flat = state[name].view(-1)
    flat[torch.randperm(flat.numel(), generator=generator)[:9]] = float("nan")
    flat[torch.randperm(flat.numel(), generator=generator)[:4]] = float("inf")
    expected_nan, expected_inf = int(flat.isnan().sum()), int(flat.isinf().sum())
    save_file(state, folder / "model.safetensors", metadata={"format": "pt"})
    assert nonfinite_counts(folder) == [("model.safetensors", name, expected_nan, expected_inf)]


def test_vocabulary_needs_two_ordinary_ids():
    from pytest_circuits.model.vocab import TokenInfo
    from pytest_circuits.rungs.repeat import check_vocabulary, repeat_tokens

    with pytest.raises(CircuitsError, match="1 ordinary token id"):
        repeat_tokens(TokenInfo(2, (0,), None, False), 2, 4, 0)
    assert check_vocabulary(TokenInfo(3, (0,), None, False)) == 2
    ids = repeat_tokens(TokenInfo(3, (0,), None, False), 4, 8, 0)
    assert set(ids.unique().tolist()) == {1, 2}


def test_probe_memory_is_refused_with_the_number():
    from pytest_circuits.model.families import Geometry
    from pytest_circuits.rungs.repeat import check_probe_memory, probe_memory, probe_peak

    geo = Geometry(n_layers=30, n_heads=9, n_kv_heads=3, d_model=576, d_head=64, vocab=49152)
    needed = probe_peak(probe_memory(geo, 8, 64, 8))
    assert check_probe_memory(geo, 8, 64, 8, available=needed) == needed
    with pytest.raises(CircuitsError) as error:
        check_probe_memory(geo, 8, 64, 8, available=needed - 1)
    assert f"{needed / 1024**3:.3g} GiB" in _one_line(error)
    with pytest.raises(CircuitsError, match="n=1000000000"):
        check_probe_memory(geo, 1_000_000_000, 64, 8)
    for bad in (dict(n=0), dict(L=1), dict(batch_size=0)):
        with pytest.raises(CircuitsError):
            check_probe_memory(geo, **{"n": 8, "L": 64, "batch_size": 8, **bad})


def test_probe_memory_token_estimate_bounds_the_measured_peak():
    """The token part of the estimate, against tracemalloc's peak of the draw (numpy reports to it)."""
    import tracemalloc

    from pytest_circuits.model.families import Geometry
    from pytest_circuits.model.vocab import TokenInfo
    from pytest_circuits.rungs.repeat import probe_memory, repeat_tokens

    n, L = 2000, 64
    tokens = TokenInfo(128, (0,), 0, True)
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        base = tracemalloc.get_traced_memory()[0]
        ids = repeat_tokens(tokens, n, L, 0)
        peak = tracemalloc.get_traced_memory()[1] - base
    finally:
        tracemalloc.stop()
    estimate = probe_memory(Geometry(1, 1, 1, 8, 8, 128), n, L, 1, knockout=False)["tokens"]
    assert ids.numel() * 8 <= peak <= estimate
    assert peak >= estimate / 2  # the estimate is not wildly above what the draw takes


def test_gguf_cache_entry_is_verified_adopted_or_rebuilt(tmp_path, monkeypatch, capsys):
    """A finished entry is reused; a pre-marker entry that is whole gets its marker (no rewrite);
    a truncated one is rebuilt with one warning line, never 'incomplete metadata' forever."""
    from pytest_circuits.model.loading import MARKER, cache_entry_problem, gguf_to_folder, safetensors_complete

    from .test_bad_inputs import write_tiny_gguf

    monkeypatch.setenv("PYTEST_CIRCUITS_CACHE", str(tmp_path / "cache"))
    gguf_file = write_tiny_gguf(tmp_path / "tiny.gguf", seed=11)
    entry = gguf_to_folder(gguf_file)
    weights = entry / "model.safetensors"
    assert cache_entry_problem(entry) is None and safetensors_complete(weights)
    inode = weights.stat().st_ino
    assert gguf_to_folder(gguf_file) == entry and weights.stat().st_ino == inode

    (entry / MARKER).unlink()  # as written before the marker existed
    assert "never finished" in cache_entry_problem(entry)
    assert gguf_to_folder(gguf_file) == entry and weights.stat().st_ino == inode
    assert cache_entry_problem(entry) is None
    capsys.readouterr()

    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2])
    assert not safetensors_complete(weights)
    assert "bytes" in cache_entry_problem(entry)
    assert gguf_to_folder(gguf_file) == entry
    assert weights.read_bytes() == data and cache_entry_problem(entry) is None
    warning = [line for line in capsys.readouterr().err.splitlines() if line]
    assert len(warning) == 1 and "rebuilding" in warning[0]
    assert load_build(resolve_model(str(gguf_file)), "fp32", "cpu").geometry.n_heads == 4
