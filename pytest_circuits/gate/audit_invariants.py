"""The rung-3 invariants: an audit slice's answers against the baseline's (docs/audit.md).

Each reads the records' ``audit`` sections (`record.audit.AuditInfo`, figures from `rungs/audit.py`)
and compares them case by case; a baseline of another slice is refused in one line (`other_slice`).

- A case is **relied on** when the baseline's drop for its relied chunks (its cited chunks; without
  ``cited``, the baseline's top chunk) is at least ``min_reliance`` nats. Cases not relied on are
  reported (named in the message), not gated.
- ``document_reliance``: over the relied cases, the mean drop ``D'`` of the build may not fall below
  ``(1 - reliance) D`` (``D`` the baseline's); the 95% paired interval over cases of ``drop' - drop``
  (`stats.paired_interval`) is shown, and with ``outside_interval`` a shrink beyond the tolerance fails
  only when that interval excludes 0. The failure lists the cases whose own drop shrank that far.
- ``document_attribution``: the share of relied cases whose top chunk is the baseline's is at least
  ``attribution``; the failure lists the cases and their chunks.
- ``answer_logprob``: the mean over cases of the answer's log-probability per token with every chunk
  present moves by at most ``answer_logprob`` nats (both ways; the same interval rule).
The slice is fixed, not sampled: no further look can be drawn, so the sequential rule does not apply.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from ..record.audit import AuditCaseRow, literal, other_slice
from ..record.schema import Record
from . import builtin_invariants  # noqa: F401 (registered first: importing registers, in gate order)
from .invariant_api import Comparison, Invariant, Row, register
from .stats import excludes_zero, paired_interval
from .tolerances import Tolerance, Tolerances

Pair = tuple[AuditCaseRow, AuditCaseRow]


def relied_drop(case: AuditCaseRow, chunks_of: AuditCaseRow) -> float:
    """``case``'s drop for the chunks ``chunks_of`` (the baseline's case) relies on: its cited drop when
    it cites chunks, else its drop for the baseline's top chunk."""
    if chunks_of.cited is not None:
        return math.nan if case.cited_drop is None else case.cited_drop
    return case.chunk_drops[chunks_of.top_chunk]


def relied_chunks(case: AuditCaseRow) -> str:
    """``cited chunks 0, 2`` / ``top chunk 1``: what a case's drop is of, in words."""
    if case.cited is not None:
        return f"cited chunk{'s' if len(case.cited) > 1 else ''} {', '.join(map(str, case.cited))}"
    return f"top chunk {case.top_chunk}"


def audit_pairs(before: Record, after: Record, tol: Tolerances) -> tuple[list[Pair], str, str]:
    """``(relied, left_out, refused)``: the case pairs the baseline relies on, the note naming the cases
    it does not (reported, not gated), and why the two cannot be compared ("" when they can)."""
    b, a = before.audit, after.audit
    assert b is not None and a is not None  # `needs` keeps records without the section out
    refused = other_slice(b, a)
    if refused:
        return [], "", refused
    pairs = list(zip(b.cases, a.cases))
    mismatch = [x.id for x, y in pairs if x.id != y.id or len(x.chunk_drops) != len(y.chunk_drops)]
    if mismatch:
        return (
            [],
            "",
            f"the cases of the {{against}} and {{build}} do not pair ({literal(', '.join(mismatch[:5]))}); record again",
        )
    relied = [(x, y) for x, y in pairs if relied_drop(x, x) >= tol.min_reliance]
    loose = [x.id for x, _ in pairs if not relied_drop(x, x) >= tol.min_reliance]
    left_out = ""
    if loose:
        shown = ", ".join(loose[:8]) + (", ..." if len(loose) > 8 else "")
        left_out = (
            f"; {len(loose)} case(s) the baseline does not rely on (drop < {tol.min_reliance:g} nats), "
            f"reported, not gated: {shown}"
        )
    return relied, left_out, ""


def interval_rule(
    before: Sequence[float], after: Sequence[float], beyond: bool, tol: Tolerances
) -> tuple[bool, tuple[float, float] | None]:
    """``(broken, interval)``: a change beyond its tolerance breaks, with ``outside_interval`` only when
    the 95% paired interval over cases excludes 0 (one case: no interval, the plain tolerance)."""
    interval = paired_interval(before, after)
    if not beyond:
        return False, interval
    return (not tol.outside_interval or interval is None or excludes_zero(interval)), interval


NONE_RELIED = "the {against} relies on none of the slice's cases; nothing to check"


class AuditInvariant(Invariant):
    """What the rung-3 invariants share: model-level rows from a record's audit section, run only when
    the run gives a slice (``opt_in``)."""

    per_head = False
    needs = frozenset({"audit"})
    opt_in = True


