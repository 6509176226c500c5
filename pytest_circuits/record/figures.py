"""Every figure the rungs report, declared once (docs/definitions.md gives each formula).

A `Figure` says which rung and result frame produce it, its type and range, whether scan
records (baselines, ``circuits scan --json``) store it, and how the CLI table, ``circuits
diff`` and the report show it. The kappa frame's columns, the record's head rows and their
validation, the CLI table and diff and the report's heatmaps all derive from `HEAD_FIGURES`
and `MODEL_FIGURES`; adding a figure is one entry here.

Light: no torch, numpy or pandas.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

HEAD_LABEL = re.compile(r"^L(\d+)H(\d+)$")  # L{layer}H{head}, zero-based


def parse_label(label) -> tuple[int, int] | None:
    """``(layer, head)`` of a head label ``L3H7``; None when ``label`` is not one."""
    match = HEAD_LABEL.match(str(label).strip())
    return (int(match[1]), int(match[2])) if match else None


# where a figure comes from: the per-head frames of the rungs, or the probe's model-level result
# record: computed by run/assemble.py; audit: rung 3 (rungs/audit.py)
SOURCES = ("index", "kappa", "probe", "knockout", "probe_model", "record", "audit")
# stored: "always" (None when not measured), "measured" (only when its frame has it), "" (never)
STORED = ("always", "measured", "")


@dataclass(frozen=True)
class Figure:
    """One per-head or model-level figure."""

    name: str
    source: str  # one of SOURCES
    kind: str  # "float", "bool", "int", "str"; "floats" (one per probe sequence), "interval" ([low, high])
    rung: str  # "1", "1/2", "2" or "" (identifiers)
    stored: str = "always"  # one of STORED
    low: float | None = None  # range checked when records are read (inclusive)
    high: float | None = None
    nullable: bool = False  # a stored None is legal (not measured), not a corrupt record
    title: str = ""  # CLI table column title ("" = not in the table)
    fmt: str = "{:.3f}"
    diff: bool = False  # shown by `circuits diff`
    heatmap: str = ""  # report heatmap title ("" = none)
    heatmap_kind: str = ""  # "diverging" (centred on 0) or "score" (0..1)


def _kappa(name: str, kind: str = "float", **how: Any) -> Figure:
    """A rung-1 figure of the kappa frame."""
    return Figure(name, "kappa", kind, "1", **how)


def _routing(name: str, **how: Any) -> Figure:
    """A rung-1/2 routing score of the repeat probe: a mean attention weight, in [0, 1]; None where the
    engine that ran the probe formed no attention pattern (llama.cpp with a quantized cache)."""
    return Figure(name, "probe", "float", "1/2", low=0.0, high=1.0, nullable=True, **how)


def sequences_key(figure: str) -> str:
    """Record key of a sampled figure's per-sequence values: ``copy_loss_sequences``."""
    return f"{figure}_sequences"


def interval_key(figure: str) -> str:
    """Record key of a sampled figure's 95% interval ``[low, high]``: ``copy_loss_interval``."""
    return f"{figure}_interval"


_PROB: dict[str, Any] = dict(low=0.0, high=1.0)

HEAD_FIGURES: tuple[Figure, ...] = (
    Figure("head", "index", "str", ""),
    Figure("layer", "index", "int", "", low=0),
    Figure("head_index", "index", "int", "", low=0),
    # rung 1: the kappa frame, in its column order
    _kappa(
        "kappa",
        low=-1.0,
        high=1.0,
        title="kappa",
        fmt="{:+.3f}",
        diff=True,
        heatmap="κ (OV copying)",
        heatmap_kind="diverging",
    ),
    _kappa("kappa_trace", low=-1.0, high=1.0, title="trace", fmt="{:+.3f}", diff=True),
    _kappa("kappa_null_mean", low=-1.0, high=1.0),
    _kappa("kappa_null_sd", low=0.0),
    _kappa("kappa_z", title="z", fmt="{:+.2f}", diff=True),
    _kappa("kappa_p", **_PROB),
    _kappa("kappa_q", **_PROB, title="q"),
    _kappa("copying", "bool"),
    _kappa("suppression", "bool"),
    _kappa("kappa_p_empirical", **_PROB, stored=""),
    _kappa("kappa_trace_null_mean", stored=""),
    _kappa("kappa_trace_null_sd", stored=""),
    _kappa("kappa_trace_z", stored="measured"),
    _kappa("kappa_trace_p", stored=""),
    _kappa("kappa_trace_q", stored=""),
    _kappa("kappa_trace_p_empirical", stored=""),
    _kappa("copying_trace", "bool", stored="measured"),
    _kappa("suppression_trace", "bool", stored="measured"),
    _kappa("kv_group", "int", stored=""),
    _kappa("ov_gain", stored="measured", low=0.0, title="ov gain"),  # the CLI shows it over the largest
    # the same scores on the uncentred W_U, for comparison (kappa itself reads the centred one)
    _kappa(
        "kappa_uncentred",
        stored="measured",
        low=-1.0,
        high=1.0,
        title="unc kappa",
        fmt="{:+.3f}",
        diff=True,
        heatmap="κ on the uncentred W_U",
        heatmap_kind="diverging",
    ),
    _kappa("kappa_trace_uncentred", stored="measured", low=-1.0, high=1.0, diff=True),
    # rung 1/2: routing scores of the repeat probe
    _routing("prefix_matching", title="prefix", diff=True, heatmap="prefix-matching", heatmap_kind="score"),
    _routing("previous_token", title="prev", diff=True, heatmap="previous-token", heatmap_kind="score"),
    _routing("duplicate_token", title="dup", diff=True),
    # the factors norm folding leaves out of the head's direct path, on the probe (times ov_gain: the gate's cut)
    Figure("path_factor", "probe", "float", "1/2", stored="measured", low=0.0),
    # rung 2: knockouts (None where a screened scan ran no exact knockout)
    Figure(
        "knockout_delta",
        "knockout",
        "float",
        "2",
        nullable=True,
        title="knockout",
        fmt="{:+.3f}",
        diff=True,
        heatmap="knockout Δloss (nats)",
        heatmap_kind="diverging",
    ),
    Figure("knockout_estimate", "knockout", "float", "2", stored="measured", nullable=True),
    # plain AtP of every head on look 1's held-out sequences, sum dz_h . dCL/dz_h (rungs/screen.py `atp`):
    # what knockout_deltas' change screen compares between a baseline and a build (gate/change_screen.py)
    Figure("knockout_atp", "knockout", "float", "2", stored="measured", nullable=True),
    # per held-out sequence i: copy_loss_i(head knocked out) - copy_loss_i(intact); they average to knockout_delta
    Figure(sequences_key("knockout_delta"), "knockout", "floats", "2", stored="measured", nullable=True),
    Figure(interval_key("knockout_delta"), "record", "interval", "2", stored="measured", nullable=True),
)

