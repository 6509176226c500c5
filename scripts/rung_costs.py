"""The measured cost of each rung on SmolLM2-135M fp32 at the gate's settings (n 8, L 64), one thread.

Rows: the load (with its self-check), rung 1 (kappa and the rotation null new records use, the
32-draw t null, every head), the repeat probe, the AtP* screen, and the exact knockout scan: timed on the
heads of three layers across the depth (0, 15, 29), its FLOPs counted from the shapes
(`knockout_flops`) for those heads and for all 270, the full scan's time = its FLOPs / the rate
measured on the subset. The docs' scale table (docs/scale.md) starts from
these numbers. Run: ``OMP_NUM_THREADS=1 python scripts/rung_costs.py`` (about 5 minutes here).
"""

from __future__ import annotations

import time

import torch


def timed(what, rows, compute):
    wall, cpu = time.perf_counter(), time.process_time()
    value = compute()
    rows.append((what, time.perf_counter() - wall, time.process_time() - cpu))
    return value


def main() -> None:
    from pytest_circuits.run.run import Run
    from pytest_circuits.rungs.knockout import knockout_scan
    from pytest_circuits.rungs.plan import knockout_flops
    from pytest_circuits.rungs.screen import screen_estimate
    from pytest_circuits.settings import CircuitsSettings

    torch.set_num_threads(1)
    session = Run(CircuitsSettings(model="smollm2-135m", device="cpu"))
    rows: list[tuple[str, float, float]] = []
    build = timed("load + self-check", rows, lambda: session.loaded.build("fp32"))
    timed("rung 1: kappa, 32-draw t null, 270 heads", rows, lambda: session.measured.ov_spectrum("fp32"))
    timed("rung 1/2: repeat probe, n 8, L 64", rows, lambda: session.measured.repeat_probe("fp32"))
    settings = session.settings.knockout_probe
    from pytest_circuits.rungs.replay import attention_implementation, held_out_ids, intact_pass

    ids = held_out_ids(build, settings)
    with attention_implementation(build.model):
        intact = intact_pass(build, ids, settings.L, 8, trace=False)

    def screen():
        with attention_implementation(build.model):
            return screen_estimate(build, ids, settings.L, "zero", intact.means, "atp*", 8)

    timed("rung 2: AtP* screen, 270 heads", rows, screen)
    geo = build.geometry
    subset = [f"L{layer}H{head}" for layer in (0, 15, 29) for head in range(geo.n_heads)]
    timed(
        f"rung 2: exact scan, {len(subset)} heads (L0, L15, L29)",
        rows,
        lambda: knockout_scan(build, settings, heads=subset, progress=False),
    )
    sub_flops = knockout_flops(build, settings, heads=subset)["scan"]
    all_flops = knockout_flops(build, settings)
    rate = sub_flops / rows[-1][1]
    print(f"SmolLM2-135M fp32, n {settings.n}, L {settings.L}, 1 thread, torch {torch.__version__}")
    print("| what | wall s | CPU s |")
    print("|---|---|---|")
    for what, wall, cpu in rows:
        print(f"| {what} | {wall:.1f} | {cpu:.1f} |")
    print(f"exact scan subset: {sub_flops / 1e9:.0f} GFLOP at {rate / 1e9:.1f} GFLOP/s")
    print(
        f"exact scan, all {geo.n_layers * geo.n_heads} heads: {all_flops['scan'] / 1e9:.0f} GFLOP "
        f"(plain loop {all_flops['plain'] / 1e9:.0f}, one forward {all_flops['forward'] / 1e9:.1f}) "
        f"-> {all_flops['scan'] / rate:.0f} s at the measured rate"
    )


if __name__ == "__main__":
    main()
