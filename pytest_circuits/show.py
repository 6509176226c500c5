"""Records as the terminal shows them: a build's heads and model figures (``circuits scan``), and two
records side by side (``circuits diff``)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from .record.schema import Head, Record


def _fmt(value, spec: str) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return spec.format(value)


def head_table(record: Record) -> str:
    """One line per head: the figures of `figures.table_figures` and the copying/suppression flag;
    ``ov gain`` is the head's OV gain over the largest head's (idle heads sit near 0)."""
    from .gate.invariants import ov_gains
    from .record.figures import table_figures

    gains = ov_gains(record)
    largest = max(gains.values(), default=0.0)

    def value(row: Head, name: str) -> Any:
        if name == "ov_gain":
            return gains[row.head] / largest if largest > 0 and row.head in gains else None
        return getattr(row, name, None)

    cols = [f for f in table_figures() if any(value(h, f.name) is not None for h in record.heads)]
    lines = [f"{'head':<8}" + "".join(f"{f.title:>10}" for f in cols) + "  flag"]
    for h in record.heads:
        flag = "copying" if h.copying else "suppression" if h.suppression else ""
        lines.append(f"{h.head:<8}" + "".join(f"{_fmt(value(h, f.name), f.fmt):>10}" for f in cols) + f"  {flag}")
    return "\n".join(lines)


def model_lines(record: Record) -> list[str]:
    """The model, its build and its probe, with the model figures and their intervals."""
    from .model.recipes import describe_identity
    from .record.figures import MODEL_FIGURES, interval_key
    from .record.read import model_kind

    m, b, p = record.model, record.build, record.probe

    def figure(f) -> str:
        interval = getattr(record, interval_key(f.name), None)
        shown = f" [{_fmt(interval[0], f.fmt)}, {_fmt(interval[1], f.fmt)}]" if interval else ""
        return f"{f.name} {_fmt(getattr(record, f.name), f.fmt)}{shown}"

    said = ", ".join(figure(f) for f in MODEL_FIGURES)
    own = "" if p.text is None else f" on own text {p.text.file}"
    return [
        f"model {m.name} ({model_kind(m)}, {m.geometry.n_layers} layers x {m.geometry.n_heads} heads), "
        f"build {b.recipe} ({b.backend_version}, {b.device})",
        *[line for line in [describe_identity(b.model_dump(exclude_none=True))] if line],
        f"probe seed {p.seed} n {p.n} L {p.L}{own}: {said} (nats; [95% t interval over the sequences])",
        *audit_lines(record),
    ]


def audit_lines(record: Record) -> list[str]:
    """Rung 3, when the record audited a slice: one line of the slice, then one per case (its answer's
    log-probability, the drop of each chunk, the cited drop and the top chunk, nats)."""
    audit = record.audit
    if audit is None:
        return []
    lines = [f"audit slice {audit.slice_name} ({audit.n_cases} cases, {audit.tokens}; nats):"]
    for case in audit.cases:
        drops = " ".join(f"{d:+.2f}" for d in case.chunk_drops)
        cited = "" if case.cited_drop is None else f", cited drop {case.cited_drop:+.2f}"
        lines.append(
            f"  {case.id}: answer logprob {case.answer_logprob:.3f}, chunk drops [{drops}]{cited}, "
            f"top chunk {case.top_chunk}"
        )
    return lines


def rung1_diffed() -> tuple[str, ...]:
    """The rung-1 figures `circuits diff` shows: the kappa frame's diffed figures and flags."""
    from .record.figures import BY_NAME, diff_figures

    return tuple(m for m in (*diff_figures(), "copying", "suppression") if BY_NAME[m].source == "kappa")


