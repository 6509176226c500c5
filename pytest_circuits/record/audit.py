"""The record's optional ``audit`` section: rung 3 on an audit slice (rungs/audit.py, docs/audit.md).

Its per-case figures are declared in the figure table (`figures.AUDIT_FIGURES`); the section names the
slice it measured (its file's sha256 and name, its case count) and how the text became ids, so a
baseline of another slice is refused (`other_slice`). Records without the section keep validating.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, create_model, model_validator

from . import figures

_STRICT = ConfigDict(strict=True, extra="allow", allow_inf_nan=False)
TOKENS = ("tokenizer", "words")  # the model's tokenizer, or the embedded model's word ids (rungs/audit.py)


def _field(figure: figures.Figure) -> tuple[Any, Any]:
    kind: Any = {"int": int, "float": float, "floats": float}[figure.kind]
    if figure.low is not None or figure.high is not None:
        kind = Annotated[kind, Field(ge=figure.low, le=figure.high)]
    if figure.kind == "floats":
        kind = Annotated[list[kind], Field(min_length=1)]
    return (kind | None, None) if figure.nullable else (kind, ...)


if TYPE_CHECKING:  # what mypy reads of the model built from the figure table (tests/test_audit.py checks it)

    class _CaseFigures(BaseModel):
        answer_tokens: int
        answer_logprob: float
        chunk_drops: list[float]
        cited_drop: float | None
        top_chunk: int

else:
    _CaseFigures = create_model(
        "_CaseFigures", __config__=_STRICT, **{f.name: _field(f) for f in figures.AUDIT_FIGURES}
    )


class AuditCaseRow(_CaseFigures):
    """One case: its name, the chunks it cites (None: none named) and its figures."""

    id: str = Field(min_length=1)
    cited: list[Annotated[int, Field(ge=0)]] | None = None

    @model_validator(mode="after")
    def _indices(self) -> AuditCaseRow:
        n = len(self.chunk_drops)
        if self.top_chunk >= n:
            raise ValueError(f"case {self.id}: top_chunk {self.top_chunk} is not one of its {n} chunks")
        if self.cited is not None and any(i >= n for i in self.cited):
            raise ValueError(f"case {self.id}: cited {self.cited} names a chunk beyond its {n} chunks")
        if (self.cited is None) != (self.cited_drop is None):
            raise ValueError(f"case {self.id}: cited and cited_drop are given together or not at all")
        return self


class AuditInfo(BaseModel):
    """The ``audit`` section: the slice (sha256 of its file, its name, ``n_cases``), the ids used, the cases."""

    model_config = _STRICT
    slice_sha256: str = Field(pattern=r"^[0-9a-f]{64}$")
    slice_name: str
    n_cases: int = Field(ge=1)
    tokens: Literal[TOKENS]  # type: ignore[valid-type]
    cases: list[AuditCaseRow]

    @model_validator(mode="after")
    def _count(self) -> AuditInfo:
        if len(self.cases) != self.n_cases:
            raise ValueError(f"audit.cases holds {len(self.cases)} cases, n_cases says {self.n_cases}")
        names = [c.id for c in self.cases]
        if len(set(names)) != len(names):
            raise ValueError("audit.cases names a case twice")
        return self


def literal(text: str) -> str:
    """``text`` kept as it is in a message the gate fills with `str.format` (its braces doubled)."""
    return text.replace("{", "{{").replace("}", "}}")


def other_slice(before: AuditInfo, after: AuditInfo) -> str:
    """Why two audit sections are not of one slice measured one way ("" when they are), a message with
    the gate's ``{against}`` and ``{build}`` to fill."""
    if before.slice_sha256 != after.slice_sha256 or before.n_cases != after.n_cases:
        return (
            f"the {{against}} audited slice {literal(before.slice_name)} (sha256 {before.slice_sha256[:12]}..., "
            f"{before.n_cases} cases), {{build}} slice {literal(after.slice_name)} (sha256 {after.slice_sha256[:12]}..., "
            f"{after.n_cases} cases): record the baseline again with this slice"
        )
    if before.tokens != after.tokens:
        return f"the {{against}} read the slice as {before.tokens}, {{build}} as {after.tokens}: record it again"
    return ""
