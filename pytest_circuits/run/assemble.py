"""A scan record assembled from the rung frames of one build: every figure as a JSON-able dict.

``assemble_record`` builds it from the three rung frames (pure); `pytest_circuits.run.records` measures
them (the same code path for the plugin and the CLI) and types it (`record.schema.Record`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import pandas as pd

from ..gate.stats import mean_interval
from ..model.families import head_label
from ..record import figures
from ..record.schema import SCHEMA_VERSION

HEAD_COLUMNS = figures.stored_head_figures("always")  # in every head row (None where not measured)
EXTRA_COLUMNS = figures.stored_head_figures("measured")  # only when the rung produced them
MODEL_FIGURES = figures.model_figure_names()
KNOCKOUT_SEQUENCES = figures.sequences_key("knockout_delta")
SERIES_FIGURES = figures.series_figure_names()  # optional per-position series (``position_loss``)


def versions() -> dict[str, Any]:
    """Versions of torch, transformers, bitsandbytes (None if absent) and pytest-circuits."""
    import torch
    import transformers

    from .. import __version__

    try:
        import importlib.metadata as metadata

        bnb = metadata.version("bitsandbytes")
    except Exception:
        bnb = None
    # plain str: torch's TorchVersion cannot cross pytest-xdist's wire
    return {
        "torch": str(torch.__version__),
        "transformers": str(transformers.__version__),
        "bitsandbytes": bnb,
        "pytest_circuits": __version__,
    }


def _plain(value: Any) -> Any:
    """numpy scalars -> Python; NaN/inf -> None (strict JSON)."""
    if isinstance(value, (np.bool_, bool)):
        return bool(value)
    if isinstance(value, (np.integer,)):
        return int(value)
    if isinstance(value, (float, np.floating)):
        value = float(value)
        return value if math.isfinite(value) else None
    if isinstance(value, (list, tuple, np.ndarray)):
        return [_plain(v) for v in value]
    return value


def interval_of(sequences: Sequence[float] | None) -> list[float] | None:
    """The 95% t interval ``[low, high]`` of the mean of per-sequence values (`stats.mean_interval`);
    None when there are none (records without per-sequence figures) or too few."""
    if sequences is None:
        return None
    interval = mean_interval(sequences)
    return None if interval is None else [float(interval[0]), float(interval[1])]


def sampled_model_figures(probe_result: Any) -> dict[str, Any]:
    """Per-sequence copy loss, first-copy loss and copy gain, each with its interval (`interval_of`)."""
    keep = getattr(probe_result, "sequence_figures", None)  # a probe result that kept none has no such method
    sequences = keep() if keep is not None else {}
    out: dict[str, Any] = {}
    for name in figures.SAMPLED_MODEL_FIGURES:
        values = sequences.get(figures.sequences_key(name))
        if values is not None:
            out[figures.sequences_key(name)] = _plain(values)
            out[figures.interval_key(name)] = interval_of(values)
    return out


def head_rows(spectrum: Any, probe_heads: Any = None, knockout: Any = None) -> list[dict[str, Any]]:
    """One dict per head (ordered by layer, head), joining the three rung frames on ``head``."""
    frame = pd.DataFrame({c: spectrum[c].to_numpy() for c in spectrum.columns})  # no attrs: they break merge
    if probe_heads is not None:
        frame = frame.merge(probe_heads.drop(columns=["layer", "head_index"], errors="ignore"), on="head", how="left")
    if knockout is not None:
        cols = [
            c
            for c in ("head", "knockout_delta", "knockout_estimate", "knockout_atp", KNOCKOUT_SEQUENCES)
            if c in knockout.columns
        ]
        frame = frame.merge(knockout[cols], on="head", how="left")
        if KNOCKOUT_SEQUENCES in frame.columns:
            frame[figures.interval_key("knockout_delta")] = [
                interval_of(v) if isinstance(v, list) else None for v in frame[KNOCKOUT_SEQUENCES]
            ]
    frame = frame.sort_values(["layer", "head_index"])
    columns = list(HEAD_COLUMNS) + [c for c in EXTRA_COLUMNS if c in frame.columns]
    rows = []
    for _, r in frame.iterrows():
        rows.append({c: _plain(r[c]) if c in frame.columns else None for c in columns})
    return rows


def eigenvalue_map(eigenvalues: Any) -> dict[str, Any]:
    """``(n_layers, n_heads, d_head)`` complex array -> ``{"L0H0": [[re, im], ...]}``."""
    if eigenvalues is None:
        return {}
    ev = np.asarray(eigenvalues)
    out = {}
    for l in range(ev.shape[0]):
        for h in range(ev.shape[1]):
            out[head_label(l, h)] = [[float(z.real), float(z.imag)] for z in ev[l, h]]
    return out


def assemble_record(
    *,
    model: dict[str, Any],
    build: dict[str, Any],
    probe: dict[str, Any],
    knockout_info: dict[str, Any] | None,
    spectrum: Any,
    probe_result: Any,
    knockout: Any = None,
    rung1: dict[str, Any],
    audit: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The scan record from its parts (pure; see the contract in the module docstring), its floats
    rounded as a stored record's are (`store.round_sig`): a record measured now and the same record
    read back from its file are one record, and every front end gates the same numbers."""
    from ..record.store import round_sig

    model_figures = probe_result.model_figures() if probe_result is not None else {}
    record = {
        "schema_version": SCHEMA_VERSION,
        "model": model,
        "build": build,
        "versions": versions(),
        "probe": probe,
        "knockout": knockout_info,
        "rung1": rung1,
        **{k: _plain(model_figures.get(k)) for k in MODEL_FIGURES},
        **sampled_model_figures(probe_result),
        **_series(probe_result),
        "heads": head_rows(spectrum, None if probe_result is None else probe_result.heads, knockout),
        "eigenvalues": eigenvalue_map(spectrum.attrs.get("eigenvalues")),
        **({} if audit is None else {"audit": audit}),  # rung 3 (`rungs.audit`): absent without a slice
    }
    rounded: dict[str, Any] = round_sig(record)
    return rounded


