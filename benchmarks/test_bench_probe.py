"""The repeat probe against a plain forward of the same tokens with ``output_attentions=True``.

Time: the probe (forward, per-layer score hooks, losses) is timed by pytest-benchmark; the
reference forward is timed in the untimed ``setup`` of every round, so the two alternate
and share the machine's noise. ``extra_info["time_ratio"]`` = min probe / min reference
(target <= 1.1). Both run on one torch thread (see `single_thread`).

Memory: tracemalloc does not see torch's CPU allocator, so the peak is read from torch's
own profiler (``profile_memory=True``): the running sum of every allocation and free
during the call, maximised over time, i.e. the most bytes torch held at once beyond
what was already allocated before the call. Also recorded: the bytes of attention maps
alive at once (weakref-counted), all layers' for the reference vs about one layer's
for the probe.
"""

from __future__ import annotations

import itertools
import time
import weakref

import pytest
import torch

from pytest_circuits.model.builds import load_build
from pytest_circuits.model.families import attention_module
from pytest_circuits.model.loading import resolve_model
from pytest_circuits.rungs.probe import run_repeat_probe
from pytest_circuits.rungs.repeat import repeat_tokens
from pytest_circuits.rungs.repeat_settings import RepeatSettings
from pytest_circuits.testing import requires_embedded_model, requires_smollm2

BATCH = 8


@pytest.fixture(autouse=True)
def single_thread():
    """One torch thread: on a shared CPU, oversubscribed threads make ratios swing by 30%."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def plain_forward(build, settings: RepeatSettings, batch_size: int = BATCH) -> None:
    """The reference: the same batches of the same tokens, every layer's attention returned."""
    ids = repeat_tokens(build.tokens, settings.n, settings.L, settings.seed)
    with torch.no_grad():
        for start in range(0, settings.n, batch_size):
            out = build.model(input_ids=ids[start : start + batch_size], output_attentions=True, use_cache=False)
            assert len(out.attentions) == build.geometry.n_layers
            del out


def torch_peak_bytes(fn) -> int:
    """Most bytes torch's CPU allocator held at once during ``fn()``, above its level at the start."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events() if e.name() == "[memory]")
    return max(itertools.accumulate((b for _, b in events), initial=0))


def attention_bytes_alive(build, fn) -> int:
    """Most bytes of attention maps (tensors returned by the attention modules) alive at once."""
    alive, most = [0], [0]

    def track(module, args, output):
        weights = output[1]
        alive[0] += weights.nbytes
        most[0] = max(most[0], alive[0])
        size = weights.nbytes
        weakref.finalize(weights, lambda: alive.__setitem__(0, alive[0] - size))

    model = build.model
    handles = [attention_module(model, l).register_forward_hook(track) for l in range(build.geometry.n_layers)]
    try:
        fn()
    finally:
        for handle in handles:
            handle.remove()
    return most[0]


def compare(benchmark, build, settings: RepeatSettings, rounds: int) -> dict:
    """Benchmark the probe, time the reference in between, and record both memory measures."""
    reference_times: list[float] = []

    def time_reference():
        start = time.perf_counter()
        plain_forward(build, settings)
        reference_times.append(time.perf_counter() - start)

    probe = benchmark.pedantic(
        run_repeat_probe, args=(build, settings, BATCH), setup=time_reference, rounds=rounds, warmup_rounds=1
    )
    info = {
        "model": build.label,
        "settings": settings.as_dict(),
        "probe_min_s": benchmark.stats.stats.min,
        "reference_min_s": min(reference_times),
        "time_ratio": benchmark.stats.stats.min / min(reference_times),
        "probe_peak_bytes": torch_peak_bytes(lambda: run_repeat_probe(build, settings, BATCH)),
        "reference_peak_bytes": torch_peak_bytes(lambda: plain_forward(build, settings)),
        "probe_attention_bytes": attention_bytes_alive(build, lambda: run_repeat_probe(build, settings, BATCH)),
        "reference_attention_bytes": attention_bytes_alive(build, lambda: plain_forward(build, settings)),
        "copy_loss": probe.copy_loss,
        "first_copy_loss": probe.first_copy_loss,
    }
    benchmark.extra_info.update(info)
    print("\n" + " ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in info.items()))
    # memory is deterministic here (same tokens, same ops), unlike time: it is asserted
    assert info["probe_attention_bytes"] * build.geometry.n_layers <= info["reference_attention_bytes"]
    assert info["probe_peak_bytes"] < info["reference_peak_bytes"]
    return info


@pytest.mark.slow
@requires_embedded_model()
def test_bench_probe_embedded(benchmark):
    build = load_build(resolve_model("tiny-induction"), "fp32", "cpu")
    compare(benchmark, build, RepeatSettings(seed=0, n=32, L=64), rounds=10)


@pytest.mark.slow
@pytest.mark.real
@requires_smollm2()
def test_bench_probe_smollm2(benchmark):
    build = load_build(resolve_model("smollm2-135m"), "fp32", "cpu")
    compare(benchmark, build, RepeatSettings(seed=0, n=8, L=64), rounds=3)
