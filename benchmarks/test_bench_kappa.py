"""Rung 1 on SmolLM2-135M: the batched kappa scan with its rotation null, against a naive per-head loop;
the cheap null (32 draws, symmetric t) against the old one (256 draws, normal) and its calibration.

Run:  python -m pytest benchmarks/test_bench_kappa.py -m real --run-slow --benchmark-only -s

The naive loop (per head: ``M_h`` from scratch without sharing ``W_U W_E``, numpy eigvals,
then one rotation at a time) runs on 9 heads (3 layers x the 3 key/value groups) and is
extrapolated to all 270 (its cost is the same for every head); set
``PYTEST_CIRCUITS_BENCH_NAIVE=all`` to time it on every head (a few minutes on idle cores).
Both see the same rotations, so their numbers must agree to 1e-6 with float64 products and null
eigenvalues (kappa and kappa_trace to 1e-4 with the default float32 ones).

``test_bench_rung1_against_the_matmul_ceiling`` (no SmolLM2 needed) times rung 1 at the Llama-3.2-1B
shape (random weights held in memory) beside one large float32 and bf16 ``torch.matmul``: the ceiling,
and rung 1's counted rate as a fraction of it.

Besides wall time the scan's CPU time is recorded: on a machine shared with other jobs,
``cpu_s / threads`` estimates the wall time on otherwise idle cores.
"""

from __future__ import annotations

import importlib.util
import os
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from pytest_circuits.model.builds import load_build
from pytest_circuits.model.loading import resolve_model
from pytest_circuits.model.weights import extract_weights
from pytest_circuits.rungs.kappa import ov_spectrum
from pytest_circuits.rungs.plain_loops import plain_ov_spectrum
from pytest_circuits.rungs.plan import rung1_flops
from pytest_circuits.testing import requires_smollm2

pytestmark = [pytest.mark.slow]
real = [pytest.mark.real, requires_smollm2()]

TARGET_S = 30.0
NAIVE_HEADS = [(layer, head) for layer in (0, 14, 29) for head in (0, 4, 8)]
COMPARED = [
    "kappa",
    "kappa_trace",
    "kappa_null_mean",
    "kappa_null_sd",
    "kappa_z",
    "kappa_p",
    "kappa_trace_null_mean",
    "kappa_trace_null_sd",
    "kappa_trace_z",
    "kappa_trace_p",
]
SCORES = ["kappa", "kappa_trace"]


@pytest.fixture(scope="module")
def smollm2():
    """SmolLM2-135M fp32 weights, folded, with the seconds spent loading and extracting them."""
    start = time.perf_counter()
    build = load_build(resolve_model("smollm2-135m"), "fp32")
    loaded = time.perf_counter()
    weights = extract_weights(build.model, fold=True)
    return weights, loaded - start, time.perf_counter() - loaded


