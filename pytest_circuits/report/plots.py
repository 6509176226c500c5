"""The report's plots, drawn on ``matplotlib.figure.Figure`` with the Agg canvas (what each figure is: `record/figures.py`).

pyplot is never imported, so the user's global backend is left alone and no display is
needed. matplotlib is optional: `require_matplotlib` turns its absence into one line.
"""

from __future__ import annotations

import importlib
import io
import math
from collections.abc import Collection
from typing import Any, Literal

import numpy as np

from ..errors import CircuitsError
from ..record.drawn import DrawnHead, drawn_record
from . import data

COPYING, SUPPRESSION, REFERENCE = "#1a9850", "#d73027", "#9e9e9e"
UNMEASURED: dict[str, Any] = dict(facecolor="#eeeeee", edgecolor="#9a9a9a", hatch="////", linewidth=0)  # never as 0
BUILD_COLOURS = ("#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b", "#e377c2", "#17becf")
_ANNOTATE_MAX_CELLS = 64  # write the value in each cell only on small models
_LABEL_MAX_HEADS = 12  # name the copying/suppression heads in the kappa plot when this few


def require_matplotlib():
    """The matplotlib module, or a one-line CircuitsError saying how to install it."""
    try:
        return importlib.import_module("matplotlib")
    except ImportError:
        raise CircuitsError(
            "the circuits report draws with matplotlib, which is not installed: pip install matplotlib "
            "(pytest-circuits depends on it; an install with --no-deps leaves it out)"
        ) from None


def new_figure(width: float, height: float, layout: Literal["constrained"] | None = "constrained"):
    """A Figure bound to an Agg canvas (no pyplot, no display).

    ``layout=None`` leaves the margins to the caller: about half the drawing time of the
    constrained layout on many-axes figures.
    """
    require_matplotlib()
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), layout=layout)
    FigureCanvasAgg(fig)
    return fig


def png_bytes(fig, dpi: int = 110) -> bytes:
    """The figure rendered as PNG."""
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=dpi, facecolor="white")
    return buffer.getvalue()


def _cmap(name: str):
    import matplotlib

    return matplotlib.colormaps[name].with_extremes(bad="#e0e0e0")  # NaN: not measured


def eigenvalue_figure(record: dict, title: str):
    """Every head's normalised OV eigenvalues in the complex plane, coloured by layer."""
    matplotlib = require_matplotlib()
    eig = data.normalised_eigenvalues(record)
    n_layers = max(data.grid_shape(record)[0], 1 + max((data.layer_of(k) for k in eig), default=0))
    fig = new_figure(6.2, 5.2)
    ax = fig.add_subplot()
    theta = np.linspace(0, 2 * math.pi, 361)
    ax.plot(np.cos(theta), np.sin(theta), color="#555555", lw=0.8)
    ax.axhline(0, color="#bbbbbb", lw=0.6)
    ax.axvline(0, color="#bbbbbb", lw=0.6)
    if eig:
        lam = np.concatenate(list(eig.values()))
        layer = np.concatenate([np.full(v.size, data.layer_of(k)) for k, v in eig.items()])
        order = np.random.default_rng(0).permutation(lam.size)  # no layer painted over all the others
        lam, layer = lam[order], layer[order]
        norm = matplotlib.colors.Normalize(vmin=-0.5, vmax=n_layers - 0.5)
        # viridis without its palest yellow, which vanishes on white
        cmap = matplotlib.colors.ListedColormap(matplotlib.colormaps["viridis"](np.linspace(0, 0.85, max(n_layers, 2))))
        size = 7 if lam.size > 2000 else 16
        points = ax.scatter(lam.real, lam.imag, c=layer, cmap=cmap, norm=norm, s=size, alpha=0.65, linewidths=0)
        bar = fig.colorbar(points, ax=ax, shrink=0.85)
        bar.set_label("layer")
        if n_layers <= 12:
            bar.set_ticks(range(n_layers))
    else:
        ax.text(0, 0, "no eigenvalues in this record", ha="center", va="center", color="#777777")
    ax.set_xlim(-1.12, 1.12)
    ax.set_ylim(-1.12, 1.12)
    ax.set_aspect("equal")
    ax.set_xlabel("Re λ / max|λ|  (copying →)")
    ax.set_ylabel("Im λ / max|λ|")
    ax.set_title(title, fontsize=10)
    return fig


