"""Rung 2 on SmolLM2-135M: the exact replayed scan against the honest plain loop, its FLOPs and
achieved rate, and the screens' recall against the exact scan. Everything in one run, one thread.

* plain loop (`plain_knockout_deltas`): per head a pre-hook on the output projection and one
  full forward of all ``n`` sequences in one batch, SDPA attention, unembedding only the last
  ``L`` positions: the fastest plain loop a few lines give.
* exact scan (`knockout_scan`): the cached, stacked replay. Same heads, deltas equal to 1e-5.
* FLOPs counted from the shapes (`knockout_flops`); achieved rate = FLOPs / wall time, beside
  a plain forward's rate timed in the same test.
* recall@K of the plain AtP and the AtP* screens: the share of the exact scan's top 5 heads by
  ``|delta|`` that each screen ranks in its top ``K`` (K = 5, 12, 24), all 270 heads, zero and mean
  ablation; screen cost in forward-equivalents (its wall time / one forward's).

Run: pytest benchmarks/test_bench_knockout.py --run-slow -p no:randomly -s
"""

from __future__ import annotations

import time

import pytest
import torch

from pytest_circuits.model.builds import load_build
from pytest_circuits.model.loading import resolve_model
from pytest_circuits.rungs.knockout import knockout_scan
from pytest_circuits.rungs.plain_loops import plain_knockout_deltas
from pytest_circuits.rungs.plan import knockout_flops
from pytest_circuits.rungs.repeat import bos_offset
from pytest_circuits.rungs.repeat_settings import RepeatSettings
from pytest_circuits.rungs.replay import attention_implementation, forward_copy_losses, held_out_ids
from pytest_circuits.testing import requires_smollm2

pytestmark = [pytest.mark.real, pytest.mark.slow, requires_smollm2()]

HELD_OUT = RepeatSettings(seed=1, n=4, L=32)
# every head of layers 2, 7, ..., 27 (the middle of each five-layer band): the same depth
# profile and heads-per-layer as the full 270-head scan, at a fifth of its cost
HEADS = [f"L{layer}H{head}" for layer in range(2, 30, 5) for head in range(9)]
TIMES: dict[str, float] = {}
DELTAS: dict[str, dict] = {}
RECALL_K = (5, 12, 24)


@pytest.fixture(scope="module")
def smollm2():
    """The fp32 build, timed on one thread: the host is shared, and one thread keeps the runs comparable."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield load_build(resolve_model("smollm2-135m"), "fp32", "cpu")
    torch.set_num_threads(threads)


def forward_seconds(build, rounds: int = 3) -> float:
    """Best wall time of one plain forward (all sequences, SDPA, last L positions unembedded)."""
    ids = held_out_ids(build, HELD_OUT)
    best = float("inf")
    with torch.no_grad(), attention_implementation(build.model):
        for _ in range(rounds):
            start = time.perf_counter()
            forward_copy_losses(build.model, ids, HELD_OUT.L, bos_offset(build.tokens), build.device)
            best = min(best, time.perf_counter() - start)
    return best


def plain_loop(build) -> dict[str, float]:
    """The plain loop's deltas, with its time in ``TIMES["plain"]``: measured by `test_plain_loop`'s
    benchmark when that ran first in this session, else here (timed the same way, one round), so the
    scan's ratio does not depend on the order the benchmarks run in."""
    if "plain" not in DELTAS:
        start = time.perf_counter()
        _, DELTAS["plain"] = plain_knockout_deltas(build, HELD_OUT, heads=HEADS)
        TIMES["plain"] = time.perf_counter() - start
    return DELTAS["plain"]


def _run(benchmark, name, fn):
    result = benchmark.pedantic(fn, rounds=1, iterations=1, warmup_rounds=0)
    TIMES[name] = benchmark.stats.stats.mean
    return result


@pytest.mark.benchmark(group="knockout-smollm2")
def test_plain_loop(benchmark, smollm2):
    _, deltas = _run(benchmark, "plain", lambda: plain_knockout_deltas(smollm2, HELD_OUT, heads=HEADS))
    DELTAS["plain"] = deltas