def _series(probe_result: Any) -> dict[str, Any]:
    """The per-position series the probe measured (absent keys, not empty lists, when it has none)."""
    out = {}
    for name in SERIES_FIGURES:
        values = getattr(probe_result, name, None) if probe_result is not None else None
        if values:
            out[name] = [_plain(v) for v in values]
    return out


def rung1_info(spectrum: Any, settings: Any, folded: bool, method: Any) -> dict[str, Any]:
    """The record's ``rung1`` section: how kappa was measured (`KappaMethod`) and its null's scale."""
    attrs = {**spectrum.attrs, **(spectrum.attrs.get("summary") or {})}
    null_sd = attrs.get("median_null_sd", attrs.get("null_sd_median"))
    if null_sd is None and "kappa_null_sd" in spectrum.columns:
        null_sd = float(np.nanmedian(spectrum["kappa_null_sd"].to_numpy(float)))
    floor = attrs.get("analytic_floor")
    return {
        **method.as_dict(),
        "n_rotations": int(attrs.get("n_rotations", method.n_rotations)),
        "q": float(attrs.get("q", settings.fdr_q)),
        "min_effect": float(attrs.get("min_effect", method.min_effect)),  # what flagged the heads with q
        "folded": bool(attrs.get("folded", folded)),
        "analytic_floor": _plain(floor),
        "null_sd_median": _plain(null_sd),
    }


def model_info(name: str, source: Any, build: Any) -> dict[str, Any]:
    """Name, spec, layout (``family``), model type, the quirks its config enables, weight fingerprint and
    geometry of the model ``name`` loaded from ``source`` (a `ModelSource`) as ``build``."""
    from ..model.families import active_quirks
    from ..model.loading import weight_fingerprint

    geo = build.geometry
    config = build.model.config
    return {
        "name": name,
        "spec": source.spec,
        "family": build.family.name,
        "model_type": str(getattr(config, "model_type", "")),
        "quirks": active_quirks(build.family, config),
        "fingerprint": weight_fingerprint(source.folder),  # exactly the files loaded
        "geometry": {
            **{k: getattr(geo, k) for k in ("n_layers", "n_heads", "n_kv_heads", "d_model", "d_head", "vocab")},
            **({} if geo.attention_layers is None else {"attention_layers": list(geo.attention_layers)}),
        },
    }
