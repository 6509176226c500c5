"""llama.cpp in the loop (``--circuits-engine llama.cpp``): the repeat probe of a GGUF build run by
llama.cpp itself, against the torch dequantisation of the same file.

The refusals and the gate's handling of what llama.cpp cannot measure run everywhere; the runs
through llama.cpp skip, saying so, where llama-cpp-python is not installed (it builds from source:
``pip install "pytest-circuits[llama]"``).
"""

from __future__ import annotations

import copy
import importlib.util
import json
import math
from pathlib import Path

import numpy as np
import pytest

from pytest_circuits.gate import invariants
from pytest_circuits.gate.tolerances import Tolerances

from .conftest import needs_embedded, needs_smollm2

pytestmark = needs_embedded

HAS_LLAMA_CPP = importlib.util.find_spec("llama_cpp") is not None
needs_llama_cpp = pytest.mark.skipif(
    not HAS_LLAMA_CPP, reason='needs llama-cpp-python: pip install "pytest-circuits[llama]" (builds from source)'
)
BASELINE = "baselines/tiny-induction--fp32.json"


def one_line(text: str) -> str:
    assert text.count("\n") == 1 and "Traceback" not in text, text
    return text


def cli(capsys, *args: str) -> tuple[int, str, str]:
    from pytest_circuits.cli import main

    code = main(list(args))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


# ---------------------------------------------------------------- refusals: one line, exit 2, nothing written


def test_the_engine_without_the_extra_names_the_install(capsys, monkeypatch, q8_file, tmp_path):
    monkeypatch.setitem(__import__("sys").modules, "llama_cpp", None)  # import llama_cpp raises ImportError
    out = tmp_path / "record.json"
    code, _, err = cli(capsys, "scan", "tiny-induction", "--build", f"q8={q8_file}", "--engine", "llama.cpp")
    assert code == 2 and 'pip install "pytest-circuits[llama]"' in one_line(err) and "source distribution" in err
    code, _, err = cli(
        capsys, "scan", "tiny-induction", "--build", f"q8={q8_file}", "--engine", "llama.cpp", "--json", str(out)
    )
    assert code == 2 and not out.exists()


@pytest.mark.parametrize("build", ["fp32", "bf16+kv-q8_0", "folder={model}"])
def test_the_engine_on_a_build_that_is_not_gguf_is_refused(capsys, tmp_path, build):
    from pytest_circuits.model.loading import resolve_model

    build = build.format(model=resolve_model("tiny-induction").folder)
    code, _, err = cli(
        capsys, "record", "tiny-induction", "--build", build, "--engine", "llama.cpp", "--baselines", str(tmp_path)
    )
    assert code == 2 and "runs GGUF files only" in one_line(err) and build.partition("=")[0] in err
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("cache", ["fp8-e4m3", "fp8-e4m3-dyn", "int4", "q8_0-r32"])
def test_a_cache_llama_cpp_does_not_take_is_refused(capsys, q8_file, tmp_path, cache):
    out = tmp_path / "record.json"
    code, _, err = cli(capsys, "scan", "tiny-induction", "--build", f"q8+kv-{cache}={q8_file}", "--engine", "llama.cpp")
    assert code == 2 and f"llama.cpp has no cache type {cache}" in one_line(err) and "+kv-q4_0" in err
    assert not out.exists()


def test_what_llama_cpp_runs_and_how_a_baseline_is_recorded_again():
    """A GGUF file as stored runs (NAME=FILE.gguf, or a .gguf model's fp32); a recipe that casts or
    quantizes in torch does not, and its record command names no engine (it is recorded on torch)."""
    from pytest_circuits.gate.fixes import record_command
    from pytest_circuits.model.llama_engine import runs
    from pytest_circuits.model.recipes import parse_build_spec
    from pytest_circuits.settings import build_settings

    assert runs(parse_build_spec("q8=m.gguf"), "tiny-induction") and runs(parse_build_spec("q8+kv-q4_0=m.gguf"), "x")
    assert runs(parse_build_spec("fp32"), "m.gguf") and not runs(parse_build_spec("bf16"), "m.gguf")
    assert not runs(parse_build_spec("fp32"), "tiny-induction") and not runs(parse_build_spec("q8=folder"), "x")
    s = build_settings({"builds": "q8=m.gguf", "engine": "llama.cpp"}, Path("baselines"))
    assert record_command(s, "q8=m.gguf", "b").endswith("--engine llama.cpp")
    assert "--engine" not in record_command(s, "fp32", "b")


