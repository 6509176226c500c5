#!/usr/bin/env python
"""How stable the rung-1 flags are across null seeds at d_head 256 (Gemma-style heads).

A random gemma3_text model (d_model 640, 4 query heads of d_head 256, 1 key/value head, as
Gemma-3-270M) whose heads' folded ``W_O`` are set to ``t B^T + R`` (``B = W_U W_E W_V``, ``R``
the random ``W_O``, both terms of equal Frobenius norm at ``|t| = 1``), with ``t`` on a grid from
-0.5 to 0.5, so that kappa runs from the null to strong copying and suppression. Every head is
scanned with ``--seeds`` null seeds at each ``--rotations`` count; per count it prints how many
heads' flags differ between seeds, and the smallest ``|kappa|`` (and ``|kappa_z|``) of a head
flagged under every seed against the largest of a head flagged under some but not all
(docs/definitions.md, "Rung 1, weights: kappa", "Flags that hold across null draws"). Minutes on 2 cores.
Each ``--min-effect`` flags the same scans again (`rungs.kappa.reflagged`: ``q <= 0.05`` and
``|kappa - null mean| >= min effect``) and prints the same figures for those flags;
``--d-head`` widens or narrows the heads (d_model stays 640).

    OMP_NUM_THREADS=1 python scripts/measure_null_stability.py --layers 4 --seeds 10 --rotations 32 256
    OMP_NUM_THREADS=1 python scripts/measure_null_stability.py --layers 4 --seeds 24 --rotations 32 --min-effect 0 0.05
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch

from pytest_circuits.model.weights import extract_weights
from pytest_circuits.rungs.kappa import ov_spectrum, reflagged
from pytest_circuits.testing import make_tiny_model

GRID = (0.0, 0.005, 0.01, 0.02, 0.03, 0.05, 0.07, 0.1, 0.15, 0.2, 0.3, 0.5)


def planted_model(layers: int, vocab: int, d_head: int = 256):
    """The gemma3_text model described above; ``t`` of head ``i`` is ``+-GRID[i // 2]``, cycling."""
    heads = dict(num_attention_heads=4, num_key_value_heads=1, head_dim=d_head)  # Gemma-3-270M's attention
    sizes = dict(num_hidden_layers=layers, hidden_size=640, intermediate_size=256, vocab_size=vocab)
    model = make_tiny_model("gemma3_text", seed=0, randomize_norms=False, initializer_range=0.02, **heads, **sizes)
    w = extract_weights(model)  # norms weights are 0, so g = 1 + 0 and folded W_O = raw W_O
    shared = w.W_U - w.W_U.mean(dim=1, keepdim=True)
    shared = shared @ w.W_E
    ts = []
    for layer in range(layers):
        proj = model.model.layers[layer].self_attn.o_proj
        for head in range(4):
            i = layer * 4 + head
            t = GRID[(i // 2) % len(GRID)] * (1 if i % 2 == 0 else -1)
            B = shared @ w.W_V_of(layer, head)  # (d_model, d_head)
            R = w.layers[layer].W_O[head]  # (d_head, d_model)
            new = R + t * B.T * (R.norm() / B.norm())
            with torch.no_grad():
                proj.weight[:, head * d_head : (head + 1) * d_head] = new.T
            ts.append(t)
    return model, np.array(ts)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--vocab", type=int, default=2048)
    parser.add_argument("--seeds", type=int, default=12)
    parser.add_argument("--rotations", type=int, nargs="+", default=[32, 256])
    parser.add_argument("--seeds-at-256", type=int, default=3, help="seeds for counts of 256 draws or more")
    parser.add_argument("--d-head", type=int, default=256)
    parser.add_argument("--min-effect", type=float, nargs="+", default=[0.0], help="flag with each minimum effect")
    args = parser.parse_args()
    torch.set_num_threads(1)  # one thread: on a shared 2-core machine threaded eigensolvers oversubscribe
    model, ts = planted_model(args.layers, args.vocab, args.d_head)
    weights = extract_weights(model)
    for n in args.rotations:
        seeds = args.seeds if n < 256 else min(args.seeds, args.seeds_at_256)
        start = time.perf_counter()
        scans = [ov_spectrum(weights, n_rotations=n, seed=seed, n_workers=1, min_effect=0.0) for seed in range(seeds)]
        seconds = (time.perf_counter() - start) / seeds
        print(
            f"{n} rotations ({seconds:.1f} s per scan, {len(scans[0])} heads of d_head {args.d_head}, {seeds} seeds):"
        )
        for score, suffix in (("kappa", ""), ("kappa_trace", "_trace")):
            sd = np.array([f[f"{score}_null_sd"].to_numpy() for f in scans])
            print(
                f" {score}: median null sd {np.median(sd):.4f}; its spread across seeds per head (median sd/mean) "
                f"{np.median(sd.std(axis=0) / sd.mean(axis=0)):.3f}"
            )
            for min_effect in args.min_effect:
                print(f" {score} flags, min effect {min_effect:g}:")
                report_flags([reflagged(f, min_effect) for f in scans], sd, score, suffix)


def report_flags(frames, sd: np.ndarray, score: str = "kappa", suffix: str = "") -> None:
    """How the flags of ``frames`` (one scan per null seed) on ``score`` agree across the seeds."""
    seeds = len(frames)
    flag = np.array([f[f"copying{suffix}"].to_numpy(int) - f[f"suppression{suffix}"].to_numpy(int) for f in frames])
    kappa = frames[0][score].to_numpy()
    z = np.abs(kappa) / np.median(sd, axis=0)
    always = (flag != 0).all(axis=0)
    sometimes = (flag != 0).any(axis=0) & ~always
    print(
        f"  heads flagged under every seed {always.sum()}, under some but not all {sometimes.sum()}, "
        f"never {(~always & ~sometimes).sum()}; flagged count per seed {sorted(set((flag != 0).sum(1)))}"
    )
    pairs = [(a, b) for a in range(seeds) for b in range(a + 1, seeds)]
    changed = [int((flag[a] != flag[b]).sum()) for a, b in pairs]
    print(
        f"  heads whose flag differs between two seeds: mean {np.mean(changed):.2f}, max {max(changed)}, "
        f"pairs with any change {np.mean([c > 0 for c in changed]):.2f}"
    )
    if always.any():
        print(
            f"  smallest |{score}| flagged under every seed {np.abs(kappa[always]).min():.4f} "
            f"(|{score}|/null sd {z[always].min():.2f})"
        )
    if sometimes.any():
        print(
            f"  unstable heads: |{score}| {np.round(np.abs(kappa[sometimes]), 4).tolist()}, "
            f"|{score}|/null sd {np.round(z[sometimes], 2).tolist()}, "
            f"flagged in {(flag[:, sometimes] != 0).sum(0).tolist()} of {seeds} seeds"
        )
    never = ~always & ~sometimes
    if never.any():
        print(
            f"  largest |{score}| never flagged {np.abs(kappa[never]).max():.4f} (|{score}|/null sd {z[never].max():.2f})"
        )


if __name__ == "__main__":
    main()
