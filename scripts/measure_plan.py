"""How close rung 2's planned time comes to its wall time (issue #55, item 3).

Per model and build: the plan's estimate (the screen and its top K exactly, counted at the longest
replays, `rungs.plan.planned_heads`; or every head exactly), each kind of pass at the rate the build
reaches in it, timed first (`rungs.plan.rung2_seconds`, what the plan uses: a forward, a stacked
replay, the screen's forward and backward), the same estimate for the heads the screen then chose
(`rungs.plan.replanned`, what the line after the scan compares with) and the counted FLOPs at the
forward's rate alone, each beside the wall time of the knockout scan that follows; the load average
is printed with the table.

Run: python scripts/measure_plan.py [--models tiny-induction,smollm2-135m] [--build fp32] [--screen 12] [--method atp]
(``--screen 0``: every head exactly.) A model path works too (a ``measure_sizes.py --keep`` checkpoint).
``--key-heads F``: a gate's plan instead, exact knockouts of named heads and no screen: the model's
shipped fp32 baseline's key heads where it has one, else a fraction ``F`` of its heads drawn at
random (seeded), as `rungs.plan.exact_seconds` counts them (each layer's stack filled).
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
from pytest_circuits.rungs.plan import (
    KINDS,
    calibrated_rate,
    exact_flops,
    exact_seconds,
    knockout_flops,
    replanned,
    rung2_seconds,
    screened_flops,
)
from pytest_circuits.rungs.repeat_settings import RepeatSettings

KNOCKOUT_PROBE = RepeatSettings(seed=1, n=8, L=64)  # the shipped baselines' knockout probe


def key_heads(name: str, build, share: float) -> list[str]:
    """The key heads of ``name``'s shipped fp32 baseline (the default tolerances), else a ``share`` of
    the build's heads drawn at random (seed 0)."""
    import random

    from pytest_circuits.gate.builtin_invariants import key_heads as baseline_key_heads
    from pytest_circuits.gate.tolerances import Tolerances
    from pytest_circuits.record.store import read_record, shipped_baselines

    shipped = shipped_baselines().get(f"{Path(name).name}--fp32")
    if shipped is not None:
        return baseline_key_heads(read_record(shipped), "knockout_delta", 0, Tolerances().min_delta)
    geo = build.geometry
    every = [f"L{layer}H{head}" for layer in range(geo.n_layers) for head in range(geo.n_heads)]
    return random.Random(0).sample(every, max(1, round(share * len(every))))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="tiny-induction,smollm2-135m")
    parser.add_argument("--build", default="fp32")
    parser.add_argument("--screen", type=int, default=12, help="exact knockouts after the screen; 0: every head")
    parser.add_argument("--method", default="atp", help="the screen's method")
    parser.add_argument(
        "--key-heads", type=float, default=None, help="a gate's plan: the shipped key heads, else this share at random"
    )
    args = parser.parse_args()
    rows = []
    for name in args.models.split(","):
        build = load_build(resolve_model(name), args.build, "cpu")
        heads = build.geometry.n_layers * build.geometry.n_heads
        start = time.perf_counter()
        rates = [calibrated_rate(build, KNOCKOUT_PROBE, kind) for kind in KINDS]
        calibration = time.perf_counter() - start
        top_k = args.screen or None
        named = None if args.key_heads is None else key_heads(name, build, args.key_heads)
        if named is not None:
            estimate = exact_seconds(build, KNOCKOUT_PROBE, named)
            counted = knockout_flops(build, KNOCKOUT_PROBE, heads=named)["scan"]
            plan = f"{len(named)} key heads exactly"
        elif args.screen:
            estimate = rung2_seconds(build, KNOCKOUT_PROBE, top_k, (), args.method)
            counted = screened_flops(build, KNOCKOUT_PROBE, args.screen, (), args.method)
            plan = f"{args.method} screen + top {args.screen}"
        else:
            estimate = rung2_seconds(build, KNOCKOUT_PROBE, top_k, (), args.method)
            counted, plan = exact_flops(build, KNOCKOUT_PROBE), "every head exactly"
        load = os.getloadavg()[0]
        start = time.perf_counter()
        if named is not None:  # as a gate runs it: the named heads, each exactly, no screen
            knockout_scan(build, KNOCKOUT_PROBE, heads=named, progress=False)
            chose = estimate
        else:
            frame = knockout_scan(
                build, KNOCKOUT_PROBE, screen_top_k=args.screen or None, screen_method=args.method, progress=False
            )  # the plan counted the screen's picks at the longest replays: its estimate for the ones it chose
            chose = replanned(build, KNOCKOUT_PROBE, estimate, frame.attrs["exact_heads"], top_k=top_k)
        wall = time.perf_counter() - start
        rows.append((name, heads, plan, counted, rates, calibration, estimate, chose, counted / rates[0], wall, load))
        del build
    print(f"{torch.get_num_threads()} threads on {os.cpu_count()} CPUs; n 8, L 64, build {args.build}\n")
    print(
        "| model (heads) | plan | counted | rates: forward, replay, screen | estimate; for the heads chosen; wall "
        "| wall / estimate | wall / the estimate for the heads chosen | wall / the forward's rate alone | load |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for name, heads, plan, counted, rates, calibration, estimate, chose, old, wall, load in rows:
        said = ", ".join(f"{rate / 1e9:.0f}" for rate in rates)
        print(
            f"| {Path(name).name} ({heads}) | {plan} | {counted / 1e12:.3g} TFLOP | {said} GFLOP/s, timed in "
            f"{calibration:.1f} s | {estimate:.1f} s; {chose:.1f} s; {wall:.1f} s | **{wall / estimate:.2f}** | "
            f"{wall / chose:.2f} | {wall / old:.2f} | {load:.1f} |"
        )


if __name__ == "__main__":
    main()
