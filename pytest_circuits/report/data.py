"""Read scan records and gate results into grids and rankings (numpy only, no plotting).

A scan record (a dict, a `Record`) is read through its lenient typed view (`record.drawn.Drawn`):
missing or ``None`` fields read as NaN, so a scan without knockouts still draws.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np

from ..model.families import head_label
from ..record import figures
from ..record.drawn import Drawn, DrawnHead, drawn_record
from ..record.read import record_eigenvalues
from ..record.schema import Record
from ..record.store import UNCHANGED_ABS, UNCHANGED_REL

# (column, title, kind): "diverging" maps are centred on 0, "score" maps run over [0, 1]
HEATMAP_METRICS = figures.heatmap_figures()
MODEL_FIGURES = figures.model_figure_names()

Drawable = Mapping[str, Any] | Record | Drawn  # a record the report draws: read through its `Drawn` view


def number(value: Any) -> float:
    """``value`` as a float; None, missing or non-numeric read as NaN."""
    if value is None or isinstance(value, str):
        return math.nan
    try:
        return float(value)
    except (TypeError, ValueError):
        return math.nan


def build_name_of(record: Drawable) -> str:
    """The name of the build a record was scanned from (its ``build.recipe`` key; ``"build"`` if unnamed)."""
    return drawn_record(record).build_name


def heads_of(record: Drawable) -> list[DrawnHead]:
    """The record's head rows in model order (L0H0, L0H1, ..., L1H0, ...)."""
    return drawn_record(record).heads


def grid_shape(record: Drawable) -> tuple[int, int]:
    """(n_layers, n_heads) from the record's geometry, else from its head table."""
    view = drawn_record(record)
    n_layers, n_heads = view.info("model", "geometry", "n_layers"), view.info("model", "geometry", "n_heads")
    if n_layers and n_heads:
        return int(n_layers), int(n_heads)
    heads = view.heads
    if not heads:
        return 0, 0
    return 1 + max(h.layer for h in heads), 1 + max(h.head_index for h in heads)


def metric_grid(record: Drawable, column: str) -> np.ndarray:
    """Layer x head array of one per-head figure; NaN where a head lacks it."""
    grid = np.full(grid_shape(record), np.nan)
    for h in heads_of(record):
        layer, index = h.layer, h.head_index
        if layer < grid.shape[0] and index < grid.shape[1]:
            grid[layer, index] = number(h.figure(column))
    return grid


def has_metric(record: Drawable, column: str) -> bool:
    """True when at least one head carries a finite value of ``column``."""
    return bool(np.isfinite(metric_grid(record, column)).any())


def difference_grid(record: Drawable, baseline: Drawable, column: str) -> np.ndarray | None:
    """``record - baseline`` per head, or None when the two models' head grids differ."""
    if grid_shape(record) != grid_shape(baseline):
        return None
    return metric_grid(record, column) - metric_grid(baseline, column)


def changed_cells(record: Drawable, baseline: Drawable, column: str) -> np.ndarray:
    """Boolean layer x head mask: measured in both and moved by more than a baseline re-record
    does (``|after - before| > UNCHANGED_ABS + UNCHANGED_REL |before|``: 6-digit rounding is no change)."""
    diff = difference_grid(record, baseline, column)
    if diff is None:
        return np.zeros(grid_shape(record), dtype=bool)
    before = metric_grid(baseline, column)
    with np.errstate(invalid="ignore"):
        return np.isfinite(diff) & (np.abs(diff) > UNCHANGED_ABS + UNCHANGED_REL * np.abs(before))


def flagged_heads(record: Drawable, flag: str) -> list[str]:
    """Labels of the heads whose boolean ``flag`` (``copying``, ``suppression``) is set."""
    return [str(h.head) for h in heads_of(record) if h.figure(flag) is True]


def normalised_eigenvalues(record: Drawable) -> dict[str, np.ndarray]:
    """Each head's OV eigenvalues divided by that head's max |lambda| (all within the unit circle)."""
    out = {}
    for label, lam in record_eigenvalues(drawn_record(record).figure("eigenvalues") or {}).items():
        top = np.abs(lam).max() if lam.size else 0.0
        out[label] = lam / top if top > 0 else lam
    return out


def cell_of(label: Any) -> tuple[int, int] | None:
    """(layer, head) of a head label ``L{l}H{h}``; None if the label is not of that form."""
    return figures.parse_label(label)


def layer_of(label: Any) -> int:
    """The layer of a head label ``L{l}H{h}`` (-1 if the label is not of that form)."""
    cell = cell_of(label)
    return cell[0] if cell else -1


def result_dict(result: Any) -> dict:
    """An InvariantResult (or its ``as_dict()``) as a plain dict with every key present."""
    raw = result.as_dict() if hasattr(result, "as_dict") else dict(result)
    return {
        "invariant": str(raw.get("invariant", "?")),
        "build": str(raw.get("build", "?")),
        "against": str(raw.get("against") or ""),
        "passed": bool(raw.get("passed")),
        "status": str(raw.get("status") or ("passed" if raw.get("passed") else "failed")),
        # "error": the plugin could not gate it (a missing baseline, a build that failed to load)
        "failed": str(raw.get("status") or ("passed" if raw.get("passed") else "failed")) in ("failed", "error"),
        "message": str(raw.get("message") or ""),
        "moved": [dict(m) for m in raw.get("moved") or []],
    }


def results_by_build(results: Iterable[Any] | None) -> dict[str, list[dict]]:
    """Gate results grouped by build recipe, in the order first seen."""
    grouped: dict[str, list[dict]] = {}
    for result in results or []:
        r = result_dict(result)
        grouped.setdefault(r["build"], []).append(r)
    return grouped