def diff_rows(a: Record, b: Record, min_change: float = 0.01) -> list[tuple]:
    """``(head, metric, before, after, change)`` for every per-head figure that moved at least
    ``min_change``; rung-1 figures only where both records measured them alike (`kappa_pairs`)."""
    from .gate.invariants import kappa_pairs
    from .gate.rows import head_pairs
    from .record.figures import diff_figures

    rung1 = rung1_diffed()
    paired, _ = kappa_pairs(a, b, rung1)
    rows = []
    for head, ha, hb in head_pairs(a, b):
        for metric in diff_figures():
            if metric in rung1 and metric not in paired:
                continue
            ma, mb = paired.get(metric, (metric, metric))
            x, y = getattr(ha, ma, None), getattr(hb, mb, None)
            if x is None or y is None:
                continue
            if abs(y - x) >= min_change:
                rows.append((head, metric, x, y, y - x))
        for flag in [f for f in ("copying", "suppression") if f in paired]:
            before, after = bool(getattr(ha, flag)), bool(getattr(hb, flag))
            if before != after:
                rows.append((head, flag, float(before), float(after), None))
    return rows


def diff_lines(file_a: Path, file_b: Path, min_change: float) -> list[str]:
    """``circuits diff A B``: what it prints, line by line: notes, both records, the model figures with
    their paired intervals, the per-head figures that moved ``min_change`` or more, and the verdict of B
    against A with the default tolerances (the one verdict, `gate.check.check`)."""
    from .gate.check import check
    from .gate.invariants import format_interval, kappa_pairs, verdict
    from .gate.stats import paired_interval
    from .gate.tolerances import Tolerances
    from .record.figures import MODEL_FIGURES, sequences_key
    from .record.store import geometry_difference, other_model_type, read_record

    out: list[str] = []
    a, b = read_record(file_a), read_record(file_b)
    across = bool(geometry_difference(a, b) or other_model_type(a, b))  # two base models: no head pairs
    label = f"baseline {file_a.name}"
    verdicts = check(a, b, Tolerances(), build_name=b.build.recipe, label=label, across=across)
    out.extend(verdicts.notes)
    _, mismatch = kappa_pairs(a, b, rung1_diffed())
    if mismatch:
        out.append("note: " + mismatch.format(against=label, build=f"{file_b.name}"))
    out.append(f"A {file_a}: {a.model.name} {a.build.recipe}")
    out.append(f"B {file_b}: {b.model.name} {b.build.recipe}")
    for figure in MODEL_FIGURES:
        x, y = getattr(a, figure.name), getattr(b, figure.name)
        if x is not None and y is not None:
            xs, ys = getattr(a, sequences_key(figure.name), None), getattr(b, sequences_key(figure.name), None)
            same_tokens = xs is not None and ys is not None and not across  # two vocabularies: no pairs
            paired = format_interval(paired_interval(xs, ys)) if same_tokens and xs and ys else ""
            out.append(f"  {figure.name:<16} {x:10.4f} -> {y:10.4f}  ({y - x:+.4f}{' ' + paired if paired else ''})")
    if across:  # heads do not correspond across models: the profiles instead
        from .gate.profile import profile, profile_line

        for side, record in (("A", a), ("B", b)):
            out.append(f"{side} {profile_line(profile(record, Tolerances().swap_induction_score))}")
        rows = []
        out.append("per-head figures not compared: A and B are two base models (heads do not correspond)")
    else:
        rows = diff_rows(a, b, min_change)
    if rows:
        width = max(16, *(len(row[1]) for row in rows))  # the longest metric name (kappa_trace_uncentred) sets it
        out.append(f"{'head':<8} {'metric':<{width}} {'A':>10} {'B':>10} {'change':>10}")
        for head, metric, x, y, change in rows:
            out.append(f"{head:<8} {metric:<{width}} {x:>10.4f} {y:>10.4f} {_fmt(change, '{:+.4f}'):>10}")
    elif not across:
        out.append(f"no per-head figure moved by {min_change} or more")
    _, line = verdict(verdicts.results)
    out.append(f"with default tolerances, B against A: {line}")
    return out
