"""How close rung 2's planned time comes to its wall time (issue #55, item 3).

Per model and build: the plan's estimate (the screen and its top K exactly, or every head exactly),
each kind of pass at the rate the build reaches in it, timed first (`rungs.plan.rung2_seconds`, what
the plan uses: a forward, a stacked replay, the screen's forward and backward), and its counted FLOPs
at the forward's rate alone (what it used before), each beside the wall time of the knockout scan
that follows; the load average is printed with the table.

Run: python scripts/measure_plan.py [--models tiny-induction,smollm2-135m] [--build fp32] [--screen 12] [--method atp]
(``--screen 0``: every head exactly.) A model path works too (a ``measure_sizes.py --keep`` checkpoint).
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import torch

from pytest_circuits.model.builds import load_build
from pytest_circuits.model.loading import resolve_model
from pytest_circuits.rungs.knockout import knockout_scan
from pytest_circuits.rungs.plan import KINDS, calibrated_rate, exact_flops, rung2_seconds, screened_flops
from pytest_circuits.rungs.repeat_settings import RepeatSettings

KNOCKOUT_PROBE = RepeatSettings(seed=1, n=8, L=64)  # the shipped baselines' knockout probe


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="tiny-induction,smollm2-135m")
    parser.add_argument("--build", default="fp32")
    parser.add_argument("--screen", type=int, default=12, help="exact knockouts after the screen; 0: every head")
    parser.add_argument("--method", default="atp", help="the screen's method")
    args = parser.parse_args()
    rows = []
    for name in args.models.split(","):
        build = load_build(resolve_model(name), args.build, "cpu")
        heads = build.geometry.n_layers * build.geometry.n_heads
        start = time.perf_counter()
        rates = [calibrated_rate(build, KNOCKOUT_PROBE, kind) for kind in KINDS]
        calibration = time.perf_counter() - start
        top_k = args.screen or None
        estimate = rung2_seconds(build, KNOCKOUT_PROBE, top_k, 0, args.method)
        if args.screen:
            counted = screened_flops(build, KNOCKOUT_PROBE, args.screen, 0, args.method)
            plan = f"{args.method} screen + top {args.screen}"
        else:
            counted, plan = exact_flops(build, KNOCKOUT_PROBE), "every head exactly"
        load = os.getloadavg()[0]
        start = time.perf_counter()
        knockout_scan(
            build, KNOCKOUT_PROBE, screen_top_k=args.screen or None, screen_method=args.method, progress=False
        )
        wall = time.perf_counter() - start
        rows.append((name, heads, plan, counted, rates, calibration, estimate, counted / rates[0], wall, load))
        del build
    print(f"{torch.get_num_threads()} threads on {os.cpu_count()} CPUs; n 8, L 64, build {args.build}\n")
    print(
        "| model (heads) | plan | counted | rates: forward, replay, screen | estimate; wall | wall / estimate "
        "| wall / the forward's rate alone | load |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for name, heads, plan, counted, rates, calibration, estimate, old, wall, load in rows:
        said = ", ".join(f"{rate / 1e9:.0f}" for rate in rates)
        print(
            f"| {Path(name).name} ({heads}) | {plan} | {counted / 1e12:.3g} TFLOP | {said} GFLOP/s, timed in "
            f"{calibration:.1f} s | {estimate:.1f} s; {wall:.1f} s | **{wall / estimate:.2f}** | {wall / old:.2f} | {load:.1f} |"
        )


if __name__ == "__main__":
    main()