METRIC_SYMBOLS = {"kappa": "κ", "kappa_trace": "κ_trace", "kappa_z": "κ z", "kappa_trace_z": "κ_trace z"}


def moved_eigenvalue_figure(record: dict, baseline: dict, flagged: list[dict], title: str):
    """Small multiples: the baseline's eigenvalues (grey rings) and the build's (dots) for the
    heads the gate flagged; each title gives the flagged figure (``metric``, and the first of
    ``also``) before -> after."""
    eig, ref = data.normalised_eigenvalues(record), data.normalised_eigenvalues(baseline)
    flagged = [m for m in flagged if m.get("head") in eig or m.get("head") in ref]
    if not flagged:
        return None
    heads = [str(m["head"]) for m in flagged]
    cols = min(4, len(heads))
    rows = math.ceil(len(heads) / cols)
    width, height = max(2.6 * cols, 5.6), 2.8 * rows + 0.5  # wide enough for the title over one panel
    side = (width - 2.6 * cols) / 2 + 0.1
    fig = new_figure(width, height, layout=None)
    fig.subplots_adjust(
        left=side / width, right=1 - side / width, bottom=0.1 / height, top=1 - 0.9 / height, wspace=0.1, hspace=0.45
    )
    theta = np.linspace(0, 2 * math.pi, 181)
    for i, head in enumerate(heads):
        ax = fig.add_subplot(rows, cols, i + 1)
        ax.plot(np.cos(theta), np.sin(theta), color="#888888", lw=0.6)
        ax.axvline(0, color="#cccccc", lw=0.5)
        if head in ref:
            ax.scatter(
                ref[head].real,
                ref[head].imag,
                s=16,
                facecolors="none",
                edgecolors=REFERENCE,
                linewidths=0.8,
                label="baseline",
            )
        if head in eig:
            ax.scatter(eig[head].real, eig[head].imag, s=8, color="#3b4cc0", label="this build")
        ax.set_xlim(-1.1, 1.1)
        ax.set_ylim(-1.1, 1.1)
        ax.set_aspect("equal")
        ax.set_xticks([])
        ax.set_yticks([])
        named = [flagged[i], *flagged[i].get("also", [])][:2]
        said = [
            f"{METRIC_SYMBOLS.get(str(m.get('metric')), str(m.get('metric')))} "
            f"{data.fmt(m.get('before'), 2)} → {data.fmt(m.get('after'), 2)}"
            for m in named
        ]
        ax.set_title(f"{head}  " + "\n".join(said), fontsize=9)
        if i == 0:
            ax.legend(fontsize=7, loc="lower left", frameon=False)
    fig.suptitle(title, fontsize=10)
    return fig


def kappa_figure(record: dict, title: str, baseline: dict | None = None):
    """Kappa of every head against its rotation-null band (mean ± 2 sd); copying/suppression marked."""
    heads = data.heads_of(record)
    n = len(heads)
    x = np.arange(n)
    kappa = np.array([data.number(h.figure("kappa")) for h in heads])
    mean = np.array([data.number(h.figure("kappa_null_mean")) for h in heads])
    sd = np.array([data.number(h.figure("kappa_null_sd")) for h in heads])
    fig = new_figure(min(16.0, max(6.5, 0.055 * n + 4)), 3.8)
    ax = fig.add_subplot()
    band = np.isfinite(mean) & np.isfinite(sd)
    if band.any():  # one collection of rectangles: far cheaper than ax.bar on hundreds of heads
        from matplotlib.collections import PolyCollection

        lo, hi, xb = mean[band] - 2 * sd[band], mean[band] + 2 * sd[band], x[band]
        boxes = list(
            np.stack([np.c_[xb - 0.42, lo], np.c_[xb + 0.42, lo], np.c_[xb + 0.42, hi], np.c_[xb - 0.42, hi]], 1)
        )
        ax.add_collection(
            PolyCollection(boxes, facecolors="#d9d9d9", edgecolors="none", label="null band (mean ± 2 sd)")
        )
    if baseline is not None and data.grid_shape(baseline) == data.grid_shape(record):
        baseline_kappa = {h.head: data.number(h.figure("kappa")) for h in data.heads_of(baseline)}
        ax.scatter(
            x,
            [baseline_kappa.get(h.head, np.nan) for h in heads],
            s=22,
            facecolors="none",
            edgecolors=REFERENCE,
            linewidths=0.9,
            label="baseline κ",
            zorder=3,
        )
    copying = np.array([h.figure("copying") is True for h in heads], dtype=bool)
    suppression = np.array([h.figure("suppression") is True for h in heads], dtype=bool)
    plain = ~(copying | suppression)
    ax.scatter(x[plain], kappa[plain], s=10, color="#333333", label="head κ", zorder=4)
    if copying.any():
        ax.scatter(x[copying], kappa[copying], s=42, marker="^", color=COPYING, label="copying head", zorder=5)
    if suppression.any():
        ax.scatter(
            x[suppression], kappa[suppression], s=42, marker="v", color=SUPPRESSION, label="suppression head", zorder=5
        )
    flagged = np.flatnonzero(copying | suppression)
    if flagged.size <= _LABEL_MAX_HEADS:
        for i in flagged:
            ax.annotate(
                heads[i].head, (x[i], kappa[i]), xytext=(4, 0), textcoords="offset points", fontsize=7, va="center"
            )
    ax.axhline(0, color="#777777", lw=0.6)
    _layer_axis(ax, heads)
    ax.set_xlim(-0.8, n - 0.2)
    ax.set_ylabel("κ")
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0), frameon=False)
    return fig


