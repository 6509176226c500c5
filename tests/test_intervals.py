"""Sampling intervals: per-sequence figures, their t intervals, and the "outside the interval" rule."""

from __future__ import annotations

import copy
import json

import numpy as np
import pytest
import torch
from scipy import stats as scipy_stats

from pytest_circuits.errors import BaselineCorrupt
from pytest_circuits.gate.invariants import evaluate, format_rows, gate_all, key_heads
from pytest_circuits.gate.stats import excludes_zero, mean_interval, paired_interval
from pytest_circuits.gate.tolerances import Tolerances
from pytest_circuits.model.builds import load_build
from pytest_circuits.model.loading import resolve_model
from pytest_circuits.record.figures import SAMPLED_MODEL_FIGURES, interval_key, sequences_key
from pytest_circuits.record.store import dumps, read_baseline, validate
from pytest_circuits.run.assemble import interval_of
from pytest_circuits.rungs.knockout import knockout_scan
from pytest_circuits.rungs.plain_loops import plain_knockout_deltas
from pytest_circuits.rungs.probe import run_repeat_probe
from pytest_circuits.rungs.repeat import bos_offset, repeat_tokens
from pytest_circuits.rungs.repeat_settings import RepeatSettings
from pytest_circuits.testing import negate_head_ov

from .conftest import LEGACY_BASELINE, needs_embedded
from .scan_records import complete

TOL = Tolerances()
PLAIN = Tolerances(outside_interval=False)
KO = sequences_key("knockout_delta")


# ---------------------------------------------------------------- the interval, against scipy by hand


def by_hand(x) -> tuple[float, float]:
    x = np.asarray(x, float)
    half = scipy_stats.t.ppf(0.975, df=x.size - 1) * np.std(x, ddof=1) / np.sqrt(x.size)
    return x.mean() - half, x.mean() + half


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_intervals_equal_scipy_t_by_hand(seed):
    rng = np.random.default_rng(seed)
    before = rng.normal(3.0, 1.0, 8)
    after = before + rng.normal(0.2, 0.1, 8)
    assert mean_interval(before) == pytest.approx(by_hand(before), rel=1e-12)
    assert paired_interval(before, after) == pytest.approx(by_hand(after - before), rel=1e-12)
    ci = scipy_stats.ttest_rel(after, before).confidence_interval(0.95)  # scipy's own paired t interval
    assert paired_interval(before, after) == pytest.approx((ci.low, ci.high), rel=1e-10)
    # pairing matters: the unpaired spread of the sequences is far wider than that of the change
    unpaired = by_hand(after)[1] - by_hand(after)[0]
    assert paired_interval(before, after)[1] - paired_interval(before, after)[0] < unpaired / 3


def test_no_interval_without_two_values_or_pairing():
    assert mean_interval([1.0]) is None and mean_interval([1.0, float("nan")]) is None
    assert paired_interval([1.0, 2.0], [1.0, 2.0, 3.0]) is None
    assert paired_interval([1.0, 2.0], [1.5, 2.5]) == (0.5, 0.5)  # every sequence moved by the same amount
    assert excludes_zero((0.5, 0.5)) and not excludes_zero((0.0, 0.0)) and not excludes_zero((-0.1, 0.3))
    assert not excludes_zero(None)


# ---------------------------------------------------------------- per-sequence figures average to the recorded ones


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from pytest_circuits.testing import save_tiny_model

    folder = save_tiny_model("llama", tmp_path_factory.mktemp("llama"), seed=2, initializer_range=0.2)
    return load_build(resolve_model(str(folder)), "fp32", "cpu")


def own_sequence_losses(model, ids, L, offset) -> tuple[np.ndarray, np.ndarray]:
    """Per-sequence first-copy and copy losses, one sequence and one plain forward at a time."""
    first, copy_ = [], []
    with torch.no_grad():
        for row in ids:
            logp = torch.log_softmax(model(input_ids=row[None]).logits[0].double(), dim=-1)
            ce = -logp[:-1].gather(1, row[1:, None])[:, 0]  # ce[c] predicts position c + 1
            first.append(float(ce[offset : offset + L - 1].mean()))
            copy_.append(float(ce[offset + L : offset + 2 * L - 1].mean()))
    return np.array(first), np.array(copy_)


