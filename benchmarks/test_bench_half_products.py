"""A half-precision build's forward with its products taken over (`model.half_products`) against the
same build on torch's own half-precision kernels, in the same run.

pytest-benchmark times a forward of the knockout probe's 8 sequences on the build whose products run as
float32 GEMMs rounded once; the same forward on the build that keeps torch's kernels is timed in the
untimed ``setup`` of every round, so the two alternate and share the machine's noise.
``extra_info["time_ratio"]`` = min taken-over / min native: far below 1 on a CPU whose oneDNN has no
kernel for the dtype (``native`` False in ``extra_info``; 0.17 for SmolLM2 bf16 on an AVX2 EPYC), about
1 or above where it has one (there a build keeps its own kernels). Both builds run on every thread.
"""

from __future__ import annotations

import time

import pytest
import torch

from pytest_circuits.model import half_products
from pytest_circuits.model.builds import load_build
from pytest_circuits.model.loading import resolve_model
from pytest_circuits.rungs.repeat_settings import RepeatSettings
from pytest_circuits.rungs.replay import attention_implementation, held_out_ids
from pytest_circuits.testing import requires_embedded_model, requires_smollm2

PROBE = RepeatSettings(seed=1, n=8, L=64)  # the shipped baselines' knockout probe


def compare(benchmark, model: str, recipe: str, rounds: int, monkeypatch) -> dict:
    source = resolve_model(model)
    with monkeypatch.context() as patched:
        patched.setattr(half_products, "native_half_products", lambda dtype: True)
        native = load_build(source, recipe, "cpu")
    taken = load_build(source, recipe, "cpu")
    dtype = half_products.float32_products(taken.model, force=True)
    ids = held_out_ids(taken, PROBE)
    reference: list[float] = []

    def forward(build):
        with attention_implementation(build.model), torch.no_grad():
            return build.model(input_ids=ids, use_cache=False).logits

    def time_native():
        start = time.perf_counter()
        forward(native)
        reference.append(time.perf_counter() - start)

    logits = benchmark.pedantic(forward, args=(taken,), setup=time_native, rounds=rounds, warmup_rounds=1)
    info = {
        "model": taken.label,
        "native": half_products.native_half_products(dtype),
        "taken_min_s": benchmark.stats.stats.min,
        "native_min_s": min(reference),
        "time_ratio": benchmark.stats.stats.min / min(reference),
        "max_logit_change": float((logits.float() - forward(native).float()).abs().max()),
    }
    benchmark.extra_info.update(info)
    print("\n" + " ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in info.items()))
    assert logits.dtype == dtype
    return info


@pytest.mark.slow
@requires_embedded_model()
@pytest.mark.parametrize("recipe", ["bf16", "fp16"])
def test_bench_half_products_embedded(benchmark, recipe, monkeypatch):
    compare(benchmark, "tiny-induction", recipe, rounds=10, monkeypatch=monkeypatch)


@pytest.mark.slow
@pytest.mark.real
@requires_smollm2()
@pytest.mark.parametrize("recipe", ["bf16", "fp16"])
def test_bench_half_products_smollm2(benchmark, recipe, monkeypatch):
    compare(benchmark, "smollm2-135m", recipe, rounds=3, monkeypatch=monkeypatch)