def _layer_axis(ax, heads: list[DrawnHead]) -> None:
    """Separate the layers with dotted lines and label the x axis by layer."""
    layers = np.array([h.layer for h in heads])
    if layers.size == 0:
        return
    starts = np.flatnonzero(np.diff(layers)) + 1
    if starts.size:
        ax.vlines(starts - 0.5, 0, 1, transform=ax.get_xaxis_transform(), color="#bbbbbb", lw=0.5, ls=":")
    unique = np.unique(layers)
    step = max(1, math.ceil(unique.size / 30))
    centres = [np.flatnonzero(layers == l).mean() for l in unique[::step]]
    ax.set_xticks(centres, [f"L{l}" for l in unique[::step]], fontsize=7)
    ax.set_xlabel("head (grouped by layer)")


def heatmap_figure(panels: list[dict], title: str, outline: Collection[tuple[int, int]] = frozenset()):
    """Layer x head heatmaps side by side.

    Each panel: ``grid`` (layers x heads, NaN = not measured, None = not available),
    ``title``, ``kind`` ("diverging": centred on 0, "score": fixed [0, 1]), optional ``note``
    and ``floor`` (least half-range of a diverging colour scale).
    ``outline`` boxes the (layer, head) cells named by the gate (a panel's own ``outline`` wins).
    """
    shapes = [p["grid"].shape for p in panels if p["grid"] is not None]
    n_layers, n_heads = shapes[0] if shapes else (1, 1)
    width = len(panels) * max(2.8, 0.25 * n_heads + 1.3)
    height = max(2.8, 0.2 * n_layers + 1.6)
    gapped = any(p["grid"] is not None and np.isfinite(p["grid"]).any() and np.isnan(p["grid"]).any() for p in panels)
    height += 0.3 if gapped else 0.0  # room for the legend of the hatched cells
    fig = new_figure(width, height, layout=None)
    fig.subplots_adjust(
        left=0.55 / width,
        right=1 - 0.45 / width,
        bottom=(0.9 if gapped else 0.6) / height,
        top=1 - 0.75 / height,
        wspace=0.5,
    )
    axes = fig.subplots(1, len(panels), squeeze=False)[0]
    missing = []
    for ax, panel in zip(axes, panels):
        if _heatmap(fig, ax, panel, outline):
            missing.append(panel.get("missing") or "not measured")
    if missing:  # hatched cells: their legend, one entry per kind of gap
        from matplotlib.patches import Patch

        handles = [Patch(**UNMEASURED, label=label) for label in dict.fromkeys(missing)]
        fig.legend(handles=handles, loc="lower right", fontsize=7, frameon=False, ncols=len(handles))
    fig.suptitle(title, fontsize=10)
    return fig


