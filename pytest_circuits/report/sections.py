"""One report section per build: its record, reference, verdicts and figures (as PNG bytes)."""

from __future__ import annotations

from dataclasses import dataclass, field

from . import data, figures

EIGEN_CAPTION = (
    "Eigenvalues λ of every head's reduced OV matrix M = W_O W_U W_E W_V, one dot each, coloured "
    "by layer. Each head's eigenvalues are divided by that head's largest |λ|, so every head fits "
    "the unit circle and only the directions compare across heads (not the gains). Copying heads "
    "put their eigenvalues in the right half-plane (Re λ > 0), suppression heads in the left."
)
KAPPA_CAPTION = (
    "κ = mean of Re λ / |λ| over the head's eigenvalues, one dot per head, heads grouped by layer. "
    "Grey bars: the head's rotation null band (null mean ± 2 sd, Haar-random rotations that keep "
    "its gain spectrum). Green ▲ copying heads and red ▼ suppression heads are significant after "
    "FDR control across all heads."
)
HEATMAP_CAPTION = (
    "Per-head figures, layer (rows) by head (columns). κ: OV copying score; prefix-matching: "
    "attention from t to t−L+1 on repeated random tokens (induction); previous-token: attention "
    "from t to t−1; knockout Δ: copy loss with the head zeroed minus intact copy loss (nats). "
    "Grey cells were not measured."
)
DIFF_CAPTION = (
    "The same maps as differences: this build minus the reference baseline (red: higher here, "
    "blue: lower; each scale spans at least ±0.05, so smaller drift stays pale). Boxed cells are "
    "heads the gate named as moved."
)
MOVED_CAPTION = (
    "The heads that moved most: reference eigenvalues (grey rings) and this build's (dots), "
    "each set normalised by its own largest |λ|, with κ before → after."
)
MAX_MOVED_PANELS = 8
DIFF_FLOOR = 0.05  # difference maps span at least ±0.05 (kappa, scores, nats): tiny drift stays pale


@dataclass
class Figure:
    """One drawn figure: where it is written and what it shows."""

    title: str
    caption: str
    file: str
    png: bytes


@dataclass
class Section:
    """Everything the HTML and markdown pages say about one build."""

    label: str
    slug: str
    record: dict
    reference: dict | None
    results: list[dict]
    figures: list[Figure] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    changes: list[dict] = field(default_factory=list)

    @property
    def failed(self) -> list[dict]:
        return [r for r in self.results if r["failed"]]


def build_section(record: dict, reference: dict | None, results: list[dict], slug: str) -> Section:
    """Draw one build's figures and gather its verdicts; what moved comes before the build's own maps."""
    section = Section(data.recipe_of(record), slug, record, reference, results)
    comparison = _comparison_figures(section) if reference is not None else []
    section.figures = comparison + _own_figures(section)
    return section


def _own_figures(section: Section) -> list[Figure]:
    record, label, slug = section.record, section.label, section.slug
    drawn = []
    if record.get("eigenvalues"):
        drawn.append(
            _draw(
                f"{label}: OV eigenvalues of every head (normalised per head)",
                EIGEN_CAPTION,
                f"{slug}-eigenvalues.png",
                figures.eigenvalue_figure,
                record,
                f"{label}: OV eigenvalues, normalised per head by max |λ|",
            )
        )
    else:
        section.notes.append("This record carries no eigenvalues: the complex-plane figure is left out.")
    if data.has_metric(record, "kappa"):
        drawn.append(
            _draw(
                f"{label}: κ per head against its null band",
                KAPPA_CAPTION,
                f"{slug}-kappa.png",
                figures.kappa_figure,
                record,
                f"{label}: OV copying score κ per head",
                section.reference,
            )
        )
    drawn.append(
        _draw(
            f"{label}: per-head maps",
            HEATMAP_CAPTION,
            f"{slug}-heads.png",
            figures.heatmap_figure,
            _panels(record),
            f"{label}: per-head figures",
        )
    )
    if not data.has_metric(record, "knockout_delta"):
        section.notes.append("This scan ran no head knockouts: the knockout map is empty.")
    return drawn


def _comparison_figures(section: Section) -> list[Figure]:
    """Difference maps against the reference, then the eigenvalues of the heads that moved most."""
    record, reference, label, slug = section.record, section.reference, section.label, section.slug
    assert reference is not None  # callers draw comparisons only against a reference
    against = data.recipe_of(reference)
    if data.grid_shape(record) != data.grid_shape(reference):
        section.notes.append(
            f"The reference ({against}) has a different head grid {data.grid_shape(reference)} from this "
            f"build {data.grid_shape(record)}: no per-head differences are drawn."
        )
        return []
    section.changes = data.largest_changes(record, reference)
    named = {m.get("head") for r in section.results for m in r["moved"]}
    outline = {cell for cell in map(data.cell_of, named) if cell is not None}
    panels = [
        {
            "grid": data.difference_grid(record, reference, column),
            "title": f"{title}, change",
            "kind": "diverging",
            "note": "not measured in both",
            "floor": DIFF_FLOOR,
        }
        for column, title, _ in data.HEATMAP_METRICS
    ]
    drawn = [
        _draw(
            f"{label}: differences against the reference ({against})",
            DIFF_CAPTION,
            f"{slug}-differences.png",
            figures.heatmap_figure,
            panels,
            f"{label} minus reference ({against})",
            outline,
        )
    ]
    heads = _most_moved_heads(section)
    if heads and record.get("eigenvalues") and reference.get("eigenvalues"):
        fig = figures.moved_eigenvalue_figure(
            record, reference, heads, f"{label}: heads that moved most, against {against}"
        )
        if fig is not None:
            drawn.append(
                Figure(
                    f"{label}: eigenvalues of the heads that moved most",
                    MOVED_CAPTION,
                    f"{slug}-moved-heads.png",
                    figures.png_bytes(fig),
                )
            )
    return drawn


def _most_moved_heads(section: Section) -> list[str]:
    """Heads the failed gates named first, then those the gate moved, then the largest κ changes."""
    ranked = data.top_moved(section.failed, k=100) + data.top_moved(section.results, k=100)
    ranked += [c for c in section.changes if c["metric"] == "kappa"]
    heads: list[str] = []
    for entry in ranked:
        head = entry.get("head")
        if data.cell_of(head) is not None and head not in heads:
            heads.append(str(head))
    return heads[:MAX_MOVED_PANELS]


def _panels(record: dict) -> list[dict]:
    return [
        {
            "grid": data.metric_grid(record, column),
            "title": title,
            "kind": kind,
            "note": "no knockouts in this scan" if column == "knockout_delta" else "not measured",
        }
        for column, title, kind in data.HEATMAP_METRICS
    ]


def _draw(title: str, caption: str, file: str, draw, *args) -> Figure:
    return Figure(title, caption, file, figures.png_bytes(draw(*args)))
