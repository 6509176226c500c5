"""``summary.md``: the verdicts as markdown for CI step summaries; the PNGs are named, not linked.

A GitHub step summary shows neither images by relative path (the job's disk is not served)
nor ``data:`` URIs (stripped), and holds at most 1 MiB: so the summary names each PNG file
and says where it is (the report folder, to upload as an artifact) instead of embedding it.
``report.html`` in the same folder embeds every figure.
"""

from __future__ import annotations

from collections.abc import Sequence

from ..gate.invariants import guarded
from ..record.drawn import drawn_record
from . import data
from .sections import Figure, Section


def summary(
    sections: list[Section],
    extra_results: list[dict],
    overview: Sequence[Figure] = (),
    overview_notes: Sequence[str] = (),
    folder: str = "circuits-report",
) -> str:
    """The markdown summary of the same verdicts as the HTML page; the figures by file name."""
    results = [r for s in sections for r in s.results] + extra_results
    failed = [r for r in results if r["failed"]]
    name = next((drawn_record(s.record).info("model", "name") for s in sections), None)
    lines = [f"# Circuits report{': ' + str(name) if name else ''}", ""]
    if failed:
        lines.append(
            f"**{len(failed)} of {len(results)} invariants "
            + ("broken or not gated" if any(r["status"] == "error" for r in failed) else "broken")
            + ":** "
            + ", ".join(
                f"`{r['invariant']}` ({r['build']}" + (f" vs {r['against']})" if r["against"] else ")") for r in failed
            )
        )
    elif results:
        held = sum(r["passed"] for r in results)
        lines.append(
            f"All {held} invariants held."
            if held == len(results)
            else f"{held} of {len(results)} invariants held, none broken; skipped: {data.said_skips(results)}."
        )
        if guarded(results):
            lines.append(f"**{data.sentence(guarded(results))}.**")
    else:
        lines.append("No gate verdicts: scan results only.")
    lines.append("")
    if failed:
        lines += _verdict_table(failed) + [""]
    held = [r for r in results if not r["failed"]]
    if held:  # what held folds away (GitHub renders <details> in step summaries)
        skipped = sum(r["status"] == "skipped" for r in held)
        said = f"{len(held) - skipped} held" + (f", {skipped} skipped" if skipped else "")
        lines += [f"<details><summary>{said}</summary>", "", *_verdict_table(held), "", "</details>", ""]
    if sections:
        lines += _builds_table(sections)
    for r in failed:
        lines += [
            f"### `{r['invariant']}` "
            + ("could not be gated" if r["status"] == "error" else "broken")
            + f" for {r['build']}"
            + (f" against {r['against']}" if r["against"] else ""),
            "",
        ]
        if r["message"]:
            lines += ["```text", r["message"].rstrip(), "```", ""]
    moved = [(s.label, m) for s in sections for m in data.top_moved(s.results, k=8)]
    if moved:
        lines += [
            "## Heads that moved most",
            "",
            "| build | head | metric | before | after | tolerance |",
            "|---|---|---|---|---|---|",
        ]
        lines += [
            f"| {label} | {m.get('head')} | {m.get('metric')} | {data.fmt(m.get('before'))} | "
            f"{data.fmt(m.get('after'))} | {data.fmt(m.get('tolerance'))} |"
            for label, m in moved
        ]
        lines.append("")
    lines += _figure_lines(sections, overview, overview_notes, folder)
    return "\n".join(lines).rstrip() + "\n"


def _verdict_table(results: list[dict]) -> list[str]:
    words = {"passed": "pass", "skipped": "skip", "error": "**ERROR**"}
    return ["| result | build | invariant | against |", "|---|---|---|---|"] + [
        f"| {words.get(r['status'], '**FAIL**')} | {r['build']} | {r['invariant']} | {r['against']} |" for r in results
    ]


def _builds_table(sections: list[Section]) -> list[str]:
    lines = [
        "| build | dtype | backend | baseline | copy loss | Δ copy loss | copy gain | copying heads | "
        "suppression heads |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for s in sections:
        view = drawn_record(s.record)
        measured = data.model_figures(s.record)
        change = "—"
        if s.baseline is not None:
            measured_before = data.model_figures(s.baseline)
            change = data.fmt(measured["copy_loss"] - measured_before["copy_loss"], sign=True)
            change += f" {data.model_interval(s.record, s.baseline, 'copy_loss')}"
        copying = data.flagged_heads(s.record, "copying")
        suppression = data.flagged_heads(s.record, "suppression")
        lines.append(
            f"| {s.label} | {view.info('build', 'dtype') or '—'} | {view.info('build', 'backend') or '—'} | "
            f"{data.build_name_of(s.baseline) if s.baseline is not None else '—'} | {data.fmt(measured['copy_loss'])} | "
            f"{change} | {data.fmt(measured['copy_gain'])} | {_few(copying)} | {_few(suppression)} |"
        )
    return lines + [""]


def _few(heads: list[str], k: int = 6) -> str:
    if not heads:
        return "none"
    return ", ".join(heads[:k]) + (f" (+{len(heads) - k})" if len(heads) > k else "")


def _figure_lines(
    sections: list[Section], overview: Sequence[Figure], overview_notes: Sequence[str], folder: str
) -> list[str]:
    """Where the figures are: file names in the report folder (a step summary cannot show them)."""
    if not (overview or any(s.figures for s in sections)):
        return []
    lines = [
        "## Figures",
        "",
        f"The figures are PNG files in the report folder `{folder}/`, beside this summary, and embedded "
        f"in its `report.html`; in CI, upload that folder as an artifact (e.g. named `{folder}`) and open "
        "`report.html` from it. A step summary cannot show them: images by relative path are not "
        "served from the job's disk and `data:` URIs are stripped.",
        "",
    ]
    lines += [f"_{note}_" for note in overview_notes] + ([""] if overview_notes else [])
    lines += [f"- `{f.file}`: {f.title}" for f in overview]
    for s in sections:
        for note in s.notes:
            lines.append(f"- _{s.label}: {note}_")
        for f in s.figures:
            lines.append(f"- `{f.file}`: {f.title}" + (f" ({f.folded})" if f.folded else ""))
    return lines + [""]
