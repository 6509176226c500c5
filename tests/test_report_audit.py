"""The report's heat map of rung 3 (issue 53, item 6): the per-case chunk drops, cases x chunks, the
baseline beside the build, drawn when the record audited a slice and only then."""

from __future__ import annotations

import copy

import numpy as np

from pytest_circuits.report import REPORT_PAGE, SUMMARY_PAGE, write_report
from pytest_circuits.report.plots import audit_drops_figure

from .test_report import fake_record

BASELINE_DROPS = {"ledger-vault": [0.2, 29.5, 0.1], "two-sources": [14.0, 13.0], "no-document-needed": [0.3, 0.2, 0.1]}
BROKEN_DROPS = {"ledger-vault": [0.0, 0.4, 0.0], "two-sources": [0.1, 0.2], "no-document-needed": [0.1, 0.0, 0.0]}


def with_audit(record: dict, drops: dict[str, list[float]]) -> dict:
    cases = [
        {
            "id": case,
            "answer_tokens": 3,
            "answer_logprob": -1.0,
            "chunk_drops": values,
            "cited": None,
            "cited_drop": None,
            "top_chunk": int(np.argmax(values)),
        }
        for case, values in drops.items()
    ]
    audit = {"slice_sha256": "0" * 64, "slice_name": "team.jsonl", "n_cases": len(cases), "tokens": "words"}
    return {**copy.deepcopy(record), "audit": {**audit, "cases": cases}}


def test_the_report_draws_the_chunk_drops_of_an_audit_gate_and_not_without_one(tmp_path):
    reference, candidate = fake_record("fp32"), fake_record("bnb-nf4", dtype="nf4")
    results = [{"invariant": "document_reliance", "build": "bnb-nf4", "against": "fp32 baseline", "passed": False}]
    audited = tmp_path / "audited"
    page = write_report(
        audited,
        [with_audit(reference, BASELINE_DROPS), with_audit(candidate, BROKEN_DROPS)],
        {"bnb-nf4": with_audit(reference, BASELINE_DROPS)},
        results,
    )
    text = page.read_text(encoding="utf-8")
    assert "bnb-nf4: chunk drops on team.jsonl" in text and "the baseline beside this build" in text
    assert (audited / "bnb-nf4-audit.png").is_file() and (audited / "fp32-audit.png").is_file()
    assert "`bnb-nf4-audit.png`" in (audited / SUMMARY_PAGE).read_text()
    plain = tmp_path / "plain"
    page = write_report(plain, [reference, candidate], {"bnb-nf4": reference}, [])
    assert "chunk drops" not in page.read_text(encoding="utf-8") and not list(plain.glob("*-audit.png"))
    assert page.name == REPORT_PAGE


def test_the_heat_map_holds_the_records_drops_case_by_case_on_one_scale():
    panels = [("baseline (fp32)", list(BASELINE_DROPS.items())), ("broken", list(reversed(BROKEN_DROPS.items())))]
    fig = audit_drops_figure(panels, "drops")
    axes = [ax for ax in fig.axes if ax.get_images()]
    assert [ax.get_title() for ax in axes] == ["baseline (fp32)", "broken"]
    ids = list(BASELINE_DROPS)
    assert [t.get_text() for t in axes[0].get_yticklabels()] == ids
    for ax, drops in zip(axes, (BASELINE_DROPS, BROKEN_DROPS)):
        image = ax.get_images()[0]
        grid = np.ma.filled(image.get_array(), np.nan)
        assert grid.shape == (3, 3)
        for row, case in enumerate(ids):  # rows matched by case id, whatever order a panel lists them in
            values = drops[case]
            assert np.allclose(grid[row, : len(values)], values)
            assert np.isnan(grid[row, len(values) :]).all()  # no such chunk: blank, never 0
        assert image.get_clim() == (-29.5, 29.5)  # one scale for both panels: the largest drop of either
