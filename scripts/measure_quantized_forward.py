"""Where the activation-quantizing recipes spend their time (issue #55, item 1): SmolLM2-135M, one thread.

Prints a markdown table: per recipe, one forward (n 4, L 32) and a knockout scan of 18 heads (layers
2 and 27), each with its ratio to bf16 and to fp32 in the same run; then the CPU's matmul primitives
at one of SmolLM2's MLP shapes (float32, bfloat16, int8 ``torch._int_mm``, float8 ``torch._scaled_mm``).

Run: python scripts/measure_quantized_forward.py [--recipes bf16,fp32,fp8-e4m3,fp8-e4m3-dyn,int8-w8a8]
"""

from __future__ import annotations

import argparse
import os
import time
from functools import partial

import torch

from pytest_circuits.model import token_quant
from pytest_circuits.model.builds import load_build
from pytest_circuits.model.loading import resolve_model
from pytest_circuits.rungs.knockout import knockout_scan
from pytest_circuits.rungs.repeat_settings import RepeatSettings
from pytest_circuits.rungs.replay import held_out_ids

SETTINGS = RepeatSettings(seed=1, n=4, L=32)
HEADS = [f"L{layer}H{head}" for layer in (2, 27) for head in range(9)]


def best_of(run, rounds: int = 3) -> float:
    run()
    best = float("inf")
    for _ in range(rounds):
        start = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - start)
    return best


def measure(build) -> tuple[tuple[float, float, str], object]:
    """``((forward s, knockout-scan s, dtype), the scan's frame)`` of one build."""
    ids = held_out_ids(build, SETTINGS)
    with torch.no_grad():
        forward = best_of(partial(build.model, ids))
    start = time.perf_counter()
    frame = knockout_scan(build, SETTINGS, heads=HEADS, progress=False)
    return (forward, time.perf_counter() - start, str(next(build.model.parameters()).dtype)), frame


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipes", default="bf16,fp32,fp8-e4m3,fp8-e4m3-dyn,int8-w8a8")
    args = parser.parse_args()
    torch.set_num_threads(1)
    source = resolve_model("smollm2-135m")
    rows, moved = {}, {}
    for name in args.recipes.split(","):
        build = load_build(source, name, "cpu")
        fast = token_quant.installed(build.model)
        rows[name], frame = measure(build)
        if fast:  # the same build on compressed-tensors' own forward, and how far the figures moved
            token_quant.remove(build.model)
            rows[f"{name}, compressed-tensors' forward"], reference = measure(build)
            numbers = frame.select_dtypes("number").columns
            moved[name] = float((frame[numbers] - reference[numbers]).abs().max().max())
        del build
    print(f"load average before the table: {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs\n")
    print("| recipe | computes in | forward (s) | x bf16 | x fp32 | knockout, 18 heads (s) | x bf16 | x fp32 |")
    print("|---|---|---|---|---|---|---|---|")
    ref, base = rows.get("bf16"), rows.get("fp32")
    for name, (forward, scan, dtype) in rows.items():
        ratio = [f"{forward / r[0]:.2f}" if r else "-" for r in (ref, base)]
        ratio_scan = [f"{scan / r[1]:.2f}" if r else "-" for r in (ref, base)]
        print(
            f"| {name} | {dtype} | {forward:.2f} | {ratio[0]} | {ratio[1]} | {scan:.1f} | {ratio_scan[0]} | {ratio_scan[1]} |"
        )

    for name, difference in moved.items():
        print(
            f"\n{name}: the knockout scan's figures, fast forward minus compressed-tensors' own: max |difference| {difference:.2e}"
        )

    m, k, n = SETTINGS.n * (2 * SETTINGS.L + 1), 576, 1536  # the probe's tokens x SmolLM2's MLP up projection
    a, b = torch.randn(m, k), torch.randn(n, k)
    prims = {
        "float32 mm": lambda: a @ b.T,
        "bfloat16 mm": (lambda x, y: lambda: x @ y.T)(a.bfloat16(), b.bfloat16()),
        "int8 x int8 -> int32 (torch._int_mm)": (lambda x, y: lambda: torch._int_mm(x, y))(
            a.clamp(-1, 1).mul(127).to(torch.int8), b.clamp(-1, 1).mul(127).to(torch.int8).T.contiguous()
        ),
    }
    print(f"\n| one matmul, {m} x {k} by {k} x {n}, one thread | ms |\n|---|---|")
    for label, run in prims.items():
        print(f"| {label} | {best_of(run, 5) * 1e3:.2f} |")
    one = torch.tensor(1.0)
    a8, b8 = a.to(torch.float8_e4m3fn), b.to(torch.float8_e4m3fn)
    start = time.perf_counter()
    torch._scaled_mm(a8, b8.T, scale_a=one, scale_b=one, out_dtype=torch.float32)
    print(f"| float8 e4m3 (torch._scaled_mm, once) | {(time.perf_counter() - start) * 1e3:.0f} |")


if __name__ == "__main__":
    main()
