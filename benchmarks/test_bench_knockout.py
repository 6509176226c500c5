"""Cached and batched knockout scan vs the plain loop (one full forward per head) on SmolLM2-135M.

Both run in the same session on the same heads; the cached scan must give the same deltas
(1e-5) and is reported as a ratio of the plain loop's wall time (target: <= 0.5).
Run: pytest benchmarks/test_bench_knockout.py --run-slow -p no:randomly -s
"""

from __future__ import annotations

import pytest
import torch

from pytest_circuits.model.builds import load_build
from pytest_circuits.model.loading import resolve_model
from pytest_circuits.rungs.knockout import knockout_scan, naive_knockout_deltas
from pytest_circuits.rungs.repeat import RepeatSettings
from pytest_circuits.testing import requires_smollm2

pytestmark = [pytest.mark.real, pytest.mark.slow, requires_smollm2()]

HELD_OUT = RepeatSettings(seed=1, n=4, L=16)
# every head of layers 2, 7, ..., 27 (the middle of each five-layer band): the same depth
# profile and heads-per-layer as the full 270-head scan, at a fifth of its cost
HEADS = [f"L{layer}H{head}" for layer in range(2, 30, 5) for head in range(9)]
TIMES: dict[str, float] = {}
DELTAS: dict[str, dict] = {}


@pytest.fixture(scope="module")
def smollm2():
    """The fp32 build, timed on one thread: the host is shared, and one thread keeps both runs comparable."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield load_build(resolve_model("smollm2-135m"), "fp32", "cpu")
    torch.set_num_threads(threads)


def _run(benchmark, name, fn):
    result = benchmark.pedantic(fn, rounds=1, iterations=1, warmup_rounds=0)
    TIMES[name] = benchmark.stats.stats.mean
    return result


@pytest.mark.benchmark(group="knockout-smollm2")
def test_naive_loop(benchmark, smollm2):
    _, deltas = _run(benchmark, "naive", lambda: naive_knockout_deltas(smollm2, HELD_OUT, heads=HEADS))
    DELTAS["naive"] = deltas


@pytest.mark.benchmark(group="knockout-smollm2")
def test_cached_batched_scan(benchmark, smollm2):
    df = _run(benchmark, "cached", lambda: knockout_scan(smollm2, HELD_OUT, heads=HEADS, progress=False))
    cached = df.set_index("head")["knockout_delta"]
    if "naive" not in DELTAS:
        pytest.skip("run with test_naive_loop first (same session) for the ratio")
    worst = max(abs(cached[h] - d) for h, d in DELTAS["naive"].items())
    ratio = TIMES["cached"] / TIMES["naive"]
    benchmark.extra_info.update(ratio_to_naive=ratio, max_abs_diff=worst, heads=len(HEADS), threads=torch.get_num_threads())
    print(f"\ncached/naive wall time: {TIMES['cached']:.1f}s / {TIMES['naive']:.1f}s = {ratio:.2f}; max |diff| {worst:.2g}")
    assert worst <= 1e-5
