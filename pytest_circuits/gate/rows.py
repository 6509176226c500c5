"""The rows invariants build from two records: figures read by name, heads paired by label, and
the rows of sampled figures (means over probe sequences), decided by the sequential rule over the
looks both records hold, or by the fixed rule's paired interval (docs/definitions.md, "The gate")."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from ..record.schema import Head, Record, RecordLike
from .invariant_api import Row, format_interval, signed
from .stats import LEVEL, excludes_zero, implausible_spread, paired_interval
from .tolerances import Tolerances


def num(value: Any) -> float:
    """A float, NaN for None (a figure that was not measured)."""
    return float("nan") if value is None else float(value)


def figure(row: Record | Head | None, name: str) -> float:
    """Figure ``name`` of a record or head row (its figures are named by the table, `record.figures`)
    as a float: NaN when not measured, or when there is no such row (a head the build lacks)."""
    return num(getattr(row, name, None))


def heads_by_label(record: RecordLike) -> dict[str, Head]:
    return {row.head: row for row in Record.of(record).heads}


def head_pairs(before: Record, after: Record) -> list[tuple[str, Head, Head]]:
    """Heads present in both records, in the baseline's order."""
    b, a = heads_by_label(before), heads_by_label(after)
    return [(name, b[name], a[name]) for name in b if name in a]


NO_INTERVAL = (
    "interval not available ({side} recorded without per-sequence figures; re-record); plain tolerance applies"
)


def sampled_within(
    subject: str,
    metric: str,
    before: Record | Head,
    after: Record | Head | None,
    limit: float,
    tol: Tolerances,
    note: str = "",
    looks: tuple[list[list[float]], list[list[float]]] = ([], []),
) -> Row:
    """A row of a sampled figure (a mean over the probe's sequences; record/figures.py), read from
    ``before`` / ``after`` (a record, or one of its head rows) with its per-sequence values, and
    ``looks``: the per-sequence values of each side's further looks (`record.looks.look_values`).

    With ``tol.outside_interval`` (the default) and a baseline holding further looks (up to
    ``tol.looks``), the sequential rule decides (`sequential_row`). Else the fixed rule: its interval
    is the 95% paired t interval of the change (`stats.paired_interval`); it breaks when
    ``|after - before| > limit`` and, with ``tol.outside_interval``, the interval excludes 0; without
    per-sequence values on both sides the plain tolerance applies and the note says so.
    """
    from ..record.figures import sequences_key

    x, y = figure(before, metric), figure(after, metric)
    key = sequences_key(metric)
    xs, ys = getattr(before, key, None), getattr(after, key, None)
    interval = paired_interval(xs, ys) if xs is not None and ys is not None else None
    beyond = not abs(y - x) <= limit
    said = [note] if note else []
    # a baseline whose values spread implausibly carries no evidence for either rule: the fixed path says so
    if (
        interval is not None
        and xs is not None
        and ys is not None
        and tol.outside_interval
        and math.isfinite(limit)
        and implausible_spread(xs, ys) is None
    ):  # (an interval needs both sides' values)
        row = sequential_row(subject, metric, x, y, xs, ys, looks, limit, tol, said)
        if row is not None:
            return row
    if interval is None:
        if math.isfinite(y) and (xs is None or ys is None):
            said.append(NO_INTERVAL.format(side="baseline" if xs is None else "build"))
        elif math.isfinite(y) and xs is not None and ys is not None:
            said.append(f"interval not available ({len(xs)} vs {len(ys)} sequences); plain tolerance applies")
        broken = beyond
    elif tol.outside_interval:
        broken = beyond and excludes_zero(interval)
        ratio = implausible_spread(xs, ys) if beyond and not broken and xs is not None and ys is not None else None
        if ratio is not None:
            broken = True  # only the baseline's implausible spread held the interval over 0
            said.append(NO_EVIDENCE.format(ratio=ratio, n=len(xs or ())))
        elif beyond and not broken:
            said.append(f"beyond {limit:.3g} but {SPARED} (the {LEVEL:.0%} interval holds 0)")
    else:
        broken = beyond
    sequences = len(xs) if interval is not None and xs is not None else None
    if sequences is not None and tol.outside_interval:
        said.append(FIXED.format(n=sequences))
    return Row(subject, metric, x, y, limit, broken, " ".join(said), interval, sequences)


FIXED = "fixed rule on {n} sequences"  # the note of a sampled row decided by the fixed rule
NO_LOOKS = "; fixed rule: the baseline holds no further looks (record it again for the sequential rule)"