@pytest.mark.benchmark(group="knockout-smollm2")
def test_exact_scan_against_plain_loop_and_hardware(benchmark, smollm2):
    df = _run(benchmark, "scan", lambda: knockout_scan(smollm2, HELD_OUT, heads=HEADS, progress=False))
    plain_deltas = plain_loop(smollm2)
    scan = df.set_index("head")["knockout_delta"]
    worst = max(abs(scan[h] - d) for h, d in plain_deltas.items())
    flops = knockout_flops(smollm2, HELD_OUT, HEADS)
    forward_s = forward_seconds(smollm2)
    rates = {
        "forward": flops["forward"] / forward_s / 1e9,
        "plain": flops["plain"] / TIMES["plain"] / 1e9,
        "scan": flops["scan"] / TIMES["scan"] / 1e9,
    }
    ratio = TIMES["scan"] / TIMES["plain"]
    benchmark.extra_info.update(
        ratio_to_plain=ratio,
        flop_ratio=flops["scan"] / flops["plain"],
        max_abs_diff=worst,
        heads=len(HEADS),
        gflop_scan=flops["scan"] / 1e9,
        gflop_plain=flops["plain"] / 1e9,
        gflops=rates,
        threads=torch.get_num_threads(),
    )
    print(
        f"\nexact scan / plain loop ({len(HEADS)} heads, n {HELD_OUT.n}, L {HELD_OUT.L}, 1 thread): "
        f"{TIMES['scan']:.1f} s / {TIMES['plain']:.1f} s = {ratio:.2f}; max |diff| {worst:.2g}\n"
        f"FLOPs: scan {flops['scan'] / 1e9:.0f} G, plain loop {flops['plain'] / 1e9:.0f} G "
        f"(ratio {flops['scan'] / flops['plain']:.2f}: the floor of an exact replay)\n"
        f"achieved GFLOP/s: plain forward {rates['forward']:.1f}, plain loop {rates['plain']:.1f}, "
        f"scan {rates['scan']:.1f} ({rates['scan'] / rates['forward']:.2f} of a plain forward's rate)"
    )
    assert worst <= 1e-5


def _recall(ranked: list[str], top: list[str]) -> dict[int, float]:
    return {k: len(set(top) & set(ranked[:k])) / len(top) for k in RECALL_K}


@pytest.mark.benchmark(group="knockout-screen-smollm2")
@pytest.mark.parametrize("mode", ["zero", "mean"])
def test_screen_recall(benchmark, smollm2, mode):
    start = time.perf_counter()
    exact = knockout_scan(smollm2, HELD_OUT, mode=mode, progress=False).set_index("head")["knockout_delta"]
    exact_s = time.perf_counter() - start
    top = list(exact.abs().sort_values(ascending=False).index[:5])
    forward_s = forward_seconds(smollm2)
    lines, info = [], {"exact_top5": top, "exact_forward_equivalents": exact_s / forward_s}

    def screen(method):
        t0 = time.perf_counter()
        df = knockout_scan(smollm2, HELD_OUT, mode=mode, screen_top_k=0, screen_method=method, progress=False)
        # the scan's intact forward is not part of the screen
        return df.set_index("head")["knockout_screen_score"], time.perf_counter() - t0 - forward_s

    for method in ("atp", "atp*"):
        score, seconds = (
            benchmark.pedantic(screen, args=(method,), rounds=1, iterations=1) if method == "atp*" else screen(method)
        )
        ranked = list(score.sort_values(ascending=False, kind="stable").index)
        recall = _recall(ranked, top)
        info[method] = {
            "recall": recall,
            "forward_equivalents": seconds / forward_s,
            "ranks_of_exact_top5": [ranked.index(h) + 1 for h in top],
        }
        lines.append(
            f"{method:>4}: recall@5/12/24 {recall[5]:.1f}/{recall[12]:.1f}/{recall[24]:.1f}, ranks of the exact "
            f"top 5 {info[method]['ranks_of_exact_top5']}, cost {seconds / forward_s:.0f} forward-equivalents"
        )
    benchmark.extra_info.update(info)
    print(
        f"\nscreens, {mode} ablation (exact top 5 {top}; exact scan {exact_s / forward_s:.0f} forward-equivalents):\n"
        + "\n".join(lines)
    )
