"""What a typed record says beyond its fields: whether it holds a kind of figure, its eigenvalues as
complex arrays, each head's OV gain, and how its model is named to a reader."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from .schema import Identity, ModelInfo, Record, RecordLike

NEEDS = {
    "knockout": ("knockout_delta", "knockout_atp"),  # a gate's change screen may clear every key head
    "routing": ("prefix_matching",),
    "audit": (),  # the record's audit section (`record.audit`), not a head figure
}  # what an invariant may need -> the head figures that show it


def has_figures(record: RecordLike, need: str) -> bool:
    """True when the record holds the figures of ``need`` (``"knockout"``: any measured knockout delta
    or plain AtP estimate;
    ``"routing"``: any measured routing score, which an engine without attention patterns lacks;
    ``"audit"``: rung 3 on an audit slice)."""
    if need == "audit":
        return Record.of(record).audit is not None
    columns = NEEDS[need]
    return any(getattr(row, column) is not None for row in Record.of(record).heads for column in columns)


def lacking_figures(record: Record, build: str, lacking: str) -> str:
    """Why an invariant was not checked: ``record`` holds no ``lacking`` figures (the engine that ran
    its probe could not measure them, or it was measured without them)."""
    engine = record.build.engine
    why = f"its probe ran on {engine}" if engine else "it was measured without them"
    if lacking == "audit":
        from ..options import flag

        why = f"no audit slice was given ({flag('audit')} FILE)"
    return f"not checked: the {build} record holds no {lacking} figures, {why}"


def record_eigenvalues(stored: Mapping[str, Any]) -> dict[str, np.ndarray]:
    """The inverse of `eigenvalue_map`: a record's ``eigenvalues`` (``{"L0H0": [[re, im], ...]}``) as
    complex arrays."""
    out = {}
    for label, pairs in stored.items():
        values = np.asarray(pairs, dtype=float).reshape(-1, 2)
        out[str(label)] = values[:, 0] + 1j * values[:, 1]
    return out


def ov_gain(eigenvalues: np.ndarray) -> np.ndarray:
    """``sum_i |lambda_i|`` of each head's reduced OV matrix (the denominator of kappa_trace):
    how strongly the head writes what it reads back onto the vocabulary."""
    return np.abs(np.asarray(eigenvalues)).sum(axis=-1)


def model_kind(model: ModelInfo | Mapping[str, Any]) -> str:
    """How a record's model (its `ModelInfo`, or the dict of one, parts missing) is named to a reader: its
    model type and, where it differs, the layout its heads are read with (``qwen3, llama layout``); an older
    record's layout alone. A hybrid stack's says which blocks its attention layers are."""
    typed = model if isinstance(model, ModelInfo) else Identity.of({"model": model}).model
    family = typed.family if typed is not None else None
    kind = (typed.model_type if typed is not None else None) or str(family or "")
    blocks = typed.geometry.attention_layers if typed is not None and typed.geometry is not None else None
    hybrid = f", hybrid: L0-L{len(blocks) - 1} are blocks {blocks}, the other blocks no attention" if blocks else ""
    return kind + (f", {family} layout" if family and family != kind else "") + hybrid