def test_probe_keeps_per_sequence_losses_that_average_to_its_figures(tiny):
    settings = RepeatSettings(0, 5, 10)
    probe = run_repeat_probe(tiny, settings, batch_size=2)
    ids = repeat_tokens(tiny.tokens, settings.n, settings.L, settings.seed)
    first, copy_ = own_sequence_losses(tiny.model, ids, settings.L, bos_offset(tiny.tokens))
    np.testing.assert_allclose(probe.copy_losses, copy_, rtol=1e-5)
    np.testing.assert_allclose(probe.first_copy_losses, first, rtol=1e-5)
    seq = probe.sequence_figures()
    assert np.mean(seq["copy_loss_sequences"]) == pytest.approx(probe.copy_loss, abs=1e-12)
    assert np.mean(seq["first_copy_loss_sequences"]) == pytest.approx(probe.first_copy_loss, abs=1e-12)
    assert np.mean(seq["copy_gain_sequences"]) == pytest.approx(probe.copy_gain, abs=1e-12)


def test_knockout_deltas_per_sequence_average_to_the_delta(tiny):
    settings = RepeatSettings(1, 5, 10)
    frame = knockout_scan(tiny, settings, heads=["L0H1", "L1H2"], batch_size=2, progress=False)
    _, naive = plain_knockout_deltas(tiny, settings, heads=["L0H1", "L1H2"], batch_size=5)
    ids = repeat_tokens(tiny.tokens, settings.n, settings.L, settings.seed)
    offset = bos_offset(tiny.tokens)
    _, intact = own_sequence_losses(tiny.model, ids, settings.L, offset)
    for label, layer, head in (("L0H1", 0, 1), ("L1H2", 1, 2)):
        row = frame.set_index("head").loc[label]
        per_sequence = np.asarray(row[KO])
        assert per_sequence.shape == (settings.n,)
        assert per_sequence.mean() == pytest.approx(row["knockout_delta"], abs=1e-12)
        assert row["knockout_delta"] == pytest.approx(naive[label], abs=1e-6)
        # independent: W_O's columns of the head zeroed, each sequence's own forward
        edited, d = copy.deepcopy(tiny.model), tiny.geometry.d_head
        with torch.no_grad():
            edited.model.layers[layer].self_attn.o_proj.weight[:, head * d : (head + 1) * d] = 0
        _, knocked = own_sequence_losses(edited, ids, settings.L, offset)
        assert np.abs(knocked - intact).max() > 1e-2, "the test model is too weak to show a knockout"
        np.testing.assert_allclose(per_sequence, knocked - intact, atol=1e-5)
    assert frame.set_index("head").loc["L0H0", KO] is None  # no exact knockout ran there


# ---------------------------------------------------------------- records: stored, validated, gated


@pytest.fixture(scope="module")
def embedded_records(tmp_path_factory):
    """Live fp32 records of the embedded model, of a copy with its induction head's OV negated."""
    from transformers import AutoModelForCausalLM

    from pytest_circuits.run.run import Run
    from pytest_circuits.settings import CircuitsSettings

    probe = RepeatSettings(0, 8, 32)
    base = Run(CircuitsSettings(model="tiny-induction", device="cpu", probe=probe))
    reference = json.loads(dumps(base.records.record("fp32").data))  # as a baseline file holds it
    induction = key_heads(reference, "prefix_matching", 1, 0.0)[0]
    model = AutoModelForCausalLM.from_pretrained(base.loaded.source.folder, dtype=torch.float32)
    negate_head_ov(model, int(induction[1]), int(induction.split("H")[1]))
    folder = tmp_path_factory.mktemp("negated")
    model.save_pretrained(folder, safe_serialization=True)
    edited = Run(CircuitsSettings(model=str(folder), device="cpu", probe=probe))
    return reference, json.loads(dumps(edited.records.record("fp32").data))


@needs_embedded
def test_record_stores_per_sequence_figures_and_their_intervals(embedded_records):
    record, _ = embedded_records
    validate(record, "the live record")
    for name in SAMPLED_MODEL_FIGURES:
        values = record[sequences_key(name)]
        assert len(values) == record["probe"]["n"]
        assert np.mean(values) == pytest.approx(record[name], rel=1e-5, abs=1e-6)
        assert record[interval_key(name)] == pytest.approx(by_hand(values), rel=1e-5)
    measured = [h for h in record["heads"] if h["knockout_delta"] is not None]
    assert measured and all(len(h[KO]) == record["knockout"]["n"] for h in measured)
    for h in measured:
        assert np.mean(h[KO]) == pytest.approx(h["knockout_delta"], rel=1e-5, abs=1e-6)
        assert h[interval_key("knockout_delta")] == pytest.approx(interval_of(h[KO]), rel=1e-5, abs=1e-6)


