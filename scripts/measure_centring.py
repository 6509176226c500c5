#!/usr/bin/env python
"""Centred against uncentred unembedding: how kappa moves on one model's fp32 build (rung 1 only).

Both scans use the same 32-draw t null, so only the unembedding differs (docs/definitions.md,
"The centred unembedding"). Seconds on SmolLM2-135M.

    python scripts/measure_centring.py tiny-induction
    python scripts/measure_centring.py smollm2-135m
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from pytest_circuits.run.run import Run
from pytest_circuits.rungs.kappa import ov_spectrum
from pytest_circuits.settings import CircuitsSettings


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", help="model folder or named model")
    model = parser.parse_args().model
    session = Run(CircuitsSettings(model=model, device="cpu"))
    w = session.loaded.weights("fp32")
    W_U, W_E = w.W_U.double(), w.W_E.double()
    shared = W_U @ W_E
    centred = (W_U - W_U.mean(dim=1, keepdim=True)) @ W_E
    print(
        f"{model}: family {w.family}, tied embeddings {session.loaded.build('fp32').model.config.tie_word_embeddings}"
    )
    print(f"  mean embedding row / median row norm: {W_E.mean(0).norm() / W_E.norm(dim=1).median():.3f}")
    print(f"  share of W_U W_E that centring removes (Frobenius): {(shared - centred).norm() / shared.norm():.3f}")
    start = time.process_time()
    c, u = ov_spectrum(w), ov_spectrum(w, unembedding="uncentred")
    print(f"  CPU-s for both scans: {time.process_time() - start:.1f}")
    for col in ("kappa", "kappa_trace"):
        d = c[col].to_numpy() - u[col].to_numpy()
        i = int(np.abs(d).argmax())
        flips = int((np.sign(c[col]) != np.sign(u[col])).sum())
        print(
            f"  {col}: max |delta| {np.abs(d).max():.4f} ({c['head'][i]}: {u[col][i]:+.3f} -> {c[col][i]:+.3f}), "
            f"median |delta| {np.median(np.abs(d)):.4f}, sign flips {flips} of {len(d)}"
        )
    for flag in ("copying", "suppression", "copying_trace", "suppression_trace"):
        before, after = set(u.loc[u[flag], "head"]), set(c.loc[c[flag], "head"])
        print(
            f"  {flag}: uncentred {len(before)}, centred {len(after)} "
            f"(lost {len(before - after)}, gained {len(after - before)})"
        )
    dz = c["kappa_z"].to_numpy() - u["kappa_z"].to_numpy()
    print(f"  kappa_z: mean shift {dz.mean():+.3f}, max |shift| {np.abs(dz).max():.2f}")
    gain = c["ov_gain"].to_numpy() / u["ov_gain"].to_numpy()
    print(f"  ov_gain centred / uncentred: median {np.median(gain):.3f}, range {gain.min():.3f}..{gain.max():.3f}")


if __name__ == "__main__":
    main()
