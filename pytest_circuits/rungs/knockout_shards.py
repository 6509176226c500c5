"""Knockout shards: one scan cut into runs of layers of about equal replay cost, and the shards joined again."""

from __future__ import annotations

import math

import pandas as pd

from ..errors import CircuitsError
from ..options import flag
from ..record.figures import parse_label
from .replay import replay_cost


def layer_shards(n_layers: int, shards: int) -> list[list[int]]:
    """Layers ``0..n_layers-1`` in ``shards`` contiguous runs of about equal replay cost.

    A knockout in layer ``l`` replays ``n_layers - l`` blocks (`replay_cost`), so early layers
    cost more: a cut falls where the cumulative cost passes ``j/shards`` of the total. More
    shards than layers gives one layer per shard.
    """
    if shards < 1:
        raise CircuitsError(f"knockout shards {shards} must be at least 1 ({flag('knockout-shards')})")
    shards = min(shards, n_layers)
    costs = [replay_cost(n_layers, layer) for layer in range(n_layers)]
    total, done = sum(costs), 0.0
    runs: list[list[int]] = []
    current: list[int] = []
    for layer, cost in enumerate(costs):
        target = total * (len(runs) + 1) / shards  # where the current run should end
        still_to_open = shards - len(runs) - 1
        closer_without = target - done < done + cost - target
        if current and still_to_open > 0 and (n_layers - layer == still_to_open or closer_without):
            runs.append(current)
            current = []
        current.append(layer)
        done += cost
    runs.append(current)
    return runs


def merge_knockout_shards(frames: list[pd.DataFrame]) -> pd.DataFrame:
    """One scan from its shards (each `knockout_scan(..., layers=...)` of one build and settings):
    each head's ``knockout_delta`` from the shard that owns its layer; the rest (screen columns,
    intact copy loss) is the same in every shard and is checked to be."""
    if not frames:
        raise CircuitsError("no knockout shards to merge")
    first = frames[0]
    owner: dict[int, int] = {}
    for index, frame in enumerate(frames):
        if frame.attrs.get("layers") is None:
            raise CircuitsError("a knockout shard without its layers cannot be merged")
        for layer in frame.attrs["layers"]:
            if layer in owner:
                raise CircuitsError(f"knockout shards {owner[layer]} and {index} both hold layer {layer}")
            owner[layer] = index
        same = ("copy_loss", "mode", "settings", "screened", "screen_top_k", "screen_method")
        if any(frame.attrs.get(key) != first.attrs.get(key) for key in same):
            raise CircuitsError(f"knockout shard {index} was measured with other settings than shard 0")
    merged = first.copy()
    measured = [c for c in first.columns if c.startswith("knockout_delta")]  # the delta, its sequences, ...
    for column in measured:
        merged[column] = [
            frames[owner[layer]].loc[i, column]
            if layer in owner
            else (math.nan if column == "knockout_delta" else None)
            for i, layer in enumerate(first["layer"])
        ]
    exact = sorted({label for frame in frames for label in frame.attrs["exact_heads"]}, key=_label_order)
    merged.attrs = {
        **first.attrs,
        "exact_heads": exact,
        "replayed": all(frame.attrs.get("replayed") for frame in frames),
        "layers": None,
    }
    return merged


def _label_order(label: str) -> tuple[int, int]:
    cell = parse_label(label)
    assert cell is not None  # labels come from head_label
    return cell