MODEL_FIGURES: tuple[Figure, ...] = (
    Figure("copy_loss", "probe_model", "float", "1/2", low=0.0, fmt="{:.4f}"),
    Figure("first_copy_loss", "probe_model", "float", "1/2", low=0.0, fmt="{:.4f}"),
    Figure("copy_gain", "probe_model", "float", "1/2", fmt="{:.4f}"),
    Figure("uniform_loss", "probe_model", "float", "1/2", low=0.0, fmt="{:.4f}"),
)

# Sampled figures: means over the probe's n seeded sequences. The record stores each one's
# per-sequence values (``<figure>_sequences``, averaging to the figure) and its 95% t interval
# over the sequences (``<figure>_interval``, gate/stats.py); the gate's paired intervals of a
# change come from the per-sequence values. Records written before these existed lack them.
SAMPLED_MODEL_FIGURES = ("copy_loss", "first_copy_loss", "copy_gain")
SAMPLED_HEAD_FIGURES = ("knockout_delta",)


_LOW = {f.name: f.low for f in MODEL_FIGURES}  # each sequence's value keeps its mean's range
SEQUENCE_FIGURES: tuple[Figure, ...] = tuple(
    entry
    for name in SAMPLED_MODEL_FIGURES
    for entry in (
        Figure(sequences_key(name), "probe_model", "floats", "1/2", "measured", low=_LOW[name], nullable=True),
        Figure(interval_key(name), "record", "interval", "1/2", "measured", nullable=True),
    )
)

# model-level series: one float per probe position, optional in a record (older baselines lack them)
SERIES_FIGURES: tuple[Figure, ...] = (
    # mean CE_t over the probe's sequences at each t = 1 .. 2L-1 (2L-1 values): the report's loss curve
    Figure("position_loss", "probe_model", "float", "1/2", stored="measured", low=0.0, fmt="{:.4f}"),
)

# rung 3 (rungs/audit.py): per case of an audit slice, in the record's optional ``audit`` section
# (record/audit.py); ``chunk_drops`` holds one value per chunk of the case
AUDIT_FIGURES: tuple[Figure, ...] = (
    Figure("answer_tokens", "audit", "int", "3", low=1),
    Figure("answer_logprob", "audit", "float", "3", high=0.0, fmt="{:.3f}"),
    Figure("chunk_drops", "audit", "floats", "3", fmt="{:+.3f}"),
    Figure("cited_drop", "audit", "float", "3", nullable=True, fmt="{:+.3f}"),
    Figure("top_chunk", "audit", "int", "3", low=0),
)

BY_NAME = {f.name: f for f in HEAD_FIGURES + MODEL_FIGURES + SEQUENCE_FIGURES + SERIES_FIGURES + AUDIT_FIGURES}


def columns(source: str) -> tuple[str, ...]:
    """The columns of one rung's per-head frame, in order (identifiers first)."""
    return tuple(f.name for f in HEAD_FIGURES if f.source in ("index", source))


def stored_head_figures(stored: str) -> tuple[str, ...]:
    """Per-head figures a record stores ``"always"`` or only when ``"measured"``."""
    return tuple(f.name for f in HEAD_FIGURES if f.stored == stored)


def model_figure_names() -> tuple[str, ...]:
    return tuple(f.name for f in MODEL_FIGURES)


def series_figure_names() -> tuple[str, ...]:
    """The optional per-position series of a record (``position_loss``)."""
    return tuple(f.name for f in SERIES_FIGURES)


def table_figures() -> tuple[Figure, ...]:
    """The CLI table's columns: every figure with a title."""
    return tuple(f for f in HEAD_FIGURES if f.title)


def diff_figures() -> tuple[str, ...]:
    return tuple(f.name for f in HEAD_FIGURES if f.diff)


def heatmap_figures() -> tuple[tuple[str, str, str], ...]:
    """``(column, title, kind)`` of the report's per-head maps."""
    return tuple((f.name, f.heatmap, f.heatmap_kind) for f in HEAD_FIGURES if f.heatmap)