@real[0]
@real[1]
def test_bench_kappa_scan_vs_naive(benchmark, smollm2):
    weights, load_s, extract_s = smollm2
    geo = weights.geometry
    n_heads = geo.n_layers * geo.n_heads

    start, cpu_start = time.perf_counter(), time.process_time()
    df = benchmark.pedantic(ov_spectrum, args=(weights,), kwargs=dict(seed=0), rounds=1, iterations=1)
    fast_s, cpu_s = time.perf_counter() - start, time.process_time() - cpu_start

    every = os.environ.get("PYTEST_CIRCUITS_BENCH_NAIVE", "") == "all"
    heads = [(l, h) for l in range(geo.n_layers) for h in range(geo.n_heads)] if every else NAIVE_HEADS
    start, cpu_start = time.perf_counter(), time.process_time()
    naive = plain_ov_spectrum(weights, seed=0, heads=heads)
    naive_s, naive_cpu_s = time.perf_counter() - start, time.process_time() - cpu_start
    naive_all_s = naive_s / len(heads) * n_heads
    naive_all_cpu_s = naive_cpu_s / len(heads) * n_heads

    rows = df.set_index("head").loc[naive["head"]]  # float32 products: kappa and kappa_trace to 1e-4
    np.testing.assert_allclose(rows[SCORES].to_numpy(), naive[SCORES].to_numpy(), rtol=0, atol=1e-4)
    f64 = torch.float64  # the naive loop's precision: products and the null's eigenvalues
    exact = ov_spectrum(weights, seed=0, product_dtype=f64, null_dtype=f64).set_index("head").loc[naive["head"]]
    np.testing.assert_allclose(exact[COMPARED].to_numpy(), naive[COMPARED].to_numpy(), rtol=1e-6, atol=1e-6)

    summary = df.attrs["summary"]
    info = {
        "heads": n_heads,
        "n_rotations": df.attrs["summary"]["n_rotations"],
        "threads": torch.get_num_threads(),
        "load_s": round(load_s, 2),
        "extract_s": round(extract_s, 2),
        "scan_s": round(fast_s, 2),
        "scan_cpu_s": round(cpu_s, 2),
        "scan_idle_estimate_s": round(cpu_s / torch.get_num_threads(), 2),
        "naive_heads_timed": len(heads),
        "naive_s_timed": round(naive_s, 2),
        "naive_s_all_heads": round(naive_all_s, 1),
        "naive_extrapolated": not every,
        "naive_cpu_s_all_heads": round(naive_all_cpu_s, 1),
        "speedup": round(naive_all_s / fast_s, 1),
        "speedup_cpu": round(naive_all_cpu_s / cpu_s, 1),
        "target_s": TARGET_S,
        "target_met": fast_s < TARGET_S,
        "load_average_1min": round(os.getloadavg()[0], 2),
        "n_copying": summary["n_copying"],
        "n_suppression": summary["n_suppression"],
        "n_copying_trace": int(df["copying_trace"].sum()),
        "n_suppression_trace": int(df["suppression_trace"].sum()),
        "analytic_floor": round(summary["analytic_floor"], 4),
        "median_null_sd": round(summary["median_null_sd"], 4),
        "median_trace_null_sd": round(summary["median_trace_null_sd"], 4),
    }
    benchmark.extra_info.update(info)
    print(
        f"\nkappa scan of SmolLM2-135M ({n_heads} heads, {info['n_rotations']} rotations, {info['threads']} threads, "
        f"load average {info['load_average_1min']}): {fast_s:.1f} s wall, {cpu_s:.1f} s CPU "
        f"(~{info['scan_idle_estimate_s']:.1f} s on idle cores; target {TARGET_S:.0f} s); "
        f"load {load_s:.1f} s + extract {extract_s:.1f} s\n"
        f"naive per-head loop: {naive_s:.1f} s for {len(heads)} heads -> {naive_all_s:.0f} s for {n_heads}"
        f"{' (extrapolated)' if not every else ''}; speedup x{info['speedup']} wall, "
        f"x{info['speedup_cpu']} CPU ({naive_all_cpu_s:.0f} s vs {cpu_s:.0f} s)\n"
        f"copying {info['n_copying']}, suppression {info['n_suppression']} (trace-weighted: "
        f"{info['n_copying_trace']}, {info['n_suppression_trace']}); analytic floor 1/sqrt(2 d_head) = "
        f"{info['analytic_floor']:.4f}, median null sd {info['median_null_sd']:.4f} "
        f"(trace-weighted {info['median_trace_null_sd']:.4f})"
    )
    assert len(df) == n_heads


@real[0]
@real[1]
def test_bench_cheap_null_against_256_draws_and_calibration(smollm2):
    """The default null (32 draws, symmetric t, float32 eigenvalues) against the old default
    (256 draws, normal p, float64) on the same weights, and the share of random-model heads flagged."""
    import pandas as pd

    from pytest_circuits.rungs.kappa import ov_spectrum_of_model, without_attrs
    from pytest_circuits.testing import make_tiny_model

    weights = smollm2[0]
    timed = {}
    for name, kwargs in (("cheap", {}), ("old", dict(n_rotations=256, p_method="normal", null_dtype=torch.float64))):
        cpu_start = time.process_time()
        timed[name] = (ov_spectrum(weights, seed=0, n_workers=1, **kwargs), time.process_time() - cpu_start)
    (cheap, cheap_s), (old, old_s) = timed["cheap"], timed["old"]
    lines = [
        f"\nrung 1 with its null, all {len(cheap)} heads, 1 worker: {cheap_s:.1f} CPU-s "
        f"(32 draws, t) vs {old_s:.1f} CPU-s (256 draws, normal) = {cheap_s / old_s:.2f}"
    ]
    for metric in ("kappa", "kappa_trace"):
        flag, flag_old = cheap[f"{metric}_q"] <= 0.05, old[f"{metric}_q"] <= 0.05
        ratio = (cheap[f"{metric}_z"] / old[f"{metric}_z"]).abs()
        shift = float((cheap[f"{metric}_z"] - old[f"{metric}_z"]).mean())
        lines.append(
            f"{metric}: flagged {int(flag.sum())} vs {int(flag_old.sum())} (differ on {int((flag != flag_old).sum())}); "
            f"median |z/z_old - 1| {float((ratio - 1).abs().median()):.3f}; mean z shift {shift:+.3f} (gate: +-1)"
        )
    shapes = [
        ("gpt2", dict(n_layer=3, n_head=8, n_embd=128)),
        ("llama", dict(num_hidden_layers=3, num_attention_heads=8, num_key_value_heads=4, hidden_size=128)),
        ("gpt_neox", dict(num_hidden_layers=3, num_attention_heads=8, hidden_size=128)),
    ]
    pooled = pd.concat(
        [
            without_attrs(ov_spectrum_of_model(make_tiny_model(f, seed=s, **kw), seed=s))
            for f, kw in shapes
            for s in range(4)
        ],
        ignore_index=True,
    )
    flagged = float((pooled["copying"] | pooled["suppression"]).mean())
    raw = float((pooled["kappa_p"] < 0.05).mean())
    lines.append(
        f"calibration, {len(pooled)} heads of 12 random models: flagged {flagged:.3f} (q = 0.05), "
        f"uncorrected p < 0.05: {raw:.3f}"
    )
    print("\n".join(lines))
    assert flagged <= 0.05


