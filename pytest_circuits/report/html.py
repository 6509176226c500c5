"""The self-contained HTML page: inline CSS, figures as base64 data: URIs, nothing fetched."""

from __future__ import annotations

import base64
from collections.abc import Sequence
from html import escape

from ..gate.invariants import guarded
from ..record.drawn import drawn_record
from . import data
from .sections import FOLD_MAX_HEADS, Figure, Section

STYLE = """
body { font-family: system-ui, -apple-system, "Segoe UI", sans-serif; margin: 2em auto; max-width: 1250px;
       padding: 0 1em; color: #222; line-height: 1.4; }
h1 { margin-bottom: 0.2em; } h2 { border-bottom: 1px solid #ddd; padding-bottom: 0.2em; margin-top: 2em; }
.meta { color: #555; margin-top: 0; }
.banner { padding: 0.8em 1.2em; border-radius: 6px; margin: 1em 0; }
.banner.fail { background: #fdecea; border: 1px solid #d73027; }
.banner.pass { background: #e9f6ec; border: 1px solid #1a9850; }
.banner.none { background: #f3f3f3; border: 1px solid #bbb; }
.banner h2 { margin: 0 0 0.3em 0; border: none; font-size: 1.2em; }
table { border-collapse: collapse; margin: 0.6em 0; font-size: 0.92em; }
th, td { border: 1px solid #ddd; padding: 0.25em 0.6em; text-align: left; }
th { background: #f6f6f6; } td.num { text-align: right; font-variant-numeric: tabular-nums; }
.FAIL, .ERROR { color: #b2182b; font-weight: bold; } .pass { color: #1a7837; }
pre { background: #f8f8f8; padding: 0.6em; font-size: 0.85em; white-space: pre-wrap; overflow-wrap: anywhere; }
td:not(:last-child), th { white-space: nowrap; } details > summary { cursor: pointer; color: #333; }
details.fold { margin: 1em 0; padding: 0.4em 0.8em; background: #f6f6f6; border-radius: 4px; }
figure { margin: 1.2em 0; } figure img { max-width: 100%; border: 1px solid #eee; }
figcaption { color: #444; font-size: 0.9em; max-width: 60em; }
.note { color: #8a5a00; }
"""


def page(
    sections: list[Section],
    extra_results: list[dict],
    overview: Sequence[Figure] = (),
    overview_notes: Sequence[str] = (),
) -> str:
    """The whole report; ``extra_results`` are verdicts for builds without a record; ``overview``:
    the figures of every build at once (loss per position, attention), after the verdict banner."""
    parts = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        f"<title>{escape(_title(sections))}</title>",
        f"<style>{STYLE}</style></head><body>",
        f"<h1>{escape(_title(sections))}</h1>",
        f'<p class="meta">{escape(_model_line(sections))}</p>',
        _banner(sections, extra_results),
    ]
    if len(sections) > 1:
        links = " · ".join(f'<a href="#{s.slug}">{escape(s.label)}</a>' for s in sections)
        order = " (broken first)" if any(s.failed for s in sections) else ""
        parts.append(f"<p>Builds{order}: {links}</p>")
    if overview or overview_notes:
        parts.append('<h2 id="overview">Copying at a glance</h2>')
        parts += [f'<p class="note">{escape(n)}</p>' for n in overview_notes]
        parts += [_figure(f) for f in overview]
    unrecorded = ["<h2>Builds without a scan record</h2>", _verdicts(extra_results)] if extra_results else []
    broke = any(r["failed"] for r in extra_results)  # a build that could not even be scanned broke first
    parts += (unrecorded if broke else []) + [_section(s) for s in sections] + ([] if broke else unrecorded)
    parts.append("</body></html>")
    return "\n".join(parts)


def _title(sections: list[Section]) -> str:
    name = next((drawn_record(s.record).info("model", "name") for s in sections), None)
    return f"Circuits report: {name}" if name else "Circuits report"