def skip_reasons(results: Iterable[dict], label=lambda r: r["invariant"]) -> list[tuple[str, list[str]]]:
    """The skipped results grouped by why: ``(reason, [label(r), ...])`` in the order first seen;
    the reason is the message's first clause (up to its first ';')."""
    groups: dict[str, list[str]] = {}
    for r in results:
        if r["status"] == "skipped":
            reason = r["message"].split(";")[0].strip() or "no reason given"
            groups.setdefault(reason, []).append(label(r))
    return list(groups.items())


def said_skips(results: Iterable[dict], label=lambda r: r["invariant"]) -> str:
    """``"a, b (why); c (why)"`` for the skipped results, "" when none was skipped."""
    return "; ".join(f"{', '.join(names)} ({reason})" for reason, names in skip_reasons(results, label))


def moved_size(entry: dict) -> float:
    """How far a moved head went: |after - before| / tolerance (plain |after - before| without one)."""
    change = abs(number(entry.get("after")) - number(entry.get("before")))
    if not math.isfinite(change):
        return math.inf if entry.get("before") != entry.get("after") else 0.0
    tolerance = number(entry.get("tolerance"))
    return change / tolerance if math.isfinite(tolerance) and tolerance > 0 else change


def moved(entry: dict) -> bool:
    """True when a gate row's after differs from its before by more than a re-record's rounding."""
    before, after = number(entry.get("before")), number(entry.get("after"))
    if not (math.isfinite(before) and math.isfinite(after)):
        return entry.get("before") != entry.get("after")
    return abs(after - before) > UNCHANGED_ABS + UNCHANGED_REL * abs(before)


def top_moved(results: Iterable[dict], k: int = 5) -> list[dict]:
    """The ``k`` moved entries of ``results`` that went furthest (see `moved_size`), heads
    (``L1H0``) before model-level rows (``model copy_gain``), each change once (a build gated
    against the reference build's baseline and its own lists the same row twice)."""
    entries: dict[tuple, dict] = {}
    for m in (m for r in results for m in r.get("moved") or []):
        entries.setdefault((m.get("head"), m.get("metric"), m.get("before"), m.get("after")), m)

    def rank(m: dict) -> tuple[bool, float]:
        return bool(re.fullmatch(r"L\d+H\d+", str(m.get("head")))), moved_size(m)

    return sorted(entries.values(), key=rank, reverse=True)[:k]


def largest_changes(record: Drawable, baseline: Drawable, k: int = 10) -> list[dict]:
    """The ``k`` largest per-head changes against the baseline, over the heatmap metrics.

    Ranked by |after - before| divided by the metric's spread in the baseline
    (its standard deviation across heads), so metrics on different scales compare;
    heads that did not change (`changed_cells`) are left out.
    Descriptive only: the verdicts come from the gate's InvariantResults.
    """
    changes: list[dict[str, Any]] = []
    for column, _, _ in HEATMAP_METRICS:
        diff = difference_grid(record, baseline, column)
        if diff is None or not np.isfinite(diff).any():
            continue
        before, after = metric_grid(baseline, column), metric_grid(record, column)
        spread = float(np.nanstd(before)) or 1.0
        for layer, index in zip(*np.nonzero(changed_cells(record, baseline, column))):
            changes.append(
                {
                    "head": head_label(layer, index),
                    "metric": column,
                    "before": float(before[layer, index]),
                    "after": float(after[layer, index]),
                    "change": float(diff[layer, index]),
                    "score": abs(float(diff[layer, index])) / spread,
                }
            )
    return sorted(changes, key=lambda c: c["score"], reverse=True)[:k]


def model_figures(record: Drawable) -> dict[str, float]:
    """The model-level figures of a record (NaN where absent)."""
    view = drawn_record(record)
    return {name: number(view.figure(name)) for name in MODEL_FIGURES}


def model_interval(record: Drawable, baseline: Drawable | None, name: str) -> str:
    """The 95% interval of a sampled model figure as text: of its change against ``baseline``
    (paired over the probe's sequences) when there is one, else of the figure itself; why not
    when a record lacks per-sequence figures; "" for a figure that is not sampled."""
    from ..gate.invariants import format_interval
    from ..gate.stats import paired_interval

    if name not in figures.SAMPLED_MODEL_FIGURES:
        return ""
    key = figures.sequences_key(name)
    mine = drawn_record(record).figure(key)
    if baseline is None:
        interval = drawn_record(record).figure(figures.interval_key(name))
        return f"[{fmt(interval[0])}, {fmt(interval[1])}]" if interval else "not available"
    theirs = drawn_record(baseline).figure(key)
    if mine is None or theirs is None:
        side = "baseline" if theirs is None else "build"
        return f"not available ({side} recorded without per-sequence figures; re-record)"
    return format_interval(paired_interval(theirs, mine)) or "not available"


def fmt(value: Any, digits: int = 3, sign: bool = False) -> str:
    """A short human form of a number (``sign``: always show + or -), bool or missing value."""
    if isinstance(value, bool):
        return "yes" if value else "no"
    x = number(value)
    if math.isnan(x):
        return "—" if value is None or isinstance(value, float) else str(value)
    text = f"{x:+.{digits}f}" if sign else f"{x:.{digits}f}"
    return f"{0:.{digits}f}" if float(text) == 0 else text  # no "-0.000"


def slug(text: str) -> str:
    """A file-name-safe form of a build label."""
    return re.sub(r"[^A-Za-z0-9._-]+", "-", text).strip("-") or "build"


def sentence(text: str) -> str:
    """``text`` with its first letter capitalised, the rest as written."""
    return text[:1].upper() + text[1:]