SIZES_SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "measure_sizes.py"  # the shapes, the FLOP count
CEILING_N = 4096  # one n x n x n matmul: the machine's rate at this dtype


def matmul_rate(dtype: torch.dtype, n: int = CEILING_N) -> float:
    """GFLOP/s (``2 n^3`` per CPU-second, over every thread) of one large ``torch.matmul`` in ``dtype``, after a warm-up."""
    gen = torch.Generator().manual_seed(0)
    a, b = (torch.randn(n, n, generator=gen).to(dtype) for _ in range(2))
    a @ b
    cpu = time.process_time()
    a @ b
    return 2 * n**3 / (time.process_time() - cpu) / 1e9


def random_weights(shape: str = "llama-3.2-1b"):
    """`ModelWeights` of a `scripts/measure_sizes.py` shape: N(0, 0.02^2) weights rounded to bf16, W_U tied to W_E."""
    from pytest_circuits.model.families import Geometry
    from pytest_circuits.model.weights import LayerWeights, ModelWeights

    spec = importlib.util.spec_from_file_location("measure_sizes", SIZES_SCRIPT)
    assert spec is not None and spec.loader is not None
    sizes = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(sizes)
    config = sizes.SHAPES[shape]
    d, V, dh = config["hidden_size"], config["vocab_size"], config["head_dim"]
    L, H, KV = config["num_hidden_layers"], config["num_attention_heads"], config["num_key_value_heads"]
    gen = torch.Generator().manual_seed(0)

    def draw(*size):
        return (torch.randn(*size, generator=gen) * sizes.INIT_STD).bfloat16().float()

    layers = [
        LayerWeights(None, None, draw(KV, d, dh), draw(H, dh, d), None, None, None, None, torch.ones(d))
        for _ in range(L)
    ]
    W_E = draw(V, d)
    geometry = Geometry(n_layers=L, n_heads=H, n_kv_heads=KV, d_model=d, d_head=dh, vocab=V)
    return ModelWeights("llama", geometry, layers, W_E, W_E.T, torch.ones(d), True), rung1_flops(geometry, 32)


def test_bench_rung1_against_the_matmul_ceiling(benchmark):
    """Rung 1 at the Llama-3.2-1B shape, its ``W_U W_E`` alone in float32 and float64, and the ceiling."""
    from pytest_circuits.rungs.kappa import vocab_products

    weights, flops = random_weights()
    ceiling = {str(dtype).removeprefix("torch."): matmul_rate(dtype) for dtype in (torch.float32, torch.bfloat16)}
    d, V = weights.geometry.d_model, weights.geometry.vocab
    products = {}
    for dtype in (torch.float32, torch.float64):
        cpu = time.process_time()
        vocab_products(weights, dtype=dtype)
        products[str(dtype).removeprefix("torch.")] = time.process_time() - cpu
    cpu = time.process_time()
    frame = benchmark.pedantic(ov_spectrum, args=(weights,), rounds=1, iterations=1)
    rung1_s = time.process_time() - cpu
    rate = flops / rung1_s / 1e9
    product_rate = 2 * d * d * V / products["float32"] / 1e9
    info = {
        "threads": torch.get_num_threads(),
        "load_average_1min": round(os.getloadavg()[0], 2),
        "ceiling_gflops": {k: round(v) for k, v in ceiling.items()},
        "rung1_cpu_s": round(rung1_s, 2),
        "rung1_counted_tflop": round(flops / 1e12, 3),
        "rung1_gflops": round(rate, 1),
        "rung1_fraction_of_float32": round(rate / ceiling["float32"], 3),
        "rung1_fraction_of_bf16": round(rate / ceiling["bfloat16"], 3),
        "W_U_W_E_cpu_s": {k: round(v, 2) for k, v in products.items()},
        "W_U_W_E_fraction_of_float32": round(product_rate / ceiling["float32"], 3),
    }
    benchmark.extra_info.update(info)
    print(
        f"\nrung 1 at the Llama-3.2-1B shape ({len(frame)} heads, {info['threads']} threads, load average "
        f"{info['load_average_1min']}): {rung1_s:.1f} CPU-s, {flops / 1e12:.2f} TFLOP counted = {rate:.0f} GFLOP/s, "
        f"{info['rung1_fraction_of_float32']:.0%} of float32 matmul ({ceiling['float32']:.0f} GFLOP/s), "
        f"{info['rung1_fraction_of_bf16']:.0%} of bf16 ({ceiling['bfloat16']:.0f})\n"
        f"W_U W_E alone: {products['float32']:.1f} CPU-s in float32 ({product_rate:.0f} GFLOP/s, "
        f"{info['W_U_W_E_fraction_of_float32']:.0%} of the ceiling), {products['float64']:.1f} in float64"
    )
    assert len(frame) == weights.geometry.n_layers * weights.geometry.n_heads