def test_an_unknown_engine_is_one_line_naming_the_choices(capsys):
    code, _, err = cli(capsys, "scan", "tiny-induction", "--engine", "vllm")
    assert code == 2 and "torch, llama.cpp" in one_line(err)


# ---------------------------------------------------------------- the gate on figures llama.cpp cannot measure


def llama_record(record: dict) -> dict:
    """``record`` as a llama.cpp run writes it: no routing score, no path factor, no knockout; an engine line."""
    out = copy.deepcopy(record)
    for row in out["heads"]:
        for key in ("prefix_matching", "previous_token", "duplicate_token", "path_factor", "knockout_delta"):
            row[key] = None
    out["build"]["engine"] = "llama.cpp (llama-cpp-python 0.3.36, CPU): REASON"
    return out


def test_invariants_needing_internals_skip_with_the_engines_reason_never_pass():
    from pytest_circuits.record.store import read_baseline

    baseline = read_baseline(Path(BASELINE))
    after = llama_record(baseline)
    results = {r.invariant: r for r in invariants.gate_all(baseline, after, Tolerances(), "q8", "fp32 baseline")}
    for name in ("induction_heads", "knockout_deltas"):
        assert results[name].status == "skipped", results[name]
        assert "its probe ran on llama.cpp (llama-cpp-python 0.3.36" in results[name].message
    for name in ("copy_loss", "copying_heads", "kappa_distribution", "ov_gain"):  # figures it has: compared
        assert results[name].status == "passed", results[name]
    one = invariants.evaluate("induction_heads", baseline, after, Tolerances(), "q8", "fp32 baseline")
    assert one.status == "skipped" and "REASON" in one.message  # asked for alone: skipped too, never passed


def test_a_baseline_of_another_engine_is_noted_and_never_gates_drift():
    from pytest_circuits.errors import ForeignBaseline
    from pytest_circuits.record.store import compatibility, read_baseline
    from pytest_circuits.run.flow import OWN, gate_against

    baseline = read_baseline(Path(BASELINE))
    after = llama_record(baseline)
    notes = compatibility(baseline, after, "fp32 baseline")
    assert any("baseline: torch, this build: llama.cpp" in n for n in notes), notes

    class Records:  # the `RecordSource` gate_against reads
        def stand_in(self):
            return {"model": baseline["model"], "probe": baseline["probe"]}

        def record(self, build_name, knockout, method, key_heads=False):
            return after

    with pytest.raises(ForeignBaseline, match="recorded on torch, this run measures it on llama.cpp"):
        gate_against(Records(), "q8", baseline, OWN, Tolerances(), None)


def test_rope_theta_of_a_transformers_5_config_reaches_the_gguf_file(tmp_path):
    """transformers 5 keeps rope_theta only in ``rope_parameters``; without ``rope.freq_base`` llama.cpp
    (and transformers' own GGUF loader: measured) read the file at theta 10000, whatever the model's."""
    from gguf import GGUFReader

    from pytest_circuits.model.gguf_write import write_float_gguf
    from pytest_circuits.testing import make_tiny_model

    model = make_tiny_model("llama", seed=0)
    model.config.rope_parameters = {"rope_theta": 50000.0, "rope_type": "default"}
    path = write_float_gguf(model, tmp_path / "m.gguf")
    field = GGUFReader(str(path)).fields["llama.rope.freq_base"]
    assert float(field.contents()) == 50000.0