@needs_embedded
def test_schema_refuses_sequences_that_do_not_match(embedded_records):
    record, _ = embedded_records
    short = copy.deepcopy(record)
    short["copy_loss_sequences"] = short["copy_loss_sequences"][:-1]
    with pytest.raises(BaselineCorrupt, match="copy_loss_sequences holds 7 values but the probe has n=8"):
        validate(short, "a record")
    off = copy.deepcopy(record)
    off["copy_loss_sequences"] = [v + 0.1 for v in off["copy_loss_sequences"]]
    with pytest.raises(BaselineCorrupt, match="copy_loss_sequences average"):
        validate(off, "a record")
    negative = copy.deepcopy(record)
    negative["copy_loss_sequences"][0] = -1.0
    with pytest.raises(BaselineCorrupt, match="copy_loss_sequences"):
        validate(negative, "a record")


@needs_embedded
def test_old_baselines_validate_and_gate_on_the_plain_tolerance(embedded_records):
    """A shipped baseline (no per-sequence figures) still gates: the row says the interval is not
    available and the plain tolerance decides, in both states of the rule."""
    live, _ = embedded_records
    old = read_baseline(LEGACY_BASELINE)
    assert sequences_key("copy_loss") not in old
    old = {**old, "probe": live["probe"], "knockout": live["knockout"]}  # the live scan's shorter L
    note = "interval not available (baseline recorded without per-sequence figures; re-record)"
    for tol in (TOL, PLAIN):
        tight = tol.updated({"copy_loss": 1e-6})
        result = evaluate("copy_loss", old, live, tight, "fp32", "old baseline")
        assert result.status == "failed" and note in result.message and "plain tolerance applies" in result.message
        assert result.moved[0]["interval"] is None
        assert evaluate("knockout_deltas", old, live, tol, "fp32", "old baseline").status in ("passed", "failed")
    passed = evaluate("copy_loss", old, live, TOL.updated({"copy_loss": 10, "copy_gain": 10}), "fp32", "old")
    assert passed.passed and note in passed.message


# ---------------------------------------------------------------- the rule, both states


def sampled(copy_losses, first_copy_losses) -> dict:
    """A record of the two invariants' figures from per-sequence values."""
    c, f = np.asarray(copy_losses, float), np.asarray(first_copy_losses, float)
    return complete(
        {
            "copy_loss": float(c.mean()),
            "first_copy_loss": float(f.mean()),
            "copy_gain": float((f - c).mean()),
            "copy_loss_sequences": c.tolist(),
            "first_copy_loss_sequences": f.tolist(),
            "copy_gain_sequences": (f - c).tolist(),
        }
    )


def test_sampling_noise_passes_with_the_rule_and_fails_without():
    rng = np.random.default_rng(14)  # a draw whose mean noise is beyond 0.25 (asserted below)
    base = rng.normal(3.0, 1.0, 8) + 3.0  # + 3: a copy loss is never negative
    first = base + 11.0
    noise = rng.normal(0.0, 0.6, 8)  # no systematic change: pure per-sequence noise
    before, after = sampled(base, first), sampled(base + noise, first)
    change = noise.mean()
    low, high = by_hand(noise)
    assert abs(change) > TOL.copy_loss and low < 0 < high  # beyond the tolerance, inside the noise
    spared = evaluate("copy_loss", before, after, TOL, "noisy", "fp32")
    assert spared.passed and "within sampling noise" in spared.message
    assert f"{change:+.3f} [{low:+.3f}, {high:+.3f}]" in spared.message
    plain = evaluate("copy_loss", before, after, PLAIN, "noisy", "fp32")
    assert plain.status == "failed" and plain.moved[0]["interval"] == pytest.approx([low, high])
    assert f"{change:+.3f} [{low:+.3f}, {high:+.3f}] (tolerance 0.25)" in plain.message


def test_a_consistent_change_fails_in_both_states():
    rng = np.random.default_rng(4)
    base = rng.normal(3.0, 1.0, 8)
    before, after = sampled(base, base + 11), sampled(base + 0.3 + rng.normal(0, 0.02, 8), base + 11)
    for tol in (TOL, PLAIN):
        result = evaluate("copy_loss", before, after, tol, "b", "a")
        assert result.status == "failed" and result.moved[0]["metric"] == "copy_loss"
        low, high = result.moved[0]["interval"]
        assert low > 0 and (low, high) == pytest.approx(by_hand(np.asarray(after["copy_loss_sequences"]) - base))
    small = sampled(base + 0.1 + rng.normal(0, 0.02, 8), base + 11)  # outside the noise but within tolerance
    assert evaluate("copy_loss", before, small, TOL, "b", "a").passed


