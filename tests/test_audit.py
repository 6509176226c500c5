"""Rung 3 on an audit slice: the figures against plain single forwards, the record's audit section, and
the three invariants on the shipped example (the embedded model: a benign build passes, a build whose
induction head is broken fails document_reliance naming the cases)."""

from __future__ import annotations

import copy
import hashlib
import json
import math

import pytest
import torch

from pytest_circuits.errors import CircuitsError
from pytest_circuits.gate.invariants import evaluate, gate_all, verdict
from pytest_circuits.gate.tolerances import Tolerances
from pytest_circuits.record.schema import Record
from pytest_circuits.record.store import read_record, round_sig, shipped_baselines
from pytest_circuits.rungs.audit import answer_logprobs, audit_figures
from pytest_circuits.rungs.audit_slice import AuditSlice, AuditSliceError, read_slice
from pytest_circuits.testing import requires_embedded_model

pytestmark = requires_embedded_model()
AUDIT = ("document_reliance", "document_attribution", "answer_logprob")


@pytest.fixture(scope="module")
def run():
    from pytest_circuits.run.run import Run
    from pytest_circuits.settings import CircuitsSettings

    return Run(CircuitsSettings(builds=("fp32", "rtn-int8"), device="cpu"))


@pytest.fixture(scope="module")
def example():
    return read_slice("tiny-induction-audit")


@pytest.fixture(scope="module")
def figures(run, example):
    """The fp32, rtn-int8 and broken (the induction head L1H0's W_O zeroed) figures of the example."""
    from pytest_circuits.run.sensitivity import Restorer, scale_head_ov

    fp32 = run.loaded.build("fp32")
    measured = {"fp32": audit_figures(fp32, example), "rtn-int8": audit_figures(run.loaded.build("rtn-int8"), example)}
    restorer = Restorer(fp32.model)
    scale_head_ov(fp32.model, 1, 0, 0.0)
    try:
        measured["broken"] = audit_figures(fp32, example)
    finally:
        restorer.restore()
    return measured


def plain_logprob(model, words: list[str], answer: list[str]) -> float:
    """An independent answer log-probability: one forward of the word ids, the answer's terms summed."""

    def wid(w: str) -> int:
        return int(hashlib.sha256(w.encode()).hexdigest()[:16], 16) % 512

    ids = [wid(w) for w in words + answer]
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids])).logits[0].double()
    logp = torch.log_softmax(logits, dim=-1)
    start = len(words)
    return sum(float(logp[start + j - 1, ids[start + j]]) for j in range(len(answer)))


def test_the_figures_match_a_loop_of_single_forwards(run, example, figures):
    model = run.loaded.build("fp32").model

    def without(case, removed: set[int]) -> float:
        kept = [w for i, c in enumerate(case.chunks) if i not in removed for w in c.split()]
        return plain_logprob(model, kept + case.question.split(), case.answer.split())

    for case, got in zip(example.cases, figures["fp32"].cases):
        answer = case.answer.split()
        full = without(case, set())
        assert got.answer_logprob == pytest.approx(full, abs=1e-4)
        assert got.answer_tokens == len(answer)
        for i, drop in enumerate(got.chunk_drops):
            assert drop == pytest.approx(full - without(case, {i}), abs=1e-4), (case.id, i)
        if case.cited is not None:
            assert got.cited_drop == pytest.approx(full - without(case, set(case.cited)), abs=1e-4)
        drops = got.chunk_drops
        assert got.top_chunk == drops.index(max(drops))


def test_batched_right_padded_forwards_equal_unbatched_ones(run):
    model = run.loaded.build("fp32").model
    sequences = [[5, 9, 11, 3, 7, 5, 9], [1, 2, 3, 4], [8, 8, 1, 5, 9, 2, 6, 4, 3, 10, 12]]
    batched = answer_logprobs(model, sequences, 2, rows=3, device="cpu")
    single = answer_logprobs(model, sequences, 2, rows=1, device="cpu")
    assert batched == pytest.approx(single, abs=1e-5)


