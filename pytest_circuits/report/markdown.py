"""``summary.md``: the verdicts as markdown for CI step summaries, linking the PNGs beside it."""

from __future__ import annotations

from . import data
from .sections import Section


def summary(sections: list[Section], extra_results: list[dict]) -> str:
    """The markdown summary of the same verdicts and figures as the HTML page."""
    results = [r for s in sections for r in s.results] + extra_results
    failed = [r for r in results if r["failed"]]
    name = next(((s.record.get("model") or {}).get("name") for s in sections), None)
    lines = [f"# Circuits report{': ' + str(name) if name else ''}", ""]
    if failed:
        lines.append(
            f"**{len(failed)} of {len(results)} invariants broken:** "
            + ", ".join(f"`{r['invariant']}` ({r['build']})" for r in failed)
        )
    elif results:
        held = sum(r["passed"] for r in results)
        lines.append(
            f"All {held} invariants held."
            if held == len(results)
            else f"{held} of {len(results)} invariants held, none broken (the rest skipped: nothing to compare)."
        )
    else:
        lines.append("No gate verdicts: scan results only.")
    lines.append("")
    if results:
        lines += ["| result | build | invariant | against |", "|---|---|---|---|"]
        lines += [
            f"| { {'passed': 'pass', 'skipped': 'skip'}.get(r['status'], '**FAIL**') } | {r['build']} | {r['invariant']} | {r['against']} |"
            for r in results
        ]
        lines.append("")
    if sections:
        lines += _builds_table(sections)
    for r in failed:
        lines += [
            f"### `{r['invariant']}` broken for {r['build']}" + (f" against {r['against']}" if r["against"] else ""),
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
    for s in sections:
        if s.figures or s.notes:
            lines += [f"## Figures: {s.label}", ""]
            for item in [f"_{note}_" for note in s.notes] + [f"![{f.title}]({f.file})" for f in s.figures]:
                lines += [item, ""]
    return "\n".join(lines).rstrip() + "\n"


def _builds_table(sections: list[Section]) -> list[str]:
    lines = [
        "| build | dtype | backend | reference | copy loss | Δ copy loss | copy gain | copying heads | "
        "suppression heads |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for s in sections:
        build = s.record.get("build") or {}
        figures = data.model_figures(s.record)
        change = "—"
        if s.reference is not None:
            change = data.fmt(figures["copy_loss"] - data.model_figures(s.reference)["copy_loss"], sign=True)
            change += f" {data.model_interval(s.record, s.reference, 'copy_loss')}"
        copying = data.flagged_heads(s.record, "copying")
        suppression = data.flagged_heads(s.record, "suppression")
        lines.append(
            f"| {s.label} | {build.get('dtype') or '—'} | {build.get('backend') or '—'} | "
            f"{data.recipe_of(s.reference) if s.reference is not None else '—'} | {data.fmt(figures['copy_loss'])} | "
            f"{change} | {data.fmt(figures['copy_gain'])} | {_few(copying)} | {_few(suppression)} |"
        )
    return lines + [""]


def _few(heads: list[str], k: int = 6) -> str:
    if not heads:
        return "none"
    return ", ".join(heads[:k]) + (f" (+{len(heads) - k})" if len(heads) > k else "")