# ---------------------------------------------------------------- llama.cpp against torch, on the same file


def probes(model: str, path: Path, kv: str | None, L: int = 64, n: int = 8):
    """``(llama.cpp's RepeatProbe, torch's)`` of GGUF file ``path`` (a build of ``model``), one cache each."""
    from pytest_circuits.model.external import load_external_build
    from pytest_circuits.model.kv_cache import attach_kv_cache
    from pytest_circuits.model.kv_formats import parse_kv
    from pytest_circuits.model.loading import resolve_model
    from pytest_circuits.model.recipes import parse_build_spec
    from pytest_circuits.rungs.llama_probe import llama_repeat_probe
    from pytest_circuits.rungs.probe import run_repeat_probe
    from pytest_circuits.rungs.repeat_settings import RepeatSettings

    settings = RepeatSettings(seed=0, n=n, L=L)
    build = load_external_build(resolve_model(model), parse_build_spec(f"g={path}"), "cpu")
    spec = None if kv is None else parse_kv(kv)
    ours = llama_repeat_probe(path, build.tokens, build.geometry, settings, spec, threads=1)
    theirs = run_repeat_probe(build if spec is None else attach_kv_cache(build, spec), settings)
    return ours, theirs


@pytest.fixture(scope="module")
def f32_probes(float_gguf):
    return probes("tiny-induction", float_gguf, None)


@needs_llama_cpp
def test_f32_gguf_through_llama_cpp_matches_torch_closely(f32_probes):
    """F32 weights: llama.cpp's matmuls are float32 like torch's; its f16 KV cache is the one
    difference (about 5e-4 relative on each key and value): per sequence the copy loss stays within
    0.002 nats of torch's (measured: at most 0.0002 over 8 sequences; a tenth of the bound)."""
    ours, theirs = f32_probes
    diff = np.abs(ours.copy_losses - theirs.copy_losses)
    assert diff.max() < 0.002, diff
    assert abs(ours.copy_gain - theirs.copy_gain) < 0.002


@needs_llama_cpp
def test_routing_scores_read_from_llama_cpps_own_patterns_match_torch(f32_probes, q8_file):
    """The patterns llama.cpp hands its eval callback (``kq_soft_max-<layer>``) give every head's
    prefix-matching, previous-token and duplicate-token scores: within 1e-4 of torch's on the F32 file
    (measured: 4e-6) and 1e-3 on the Q8_0 file (measured: 7e-5; activations quantized); with a
    quantized cache (flash attention) there is no pattern, and every score is NaN, never a number."""
    for (ours, theirs), bound in ((f32_probes, 1e-4), (probes("tiny-induction", q8_file, None), 1e-3)):
        for score in ("prefix_matching", "previous_token", "duplicate_token"):
            gap = (ours.heads[score] - theirs.heads[score]).abs().max()
            assert gap < bound, (score, gap)
    ours, _ = probes("tiny-induction", q8_file, "q8_0")
    assert np.isnan(ours.heads["prefix_matching"]).all() and np.isnan(ours.heads["path_factor"]).all()


@needs_llama_cpp
def test_q8_0_gguf_through_llama_cpp_is_close_to_torch_but_not_equal(q8_file, f32_probes):
    """Q8_0 weights: llama.cpp quantizes every activation row to Q8_0 blocks (int8, one fp16 scale per
    32) before the integer dot product, where torch multiplies the dequantised weights by float32
    activations: about 0.4% relative on each activation. Per sequence the copy loss stays within
    0.02 nats of torch's on the same file and the mean within 0.005 (measured: 0.0018 and 0.00005),
    and it moves further from torch than the F32 file's does (measured: 9x): llama.cpp's own
    kernels ran, not a float path."""
    ours, theirs = probes("tiny-induction", q8_file, None)
    diff = ours.copy_losses - theirs.copy_losses
    assert np.abs(diff).max() < 0.02 and abs(diff.mean()) < 0.005, diff
    f32_diff = f32_probes[0].copy_losses - f32_probes[1].copy_losses
    assert np.abs(diff).max() > np.abs(f32_diff).max()


