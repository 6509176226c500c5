"""The plain loops the fast scans are checked and timed against (tests, benchmarks, scripts): slow on purpose.

Every name here starts with ``plain_`` (tests/test_vocabulary.py keeps it so).

* Knockout: one full forward per knocked-out head (`plain_knockout_deltas`; `plain_knockout_losses`
  is also the knockout scan's fallback when its replay is off or not exact).
* Kappa: per head, ``M_h`` from scratch and its eigenvalues by a plain loop (`plain_ov_spectrum`).
"""

from __future__ import annotations

import numpy as np
import pandas as pd
import torch

from ..model.builds import LoadedBuild
from ..model.families import head_label
from ..model.weights import ModelWeights
from .ablation import ablated, check_mode, parse_heads
from .kappa import (
    DEFAULT,
    EIG_REL_TOL,
    N_ROTATIONS,
    check_settings,
    check_unembedding,
    spectrum_frame,
)
from .kappa_null import layer_rotations
from .repeat import bos_offset
from .repeat_settings import RepeatSettings
from .replay import (
    attention_implementation,
    batches,
    forward_copy_losses,
    held_out_ids,
    intact_pass,
    mean_delta,
    sequence_deltas,
)


@torch.no_grad()
def plain_knockout_losses(build, ids, L, pairs, mode, means, batch_size, bar=None) -> dict:
    """The honest plain loop: per head, a pre-hook on its output projection and one full forward
    of every sequence (all in one batch unless ``batch_size`` is smaller), unembedding only the last ``L`` positions."""
    losses, offset = {}, bos_offset(build.tokens)
    for layer, head in pairs:
        layer_means = means[layer] if mode == "mean" else None
        with ablated(build.model, layer, build.geometry.d_head, [(slice(None), head)], layer_means):
            parts = [
                forward_copy_losses(build.model, batch, L, offset, build.device).double().cpu()
                for batch in batches(ids, batch_size)
            ]
        losses[(layer, head)] = torch.cat(parts)
        if bar is not None:
            bar.update(1, 1, head_label(layer, head))
    return losses


def plain_knockout_deltas(
    build: LoadedBuild, settings: RepeatSettings, *, mode: str = "zero", heads=None, batch_size: int = 8
) -> tuple[float, dict[str, float]]:
    """The plain reference: intact copy loss and ``{label: delta}``, one full forward per head."""
    check_mode(mode)
    pairs = parse_heads(heads, build.geometry)
    ids = held_out_ids(build, settings)
    with attention_implementation(build.model):
        intact = intact_pass(build, ids, settings.L, batch_size, trace=False)
        losses = plain_knockout_losses(build, ids, settings.L, pairs, mode, intact.means, batch_size)
    return intact.copy_loss, {head_label(*p): mean_delta(sequence_deltas(v, intact)) for p, v in losses.items()}


def plain_unembedding(weights: ModelWeights, unembedding: str = DEFAULT.unembedding) -> np.ndarray:
    """``W_U`` (float64 numpy) by the definition: centred as ``W_U (I - 11^T / vocab)``, formed explicitly."""
    check_unembedding(unembedding)
    W_U = weights.W_U.double().numpy()
    if unembedding == "uncentred":
        return W_U
    return W_U - (W_U @ np.ones((W_U.shape[1], 1))) @ np.ones((1, W_U.shape[1])) / W_U.shape[1]


def plain_reduced_ov(
    weights: ModelWeights,
    layer: int,
    head: int,
    W_E: np.ndarray | None = None,
    W_U: np.ndarray | None = None,
    unembedding: str = DEFAULT.unembedding,
) -> np.ndarray:
    """``M_h = (W_O W_U)(W_E W_V)`` of one head, float64, without sharing ``W_U W_E`` (slow).

    ``W_E``/``W_U`` may be passed already in float64, so a loop converts them once; ``W_U``
    defaults to `plain_unembedding` of ``unembedding``.
    """
    W_O = weights.layers[layer].W_O[head].double().numpy()
    W_V = weights.W_V_of(layer, head).double().numpy()
    W_E = weights.W_E.double().numpy() if W_E is None else W_E
    W_U = plain_unembedding(weights, unembedding) if W_U is None else W_U
    return (W_O @ W_U) @ (W_E @ W_V)


def plain_kappa(M, rel_tol: float = EIG_REL_TOL) -> tuple[float, float]:
    """``(kappa, kappa_trace)`` of one matrix by a plain loop over ``numpy.linalg.eigvals``."""
    lam = np.linalg.eigvals(np.asarray(M, dtype=np.float64))
    largest = max(abs(x) for x in lam)
    total_f, total_re, total_abs = 0.0, 0.0, 0.0
    for x in lam:
        if abs(x) > rel_tol * largest:
            total_f += x.real / abs(x)
        total_re += x.real
        total_abs += abs(x)
    return total_f / len(lam), (total_re / total_abs if total_abs > 0 else 0.0)


def plain_ov_spectrum(
    weights: ModelWeights,
    *,
    n_rotations: int = N_ROTATIONS,
    q: float = 0.05,
    seed: int = 0,
    p_method: str = "t",
    heads: list[tuple[int, int]] | None = None,
    unembedding: str = DEFAULT.unembedding,
) -> pd.DataFrame:
    """The plain scan: per head, ``M_h`` from scratch, ``plain_kappa``, then one rotation at a time.

    Same rotations as ``ov_spectrum`` (``layer_rotations``), so the same numbers to float64
    round-off. ``heads`` restricts it to some ``(layer, head)`` pairs (for timing); the frame
    then holds only those rows, with BH over them only.
    """
    check_settings(n_rotations, q, seed, p_method)
    geo = weights.geometry
    n_layers, n_heads, d = len(weights.layers), geo.n_heads, geo.d_head
    chosen = heads if heads is not None else [(l, h) for l in range(n_layers) for h in range(n_heads)]
    lam = np.zeros((len(chosen), d), dtype=np.complex128)
    kappa, trace = np.zeros(len(chosen)), np.zeros(len(chosen))
    null_k, null_t = np.zeros((len(chosen), n_rotations)), np.zeros((len(chosen), n_rotations))
    W_E = weights.W_E.double().numpy()
    W_U, W_U_raw = plain_unembedding(weights, unembedding), plain_unembedding(weights, "uncentred")
    kappa_u, trace_u = np.zeros(len(chosen)), np.zeros(len(chosen))
    for i, (layer, head) in enumerate(chosen):
        M = plain_reduced_ov(weights, layer, head, W_E, W_U)
        lam[i] = np.linalg.eigvals(M)
        kappa[i], trace[i] = plain_kappa(M)
        kappa_u[i], trace_u[i] = plain_kappa(plain_reduced_ov(weights, layer, head, W_E, W_U_raw))
        rotations = layer_rotations(n_rotations, d, seed, layer).numpy()  # drawn again per head
        for r in range(n_rotations):
            null_k[i, r], null_t[i, r] = plain_kappa(M @ rotations[r])
    frame = spectrum_frame(
        weights,
        lam[None],
        kappa[None],
        trace[None],
        null_k[None],
        null_t[None],
        q=q,
        seed=seed,
        p_method=p_method,
        unembedding=unembedding,
        uncentred=(kappa_u[None], trace_u[None]),
    )
    frame["layer"] = [l for l, _ in chosen]
    frame["head_index"] = [h for _, h in chosen]
    frame["head"] = [head_label(l, h) for l, h in chosen]
    frame["kv_group"] = [geo.kv_group(h) for _, h in chosen]
    return frame