@register
class DocumentReliance(AuditInvariant):
    """Rung 3: the mean drop of the answers' log-probability when their cited chunks are removed does not shrink by more than ``reliance`` of the baseline's."""

    name = "document_reliance"
    guards = "the answers' reliance on their documents"
    tolerances = {
        "reliance": Tolerance(
            0.5, "how far the mean cited-chunk drop of an audit slice may shrink, x the baseline's", minimum=0
        ),
        "min_reliance": Tolerance(1.0, "a case whose baseline drop is below this (nats) is reported, not gated"),
    }
    reads = ("outside_interval",)
    held = "answers of {build} still rest on their documents as in the {against}"
    moved = "answers of {build} rest less on their documents than in the {against}"

    def compare(self, before: Record, after: Record, tol: Tolerances) -> Comparison:
        relied, left_out, refused = audit_pairs(before, after, tol)
        if refused:
            return Comparison(nothing=refused)
        if not relied:
            return Comparison(left_out=left_out, nothing=NONE_RELIED + literal(left_out), nothing_is_skip=True)
        xs = [relied_drop(x, x) for x, _ in relied]
        ys = [relied_drop(y, x) for x, y in relied]
        mb, ma = sum(xs) / len(xs), sum(ys) / len(ys)
        floor = (1 - tol.reliance) * mb
        broken, interval = interval_rule(xs, ys, not ma >= floor, tol)
        row = Row(
            f"{len(relied)} cases",
            "mean cited drop",
            mb,
            ma,
            tol.reliance * mb,
            broken,
            f"(may fall to {floor:.3g} nats)",
            interval,
        )
        context = [
            Row(x.id, "drop", bx, by, tol.reliance * bx, True, f"({relied_chunks(x)} removed)")
            for (x, _), bx, by in zip(relied, xs, ys)
            if not by >= (1 - tol.reliance) * bx
        ]
        return Comparison([row], context if broken else [], left_out, f"mean drop {mb:.3f} -> {ma:.3f} nats")


@register
class DocumentAttribution(AuditInvariant):
    """Rung 3: the chunk whose removal hurts an answer most is the baseline's on at least ``attribution`` of the relied cases."""

    name = "document_attribution"
    guards = "which document each answer rests on"
    tolerances = {
        "attribution": Tolerance(0.8, "least share of relied audit cases whose top chunk is the baseline's", minimum=0),
    }
    reads = ("min_reliance",)
    held = "answers of {build} rest on the same documents as in the {against}"
    moved = "answers of {build} rest on other documents than in the {against}"

    def compare(self, before: Record, after: Record, tol: Tolerances) -> Comparison:
        relied, left_out, refused = audit_pairs(before, after, tol)
        if refused:
            return Comparison(nothing=refused)
        if not relied:
            return Comparison(left_out=left_out, nothing=NONE_RELIED + literal(left_out), nothing_is_skip=True)
        other = [(x, y) for x, y in relied if x.top_chunk != y.top_chunk]
        share = 1 - len(other) / len(relied)
        broken = not share >= tol.attribution
        row = Row(
            f"{len(relied)} cases",
            "top chunk agrees",
            1.0,
            share,
            1 - tol.attribution,
            broken,
            f"(at least {tol.attribution:g} of the cases)",
        )
        context = [
            Row(
                x.id,
                "top chunk",
                float(x.top_chunk),
                float(y.top_chunk),
                0.0,
                True,
                f"(chunk {x.top_chunk} -> chunk {y.top_chunk})",
            )
            for x, y in other
        ]
        return Comparison(
            [row], context if broken else [], left_out, f"{len(relied) - len(other)} of {len(relied)} agree"
        )


@register
class AnswerLogprob(AuditInvariant):
    """Rung 3: the answers' log-probability per token with every chunk present moves by at most ``answer_logprob`` nats (mean over the slice's cases)."""

    name = "answer_logprob"
    guards = "the answers' log-probability"
    tolerances = {
        "answer_logprob": Tolerance(
            0.25, "|delta answer log-probability per token| of an audit slice, mean over cases, nats"
        ),
    }
    reads = ("outside_interval",)
    held = "answers of {build} as likely as in the {against}"
    moved = "answers of {build} changed their likelihood against the {against}"

    def compare(self, before: Record, after: Record, tol: Tolerances) -> Comparison:
        _, _, refused = audit_pairs(before, after, tol)
        if refused:
            return Comparison(nothing=refused)
        assert before.audit is not None and after.audit is not None
        pairs = list(zip(before.audit.cases, after.audit.cases))
        xs = [x.answer_logprob / x.answer_tokens for x, _ in pairs]
        ys = [y.answer_logprob / y.answer_tokens for _, y in pairs]
        mb, ma = sum(xs) / len(xs), sum(ys) / len(ys)
        broken, interval = interval_rule(xs, ys, not abs(ma - mb) <= tol.answer_logprob, tol)
        row = Row(f"{len(pairs)} cases", "answer logprob/token", mb, ma, tol.answer_logprob, broken, "", interval)
        moved = sorted(
            ((x, bx, by) for (x, _), bx, by in zip(pairs, xs, ys) if not abs(by - bx) <= tol.answer_logprob),
            key=lambda t: -abs(t[2] - t[1]),
        )
        context = [Row(x.id, "logprob/token", bx, by, tol.answer_logprob, True) for x, bx, by in moved[:10]]
        return Comparison([row], context if broken else [], detail=f"mean {mb:.3f} -> {ma:.3f} nats per token")
