"""Hooks on the attention output projection, whose input is ``z`` (docs/definitions.md, "Rung 2").

``z`` is the concatenation of the head outputs: head ``h`` is columns
``h*d_head:(h+1)*d_head`` of the input of ``out_proj_module(model, l)``. Knocking out
head ``h`` replaces that slice with zeros (zero ablation) or with the head's mean
``mu_h`` over a reference batch (mean ablation). With grouped-query attention the slice
is one query head's output. The hooks only touch the projection's input, so they work
the same for every family and for quantized projections (bitsandbytes, RTN).
"""

from __future__ import annotations

from contextlib import contextmanager

import torch

from ..errors import CircuitsError
from ..model.families import Geometry, head_label, out_proj_module
from ..model.hooks import hooked
from ..options import KNOCKOUT_MODES, flag
from ..record.figures import parse_label


def check_mode(mode: str) -> None:
    if mode not in KNOCKOUT_MODES:
        raise CircuitsError(f"knockout mode {mode!r} is unknown; use zero or mean ({flag('knockout-mode')})")


def parse_heads(heads, geo: Geometry) -> list[tuple[int, int]]:
    """``None`` -> every head; else labels (``"L1H3"``) or ``(layer, head)`` pairs, checked, in model order."""
    if heads is None:
        return [(l, h) for l in range(geo.n_layers) for h in range(geo.n_heads)]
    if isinstance(heads, str):
        heads = [heads]
    parsed = set()
    for item in heads:
        if isinstance(item, str):
            cell = parse_label(item)
            if cell is None:
                raise CircuitsError(f"head {item!r} is not a head label; write heads as L<layer>H<head>, e.g. L1H3")
            layer, head = cell
        else:
            layer, head = (int(v) for v in item)
        if not (0 <= layer < geo.n_layers and 0 <= head < geo.n_heads):
            raise CircuitsError(
                f"head {head_label(layer, head)} does not exist; the model has layers 0..{geo.n_layers - 1} "
                f"and heads 0..{geo.n_heads - 1}"
            )
        parsed.add((layer, head))
    return sorted(parsed)


def _replace_input(args, kwargs, new):
    if args:
        return (new, *args[1:]), kwargs
    key = next(iter(kwargs))
    return args, {**kwargs, key: new}


def _first_input(args, kwargs) -> torch.Tensor:
    return args[0] if args else next(iter(kwargs.values()))


@contextmanager
def ablated(model, layer: int, d_head: int, assignments, means: torch.Tensor | None = None):
    """Knock out heads of ``layer`` while inside the block.

    ``assignments``: ``(rows, head)`` pairs; ``rows`` (a slice of the batch axis, or
    ``slice(None)`` for every row) has head ``head`` knocked out. ``means``: this layer's
    ``(n_heads, d_head)`` mean ``z`` for mean ablation; ``None`` for zero ablation.
    """
    assignments = list(assignments)

    def hook(module, args, kwargs):
        z = _first_input(args, kwargs).clone()
        if z.dim() < 3 and any(rows != slice(None) for rows, _ in assignments):
            raise CircuitsError(
                f"layer {layer}: the output projection gets a flattened z {tuple(z.shape)}, so stacked "
                "knockouts cannot be told apart; use knockouts_per_pass=1"
            )
        for rows, head in assignments:
            cols = slice(head * d_head, (head + 1) * d_head)
            if means is None:
                z[rows, ..., cols] = 0
            else:
                z[rows, ..., cols] = means[head].to(device=z.device, dtype=z.dtype)
        return _replace_input(args, kwargs, z)

    with hooked((out_proj_module(model, layer), "pre_kwargs", hook)):
        yield


@contextmanager
def z_observed(model, n_layers: int, observe):
    """Call ``observe(layer, z)`` with every layer's ``z`` (the out-projection's input) during forwards."""

    def make(layer):
        def hook(module, args, kwargs):
            observe(layer, _first_input(args, kwargs))

        return hook

    with hooked(*[(out_proj_module(model, l), "pre_kwargs", make(l)) for l in range(n_layers)]):
        yield


class ZLeaves(list):
    """``(layer, z, delta)`` per call of a layer's output projection; ``closed`` once the forward is
    done: a block recomputed in the backward (`screen.recomputed_blocks`) calls it again, and those
    calls add no leaf."""

    closed = False


@contextmanager
def z_differentiable(model, n_layers: int):
    """Add a zero leaf ``delta_l`` (requires grad) to every layer's ``z``; yields the `ZLeaves`.

    After ``loss.backward()``, ``delta_l.grad`` is ``dLoss/dz_l`` through every downstream
    path (the value of ``z`` is unchanged: ``z + 0``). Leaves are appended per forward until the
    list is closed.
    """
    leaves = ZLeaves()

    def make(layer):
        def hook(module, args, kwargs):
            z = _first_input(args, kwargs)
            delta = torch.zeros_like(z, requires_grad=True)  # recomputed: the same graph, its leaf not kept
            if not leaves.closed:
                leaves.append((layer, z.detach(), delta))
            return _replace_input(args, kwargs, z + delta)

        return hook

    with hooked(*[(out_proj_module(model, l), "pre_kwargs", make(l)) for l in range(n_layers)]):
        yield leaves


class ZMeans:
    """Running mean of every head's ``z`` over sequences and positions (float64 sums)."""

    def __init__(self, geo: Geometry):
        self.geo = geo
        self.sums = torch.zeros(geo.n_layers, geo.n_heads * geo.d_head, dtype=torch.float64)
        self.counts = torch.zeros(geo.n_layers, dtype=torch.float64)

    def observe(self, layer: int, z: torch.Tensor) -> None:
        flat = z.detach().reshape(-1, z.shape[-1])
        self.sums[layer] += flat.double().sum(dim=0).cpu()
        self.counts[layer] += flat.shape[0]

    def means(self) -> torch.Tensor:
        """``(n_layers, n_heads, d_head)`` float32: ``mu_{l,h} = mean over (sequence, position) of z_{l,h}``."""
        mean = self.sums / self.counts.clamp_min(1)[:, None]
        return mean.reshape(self.geo.n_layers, self.geo.n_heads, self.geo.d_head).float()