def fixed_why(before: Record, rows: list[Row], tol: Tolerances) -> str:
    """The invariant's words (a `Comparison.left_out`) when the fixed rule decided a row because the
    baseline holds no further looks ("" otherwise: the sequential rule, or ``looks`` = 1 asked)."""
    fixed = any(FIXED.format(n=r.sequences) in r.note for r in rows if r.sequences is not None)
    return NO_LOOKS if fixed and tol.looks > 1 and not before.looks else ""


def sequential_row(
    subject: str,
    metric: str,
    x: float,
    y: float,
    xs: list[float],
    ys: list[float],
    looks: tuple[list[list[float]], list[list[float]]],
    limit: float,
    tol: Tolerances,
    said: list[str],
) -> Row | None:
    """The row the sequential rule (`gate.sequential.decide`) gives: over look 1 (``xs``, ``ys``)
    and the further looks both sides hold, at most ``tol.looks`` (and the baseline's count). None
    when the baseline holds no further look (or ``tol.looks`` is 1): the fixed rule applies. A row
    still undecided after the build's last measured look asks for the next (``wants``) and is
    judged by the fixed rule meanwhile, saying so."""
    from .sequential import decide

    before_looks, after_looks = looks
    most = min(max(int(tol.looks), 1), 1 + len(before_looks))
    if most < 2 or len(xs) != len(ys):
        return None
    parts: list[np.ndarray[Any, Any]] = [np.subtract(np.asarray(ys, float), np.asarray(xs, float))]
    for b, a in zip(before_looks[: most - 1], after_looks):
        if len(a) != len(b):
            break
        parts.append(np.subtract(np.asarray(a, float), np.asarray(b, float)))
    decision = decide(parts, limit, most)
    if decision is None:
        return None
    if decision.verdict == "more":  # the caller measures the next look (record.looks.extend); until then: fixed rule
        interval = paired_interval(xs, ys)
        broken = not abs(y - x) <= limit and excludes_zero(interval)
        why = f"(the build's look {decision.look + 1} is not measured: a record read from a file)"
        note = " ".join([*said, f"undecided after look {decision.look} of {most};", FIXED.format(n=len(xs)), why])
        return Row(subject, metric, x, y, limit, broken, note, interval, len(xs), wants=decision.look + 1)
    low, high = decision.interval
    shown_beyond = low > limit or high < -limit
    rule = "shown within" if decision.verdict == "pass" else "shown beyond" if shown_beyond else "not shown within"
    mean = f": mean change {signed(decision.mean)}" if decision.look > 1 else ""  # look 1: the change shown
    note = " ".join([*said, f"{rule} {limit:.3g}{mean}, {decision.said()}"])
    return Row(subject, metric, x, y, limit, decision.verdict == "fail", note, decision.interval, decision.sequences)


# A baseline whose per-sequence values spread implausibly for its n (`stats.implausible_spread`) cannot
# say a change is noise: its interval would hold 0 whatever the build did (docs/definitions.md).
NO_EVIDENCE = (
    "the baseline's per-sequence values carry no evidence (their spread is {ratio:.3g}x the build's on the "
    "same {n} sequences, beyond F({n}-1, {n}-1) at 99.9%); plain tolerance applies: record the baseline again"
)
SPARED = "within sampling noise"  # the note of a row the interval rule kept from breaking


def spared(rows: list[Row]) -> list[Row]:
    """Rows beyond their tolerance that the interval rule kept (shown under a failure as context)."""
    return [r for r in rows if SPARED in r.note]


def interval_detail(rows: list[Row], shown: list[Row] | None = None) -> str:
    """Pass-line words for sampled rows: the changes of ``shown`` (default all) with their intervals,
    how many rows the interval rule spared, and why an interval was not available."""
    parts = []
    for r in rows if shown is None else shown:
        subject = "" if r.subject == "model" else f"{r.subject} "
        parts.append(
            f"{subject}d{r.metric} {signed(r.after - r.before)} {format_interval(r.interval) or '(no interval)'}"
        )
    kept = len(spared(rows))
    missing = {r.note[r.note.index("interval not available") :] for r in rows if "interval not available" in r.note}
    said = [", ".join(parts)] if parts else []
    said += [f"{kept} beyond tolerance but {SPARED}"] if kept else []
    return "; ".join(said + sorted(missing) + [s for s in [sequences_said(rows)] if s])


def sequences_said(rows: list[Row]) -> str:
    """``"decided on 16-48 sequences (sequential rule)"`` / ``"... (fixed rule)"``: how many paired
    sequences decided the sampled rows ("" when none had per-sequence values)."""
    counts = sorted({r.sequences for r in rows if r.sequences is not None})
    if not counts:
        return ""
    span = str(counts[0]) if len(counts) == 1 else f"{counts[0]}-{counts[-1]}"
    fixed = any("fixed rule" in r.note for r in rows if r.sequences is not None)
    return f"decided on {span} sequences ({'fixed' if fixed else 'sequential'} rule)"
