"""Why first-order screens miss SmolLM2-135M's early heads: their knockout effects do not add up.

For each head given (default: the exact top 5 of a zero-ablation scan at n 4, L 32, and L1H3,
the seventh), the copy-loss change when the head is zeroed at the first position only, at
every other position only, and at every position (the knockout delta), beside the plain AtP
and the AtP* estimates. A first-order estimate is additive over positions; where the first two
columns do not sum to the third, no linearisation can be right. docs/definitions.md,
"knockout_estimate", quotes L0H8. Run: ``python scripts/measure_screen_misses.py [HEAD ...]``
(about two minutes).
"""

from __future__ import annotations

import sys

import torch

HEADS = ("L0H8", "L1H5", "L1H4", "L1H3", "L16H0", "L2H2")


def main(heads: list[str]) -> None:
    from pytest_circuits.model.builds import load_build
    from pytest_circuits.model.families import out_proj_module
    from pytest_circuits.model.loading import resolve_model
    from pytest_circuits.record.figures import parse_label
    from pytest_circuits.rungs.knockout import knockout_scan
    from pytest_circuits.rungs.repeat import bos_offset
    from pytest_circuits.rungs.repeat_settings import RepeatSettings
    from pytest_circuits.rungs.replay import attention_implementation, forward_copy_losses, held_out_ids

    torch.set_num_threads(1)
    build = load_build(resolve_model("smollm2-135m"), "fp32", "cpu")
    settings = RepeatSettings(seed=1, n=4, L=32)
    ids, d = held_out_ids(build, settings), build.geometry.d_head

    def copy_loss(layer=None, head=None, where=slice(None)) -> float:
        handle = None
        if layer is not None:

            def zero(module, args):
                z = args[0].clone()
                z[:, where, head * d : (head + 1) * d] = 0
                return (z,)

            handle = out_proj_module(build.model, layer).register_forward_pre_hook(zero)
        try:
            with torch.no_grad(), attention_implementation(build.model):
                return float(
                    forward_copy_losses(build.model, ids, settings.L, bos_offset(build.tokens), build.device).mean()
                )
        finally:
            if handle is not None:
                handle.remove()

    estimates = {
        method: knockout_scan(build, settings, screen_top_k=0, screen_method=method, progress=False).set_index("head")[
            "knockout_estimate"
        ]
        for method in ("atp", "atp*")
    }
    intact = copy_loss()
    print(
        f"SmolLM2-135M fp32, zero ablation, held-out seed 1, n {settings.n}, L {settings.L}; intact copy loss {intact:.3f}"
    )
    print("| head | first position only | other positions only | every position (delta) | AtP | AtP* |")
    print("|---|---|---|---|---|---|")
    for label in heads:
        cell = parse_label(label)
        if cell is None:
            raise SystemExit(f"{label!r} is not a head label like L3H7")
        layer, head = cell
        parts = [copy_loss(layer, head, where) - intact for where in (slice(0, 1), slice(1, None), slice(None))]
        print(
            f"| {label} | {parts[0]:+.3f} | {parts[1]:+.3f} | {parts[2]:+.3f} | "
            f"{estimates['atp'][label]:+.3f} | {estimates['atp*'][label]:+.3f} |"
        )


if __name__ == "__main__":
    main(sys.argv[1:] or list(HEADS))