def _heatmap(fig, ax, panel: dict, outline) -> bool:
    """Draw one panel; True when some (not all) of its cells were not measured (drawn hatched)."""
    grid = panel["grid"]
    ax.set_title(panel["title"], fontsize=9)
    if grid is None or not np.isfinite(grid).any():
        ax.text(
            0.5,
            0.5,
            panel.get("note") or "not measured",
            ha="center",
            va="center",
            transform=ax.transAxes,
            color="#777777",
            fontsize=9,
            wrap=True,
        )
        ax.set_xticks([])
        ax.set_yticks([])
        return False
    if panel["kind"] == "score":
        cmap, vmin, vmax = _cmap("viridis"), 0.0, 1.0
    else:
        # the floor keeps changes far below it pale instead of stretched to full colour
        top = max(float(np.nanmax(np.abs(grid))), panel.get("floor") or 1e-9)
        cmap, vmin, vmax = _cmap("RdBu_r"), -top, top
    image = ax.imshow(
        np.ma.masked_invalid(grid), cmap=cmap, vmin=vmin, vmax=vmax, aspect="auto", interpolation="nearest"
    )
    bar = fig.colorbar(image, ax=ax, fraction=0.08, pad=0.04, format="%.2g")
    bar.ax.tick_params(labelsize=7)
    n_layers, n_heads = grid.shape
    ax.set_xlabel("head")
    ax.set_ylabel("layer")
    ax.set_xticks(range(n_heads))
    ax.tick_params(labelsize=7)
    ystep = max(1, math.ceil(n_layers / 16))
    ax.set_yticks(range(0, n_layers, ystep))
    if grid.size <= _ANNOTATE_MAX_CELLS:
        for (layer, head), value in np.ndenumerate(grid):
            if np.isfinite(value):
                dark = abs(value - (vmin + vmax) / 2) > 0.3 * (vmax - vmin)
                ax.text(
                    head,
                    layer,
                    f"{value:.2f}".replace("-0.00", "0.00"),
                    ha="center",
                    va="center",
                    fontsize=7,
                    color="white" if dark else "black",
                )
    gaps = np.argwhere(~np.isfinite(grid))
    if gaps.size:
        from matplotlib.collections import PatchCollection
        from matplotlib.patches import Rectangle

        cells = [Rectangle((head - 0.5, layer - 0.5), 1, 1) for layer, head in gaps]
        ax.add_collection(PatchCollection(cells, match_original=False, **UNMEASURED))
    for layer, head in panel.get("outline", outline):
        if layer < n_layers and head < n_heads:
            ax.add_patch(_box(layer, head))
    return bool(gaps.size)


def _box(layer: int, head: int):
    from matplotlib.patches import Rectangle

    return Rectangle((head - 0.5, layer - 0.5), 1, 1, fill=False, edgecolor="black", lw=1.6)


