"""One report section per build: its record, baseline, verdicts and figures (as PNG bytes)."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..record.drawn import drawn_record
from . import data, plots

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
    "FDR control across all heads and differ from the null mean by at least the record's minimum "
    "effect (rung1.min_effect; 0 in records made before it)."
)
HEATMAP_CAPTION = (
    "Per-head figures, layer (rows) by head (columns). κ: OV copying score; prefix-matching: "
    "attention from t to t−L+1 on repeated random tokens (induction); previous-token: attention "
    "from t to t−1; knockout Δ: copy loss with the head zeroed minus intact copy loss (nats). "
    "Hatched grey cells were not measured (a screened knockout scan measures only its top heads "
    "exactly); they are never drawn as zero."
)
DIFF_CAPTION = (
    "The same maps as differences: this build minus the baseline it is drawn against (red: higher here, "
    "blue: lower; each scale spans at least ±0.05, so smaller drift stays pale). Boxed cells are "
    "heads the gate named as moved."
)
MOVED_CAPTION = (
    "The heads the gate flagged on κ: baseline eigenvalues (grey rings) and this build's (dots), "
    "each set normalised by its own largest |λ|; each title gives the figure the gate flagged "
    "(κ, κ_trace or their z) before → after."
)
LOSS_CAPTION = (
    "Mean next-token loss CE_t at each position t of the probe's two copies (t = 1 .. 2L−1, "
    "averaged over its sequences), one line per build. The first copy is random tokens: its loss is "
    "the model's loss on tokens it cannot predict, flat, and above the uniform ln V (dashed) when the "
    "model is confident in other tokens (a trained LM: SmolLM2-135M sits near 14 against ln V = 10.8). "
    "From t = L the tokens repeat, and a model that copies drops its loss there: the signature of induction."
)
ATTENTION_CAPTION = (
    "The attention pattern A[dst, src] of the reference's strongest induction head (largest "
    "prefix-matching score) on the probe's first sequence, one panel per build. An induction head "
    "draws an offset diagonal in the second copy at src = dst − (L−1): each token attends to the "
    "token after its earlier occurrence."
)
AUDIT_CAPTION = (
    "Rung 3 on the audit slice: the drop of each chunk, lp(all) − lp(all without that chunk) in nats, for "
    "each case (rows) and chunk (columns), the baseline beside this build on one colour scale. Red: removing "
    "the chunk makes the reference answer less likely, the answer rests on it; pale: it does not. A build "
    "that stops answering from its documents pales where the baseline is red. Blank: the case has no such chunk."
)
KAPPA_METRICS = ("kappa", "kappa_trace", "kappa_z", "kappa_trace_z")  # gate rows that earn an eigenvalue close-up
FOLD_MAX_HEADS = 12  # longer lists of copying/suppression heads fold away
MAX_MOVED_PANELS = 8
DIFF_FLOOR = 0.05  # difference maps span at least ±0.05 (kappa, scores, nats): tiny drift stays pale


@dataclass
class Figure:
    """One drawn figure: where it is written and what it shows."""

    title: str
    caption: str
    file: str
    png: bytes
    folded: str = ""  # the one-line note a folded figure hides behind ("" = shown)


@dataclass
class Section:
    """Everything the HTML and markdown pages say about one build."""

    label: str
    slug: str
    record: dict
    baseline: dict | None
    results: list[dict]
    figures: list[Figure] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    changes: list[dict] = field(default_factory=list)
    identical: bool = False  # every per-head figure equals the baseline's (all-zero differences)

    @property
    def failed(self) -> list[dict]:
        return [r for r in self.results if r["failed"]]


def failing_first(sections: list[Section]) -> list[Section]:
    """The sections with a broken invariant first, each group in its given order."""
    return [s for s in sections if s.failed] + [s for s in sections if not s.failed]


def build_section(record: dict, baseline: dict | None, results: list[dict], slug: str) -> Section:
    """Draw one build's figures and gather its verdicts; what moved comes before the build's own maps."""
    section = Section(data.build_name_of(record), slug, record, baseline, results)
    comparison = _comparison_figures(section) if baseline is not None else []
    section.figures = comparison + _audit_figures(section) + _own_figures(section)
    return section


def _audit_figures(section: Section) -> list[Figure]:
    """The per-case drops of rung 3 (cases x chunks), the baseline beside the build, when the record audited a slice."""
    drops = drawn_record(section.record).audit_drops
    if not drops:
        return []
    panels = [(section.label, drops)]
    if section.baseline is not None and drawn_record(section.baseline).audit_drops:
        against = data.build_name_of(section.baseline)
        panels.insert(0, (f"baseline ({against})", drawn_record(section.baseline).audit_drops))
    name = drawn_record(section.record).info("audit", "slice_name") or "the audit slice"
    return [
        _draw(
            f"{section.label}: chunk drops on {name}",
            AUDIT_CAPTION,
            f"{section.slug}-audit.png",
            plots.audit_drops_figure,
            panels,
            f"{section.label}: drop per case and chunk removed ({name})",
        )
    ]


def _own_figures(section: Section) -> list[Figure]:
    record, label, slug = section.record, section.label, section.slug
    drawn = []
    if drawn_record(record).figure("eigenvalues"):
        drawn.append(
            _draw(
                f"{label}: OV eigenvalues of every head (normalised per head)",
                EIGEN_CAPTION,
                f"{slug}-eigenvalues.png",
                plots.eigenvalue_figure,
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
                plots.kappa_figure,
                record,
                f"{label}: OV copying score κ per head",
                section.baseline,
            )
        )
    drawn.append(
        _draw(
            f"{label}: per-head maps",
            HEATMAP_CAPTION,
            f"{slug}-heads.png",
            plots.heatmap_figure,
            _panels(record),
            f"{label}: per-head figures",
        )
    )
    if not data.has_metric(record, "knockout_delta"):
        section.notes.append("This scan ran no head knockouts: the knockout map is empty.")
    return drawn


def _comparison_figures(section: Section) -> list[Figure]:
    """Difference maps against the baseline, then the eigenvalues of the heads that moved most."""
    record, baseline, label, slug = section.record, section.baseline, section.label, section.slug
    assert baseline is not None  # callers draw comparisons only against a baseline
    against = data.build_name_of(baseline)
    if data.grid_shape(record) != data.grid_shape(baseline):
        section.notes.append(
            f"The baseline ({against}) has a different head grid {data.grid_shape(baseline)} from this "
            f"build {data.grid_shape(record)}: no per-head differences are drawn."
        )
        return []
    section.changes = data.largest_changes(record, baseline)
    grids = {column: data.difference_grid(record, baseline, column) for column, _, _ in data.HEATMAP_METRICS}
    section.identical = not any(data.changed_cells(record, baseline, c).any() for c, _, _ in data.HEATMAP_METRICS)
    panels = [
        {
            "grid": grids[column],
            "outline": _outline(section, column),
            "title": f"{title}, change",
            "kind": "diverging",
            "note": "not measured in both",
            "missing": "not measured in both builds",
            "floor": DIFF_FLOOR,
        }
        for column, title, _ in data.HEATMAP_METRICS
    ]
    differences = _draw(
        f"{label}: differences against the baseline ({against})",
        DIFF_CAPTION,
        f"{slug}-differences.png",
        plots.heatmap_figure,
        panels,
        f"{label} minus baseline ({against})",
    )
    if section.identical:
        differences.folded = (
            f"Every per-head figure of {label} equals the baseline's ({against}) to the baselines' "
            "precision: the difference maps are all zero."
        )
    drawn = [differences]
    flagged = kappa_flagged(section)
    if flagged and drawn_record(record).figure("eigenvalues") and drawn_record(baseline).figure("eigenvalues"):
        fig = plots.moved_eigenvalue_figure(
            record, baseline, flagged, f"{label}: heads the gate flagged on κ, against {against}"
        )
        if fig is not None:
            drawn.append(
                Figure(
                    f"{label}: eigenvalues of the heads the gate flagged on κ",
                    MOVED_CAPTION,
                    f"{slug}-moved-heads.png",
                    plots.png_bytes(fig),
                )
            )
    return drawn


def _outline(section: Section, column: str) -> set[tuple[int, int]]:
    """The cells of one difference map to box: heads the gate named on that map's figure
    (the κ map: on any of `KAPPA_METRICS`) that did move."""
    metrics = KAPPA_METRICS if column == "kappa" else (column,)
    named = {m.get("head") for r in section.results for m in r["moved"] if m.get("metric") in metrics and data.moved(m)}
    return {cell for cell in map(data.cell_of, named) if cell is not None}


def kappa_flagged(section: Section) -> list[dict]:
    """One gate row per head flagged on a κ figure (`KAPPA_METRICS`), the one that moved furthest,
    with the head's other flagged κ rows under ``"also"``; heads of failed verdicts first, at most
    `MAX_MOVED_PANELS`. Rows that name a head which did not move earn no close-up."""
    ranked = data.top_moved(section.failed, k=1000) + data.top_moved(section.results, k=1000)
    chosen: dict[str, dict] = {}
    for entry in ranked:
        head = entry.get("head")
        if entry.get("metric") not in KAPPA_METRICS or data.cell_of(head) is None or not data.moved(entry):
            continue
        if head not in chosen:
            chosen[str(head)] = {**entry, "also": []}
        elif entry.get("metric") not in {chosen[head]["metric"], *(m["metric"] for m in chosen[head]["also"])}:
            chosen[str(head)]["also"].append(entry)
    return list(chosen.values())[:MAX_MOVED_PANELS]


def loss_curves(sections: list[Section]) -> list[tuple[str, dict]]:
    """``(label, record)`` of every build with a ``position_loss``, then each drawn-against baseline's
    stored curve once (labelled ``"<recipe> baseline"``)."""
    curves = [(s.label, s.record) for s in sections if drawn_record(s.record).figure("position_loss")]
    shown = {s.label for s in sections}
    for s in sections:
        ref = s.baseline
        name = f"{data.build_name_of(ref)} baseline" if ref else ""
        if ref and drawn_record(ref).figure("position_loss") and name not in shown:
            shown.add(name)
            curves.append((name, ref))
    return curves


def overview_figures(sections: list[Section], attention: dict[str, dict | None]) -> tuple[list[Figure], list[str]]:
    """The two pictures at the top: loss per probe position (all builds on one axis) and one
    induction head's attention per build; plus the notes on what could not be drawn."""
    notes: list[str] = []
    drawn: list[Figure] = []
    with_curve = loss_curves(sections)
    without = [s.label for s in sections if not drawn_record(s.record).figure("position_loss")]
    if without:
        notes.append(
            f"No per-position loss in the record of {', '.join(without)} (recorded before position_loss "
            "was stored): its loss curve is not drawn."
        )
    if with_curve:
        drawn.append(
            _draw(
                "Loss at each position of the probe's two copies",
                LOSS_CAPTION,
                "position-loss.png",
                plots.position_loss_figure,
                with_curve,
                "Next-token loss per probe position",
            )
        )
    maps = {s.label: attention.get(s.label) for s in sections}
    drawable = [(label, m) for label, m in maps.items() if m and m.get("pattern")]
    notes += [f"{label}: {m['note']}" for label, m in maps.items() if m and m.get("note")]
    if drawable:
        records, head = {s.label: s.record for s in sections}, next(m["head"] for _, m in drawable)
        drawn.append(
            _draw(
                f"Attention of {head} on probe sequence 0",
                ATTENTION_CAPTION,
                "attention.png",
                plots.attention_figure,
                [(label, m, records[label]) for label, m in drawable],
                f"Attention pattern of {head} (strongest induction head), probe sequence 0",
            )
        )
    elif not any(m for m in maps.values()):
        notes.append(
            "No attention map: it is computed from the loaded build when the pytest plugin writes the "
            "report (--circuits-report); a report drawn from baseline files has no model to run."
        )
    return drawn, notes


def _panels(record: dict) -> list[dict]:
    return [
        {
            "grid": data.metric_grid(record, column),
            "title": title,
            "kind": kind,
            "note": "no knockouts in this scan" if column == "knockout_delta" else "not measured",
            "missing": "not measured (screened out: no exact knockout)"
            if column == "knockout_delta"
            else "not measured",
        }
        for column, title, kind in data.HEATMAP_METRICS
    ]


def _draw(title: str, caption: str, file: str, draw, *args) -> Figure:
    return Figure(title, caption, file, plots.png_bytes(draw(*args)))
