"""Rung 3 on SmolLM2-135M (slow: 95 s on 2 shared CPU cores): the shipped example slice read
through SmolLM2's own tokenizer. Its fp32 baseline relies on the cited chunk of every case that has one;
a build with its induction heads broken fails document_reliance naming the cases; bf16 passes."""

from __future__ import annotations

import copy

import pytest

from pytest_circuits.gate.invariants import evaluate
from pytest_circuits.gate.tolerances import Tolerances
from pytest_circuits.record.schema import Record
from pytest_circuits.record.store import read_record, round_sig, shipped_baselines
from pytest_circuits.rungs.audit import audit_figures
from pytest_circuits.rungs.audit_slice import read_slice
from pytest_circuits.testing import requires_smollm2

pytestmark = [pytest.mark.slow, requires_smollm2()]
AUDIT = ("document_reliance", "document_attribution", "answer_logprob")
INDUCTION = 0.3  # prefix-matching score from which the shipped fp32 baseline counts a head as an induction head


def record_with(audit) -> Record:
    """SmolLM2's shipped fp32 record with ``audit``'s section, rounded as a stored record is."""
    data = copy.deepcopy(read_record(shipped_baselines()["smollm2-135m--fp32"]).data)
    data["audit"] = round_sig(audit.section())
    return Record.of(data)


def test_smollm2_relies_on_the_cited_chunk_and_fails_reliance_when_its_induction_heads_break():
    from pytest_circuits.run.run import Run
    from pytest_circuits.run.sensitivity import Restorer, scale_head_ov
    from pytest_circuits.settings import CircuitsSettings

    example = read_slice("tiny-induction-audit")
    run = Run(CircuitsSettings(model="smollm2-135m", builds=("fp32", "bf16"), device="cpu"))
    fp32 = run.loaded.build("fp32")
    measured = audit_figures(fp32, example)
    assert measured.tokens == "tokenizer"
    for case, got in zip(example.cases, measured.cases):
        if case.id == "no-document-needed":  # its answer is copied from its own question
            assert got.cited_drop is not None and got.cited_drop < 1.0
            continue
        holding = [i for i, chunk in enumerate(case.chunks) if case.answer in chunk]  # where the answer is a span
        assert got.top_chunk in holding, case.id
        relied = got.cited_drop if case.cited is not None else got.chunk_drops[got.top_chunk]
        assert relied is not None and relied > 10.0, case.id  # nats: removing it, the answer is far less likely
    baseline = record_with(measured)

    heads = [(h.layer, h.head_index) for h in baseline.heads if h.prefix_matching >= INDUCTION]
    assert len(heads) >= 4  # SmolLM2-135M spreads induction over several heads (layers 17-23)
    restorer = Restorer(fp32.model)
    for layer, head in heads:
        scale_head_ov(fp32.model, layer, head, 0.0)
    try:
        broken = record_with(audit_figures(fp32, example))
    finally:
        restorer.restore()
    result = evaluate("document_reliance", baseline, broken, Tolerances(), "broken", "fp32 baseline")
    assert result.status == "failed", result.message
    assert result.message.startswith("document_reliance: 7 cases mean cited drop")
    for case in example.cases:
        if case.id != "no-document-needed":
            assert case.id in result.message
    assert "reported, not gated: no-document-needed" in result.message

    benign = record_with(audit_figures(run.loaded.build("bf16"), example))
    results = [evaluate(name, baseline, benign, Tolerances(), "bf16", "fp32 baseline") for name in AUDIT]
    assert [r.status for r in results] == ["passed"] * 3, [r.message for r in results]
