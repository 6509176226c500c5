"""Records as the terminal shows them: a build's heads and model figures (``circuits scan``), and two
records side by side (``circuits diff``)."""

from __future__ import annotations

import math
from pathlib import Path


def _fmt(value, spec: str) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return spec.format(value)


def head_table(record: dict) -> str:
    """One line per head: the figures of `figures.table_figures` and the copying/suppression flag;
    ``ov gain`` is the head's OV gain over the largest head's (idle heads sit near 0)."""
    from .gate.invariants import ov_gains
    from .rungs.figures import table_figures

    gains = ov_gains(record)
    largest = max(gains.values(), default=0.0)
    heads = [
        {**h, "ov_gain": gains[h["head"]] / largest if largest > 0 and h["head"] in gains else None}
        for h in record["heads"]
    ]
    cols = [f for f in table_figures() if any(h.get(f.name) is not None for h in heads)]
    lines = [f"{'head':<8}" + "".join(f"{f.title:>10}" for f in cols) + "  flag"]
    for h in heads:
        flag = "copying" if h.get("copying") else "suppression" if h.get("suppression") else ""
        lines.append(f"{h['head']:<8}" + "".join(f"{_fmt(h.get(f.name), f.fmt):>10}" for f in cols) + f"  {flag}")
    return "\n".join(lines)


def model_lines(record: dict) -> list[str]:
    from .gate.record import model_kind
    from .model.recipes import describe_identity
    from .rungs.figures import MODEL_FIGURES, interval_key

    m, b, p = record["model"], record["build"], record["probe"]

    def figure(f) -> str:
        interval = record.get(interval_key(f.name))
        shown = f" [{_fmt(interval[0], f.fmt)}, {_fmt(interval[1], f.fmt)}]" if interval else ""
        return f"{f.name} {_fmt(record.get(f.name), f.fmt)}{shown}"

    said = ", ".join(figure(f) for f in MODEL_FIGURES)
    return [
        f"model {m['name']} ({model_kind(m)}, {m['geometry']['n_layers']} layers x {m['geometry']['n_heads']} heads), "
        f"build {b['recipe']} ({b['backend_version']}, {b['device']})",
        *[line for line in [describe_identity(b)] if line],
        f"probe seed {p['seed']} n {p['n']} L {p['L']}: {said} (nats; [95% t interval over the sequences])",
    ]


def rung1_diffed() -> tuple[str, ...]:
    """The rung-1 figures `circuits diff` shows: the kappa frame's diffed figures and flags."""
    from .rungs.figures import BY_NAME, diff_figures

    return tuple(m for m in (*diff_figures(), "copying", "suppression") if BY_NAME[m].source == "kappa")


def diff_rows(a: dict, b: dict, min_change: float = 0.01) -> list[tuple]:
    """``(head, metric, before, after, change)`` for every per-head figure that moved at least
    ``min_change``; rung-1 figures only where both records measured them alike (`kappa_pairs`)."""
    from .gate.invariants import kappa_pairs
    from .rungs.figures import diff_figures

    rung1 = rung1_diffed()
    paired, _ = kappa_pairs(a, b, rung1)
    rows = []
    heads_b = {h["head"]: h for h in b["heads"]}
    for ha in a["heads"]:
        hb = heads_b.get(ha["head"])
        if hb is None:
            continue
        for metric in diff_figures():
            if metric in rung1 and metric not in paired:
                continue
            ma, mb = paired.get(metric, (metric, metric))
            x, y = ha.get(ma), hb.get(mb)
            if x is None or y is None:
                continue
            if abs(y - x) >= min_change:
                rows.append((ha["head"], metric, x, y, y - x))
        for flag in [f for f in ("copying", "suppression") if f in paired]:
            if bool(ha.get(flag)) != bool(hb.get(flag)):
                rows.append((ha["head"], flag, float(bool(ha.get(flag))), float(bool(hb.get(flag))), None))
    return rows


def diff_lines(file_a: Path, file_b: Path, min_change: float) -> list[str]:
    """``circuits diff A B``: what it prints, line by line: notes, both records, the model figures with
    their paired intervals, the per-head figures that moved ``min_change`` or more, and the verdict of B
    against A with the default tolerances (the one verdict, `gate.check.check`)."""
    from .gate.check import check
    from .gate.invariants import format_interval, kappa_pairs, verdict
    from .gate.stats import paired_interval
    from .gate.store import geometry_difference, other_model_type, read_record
    from .gate.tolerances import Tolerances
    from .rungs.figures import MODEL_FIGURES, sequences_key

    out: list[str] = []
    typed_a, typed_b = read_record(file_a), read_record(file_b)
    a, b = typed_a.data, typed_b.data
    across = bool(geometry_difference(a, b) or other_model_type(a, b))  # two base models: no head pairs
    label = f"baseline {file_a.name}"
    verdicts = check(typed_a, typed_b, Tolerances(), build_name=typed_b.build.recipe, label=label, across=across)
    out.extend(verdicts.notes)
    _, mismatch = kappa_pairs(typed_a, typed_b, rung1_diffed())
    if mismatch:
        out.append("note: " + mismatch.format(against=label, build=f"{file_b.name}"))
    out.append(f"A {file_a}: {typed_a.model.name} {typed_a.build.recipe}")
    out.append(f"B {file_b}: {typed_b.model.name} {typed_b.build.recipe}")
    for figure in MODEL_FIGURES:
        x, y = a.get(figure.name), b.get(figure.name)
        if x is not None and y is not None:
            xs, ys = a.get(sequences_key(figure.name)), b.get(sequences_key(figure.name))
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