def _model_line(sections: list[Section]) -> str:
    """One line about the model: model type and layout, geometry, weight fingerprint."""
    from ..record.read import model_kind

    if not sections:
        return ""
    view = drawn_record(sections[0].record)
    bits = [model_kind(view.info("model") or {})]
    if view.info("model", "geometry"):
        n_layers, n_heads, n_kv, d_model, d_head, vocab = (
            view.info("model", "geometry", k)
            for k in ("n_layers", "n_heads", "n_kv_heads", "d_model", "d_head", "vocab")
        )
        bits.append(
            f"{n_layers} layers × {n_heads} heads ({n_kv} kv), d_model {d_model}, d_head {d_head}, vocab {vocab}"
        )
    if fingerprint := view.info("model", "fingerprint"):
        bits.append(f"weights {str(fingerprint)[:12]}")
    return " · ".join(b for b in bits if b)


def _banner(sections: list[Section], extra_results: list[dict]) -> str:
    """The verdict at the top: every broken invariant named, or that all held."""
    results = [r for s in sections for r in s.results] + extra_results
    failed = [r for r in results if r["failed"]]
    if failed:
        items = "".join(
            f"<li><b>{escape(r['build'])}</b>: <b>{escape(r['invariant'])}</b> "
            + (
                f"could not be gated: {escape(_first(r['message']))}"
                if r["status"] == "error"
                else f"broken{' against ' + escape(r['against']) if r['against'] else ''}"
            )
            + "</li>"
            for r in failed
        )
        said = "broken or not gated" if any(r["status"] == "error" for r in failed) else "broken"
        return (
            f'<div class="banner fail"><h2>{len(failed)} of {len(results)} invariants {said}</h2><ul>{items}</ul></div>'
        )
    if results:
        held = sum(r["passed"] for r in results)
        skipped = data.said_skips(results, label=lambda r: f"{r['build']} {r['invariant']}")
        said_guarded = guarded(results)
        note = (f"<p><b>{escape(data.sentence(said_guarded))}.</b></p>" if said_guarded else "") + (
            f"<p>Skipped: {escape(skipped)}</p>" if skipped else ""
        )
        said = (
            f"All {held} invariants held" if not skipped else f"{held} of {len(results)} invariants held, none broken"
        )
        return f'<div class="banner pass"><h2>{said}</h2>{note}</div>'
    return (
        '<div class="banner none"><h2>No gate verdicts</h2>This report shows scan results only'
        "; differences against a baseline are descriptive, not verdicts.</div>"
    )


def _first(message: str, width: int = 160) -> str:
    line = next((l.strip() for l in message.splitlines() if l.strip()), "")
    return line if len(line) <= width else line[: width - 1] + "…"


def _section(s: Section) -> str:
    parts = [f'<h2 id="{escape(s.slug)}">Build {escape(s.label)}</h2>', _identity(s), _model_figures(s)]
    if s.results:
        parts.append(_verdicts(s.results))
    moved = data.top_moved(s.results, k=12)
    if moved:
        parts += ["<h3>Heads the gate found moved</h3>", _moved_table(moved)]
    if s.changes:
        parts += [
            f"<h3>Largest per-head changes against {escape(data.build_name_of(s.baseline or {}))}</h3>",
            "<p>Ranked by the change divided by the metric's spread across heads in the baseline.</p>",
            _changes_table(s.changes),
        ]
    parts += [f'<p class="note">{escape(n)}</p>' for n in s.notes]
    parts += [_figure(f) for f in s.figures]
    return "\n".join(parts)


def _identity(s: Section) -> str:
    view = drawn_record(s.record)
    rows = [(k, view.info("build", k)) for k in ("recipe", "dtype", "backend", "backend_version", "device")]
    rows += [
        (k, view.info("build", k))
        for k in ("source", "format", "sha256", "tensor_types", "quantization", "forward")
        if view.info("build", k)
    ]  # external builds
    if view.info("probe"):
        seed, n, length = (view.info("probe", k) for k in ("seed", "n", "L"))
        rows.append(("probe", f"seed {seed}, n {n}, L {length}"))
    if s.baseline is not None:
        rows.append(("baseline", data.build_name_of(s.baseline)))
    copying, suppression = data.flagged_heads(s.record, "copying"), data.flagged_heads(s.record, "suppression")
    body = "".join(f"<tr><th>{escape(k)}</th><td>{escape(str(v if v is not None else '—'))}</td></tr>" for k, v in rows)
    for name, heads in (("copying heads", copying), ("suppression heads", suppression)):
        body += f"<tr><th>{name}</th><td>{_head_list(heads)}</td></tr>"
    return f"<table>{body}</table>"