def test_the_fp32_baseline_relies_on_the_cited_chunk(figures):
    for case in figures["fp32"].cases:
        if case.id == "no-document-needed":  # copied from its question: no chunk to rely on
            assert case.cited_drop is not None and case.cited_drop < 1.0
            continue
        relied = case.cited_drop if case.cited is not None else case.chunk_drops[case.top_chunk]
        assert relied > 10.0, case.id  # removing the chunk holding the answer: the copy is gone (nats)
        others = [d for i, d in enumerate(case.chunk_drops) if i not in (case.cited or (case.top_chunk,))]
        assert all(d < relied / 5 for d in others), case.id


def record_with(audit) -> Record:
    """The shipped fp32 record of tiny-induction with ``audit``'s section, rounded as a stored record is."""
    data = copy.deepcopy(read_record(shipped_baselines()["tiny-induction--fp32"]).data)
    data["audit"] = round_sig(audit.section())
    return Record.of(data)


def test_a_benign_build_passes_and_a_broken_induction_head_fails_reliance_naming_the_cases(figures):
    tol = Tolerances()
    baseline = record_with(figures["fp32"])
    for name in ("fp32", "rtn-int8"):
        results = [evaluate(n, baseline, record_with(figures[name]), tol, name, "fp32 baseline") for n in AUDIT]
        assert [r.status for r in results] == ["passed"] * 3, [r.message for r in results]
        assert "no-document-needed" in results[0].message  # reported, not gated
    broken = record_with(figures["broken"])
    result = evaluate("document_reliance", baseline, broken, tol, "broken", "fp32 baseline")
    assert result.status == "failed"
    assert result.message.startswith("document_reliance: 7 cases mean cited drop")
    for case in ("ledger-vault", "comet-survey", "two-sources", "clock-tower"):
        assert case in result.message
    assert "(cited chunks 0, 1 removed)" in result.message and "(top chunk 1 removed)" in result.message
    assert "1 case(s) the baseline does not rely on" in result.message and "no-document-needed" in result.message
    assert evaluate("answer_logprob", baseline, broken, tol, "broken", "fp32 baseline").status == "failed"


def test_attribution_names_the_cases_whose_top_chunk_moved(figures):
    baseline = record_with(figures["fp32"])
    moved = copy.deepcopy(figures["fp32"].section())
    moved["cases"][0]["chunk_drops"] = [30.0, 0.1, 0.2]
    moved["cases"][0]["top_chunk"] = 0
    data = copy.deepcopy(baseline.data)
    data["audit"] = round_sig(moved)
    result = evaluate(
        "document_attribution", baseline, Record.of(data), Tolerances(attribution=1.0), "b", "fp32 baseline"
    )
    assert result.status == "failed" and "ledger-vault" in result.message and "(chunk 1 -> chunk 0)" in result.message
    assert evaluate("document_attribution", baseline, Record.of(data), Tolerances(), "b", "x").status == "passed"  # 6/7


def test_a_baseline_of_another_slice_is_refused_in_one_line(figures):
    baseline = record_with(figures["fp32"])
    other = copy.deepcopy(baseline.data)
    other["audit"] = {**other["audit"], "slice_sha256": "0" * 64, "slice_name": "other.jsonl"}
    for name in AUDIT:
        result = evaluate(name, Record.of(other), baseline, Tolerances(), "fp32", "fp32 baseline")
        assert result.status == "failed"
        assert result.message.startswith("the fp32 baseline audited slice other.jsonl (sha256 000000000000...")
        assert "record the baseline again with this slice" in result.message and "\n" not in result.message


