"""The rotation null of rung 1 and the statistics against it: each head's kappa is compared with the
kappa of its reduced OV map conjugated by Haar-random rotations (seeded per layer), giving z, p (a
symmetric t test, or the normal or empirical tail) and Benjamini-Hochberg q over every head."""

from __future__ import annotations

import math
import os
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

EIG_REL_TOL = 1e-6  # f = 0 where |l| <= EIG_REL_TOL * max|l|


def scores_from_eigenvalues(lam: torch.Tensor, rel_tol: float = EIG_REL_TOL) -> tuple[torch.Tensor, torch.Tensor]:
    """``(kappa, kappa_trace)`` over the last axis of complex eigenvalues ``lam``.

    ``kappa = mean_i f(l_i)``, ``f = Re(l)/|l|`` (0 where ``|l| <= rel_tol max|l|``);
    ``kappa_trace = sum Re(l) / sum |l|`` (0 for an all-zero spectrum).
    """
    mag = lam.abs()
    keep = mag > rel_tol * mag.amax(dim=-1, keepdim=True)
    f = torch.where(keep, lam.real / torch.where(keep, mag, torch.ones_like(mag)), torch.zeros_like(mag))
    kappa = f.mean(dim=-1)
    total = mag.sum(dim=-1)
    trace = torch.where(total > 0, lam.real.sum(dim=-1) / torch.where(total > 0, total, 1.0), 0.0)
    return kappa, trace


def layer_seed(seed: int, layer: int) -> int:
    """A 63-bit seed for layer ``l``'s rotations, from ``numpy.random.SeedSequence([seed, l])``.

    The draws depend only on ``(seed, layer)``: not on the weights, the other layers,
    the batch layout or the number of worker threads.
    """
    state = np.random.SeedSequence([seed, layer]).generate_state(2, np.uint32)
    return ((int(state[0]) << 31) ^ int(state[1])) & ((1 << 63) - 1)


def layer_generator(seed: int, layer: int) -> torch.Generator:
    """The seeded ``torch.Generator`` that draws layer ``l``'s rotations."""
    return torch.Generator().manual_seed(layer_seed(seed, layer))


def haar_rotations(n: int, d: int, generator: torch.Generator) -> torch.Tensor:
    """``n`` Haar-random orthogonal ``d x d`` matrices (float64): ``Q diag(sign(diag R))`` of ``QR(G)``."""
    gauss = torch.randn(n, d, d, generator=generator, dtype=torch.float64)
    Q, R = torch.linalg.qr(gauss)
    signs = torch.sign(torch.diagonal(R, dim1=-2, dim2=-1))
    signs = torch.where(signs == 0, torch.ones_like(signs), signs)
    return Q * signs.unsqueeze(-2)


def layer_rotations(n: int, d: int, seed: int, layer: int) -> torch.Tensor:
    """The ``n`` rotations that every head of layer ``l`` is tested against."""
    return haar_rotations(n, d, layer_generator(seed, layer))


