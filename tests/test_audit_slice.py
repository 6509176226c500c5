"""The audit slice of rung 3 (rungs/audit_slice.py): the format, and one line per bad line."""

from __future__ import annotations

import json

import pytest

from pytest_circuits.rungs.audit_slice import (
    DEFAULT_TEMPLATE,
    EXAMPLES,
    AuditSliceError,
    read_slice,
    slice_file,
)

GOOD = {"chunks": ["alpha beta", "gamma {delta}"], "question": "what {x}?", "answer": "beta", "cited": [0]}


def write(tmp_path, *lines: object, raw: bytes | None = None):
    path = tmp_path / "slice.jsonl"
    if raw is not None:
        path.write_bytes(raw)
    else:
        path.write_text("".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines))
    return path


def test_a_good_slice_reads_with_its_hash_and_default_template(tmp_path):
    import hashlib

    path = write(tmp_path, GOOD, "", {**GOOD, "answer": "gamma", "id": "second", "cited": None})
    audit = read_slice(path)
    assert audit.sha256 == hashlib.sha256(path.read_bytes()).hexdigest()
    first, second = audit.cases
    assert (first.line, first.id, first.cited, first.template) == (1, "line 1", (0,), DEFAULT_TEMPLATE)
    assert (second.line, second.id, second.cited) == (3, "second", None)  # blank line 2 skipped
    # the template's placeholders are filled where they stand; braces in the text are kept as they are
    assert first.prompt() == "alpha beta\n\ngamma {delta}\n\nwhat {x}?"
    assert first.prompt((1,)) == "gamma {delta}\n\nwhat {x}?"


def test_a_case_template_places_documents_and_question(tmp_path):
    template = "Q: {question}\nContext:\n{documents}\nA:"
    case = read_slice(write(tmp_path, {**GOOD, "template": template})).cases[0]
    assert case.prompt((0,)) == "Q: what {x}?\nContext:\nalpha beta\nA:"


@pytest.mark.parametrize(
    "line, said",
    [
        ({"question": "q", "answer": "a"}, "missing field 'chunks'"),
        ({**GOOD, "answer": "  "}, "answer is empty"),
        ({**GOOD, "answer": 3}, "answer must be a string, got 3"),
        ({**GOOD, "cited": [2]}, "cited index 2 is out of range: the case has 2 chunks (0..1)"),
        ({**GOOD, "cited": [0, 0]}, "cited names a chunk twice"),
        ({**GOOD, "cited": [True]}, "cited holds true, not a chunk index"),
        ({**GOOD, "cited": []}, "cited must be a non-empty list"),
        ({**GOOD, "chunks": []}, "chunks must be a non-empty list of strings"),
        ({**GOOD, "chunks": ["a", ""]}, "chunks[1] must be a non-empty string"),
        ({**GOOD, "cite": [0]}, "unknown field 'cite' (did you mean 'cited'?)"),
        ({**GOOD, "template": "{question}"}, "template holds {documents} 0 times; it needs it exactly once"),
        ({**GOOD, "id": ""}, "id must be a non-empty string"),
        ("[1, 2]", "is a JSON list, not an object"),
        ('{"chunks": ["a"],', "not JSON"),
    ],
)
def test_a_bad_line_is_one_line_naming_file_line_and_field(tmp_path, line, said):
    path = write(tmp_path, GOOD, line)
    with pytest.raises(AuditSliceError) as caught:
        read_slice(path)
    message = str(caught.value)
    assert message.startswith(f"{path}:2: ") and said in message and "\n" not in message
    assert ";" in message or "JSON" in message  # the fix follows the problem


def test_duplicates_are_refused_naming_the_first(tmp_path):
    with pytest.raises(AuditSliceError, match=r"slice.jsonl:2: duplicate case of line 1; remove the repeat"):
        read_slice(write(tmp_path, GOOD, GOOD))
    with pytest.raises(AuditSliceError, match=r"slice.jsonl:2: duplicate id of line 1; give each case its own id"):
        read_slice(write(tmp_path, {**GOOD, "id": "x"}, {**GOOD, "answer": "alpha", "id": "x"}))


def test_files_that_are_no_slice_are_one_line(tmp_path):
    with pytest.raises(AuditSliceError, match=r"^--audit .*nope.jsonl: no such file; give the path"):
        read_slice(tmp_path / "nope.jsonl", said="--audit")
    with pytest.raises(AuditSliceError, match="holds no case"):
        read_slice(write(tmp_path, "", "  "))
    with pytest.raises(AuditSliceError, match=r"slice.jsonl:2: not UTF-8 text"):
        read_slice(write(tmp_path, raw=json.dumps(GOOD).encode() + b"\n\xff\xfe\n"))
    with pytest.raises(AuditSliceError, match="is a folder"):
        read_slice(tmp_path)


def test_the_shipped_example_is_found_by_name_and_a_file_here_comes_first(tmp_path, monkeypatch):
    assert slice_file("tiny-induction-audit") == EXAMPLES / "tiny-induction-audit.jsonl"
    assert len(read_slice("tiny-induction-audit.jsonl").cases) == 8
    monkeypatch.chdir(tmp_path)
    (tmp_path / "tiny-induction-audit.jsonl").write_text(json.dumps(GOOD) + "\n")
    assert len(read_slice("tiny-induction-audit.jsonl").cases) == 1


def test_the_shipped_example_is_answered_by_copying_from_its_cited_chunk():
    """Each answer is a span of one chunk (its cited one, where it names one), and the question ends with
    the words that precede that span there: what the embedded model's induction circuit can copy. The one
    case that needs no document copies from its question. No two words of a case share an id."""
    from pytest_circuits.rungs.audit import word_id

    for case in read_slice("tiny-induction-audit").cases:
        answer, question = case.answer.split(), case.question.split()
        ids = {word_id(w, 512) for w in set(" ".join((*case.chunks, case.question, case.answer)).split())}
        assert len(ids) == len(set(" ".join((*case.chunks, case.question, case.answer)).split())), case.id
        if case.id == "no-document-needed":
            assert all(w not in " ".join(case.chunks).split() for w in answer)
            continue
        holding = [i for i, c in enumerate(case.chunks) if " ".join(question + answer) in c]
        assert len(holding) == 1, case.id
        assert case.cited is None or holding[0] == case.cited[0], case.id