def test_rule_is_a_tolerance_flag():
    assert TOL.outside_interval is True
    for word, value in (("off", False), ("0", False), ("false", False), ("on", True), ("1", True), (True, True)):
        assert TOL.updated({"outside_interval": word}).outside_interval is value
    with pytest.raises(ValueError, match="outside_interval must be true or false"):
        TOL.updated({"outside_interval": "maybe"})


@needs_embedded
def test_sabotage_fails_under_the_rule_and_the_knockout_rows_carry_intervals(embedded_records):
    reference, negated = embedded_records
    results = {r.invariant: r for r in gate_all(reference, negated, TOL, "negated", "fp32 baseline")}
    for name in ("copy_loss", "knockout_deltas"):
        assert results[name].status == "failed", results[name].message
        broken = [m for m in results[name].moved if m["broken"]]
        assert broken and all(m["interval"] is not None and excludes_zero(m["interval"]) for m in broken)
    same = {r.invariant: r for r in gate_all(reference, reference, TOL, "fp32", "fp32 baseline")}
    assert same["copy_loss"].passed and "dcopy_loss +0.000 [+0.000, +0.000]" in same["copy_loss"].message


def test_rows_print_change_and_interval():
    from pytest_circuits.gate.invariants import Row

    text = format_rows([Row("model", "copy_loss", 2.723, 3.010, 0.25, True, "", (0.21, 0.37))])
    assert "+2.723 -> +3.010: +0.287 [+0.210, +0.370] (tolerance 0.25)" in text


# ---------------------------------------------------------------- where the intervals are shown


@needs_embedded
def test_circuits_diff_and_scan_lines_show_the_intervals(embedded_records, tmp_path, capsys):
    from pytest_circuits.cli import main
    from pytest_circuits.record.schema import Record
    from pytest_circuits.show import model_lines

    reference, negated = embedded_records
    (tmp_path / "a.json").write_text(dumps(reference))
    (tmp_path / "b.json").write_text(dumps(negated))
    assert main(["diff", str(tmp_path / "a.json"), str(tmp_path / "b.json")]) == 0
    out = capsys.readouterr().out
    low, high = paired_interval(reference["copy_loss_sequences"], negated["copy_loss_sequences"])
    change = negated["copy_loss"] - reference["copy_loss"]
    assert f"({change:+.4f} [{low:+.3f}, {high:+.3f}])" in out
    old = read_baseline(LEGACY_BASELINE)
    (tmp_path / "old.json").write_text(dumps({**old, "probe": reference["probe"], "knockout": reference["knockout"]}))
    assert main(["diff", str(tmp_path / "old.json"), str(tmp_path / "b.json")]) == 0
    assert "[" not in next(line for line in capsys.readouterr().out.splitlines() if "copy_loss " in line)
    low, high = reference["copy_loss_interval"]
    assert f"copy_loss {reference['copy_loss']:.4f} [{low:.4f}, {high:.4f}]" in model_lines(Record.of(reference))[1]


@needs_embedded
def test_report_reads_the_intervals(embedded_records):
    from pytest_circuits.report import data

    reference, negated = embedded_records
    paired = paired_interval(reference["copy_loss_sequences"], negated["copy_loss_sequences"])
    assert data.model_interval(negated, reference, "copy_loss") == f"[{paired[0]:+.3f}, {paired[1]:+.3f}]"
    own = reference["copy_loss_interval"]
    assert data.model_interval(reference, None, "copy_loss") == f"[{own[0]:.3f}, {own[1]:.3f}]"
    old = read_baseline(LEGACY_BASELINE)
    assert "baseline recorded without per-sequence figures" in data.model_interval(negated, old, "copy_loss")
    assert data.model_interval(negated, reference, "uniform_loss") == ""


def test_a_failure_lists_the_rows_the_rule_spared():
    rng = np.random.default_rng(14)
    base = rng.normal(3.0, 1.0, 8) + 3.0  # + 3: a copy loss is never negative
    noise = rng.normal(0.0, 0.6, 8)  # copy loss: beyond 0.25, inside the noise (as above)
    first = base + 11.0 + noise + 0.5 + rng.normal(0, 0.02, 8)  # copy gain: +0.5 on every sequence
    result = evaluate("copy_loss", sampled(base, base + 11.0), sampled(base + noise, first), TOL, "b", "a")
    assert result.status == "failed"
    by_metric = {m["metric"]: m for m in result.moved}
    assert by_metric["copy_gain"]["broken"] and not by_metric["copy_loss"]["broken"]
    assert "within sampling noise" in by_metric["copy_loss"]["note"]
    assert "copy_loss" in result.message.split("\n", 2)[2]  # the spared row is shown under the broken one