def rotation_null(
    M: torch.Tensor, rotations: torch.Tensor, dtype: torch.dtype = torch.float64
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(kappa, kappa_trace)`` of ``M R`` for every rotation ``R``: two ``(n_rotations,)`` tensors.

    ``M R`` is formed in float64; its eigenvalues are computed in ``dtype``.
    """
    lam = torch.linalg.eigvals((M.double() @ rotations).to(dtype)).to(torch.complex128)
    return scores_from_eigenvalues(lam)


def _layer_null(M_layer: torch.Tensor, layer: int, n_rotations: int, seed: int, dtype: torch.dtype):
    rotations = layer_rotations(n_rotations, M_layer.shape[-1], seed, layer)
    nulls = [rotation_null(M, rotations, dtype) for M in M_layer]  # one batched eigvals per head
    return torch.stack([k for k, _ in nulls]), torch.stack([t for _, t in nulls])


def default_workers() -> int:
    """The null's threads when not given: torch's, at most one a core."""
    return max(1, min(torch.get_num_threads(), os.cpu_count() or 1))


def null_distributions(
    M: torch.Tensor,
    n_rotations: int,
    seed: int,
    n_workers: int | None = None,
    dtype: torch.dtype = torch.float64,
) -> tuple[np.ndarray, np.ndarray]:
    """Rotation nulls of every head: kappa and kappa_trace, each ``(n_layers, n_heads, n_rotations)``.

    The heads of a layer share that layer's ``n_rotations`` Haar rotations (common random
    numbers: drawing a set costs a third as much as one head's eigenvalues); each head's
    null is still an exact Monte Carlo sample of its own null. Each head's draws are one batched
    ``eigvals``; layers run on a thread pool (torch releases the GIL) of ``n_workers``
    threads, by default ``torch.get_num_threads()``. ``dtype`` is the precision of the
    null's eigenvalues (float32: about 1.4x faster, same null to ~1e-6).
    """

    def run(layer):
        return _layer_null(M[layer], layer, n_rotations, seed, dtype)

    workers = n_workers or default_workers()
    layers = range(M.shape[0])
    if workers == 1:
        results = [run(layer) for layer in layers]
    else:
        with ThreadPoolExecutor(max_workers=workers) as pool:
            results = list(pool.map(run, layers))
    null_k = torch.stack([k for k, _ in results])
    null_t = torch.stack([t for _, t in results])
    return null_k.numpy(), null_t.numpy()


# ---------------------------------------------------------------- statistics


def z_scores(observed: np.ndarray, null: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(null_mean, null_sd, z)`` with ``z = (observed - mean)/sd`` over the last axis of ``null``.

    A head whose null has no spread (an all-zero OV) gets ``z = 0``.
    """
    mean = null.mean(axis=-1)
    sd = null.std(axis=-1, ddof=1)
    with np.errstate(divide="ignore", invalid="ignore"):
        z = np.where(sd > 0, (observed - mean) / np.where(sd > 0, sd, 1.0), 0.0)
    return mean, sd, z


def symmetric_t(observed: np.ndarray, null: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """``(null_mean, null_sd, z, p)`` for a null symmetric about 0 (module docstring, ``p_method="t"``).

    ``null_mean = 0``; ``null_sd = s = sqrt(mean k_i^2)``; ``t = observed / s``;
    ``p = 2 T_n(-|t|)`` (Student's t, ``n`` = draws); ``z = b_n t`` (bias-corrected). ``s = 0``: z 0, p 1.
    """
    from scipy.special import gammaln
    from scipy.stats import t as student

    n = null.shape[-1]
    sd = np.sqrt(np.mean(np.square(null), axis=-1))
    with np.errstate(divide="ignore", invalid="ignore"):
        t = np.where(sd > 0, observed / np.where(sd > 0, sd, 1.0), 0.0)
    b_n = math.sqrt(2.0 / n) * math.exp(gammaln(n / 2.0) - gammaln((n - 1) / 2.0))
    p = np.where(sd > 0, 2.0 * student.sf(np.abs(t), df=n), 1.0)
    return np.zeros_like(sd), sd, b_n * t, p


def normal_p(z: np.ndarray) -> np.ndarray:
    """Two-sided p-value of a z-score under the normal approximation: ``2 Phi(-|z|)``."""
    from scipy.stats import norm

    return 2.0 * norm.sf(np.abs(z))


def empirical_p(observed: np.ndarray, null: np.ndarray) -> np.ndarray:
    """Two-sided empirical p with the +1 correction: ``(1 + #{|k0 - mean| >= |k - mean|}) / (n + 1)``."""
    mean = null.mean(axis=-1, keepdims=True)
    extreme = np.abs(null - mean) >= np.abs(observed[..., None] - mean) - 1e-12
    return (1.0 + extreme.sum(axis=-1)) / (null.shape[-1] + 1.0)


def benjamini_hochberg(p: np.ndarray) -> np.ndarray:
    """BH-adjusted q-values: ``q_(i) = min_{j >= i} m p_(j) / j`` over the sorted p, capped at 1."""
    p = np.asarray(p, dtype=np.float64).ravel()
    m = p.size
    if m == 0:
        return p.copy()
    order = np.argsort(p, kind="stable")
    ranked = p[order] * m / np.arange(1, m + 1)
    adjusted = np.minimum.accumulate(ranked[::-1])[::-1].clip(max=1.0)
    q = np.empty(m)
    q[order] = adjusted
    return q


# ---------------------------------------------------------------- the frame
