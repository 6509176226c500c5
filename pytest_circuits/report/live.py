"""Figures drawn from a loaded build at report time (the plugin has the builds; ``circuits report`` does not).

``head_attention(build, settings, label)``: one head's attention pattern ``A[dst, src]`` on the
probe's first sequence (``[BOS] x x``), the pattern the head actually used, taken from its
attention module's returned weights. Not stored in baselines: a ``T x T`` map per build is
too big for them, and it is cheap to recompute from the build.
"""

from __future__ import annotations

import numpy as np

from . import data

DIGITS = 4  # attention weights are sent as plain floats rounded to 4 decimals (they cross pytest-xdist)


def strongest_induction_head(record: dict) -> str | None:
    """The head with the largest prefix-matching score in ``record`` (None when none was measured)."""
    grid = data.metric_grid(record, "prefix_matching")
    if not np.isfinite(grid).any():
        return None
    layer, head = np.unravel_index(int(np.nanargmax(grid)), grid.shape)
    return f"L{int(layer)}H{int(head)}"


def head_attention(build, settings, label: str) -> dict:
    """``{"head", "pattern" (T x T lists), "tokens", "L", "offset"}`` of head ``label`` on probe sequence 0."""
    from dataclasses import replace

    import torch

    from ..model.families import attention_module
    from ..model.hooks import hooked
    from ..rungs.probe import input_device
    from ..rungs.repeat import bos_offset
    from ..rungs.text_probe import probe_ids

    cell = data.cell_of(label)
    if cell is None:
        raise ValueError(f"{label!r} is not a head label L<layer>H<head>")
    layer, head = cell
    ids = probe_ids(build.source, build.tokens, replace(settings, n=1))
    caught: list = []

    def hook(module, args, output):
        weights = output[1] if isinstance(output, tuple) and len(output) > 1 else None
        if weights is not None:
            caught.append(weights[0, head].detach().float().cpu())

    with torch.no_grad(), hooked((attention_module(build.model, layer), "forward", hook)):
        build.model(input_ids=ids.to(input_device(build.model)), use_cache=False)
    if not caught:
        raise ValueError(f"layer {layer}'s attention returned no weights")
    pattern = np.round(caught[0].numpy().astype(float), DIGITS)
    return {
        "head": label,
        "pattern": pattern.tolist(),
        "tokens": ids[0].tolist(),
        "L": int(settings.L),
        "offset": bos_offset(build.tokens),
    }