@needs_llama_cpp
@pytest.mark.parametrize("kv", ["q8_0", "q4_0"])
def test_llama_cpps_own_cache_is_close_to_the_torch_simulation(float_gguf, kv):
    """The cache types through llama.cpp (type_k = type_v, flash attention) against the torch simulation of
    the same blocks on the same file: within 0.01 nats on the mean copy loss (measured: q8_0 0.0003,
    q4_0 0.0001; the blocks are ggml's own rounding in both, the rest is f16 flash-attention arithmetic)."""
    ours, theirs = probes("tiny-induction", float_gguf, kv)
    assert abs(ours.copy_loss - theirs.copy_loss) < 0.01, (ours.copy_loss, theirs.copy_loss)


def engine_blocks(x: np.ndarray, kind: str, block_bytes: int) -> np.ndarray:
    """Rows ``x`` as llama.cpp's own CPU quantizer of ``kind`` writes them (``quantize_row_<kind>`` of
    the installed libggml-cpu: the ``from_float`` that writes its cache), raw: ``(rows, blocks, bytes)``."""
    import ctypes
    import os

    import llama_cpp

    lib = ctypes.CDLL(os.path.join(os.path.dirname(llama_cpp.__file__), "lib", "libggml-cpu.so"))
    rows = np.ascontiguousarray(x, dtype=np.float32)
    raw = np.zeros((rows.shape[0], rows.shape[1] // 32, block_bytes), dtype=np.uint8)
    quantize = getattr(lib, f"quantize_row_{kind}")
    for row, out in zip(rows, raw):
        quantize(row.ctypes.data_as(ctypes.c_void_p), out.ctypes.data_as(ctypes.c_void_p), ctypes.c_int64(row.size))
    return raw


def engine_roundtrip(x: np.ndarray, kind: str) -> np.ndarray:
    """`engine_blocks` of ``kind``, dequantized by the gguf package."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, quants

    qtype = GGMLQuantizationType[kind.upper()]
    raw = engine_blocks(x, kind, GGML_QUANT_SIZES[qtype][1])
    return quants.dequantize(raw.reshape(raw.shape[0], -1), qtype).astype(np.float32)


@needs_llama_cpp
@pytest.mark.parametrize("kind", ["q8_0", "q4_0", "q4_1", "q5_0", "q5_1", "iq4_nl"])
def test_the_simulated_blocks_are_llama_cpps_own_quantizer_bit_for_bit(kind):
    """Each cache type's blocks against the installed llama.cpp's own quantizer (the one that writes
    its cache), on Gaussian rows with outliers and on bf16-rounded rows and a crafted block full of
    ties: equal to the bit (q8_0's SIMD rounding ties to even; iq4_nl's scale search)."""
    import torch

    from pytest_circuits.model.kv_cache import ggml_roundtrip

    g = torch.Generator().manual_seed(11)
    gauss = torch.randn(16, 64, generator=g) * torch.exp(torch.randn(16, 1, generator=g))
    gauss[3, 7] = 30.0
    ties = (torch.randn(8, 64, generator=g) * 4).to(torch.bfloat16).float()
    ties[:, 0] = 127.0
    crafted = torch.tensor([127.0, 0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 3.5, 4.5, -126.5] + [0.25, -0.75] * 27)
    x = torch.cat([gauss, ties, crafted.view(1, 64)])
    np.testing.assert_array_equal(ggml_roundtrip(x, kind).numpy(), engine_roundtrip(x.numpy(), kind))


@needs_llama_cpp
def test_qdot_quantizes_q_as_llama_cpps_q8_blocks_in_the_keys_layout():
    """``-qdot``: the query handed to attention is ``P^T H dq8(H P q)`` with dq8 llama.cpp's own
    ``quantize_row_q8_0`` (and q8_1 rounds Q alike): computed here from the engine's quantizer."""
    import torch

    from pytest_circuits.model.ggml_layout import ggml_layout, hadamard, interleaved_order
    from pytest_circuits.model.kv_cache import KvCache, quantize_query
    from pytest_circuits.model.kv_formats import parse_kv

    g = torch.Generator().manual_seed(2)
    q = torch.randn(1, 2, 5, 64, generator=g) * 3
    order = interleaved_order(64)
    h = hadamard(64).numpy()
    rotated = (q[..., order].reshape(-1, 64).numpy() @ h).astype(np.float32)
    for kind in ("q4_0", "q4_1"):
        expected = engine_roundtrip(rotated, "q8_0") @ h
        expected = torch.from_numpy(expected.astype(np.float32)).reshape(q.shape)[..., torch.argsort(order)]
        cache = KvCache(parse_kv(f"{kind}-qdot"), layout=ggml_layout("llama", 64, {}))
        torch.testing.assert_close(quantize_query(q, cache), expected, rtol=0, atol=1e-5)
        q8_1, q8_0 = engine_blocks(rotated, "q8_1", 36), engine_blocks(rotated, "q8_0", 34)  # {d, [s,] qs[32]}
        assert np.array_equal(q8_1[..., :2], q8_0[..., :2]) and np.array_equal(q8_1[..., 4:], q8_0[..., 2:])
        assert torch.equal(quantize_query(q, KvCache(parse_kv(kind), layout=ggml_layout("llama", 64, {}))), q)


def engine_dot(kind: str, keys: np.ndarray, queries: np.ndarray) -> np.ndarray:
    """``(queries, keys)`` scores as llama.cpp's CPU flash attention computes K.Q with a ``kind`` cache: keys
    through ``quantize_row_<kind>``, Q through its ``vec_dot_type``'s, then ``ggml_vec_dot_<kind>_<type>``."""
    import ctypes
    import os

    import llama_cpp

    from pytest_circuits.model.kv_formats import vec_dot_type

    lib = ctypes.CDLL(os.path.join(os.path.dirname(llama_cpp.__file__), "lib", "libggml-cpu.so"))
    lib.ggml_cpu_init()  # its fp16 tables: without it the dot products read zeros
    qtype = vec_dot_type(kind)
    dot = getattr(lib, f"ggml_vec_dot_{kind}_{qtype}")
    dot.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_float), ctypes.c_size_t, ctypes.c_void_p]
    dot.argtypes += [ctypes.c_size_t, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    kb = engine_blocks(keys, kind, {"q4_0": 18, "q4_1": 20}[kind])
    qb = engine_blocks(queries, qtype, 36 if qtype == "q8_1" else 34)
    out, s = np.zeros((len(queries), len(keys)), dtype=np.float32), ctypes.c_float()
    for i, q in enumerate(qb):
        for j, k in enumerate(kb):
            dot(keys.shape[1], ctypes.byref(s), 0, k.ctypes.data, 0, q.ctypes.data, 0, 1)
            out[i, j] = s.value
    return out


@needs_llama_cpp
@pytest.mark.parametrize("kind", ["q4_0", "q4_1"])
def test_llama_cpps_k_dot_q_is_the_qdot_score_but_for_q8_1s_block_sum(kind):
    """``-qdot`` scores, ``dq8(q) . dq(k)``, against llama.cpp's own K.Q on rows with an offset (so a q4_1
    block's minimum ``m`` matters): equal to float rounding for q4_0 (q8_0 Q); for q4_1 (q8_1 Q) the engine
    adds ``m s`` per block with ``s = fp16(d sum(q_i))`` its stored block sum, where the simulation has
    ``m fp16(d) sum(q_i)``: the one difference left, read from the blocks' bytes here, 1e-3 of a score."""
    import torch

    from pytest_circuits.model.kv_cache import ggml_roundtrip, q8_0_roundtrip

    g = torch.Generator().manual_seed(5)
    keys = (torch.randn(12, 64, generator=g) * 3 + 4).numpy()
    queries = (torch.randn(10, 64, generator=g) * 5 + 2).numpy()
    ours = engine_dot(kind, keys, queries)
    qdq = q8_0_roundtrip(torch.from_numpy(queries).reshape(-1, 32)).reshape(queries.shape)
    sim = (qdq.double() @ ggml_roundtrip(torch.from_numpy(keys), kind).double().T).numpy()
    if kind == "q4_0":
        np.testing.assert_allclose(ours, sim, rtol=0, atol=1e-3)
        return
    kb, qb = engine_blocks(keys, "q4_1", 20), engine_blocks(queries, "q8_1", 36)
    half = lambda raw, at: raw[..., at : at + 2].copy().view(np.float16)[..., 0].astype(np.float64)  # noqa: E731
    m, d, s = half(kb, 2), half(qb, 0), half(qb, 2)  # (keys, 2), (queries, 2), (queries, 2)
    sums = qb[..., 4:].view(np.int8).astype(np.float64).sum(-1)  # (queries, 2)
    extra = (s - d * sums) @ m.T  # sum over blocks of m (s - fp16(d) sum q)
    assert np.abs(extra).max() > 1e-3  # the block sum's rounding is there, and is not the simulation's
    np.testing.assert_allclose(ours, sim + extra, rtol=0, atol=1e-3)
    assert np.abs(ours - sim).max() < 2e-3 * np.abs(sim).max()


@needs_llama_cpp
def test_the_gate_through_llama_cpp_names_the_engine_and_skips_what_it_cannot_see(capsys, q8_file, tmp_path):
    out = tmp_path / "record.json"
    code, text, err = cli(
        capsys,
        "scan",
        "tiny-induction",
        "--build",
        f"q8+kv-q8_0={q8_file}",
        "--engine",
        "llama.cpp",
        "--json",
        str(out),
    )
    assert code == 0, err
    record = json.loads(out.read_text())
    assert record["build"]["engine"].startswith("llama.cpp (llama-cpp-python ")
    assert record["build"]["kv_cache"].startswith("q8_0: ") and "llama.cpp's own cache" in record["build"]["kv_cache"]
    assert all(row["prefix_matching"] is None and row.get("knockout_delta") is None for row in record["heads"])
    assert math.isfinite(record["copy_loss"])
    code, text, err = cli(
        capsys, "gate", "tiny-induction", "--build", f"q8={q8_file}", "--engine", "llama.cpp", "--baseline", BASELINE
    )
    assert code == 0, text + err
    assert "probe run by llama.cpp (llama-cpp-python" in text
    assert "note: the probe ran on another engine than the baseline's (baseline: torch, this build: llama.cpp)" in text
    assert "PASS copy_loss" in text and "PASS induction_heads" in text and "SKIP knockout_deltas" in text
    code, text, err = cli(
        capsys,
        "gate",
        "tiny-induction",
        "--build",
        f"q8+kv-q4_0={q8_file}",
        "--engine",
        "llama.cpp",
        "--baseline",
        BASELINE,
    )
    assert code == 0 and "SKIP induction_heads" in text and "never forms the attention pattern" in text, text + err


@needs_llama_cpp
@needs_smollm2
@pytest.mark.slow
@pytest.mark.real
def test_smollm2_q8_0_through_llama_cpp_against_torch(env):
    """SmolLM2-135M's Q8_0 file: llama.cpp's copy loss within 0.1 nats of torch's on the same file."""
    from pytest_circuits.model.gguf_quant import cached_gguf

    ours, theirs = probes("smollm2-135m", cached_gguf("smollm2-135m", "Q8_0"), None, n=4)
    assert abs(ours.copy_loss - theirs.copy_loss) < 0.1, (ours.copy_loss, theirs.copy_loss)


@needs_llama_cpp
@needs_smollm2
@pytest.mark.slow
@pytest.mark.real
@pytest.mark.parametrize(
    "kv",
    [
        "q8_0",
        "q5_0",
        "q5_1",
        "q4_0",
        "iq4_nl",
        "q4_1",
    ],
)
def test_smollm2_through_llama_cpps_own_cache_is_the_simulation(kv):
    """SmolLM2's Q8_0 file (head size 64: llama.cpp rotates Q, K, V by a Walsh-Hadamard matrix and
    keeps its keys in GGUF's interleaved order) through each of llama.cpp's caches against the torch
    simulation of the same layout and blocks, over the first 128 sequences of seed 0: the mean copy
    loss within 0.05 nats plus three standard errors of the simulation's own float noise, the spread
    of its per-sequence copy losses when every key and value moves by one ulp
    (`kv_cache.one_ulp_bumps`; another summation order, as llama.cpp's SIMD kernels and another CPU
    have). Through a 4-bit cache that spread is about 0.14 nats per sequence at L 64, and llama.cpp
    against the simulation about 0.27, so 8 sequences (q4_1: -0.19 there) said little and 128 hold a
    4-bit mean to about +-0.05 (docs/kv-cache.md, n = 256); about 3.5 minutes a cache on 2 cores.
    Before the layout was simulated q4_0 was 0.68 nats off, past that bound."""
    from pytest_circuits.model.external import load_external_build
    from pytest_circuits.model.gguf_quant import cached_gguf
    from pytest_circuits.model.kv_cache import attach_kv_cache, one_ulp_bumps
    from pytest_circuits.model.kv_formats import parse_kv
    from pytest_circuits.model.loading import resolve_model
    from pytest_circuits.model.recipes import parse_build_spec
    from pytest_circuits.rungs.probe import run_repeat_probe
    from pytest_circuits.rungs.repeat_settings import RepeatSettings

    path = cached_gguf("smollm2-135m", "Q8_0")
    n = 128
    ours, theirs = probes("smollm2-135m", path, kv, n=n)
    build = load_external_build(resolve_model("smollm2-135m"), parse_build_spec(f"g={path}"), "cpu")
    with one_ulp_bumps():
        bumped = run_repeat_probe(attach_kv_cache(build, parse_kv(kv)), RepeatSettings(seed=0, n=n, L=64))
    noise = np.std(bumped.copy_losses - theirs.copy_losses, ddof=1) / math.sqrt(len(theirs.copy_losses))
    gap = ours.copy_loss - theirs.copy_loss
    assert abs(gap) < 0.05 + 3 * noise, (ours.copy_loss, theirs.copy_loss, noise)


@needs_llama_cpp
def test_the_pytest_gate_suite_through_llama_cpp_skips_what_it_cannot_see(pytester, q8_file):
    """The shipped probes with ``circuits_engine = llama.cpp`` in the ini, a q4_0 cache (flash attention:
    no pattern): the copy loss and the weights gate the GGUF build, the induction and knockout tests
    skip naming the engine, none passes on them."""
    from .conftest import PROBES

    for test in sorted(PROBES.glob("test_*.py")):
        pytester.makepyfile(**{test.stem: test.read_text()})
    baselines = (Path(__file__).parents[1] / BASELINE).parent
    pytester.makeini(
        f"[pytest]\ncircuits_model = tiny-induction\ncircuits_builds = q8+kv-q4_0={q8_file}\ncircuits_baselines = {baselines}\n"
        "circuits_device = cpu\ncircuits_engine = llama.cpp\n"
    )
    result = pytester.runpytest("-p", "no:cacheprovider", "-rs", "-k", "q8")
    out = result.stdout.str()
    for name in ("test_induction_heads_survive", "test_knockout_deltas_keep_size"):
        assert not any("PASSED" in line and name in line for line in result.outlines), out
    skipped = [line for line in result.outlines if line.startswith("SKIPPED")]
    assert any("routing" in line and "llama.cpp" in line for line in skipped), out
    assert any("knockout" in line and "llama.cpp" in line for line in skipped), out
    assert result.ret == 0, out