def position_loss_figure(curves: list[tuple[str, dict]], title: str):
    """``position_loss`` (mean CE_t, t = 1 .. 2L-1) of each ``(label, record)`` on one axis, with
    the uniform loss ln V (dashed) and the start of the second copy (t = L, dotted); labels
    ending in " baseline" are stored baseline curves, drawn grey."""
    fig = new_figure(9.0, 3.8)
    ax = fig.add_subplot()
    lengths = set()
    for i, (label, record) in enumerate(curves):
        loss = np.array([data.number(x) for x in drawn_record(record).figure("position_loss") or []])
        t = np.arange(1, loss.size + 1)
        lengths.add(int(drawn_record(record).info("probe", "L") or (loss.size + 1) // 2))
        if label.endswith(" baseline"):  # a baseline's stored curve: grey, under the builds
            ax.plot(t, loss, ":", color=REFERENCE, lw=1.6, label=label, zorder=1)
        else:
            style = "-" if i < len(BUILD_COLOURS) else "--"
            ax.plot(t, loss, style, color=BUILD_COLOURS[i % len(BUILD_COLOURS)], lw=1.3, label=label, zorder=2)
    # one line per vocabulary: a stored baseline's ln V (6 significant digits) and a live one's are one entry
    uniform = {
        f"{u:.2f}": u
        for u in (data.number(drawn_record(r).figure("uniform_loss")) for _, r in curves)
        if math.isfinite(u)
    }
    for shown, u in sorted(uniform.items(), key=lambda item: item[1]):
        ax.axhline(u, color="#555555", lw=0.9, ls="--", label=f"uniform ln V = {shown}")
    for L in sorted(lengths):
        ax.axvline(L, color="#888888", lw=0.8, ls=":")
        ax.annotate(
            f"second copy starts (t = L = {L})",
            (L, 0.0),
            xycoords=("data", "axes fraction"),
            xytext=(-3, 4),
            ha="right",
            textcoords="offset points",
            fontsize=7,
            color="#555555",
        )
    ax.set_ylim(bottom=0)
    ax.set_xlabel("position t in the probe (first copy: t < L; second copy: t ≥ L)")
    ax.set_ylabel("mean next-token loss (nats)")
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8, loc="center left", bbox_to_anchor=(1.0, 0.5), frameon=False)
    return fig


def attention_figure(maps: list[tuple[str, dict, dict]], title: str):
    """One panel per ``(label, attention, record)``: ``attention["pattern"]`` A[dst, src] of one head
    on one probe sequence, on [0, 1], with the copy boundary marked; its prefix-matching in the title."""
    cols = min(4, len(maps))
    rows = math.ceil(len(maps) / cols)
    width, height = 3.3 * cols + 0.9, 3.3 * rows + 0.6
    fig = new_figure(width, height)
    axes = fig.subplots(rows, cols, squeeze=False).ravel()
    image = None
    for ax, (label, attention, record) in zip(axes, maps):
        pattern = np.asarray(attention["pattern"], dtype=float)
        image = ax.imshow(pattern, cmap="magma_r", vmin=0.0, vmax=1.0, interpolation="nearest")
        boundary = int(attention.get("offset", 0)) + int(attention.get("L", pattern.shape[0] // 2)) - 0.5
        ax.axhline(boundary, color="#2b8cbe", lw=0.6, ls=":")
        ax.axvline(boundary, color="#2b8cbe", lw=0.6, ls=":")
        score = {h.head: h.figure("prefix_matching") for h in data.heads_of(record)}.get(attention["head"])
        ax.set_title(f"{label}: {attention['head']}, prefix-matching {data.fmt(score, 2)}", fontsize=9)
        ax.set_xlabel("source position", fontsize=8)
        ax.set_ylabel("destination position", fontsize=8)
        ax.tick_params(labelsize=7)
    for ax in axes[len(maps) :]:
        ax.set_axis_off()
    if image is not None:
        bar = fig.colorbar(image, ax=list(axes[: len(maps)]), shrink=0.8)
        bar.set_label("attention weight", fontsize=8)
    fig.suptitle(title, fontsize=10)
    return fig


def audit_drops_figure(panels: list[tuple[str, list[tuple[str, list[float]]]]], title: str):
    """Rung 3's drops ``lp(all) - lp(all without chunk i)`` (nats) as cases (rows) x chunks (columns), one
    panel per ``(label, [(case id, drops)])`` (the baseline beside the build) on one diverging scale, so
    the panels compare; rows are matched by case id, and a chunk a case does not have is left blank."""
    ids = list(dict.fromkeys(case for _, cases in panels for case, _ in cases))
    chunks = max([len(drops) for _, cases in panels for _, drops in cases] + [1])
    grids = []
    for _, cases in panels:
        grid = np.full((max(len(ids), 1), chunks), np.nan)
        for case, drops in cases:
            grid[ids.index(case), : len(drops)] = drops
        grids.append(grid)
    finite = [np.abs(g[np.isfinite(g)]) for g in grids]
    top = max([float(f.max()) for f in finite if f.size] + [1e-9])
    width = len(panels) * max(2.6, 0.45 * chunks + 1.2) + 2.4
    height = max(2.6, 0.26 * len(ids) + 1.5)
    fig = new_figure(width, height)
    axes = fig.subplots(1, len(panels), squeeze=False)[0]
    image = None
    for i, (ax, (label, _), grid) in enumerate(zip(axes, panels, grids)):
        image = ax.imshow(
            np.ma.masked_invalid(grid),
            cmap=_cmap("RdBu_r"),
            vmin=-top,
            vmax=top,
            aspect="auto",
            interpolation="nearest",
        )
        ax.set_title(label, fontsize=9)
        ax.set_xlabel("chunk removed")
        ax.set_xticks(range(chunks))
        step = max(1, math.ceil(len(ids) / 40))
        ax.set_yticks(range(0, len(ids), step), [ids[r] for r in range(0, len(ids), step)] if i == 0 else [])
        ax.tick_params(labelsize=7)
        if grid.size <= _ANNOTATE_MAX_CELLS:
            for (row, column), value in np.ndenumerate(grid):
                if np.isfinite(value):
                    dark = abs(value) > 0.6 * top
                    ax.text(
                        column,
                        row,
                        f"{value:.1f}",
                        ha="center",
                        va="center",
                        fontsize=7,
                        color="white" if dark else "black",
                    )
    bar = fig.colorbar(image, ax=list(axes), fraction=0.05, pad=0.03, format="%.2g")
    bar.ax.tick_params(labelsize=7)
    bar.set_label("drop (nats)", fontsize=8)
    fig.suptitle(title, fontsize=10)
    return fig