def test_audit_invariants_are_left_out_of_a_gate_where_neither_record_audits(figures):
    plain = read_record(shipped_baselines()["tiny-induction--fp32"])
    results = gate_all(plain, plain, Tolerances(), "fp32", "fp32 baseline")
    assert not {r.invariant for r in results} & set(AUDIT)
    assert verdict(results)[1] == f"gate passed ({len(results)} of {len(results)} invariants hold)"
    # run alone, one is skipped saying so; a baseline without the section fails, asking for it
    alone = evaluate("document_reliance", plain, plain, Tolerances(), "fp32", "fp32 baseline")
    assert alone.status == "skipped" and "no audit slice was given (--circuits-audit FILE)" in alone.message
    lacking = evaluate("document_reliance", plain, record_with(figures["fp32"]), Tolerances(), "fp32", "fp32 baseline")
    assert lacking.status == "failed" and "holds no audit figures; record it again with them" in lacking.message
    gated = gate_all(record_with(figures["fp32"]), plain, Tolerances(), "fp32", "fp32 baseline")
    assert [r.status for r in gated if r.invariant in AUDIT] == ["skipped"] * 3  # the baseline audits: not guarded


def test_the_audit_section_is_checked_where_a_record_enters(figures):
    good = record_with(figures["fp32"]).data
    assert (
        Record.of(good).audit is not None and Record.of({k: v for k, v in good.items() if k != "audit"}).audit is None
    )
    for edit, said in (
        (lambda a: a.update(n_cases=3), "audit.cases holds 8 cases, n_cases says 3"),
        (lambda a: a["cases"][0].update(top_chunk=5), "top_chunk 5 is not one of its 3 chunks"),
        (lambda a: a["cases"][0].update(cited_drop=None), "cited and cited_drop are given together"),
        (lambda a: a["cases"][0].update(answer_logprob=0.5), "answer_logprob"),
        (lambda a: a.update(tokens="bytes"), "audit.tokens"),
    ):
        bad = copy.deepcopy(good)
        edit(bad["audit"])
        with pytest.raises(CircuitsError, match="the scan record given is not valid") as caught:
            Record.of(bad)
        assert said in str(caught.value) and "\n" not in str(caught.value)


def test_a_model_without_a_tokenizer_other_than_the_embedded_one_is_refused(tmp_path, example):
    from pytest_circuits.run.run import Run
    from pytest_circuits.settings import CircuitsSettings
    from pytest_circuits.testing import save_tiny_model

    folder = save_tiny_model("llama", tmp_path / "m")
    build = Run(CircuitsSettings(model=str(folder), builds=("fp32",), device="cpu")).loaded.build("fp32")
    with pytest.raises(AuditSliceError, match="model m has no tokenizer, and an audit slice is text"):
        audit_figures(build, example)


def test_a_prompt_over_the_context_is_one_line_naming_its_line(run, tmp_path):
    long = {"chunks": [" ".join(f"w{i}" for i in range(300))], "question": "q", "answer": "a"}
    path = tmp_path / "long.jsonl"
    path.write_text(json.dumps({"chunks": ["x y"], "question": "x", "answer": "y"}) + "\n" + json.dumps(long) + "\n")
    with pytest.raises(
        AuditSliceError, match=r"long.jsonl:2: prompt and answer are 302 tokens, over the model's context of 256"
    ):
        audit_figures(run.loaded.build("fp32"), read_slice(path))
    first = AuditSlice(path, "0" * 64, read_slice(path).cases[:1])  # the line before it is fine
    assert math.isfinite(audit_figures(run.loaded.build("fp32"), first).cases[0].answer_logprob)