def _head_list(heads: list[str]) -> str:
    """The heads, comma-separated; a long list folds away behind its count and first few."""
    if len(heads) <= FOLD_MAX_HEADS:
        return escape(", ".join(heads) or "none")
    first = ", ".join(heads[:6])
    return f"<details><summary>{len(heads)} heads ({escape(first)}, …)</summary>{escape(', '.join(heads))}</details>"


def _model_figures(s: Section) -> str:
    mine = data.model_figures(s.record)
    ref = data.model_figures(s.baseline) if s.baseline is not None else None
    head = "<tr><th>model figure (nats)</th><th>this build</th>"
    head += "<th>baseline</th><th>change</th><th>95% paired interval</th></tr>" if ref else "<th>95% interval</th></tr>"
    rows = []
    for name, value in mine.items():
        cells = f"<td>{name.replace('_', ' ')}</td><td class=num>{data.fmt(value)}</td>"
        if ref:
            cells += (
                f"<td class=num>{data.fmt(ref[name])}</td><td class=num>{data.fmt(value - ref[name], sign=True)}</td>"
            )
        cells += f"<td>{escape(data.model_interval(s.record, s.baseline, name))}</td>"
        rows.append(f"<tr>{cells}</tr>")
    return f"<table>{head}{''.join(rows)}</table>"


def _verdicts(results: list[dict]) -> str:
    rows = []
    for r in results:
        status = {"passed": "pass", "skipped": "skip", "error": "ERROR"}.get(r["status"], "FAIL")
        message = (
            f"<details{'' if r['passed'] else ' open'}><summary>details</summary><pre>"
            f"{escape(r['message'])}</pre></details>"
            if r["message"]
            else ""
        )
        rows.append(
            f"<tr><td class={status}>{status}</td><td>{escape(r['invariant'])}</td>"
            f"<td>{escape(r['build'])}</td><td>{escape(r['against'])}</td><td>{message}</td></tr>"
        )
    return (
        "<table><tr><th>result</th><th>invariant</th><th>build</th><th>against</th><th>message</th></tr>"
        + "".join(rows)
        + "</table>"
    )


def _moved_table(moved: list[dict]) -> str:
    rows = "".join(
        f"<tr><td>{escape(str(m.get('head')))}</td><td>{escape(str(m.get('metric')))}</td>"
        f"<td class=num>{_measured(m.get('before'))}</td><td class=num>{_measured(m.get('after'))}</td>"
        f"<td class=num>{data.fmt(m.get('tolerance'))}</td></tr>"
        for m in moved
    )
    return (
        "<table><tr><th>head</th><th>metric</th><th>before</th><th>after</th><th>tolerance</th></tr>"
        + rows
        + "</table>"
    )


def _measured(value) -> str:
    """A gate row's number, or "not measured" (a screened scan's missing knockout is no change)."""
    return "not measured" if data.number(value) != data.number(value) else data.fmt(value)


def _changes_table(changes: list[dict]) -> str:
    rows = "".join(
        f"<tr><td>{c['head']}</td><td>{escape(c['metric'])}</td><td class=num>{data.fmt(c['before'])}</td>"
        f"<td class=num>{data.fmt(c['after'])}</td><td class=num>{data.fmt(c['change'], sign=True)}</td></tr>"
        for c in changes
    )
    return (
        "<table><tr><th>head</th><th>metric</th><th>baseline</th><th>this build</th><th>change</th></tr>"
        + rows
        + "</table>"
    )


def _figure(f: Figure) -> str:
    uri = "data:image/png;base64," + base64.b64encode(f.png).decode("ascii")
    shown = (
        f'<figure><img src="{uri}" alt="{escape(f.title)}">'
        f"<figcaption><b>{escape(f.title)}.</b> {escape(f.caption)}</figcaption></figure>"
    )
    if f.folded:  # e.g. the baseline against itself: all-zero maps, one line until opened
        return f'<details class="fold"><summary>{escape(f.folded)} (show the maps)</summary>{shown}</details>'
    return shown
