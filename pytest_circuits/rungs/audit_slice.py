"""The audit slice of rung 3 (docs/audit.md): a team's own question-answer cases over documents, read
from JSONL and checked line by line. No torch: the plugin and the CLI read it before any model loads.

One JSON object per line (blank lines are skipped):

- ``chunks``: a non-empty list of non-empty strings, the documents retrieved for the question;
- ``question``: a non-empty string;
- ``answer``: the reference answer, a string that is not blank;
- ``cited`` (optional): distinct indices into ``chunks`` of the chunks the answer should rest on;
- ``id`` (optional): the case's name in messages (default ``line N``), unique in the file;
- ``template`` (optional): the prompt, holding ``{documents}`` and ``{question}`` once each
  (default `DEFAULT_TEMPLATE`); the chunks present are joined by `CHUNK_SEPARATOR` into ``{documents}``.

A bad line is one `AuditSliceError` naming ``file:line``, the field and the fix.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import CircuitsError, did_you_mean
from ..fsio import read_utf8

DEFAULT_TEMPLATE = "{documents}\n\n{question}"
CHUNK_SEPARATOR = "\n\n"
FIELDS = ("chunks", "question", "answer", "cited", "id", "template")
REQUIRED = ("chunks", "question", "answer")
MAX_BYTES = 64 * 1024 * 1024  # a slice larger than this is refused, not read into memory
EXAMPLES = Path(__file__).resolve().parent.parent / "examples"  # the shipped slices (docs/audit.md)


class AuditSliceError(CircuitsError):
    """A slice file that cannot be read, or one of its lines that is not a case."""


@dataclass(frozen=True)
class AuditCase:
    """One case of the slice: where it is (``line``), its name, its documents, question and answer."""

    line: int
    id: str
    chunks: tuple[str, ...]
    question: str
    answer: str
    cited: tuple[int, ...] | None
    template: str

    def prompt(self, keep: tuple[int, ...] | None = None) -> str:
        """The prompt with the chunks ``keep`` (default: every chunk), in their order."""
        kept = range(len(self.chunks)) if keep is None else keep
        documents = CHUNK_SEPARATOR.join(self.chunks[i] for i in kept)
        head, _, tail = self.template.partition("{documents}")
        # each placeholder is replaced once, where it stands: a brace in a chunk or the question is kept as it is
        return head.replace("{question}", self.question) + documents + tail.replace("{question}", self.question)


@dataclass(frozen=True)
class AuditSlice:
    """The cases of one slice file, its path and the sha256 of its bytes (a baseline names the slice it audited)."""

    path: Path
    sha256: str
    cases: tuple[AuditCase, ...]

    def where(self, case: AuditCase) -> str:
        """``slice.jsonl:7``: the case's line, for messages."""
        return f"{self.path}:{case.line}"


def slice_file(text: str | Path) -> Path:
    """The slice file a user typed: the path itself when it exists or names a folder; a bare name of a
    shipped example (``tiny-induction-audit``, with or without ``.jsonl``) that is no file here, the example."""
    path = Path(text)
    if path.exists() or len(path.parts) != 1:
        return path
    shipped = EXAMPLES / (path.name.removesuffix(".jsonl") + ".jsonl")
    return shipped if shipped.is_file() else path


def read_slice(path: str | Path, said: str = "--circuits-audit") -> AuditSlice:
    """The checked cases of the slice at ``path`` (`slice_file`; ``said``: the flag that named it)."""
    path = slice_file(path)
    data, text = read_utf8(
        path, said, "a JSONL audit slice", AuditSliceError, MAX_BYTES, "split the slice into smaller files"
    )
    cases: list[AuditCase] = []
    seen: dict[Any, int] = {}
    for number, raw in enumerate(text.splitlines(), start=1):
        if not raw.strip():
            continue
        case = _case(path, number, raw)
        for key, what in ((("id", case.id), "id"), ((case.chunks, case.question, case.answer), "case")):
            if key in seen:
                fix = "give each case its own id" if what == "id" else "remove the repeat"
                raise AuditSliceError(f"{path}:{number}: duplicate {what} of line {seen[key]}; {fix}")
            seen[key] = number
        cases.append(case)
    if not cases:
        raise AuditSliceError(f"{said} {path} holds no case; write one JSON object per line (docs/audit.md)")
    return AuditSlice(path, hashlib.sha256(data).hexdigest(), tuple(cases))


def _case(path: Path, number: int, raw: str) -> AuditCase:
    """One line as a case, or the one-line error of its first problem."""

    def bad(what: str) -> AuditSliceError:
        return AuditSliceError(f"{path}:{number}: {what}")

    try:
        value = json.loads(raw)
    except json.JSONDecodeError as error:
        raise bad(f"not JSON ({error.msg} at column {error.colno}); write one JSON object per line") from None
    if not isinstance(value, dict):
        raise bad(
            f"is a JSON {type(value).__name__}, not an object; write one object per line with chunks, question, answer"
        )
    for key in value:
        if key not in FIELDS:
            raise bad(f"unknown field {key!r}{did_you_mean(key, FIELDS)}; the fields are {', '.join(FIELDS)}")
    for key in REQUIRED:
        if key not in value:
            raise bad(f"missing field {key!r}; every case needs {', '.join(REQUIRED)}")
    chunks = value["chunks"]
    if not isinstance(chunks, list) or not chunks:
        raise bad("chunks must be a non-empty list of strings; give the documents of the case as a list")
    for i, chunk in enumerate(chunks):
        if not isinstance(chunk, str) or not chunk.strip():
            raise bad(f"chunks[{i}] must be a non-empty string, got {_short(chunk)}; drop it or give its text")
    for key in ("question", "answer"):
        if not isinstance(value[key], str) or not value[key].strip():
            raise bad(
                f"{key} is empty; give the case's {key} text"
                if isinstance(value[key], str)
                else f"{key} must be a string, got {_short(value[key])}; give the case's {key} text"
            )
    cited = value.get("cited")
    if cited is not None:
        if not isinstance(cited, list) or not cited:
            raise bad(
                f"cited must be a non-empty list of chunk indices, got {_short(cited)}; list them or leave it out"
            )
        for index in cited:
            if not isinstance(index, int) or isinstance(index, bool):
                raise bad(f"cited holds {_short(index)}, not a chunk index; use integers 0..{len(chunks) - 1}")
            if not 0 <= index < len(chunks):
                raise bad(
                    f"cited index {index} is out of range: the case has {len(chunks)} chunks (0..{len(chunks) - 1}); "
                    "indices count from 0"
                )
        if len(set(cited)) != len(cited):
            raise bad(f"cited names a chunk twice ({cited}); name each cited chunk once")
    name = value.get("id", f"line {number}")
    if not isinstance(name, str) or not name.strip():
        raise bad(f"id must be a non-empty string, got {_short(name)}; name the case or leave id out")
    template = value.get("template", DEFAULT_TEMPLATE)
    if not isinstance(template, str):
        raise bad(
            f"template must be a string, got {_short(template)}; give the prompt with {{documents}} and {{question}}"
        )
    for slot in ("{documents}", "{question}"):
        if template.count(slot) != 1:
            raise bad(f"template holds {slot} {template.count(slot)} times; it needs it exactly once")
    return AuditCase(
        number,
        name.strip(),
        tuple(chunks),
        value["question"],
        value["answer"],
        None if cited is None else tuple(cited),
        template,
    )


def _short(value: Any) -> str:
    text = json.dumps(value) if not isinstance(value, str) else repr(value)
    return text if len(text) <= 40 else text[:37] + "..."
