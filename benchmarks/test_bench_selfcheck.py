"""The load-time self-check of the per-head read, against plain forwards of the same model.

Run:  python -m pytest benchmarks/test_bench_selfcheck.py -m real --run-slow --benchmark-only -s

Timed by pytest-benchmark: `check_decomposition` on SmolLM2-135M fp32 (one forward of 16
tokens with hooks, then every layer's weights read and the per-head sum recomputed in
float64). References, timed in the untimed ``setup`` of every round so that both share the
machine's noise: a plain forward of the same 16 tokens, and one plain forward of the
probe's default batch (8 sequences of ``2L = 128`` tokens plus BOS).
``extra_info``: ``ratio_short`` = min check / min short forward, ``ratio_probe`` = min check /
min probe-batch forward. Both run on one torch thread.
"""

from __future__ import annotations

import time

import pytest
import torch

from pytest_circuits.model.builds import load_build
from pytest_circuits.model.loading import resolve_model
from pytest_circuits.model.selfcheck import N_TOKENS, check_decomposition
from pytest_circuits.rungs.repeat import repeat_tokens
from pytest_circuits.rungs.repeat_settings import RepeatSettings
from pytest_circuits.testing import requires_smollm2

pytestmark = [pytest.mark.real, pytest.mark.slow, requires_smollm2()]


@pytest.fixture(autouse=True)
def single_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_selfcheck_cost(benchmark):
    build = load_build(resolve_model("smollm2-135m"), "fp32", "cpu")
    short = torch.randint(0, build.geometry.vocab, (1, N_TOKENS), generator=torch.Generator().manual_seed(0))
    settings = RepeatSettings()
    probe = repeat_tokens(build.tokens, settings.n, settings.L, settings.seed)
    times = {"short": [], "probe": []}

    def timed(name, ids):
        start = time.perf_counter()
        with torch.no_grad():
            build.model(input_ids=ids, use_cache=False)
        times[name].append(time.perf_counter() - start)

    def setup():
        timed("short", short)
        timed("probe", probe)

    check = benchmark.pedantic(lambda: check_decomposition(build), setup=setup, rounds=5, iterations=1)
    assert check.ok
    best = benchmark.stats.stats.min
    benchmark.extra_info.update(
        check_s=best,
        short_forward_s=min(times["short"]),
        probe_forward_s=min(times["probe"]),
        ratio_short=best / min(times["short"]),
        ratio_probe=best / min(times["probe"]),
        worst_error=check.worst,
    )
    print(benchmark.extra_info)