def test_a_model_with_a_tokenizer_reads_the_slice_through_it(tmp_path):
    """A tokenizer's ids: the prompt's with its special tokens, the answer's on their own after a space;
    the figures match one plain forward of those ids."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    from pytest_circuits.run.run import Run
    from pytest_circuits.settings import CircuitsSettings
    from pytest_circuits.testing import save_tiny_model

    folder = save_tiny_model("llama", tmp_path / "m")
    words = ["[UNK]", "[BOS]", "red", "fox", "jumps", "blue", "owl", "sleeps", "who"]
    core = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    core.post_processor = processors.TemplateProcessing(single="[BOS] $A", special_tokens=[("[BOS]", 1)])
    PreTrainedTokenizerFast(tokenizer_object=core, unk_token="[UNK]", bos_token="[BOS]").save_pretrained(folder)
    path = tmp_path / "s.jsonl"
    path.write_text(
        json.dumps({"chunks": ["red fox jumps", "blue owl sleeps"], "question": "who", "answer": "owl sleeps"}) + "\n"
    )
    from pytest_circuits.rungs.repeat_settings import RepeatSettings

    settings = CircuitsSettings(model=str(folder), builds=("fp32",), device="cpu", probe=RepeatSettings(L=16))
    build = Run(settings).loaded.build("fp32")
    got = audit_figures(build, read_slice(path))
    assert got.tokens == "tokenizer" and got.cases[0].answer_tokens == 2

    def plain(ids: list[int]) -> float:
        with torch.no_grad():
            logp = torch.log_softmax(build.model(input_ids=torch.tensor([ids + [6, 7]])).logits[0].double(), -1)
        return float(logp[len(ids) - 1, 6] + logp[len(ids), 7])

    full, without_0 = plain([1, 2, 3, 4, 5, 6, 7, 8]), plain([1, 5, 6, 7, 8])
    assert got.cases[0].answer_logprob == pytest.approx(full, abs=1e-4)
    assert got.cases[0].chunk_drops[0] == pytest.approx(full - without_0, abs=1e-4)


def test_scan_shows_the_audit_figures_per_case(figures):
    from pytest_circuits.show import audit_lines, model_lines

    record = record_with(figures["fp32"])
    lines = audit_lines(record)
    assert lines[0] == "audit slice tiny-induction-audit.jsonl (8 cases, words; nats):" and len(lines) == 9
    first = figures["fp32"].cases[0]
    drops = " ".join(f"{d:+.2f}" for d in first.chunk_drops)
    assert lines[1].startswith(f"  ledger-vault: answer logprob {first.answer_logprob:.3f}, chunk drops [{drops}]")
    assert lines[1].endswith(f"cited drop {first.cited_drop:+.2f}, top chunk 1")
    assert model_lines(record)[-9:] == lines
    assert not audit_lines(read_record(shipped_baselines()["tiny-induction--fp32"]))


def test_a_baseline_relying_on_no_case_skips_reliance_and_attribution_naming_them(figures):
    baseline, tol = record_with(figures["fp32"]), Tolerances(min_reliance=100.0)  # no drop reaches 100 nats
    for name in ("document_reliance", "document_attribution"):
        result = evaluate(name, baseline, record_with(figures["broken"]), tol, "broken", "fp32 baseline")
        assert result.status == "skipped"
        assert result.message.startswith(
            "the fp32 baseline relies on none of the slice's cases; nothing to check; 8 case"
        )
    braces = copy.deepcopy(baseline.data)
    braces["audit"] = {**braces["audit"], "slice_sha256": "1" * 64, "slice_name": "odd{name}.jsonl"}
    result = evaluate("answer_logprob", Record.of(braces), baseline, Tolerances(), "fp32", "fp32 baseline")
    assert result.message.startswith("the fp32 baseline audited slice odd{name}.jsonl (sha256 111111111111...")


def test_the_preflight_refuses_a_case_the_model_cannot_read_before_any_weight_loads(tmp_path):
    from pytest_circuits.run.run import Run
    from pytest_circuits.settings import CircuitsSettings

    path = tmp_path / "s.jsonl"
    path.write_text(json.dumps({"chunks": ["a b"], "question": "a", "answer": "b"}) + "\n")
    path.write_text(path.read_text() + json.dumps({"chunks": ["x " * 255], "question": "y", "answer": "z"}) + "\n")
    run = Run(CircuitsSettings(builds=("fp32",), device="cpu", audit=read_slice(path)))
    with pytest.raises(AuditSliceError, match=r"s.jsonl:2: prompt and answer are 257 tokens, over the model's context"):
        run.loaded.preflight()
    assert run.loaded.loads == []  # no build was loaded
