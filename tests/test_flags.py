"""Rung 1 flags: a head is flagged only when its BH q-value AND its effect ``|kappa - null mean|``
clear their thresholds (`rungs.kappa.set_flags`, `KappaMethod.min_effect`); the record says which
minimum effect flagged its heads, and flags of two minimum effects are never compared."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest

from pytest_circuits.assertions import assert_copying_heads_preserved
from pytest_circuits.model.weights import extract_weights
from pytest_circuits.record.kappa_method import FLAGS, LEGACY, KappaMethod, of_record, paired_figures
from pytest_circuits.rungs.kappa import SpectrumError, ov_spectrum, reflagged
from pytest_circuits.testing import make_tiny_model, pull_head_towards_copying

from .conftest import LEGACY_BASELINE

DEFAULT = KappaMethod().min_effect
SEEDS = (0, 1, 2)
WEAK, STRONG = "L0H0", "L0H1"  # pulled towards copying by t = weak (kappa ~0.02) and t = 3 (kappa near +1)


def _planted(d_head: int, weak: float):
    """One layer of two heads of ``d_head`` (two: the eigenproblems of 256-wide heads are the cost):
    L0H0 pulled towards copying by ``weak`` (significant at d_head 256 but tiny), L0H1 by 3 (a clear copier)."""
    shape = dict(num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2, hidden_size=d_head + 64)
    model = make_tiny_model(
        "llama", seed=0, randomize_norms=False, head_dim=d_head, vocab_size=2 * (d_head + 64), **shape
    )
    for head, t in enumerate((weak, 3.0)):
        pull_head_towards_copying(model, 0, head, t)
    return extract_weights(model)


def _expected_flags(frame: pd.DataFrame, q: float, min_effect: float) -> pd.DataFrame:
    """The flag rule from the frame's columns, written out: q <= q, effect >= min_effect, the sign."""
    out = {}
    for score, suffix in (("kappa", ""), ("kappa_trace", "_trace")):
        kept = (frame[f"{score}_q"] <= q) & ((frame[score] - frame[f"{score}_null_mean"]).abs() >= min_effect)
        out[f"copying{suffix}"] = kept & (frame[score] > 0)
        out[f"suppression{suffix}"] = kept & (frame[score] < 0)
    return pd.DataFrame(out)[list(FLAGS)]


@pytest.fixture(scope="module", params=[(256, 0.02), (64, 0.03)], ids=["d_head-256", "d_head-64"])
def scans(request):
    """The planted model scanned under three null seeds with the default method."""
    weights = _planted(*request.param)
    return request.param[0], [ov_spectrum(weights, seed=seed) for seed in SEEDS]


def test_default_flags_are_identical_across_null_seeds(scans):
    """With the default minimum effect the flags do not depend on the null's draw (the measured
    contrast at min effect 0 is in docs/definitions.md, "Flags that hold across null draws")."""
    d_head, frames = scans
    first = frames[0][list(FLAGS)]
    for frame in frames:
        assert frame.attrs["summary"]["min_effect"] == DEFAULT and frame.attrs["summary"]["d_head"] == d_head
        pd.testing.assert_frame_equal(frame[list(FLAGS)], _expected_flags(frame, 0.05, DEFAULT))
        pd.testing.assert_frame_equal(frame[list(FLAGS)], first)
    assert not first.loc[0, ["copying", "suppression"]].any()  # the weak head: |kappa| under the minimum effect


def test_a_copying_head_is_still_flagged_with_the_minimum_effect(scans):
    _, frames = scans
    for frame in frames:
        row = frame.set_index("head").loc[STRONG]
        assert row["kappa"] > 0.9 and row["kappa_trace"] > 0.9
        assert row["copying"] and row["copying_trace"] and not row["suppression"]
        assert frame.attrs["summary"]["n_copying"] == int(frame["copying"].sum()) >= 1


def test_min_effect_zero_flags_on_the_q_value_alone(scans):
    """min_effect 0 reproduces the q-only flags; at d_head 256 the weak head's kappa (~0.02, a few
    null sds of 0.007) is significant, so the minimum effect is what unflags it."""
    d_head, frames = scans
    for frame in frames:
        zero = reflagged(frame, 0.0)
        pd.testing.assert_frame_equal(zero[list(FLAGS)], _expected_flags(frame, 0.05, 0.0))
        assert zero.attrs["summary"]["min_effect"] == 0.0 and frame.attrs["summary"]["min_effect"] == DEFAULT
        again = reflagged(zero, DEFAULT)
        pd.testing.assert_frame_equal(again[list(FLAGS)], frame[list(FLAGS)])
        assert again.attrs["null_kappa"] is frame.attrs["null_kappa"]  # the same scan, flagged again
    if d_head == 256:
        weak = frames[0].set_index("head").loc[WEAK]
        assert abs(weak["kappa"]) < DEFAULT and weak["kappa_q"] <= 0.05  # significant, tiny
        assert reflagged(frames[0], 0.0).set_index("head").loc[WEAK, "copying"]
        assert not weak["copying"]


def test_min_effect_is_checked():
    weights = extract_weights(make_tiny_model("llama", seed=0))
    for bad in (-0.1, 2.0, True, "0.05"):
        with pytest.raises(SpectrumError, match="min_effect") as info:
            ov_spectrum(weights, n_rotations=4, min_effect=bad)
        assert "\n" not in str(info.value)
    frame = ov_spectrum(weights, n_rotations=8, min_effect=0.3)
    assert frame.attrs["summary"]["min_effect"] == 0.3
    assert not (
        frame[list(FLAGS)].any(axis=1) & (frame["kappa"].abs() < 0.3) & (frame["kappa_trace"].abs() < 0.3)
    ).any()


# ---------------------------------------------------------------- records: which minimum effect flagged the heads


def _record(min_effect: float | None, flip: str | None = None) -> dict:
    """The shipped (older) baseline told it was measured with today's method and ``min_effect``
    (None: the key left out), one head's copying flag flipped."""
    record = json.loads(LEGACY_BASELINE.read_text())
    rung1 = {**record["rung1"], **KappaMethod().as_dict()}
    if min_effect is None:
        del rung1["min_effect"]
    else:
        rung1["min_effect"] = min_effect
    record["rung1"] = rung1
    for row in record["heads"]:
        if row["head"] == flip:
            row["copying"] = not row["copying"]
    return record


def test_a_record_without_min_effect_was_flagged_on_q_alone():
    from pytest_circuits.record.schema import Record

    old = json.loads(LEGACY_BASELINE.read_text())
    assert "min_effect" not in old["rung1"]
    assert of_record(old).min_effect == LEGACY.min_effect == 0.0
    assert of_record(_record(None)) == KappaMethod(min_effect=0.0)
    assert of_record(_record(0.05)) == KappaMethod()
    Record.model_validate(_record(0.05))
    with pytest.raises(ValueError, match="min_effect"):
        Record.model_validate(_record(-1.0))


def test_flags_of_two_minimum_effects_are_not_compared():
    """Only the flags depend on the minimum effect: kappa, z, p and q still pair; the flags do not,
    and `circuits diff` names both methods instead of reading a flag change."""
    from pytest_circuits.gate.invariants import evaluate, kappa_pairs
    from pytest_circuits.gate.tolerances import Tolerances
    from pytest_circuits.record.schema import Record
    from pytest_circuits.show import diff_rows

    zero, default = KappaMethod(min_effect=0.0), KappaMethod()
    for figure in ("kappa", "kappa_z", "kappa_q", "kappa_trace_z"):
        assert paired_figures(figure, zero, default) == (figure, figure)
    for figure in FLAGS:
        assert paired_figures(figure, zero, default) is None
        assert paired_figures(figure, default, default) == (figure, figure)
    before, after = _record(None), _record(0.05, flip="L0H3")
    _, why = kappa_pairs(before, after, ("copying", "suppression"))
    assert "min effect 0," in why and "min effect 0.05" in why
    typed_before, typed_after = Record.of(before), Record.of(after)
    assert not [r for r in diff_rows(typed_before, typed_after) if r[1] in ("copying", "suppression")]
    alike = Record.of(_record(0.05))
    assert [r[:2] for r in diff_rows(alike, typed_after) if r[1] == "copying"] == [("L0H3", "copying")]
    for name in ("copying_heads", "kappa_distribution"):  # kappa and z pair: these still compare
        assert evaluate(name, before, after, Tolerances(), "fp32", "fp32 baseline").status == "passed"
    swap = evaluate("swap_kappa", before, after, Tolerances(), "fp32", "fp32 baseline", across=True)
    assert swap.status == "failed" and swap.compared == 0 and "min effect 0.05" in swap.message
    assert evaluate("swap_kappa", alike, alike, Tolerances(), "fp32", "fp32 baseline", across=True).status == "passed"


# ---------------------------------------------------------------- the frame API's negligible-head cut


def test_assertion_cuts_negligible_heads_on_what_they_write():
    """`assert_copying_heads_preserved` cuts with the gate's measure: ov_gain x path_factor when the
    frame has both. Layer 0's OV gains are under 1% of the largest (layer 1's), but its path factor
    (x 40, layer 1's x 0.001) makes layer 0 write the most: L0H1 is watched and its loss fails the
    assertion, and layer 1, L1H0 among it, writes almost nothing and is cut. On OV gain alone
    (no path_factor) it is the other way round."""
    heads = [f"L{i // 4}H{i % 4}" for i in range(8)]
    kappa = np.array([0.95, 0.9, 0.1, -0.05, 0.8, -0.9, 0.3, 0.0])
    ref = pd.DataFrame(
        {
            "head": heads,
            "kappa": kappa,
            "copying": kappa > 0.5,
            "suppression": kappa < -0.5,
            "ov_gain": [0.01, 0.005, 0.01, 0.01, 2.0, 1.0, 1.0, 1.0],
            "path_factor": [40.0] * 4 + [0.001] * 4,
        }
    )
    lost = ref.copy()
    lost.loc[[1, 4], ["kappa", "copying"]] = [[-0.88, False], [-0.7, False]]
    with pytest.raises(AssertionError, match="L0H1") as info:
        assert_copying_heads_preserved(ref, lost, min_spearman=None)
    assert "L1H0" not in str(info.value)  # written x 0.001: cut
    raw = ref.drop(columns="path_factor")  # OV gain alone, as before path_factor: the other way round
    with pytest.raises(AssertionError, match="L1H0") as info:
        assert_copying_heads_preserved(raw, lost.drop(columns="path_factor"), min_spearman=None)
    assert "L0H1" not in str(info.value)
    with pytest.raises(AssertionError, match="2 of 3 copying heads lost"):
        assert_copying_heads_preserved(ref, lost, min_spearman=None, min_ov_gain=0)


def test_a_partial_frame_reaches_the_cut_as_head_writes_and_a_bad_one_is_one_line():
    """The assertions' frames are partial records (no model, build or figures): they reach the gate's
    negligible-head cut as typed `HeadWrites`, never validated as scan records (which they are not);
    a column that is no number is one line naming it."""
    from pytest_circuits.errors import CircuitsError
    from pytest_circuits.gate.invariants import negligible_heads
    from pytest_circuits.record.schema import HeadWrites

    frame = pd.DataFrame({"head": ["L0H0", "L0H1"], "kappa": [0.9, 0.1], "copying": [True, False]})
    assert_copying_heads_preserved(frame, frame)  # no ov_gain: no cut, nothing lost
    writes = HeadWrites.of([{"head": "L0H0", "ov_gain": 2.0}, {"head": "L0H1", "ov_gain": 0.01}])
    assert negligible_heads(writes, 0.01) == {"L0H1"}
    assert negligible_heads(HeadWrites.of([{"head": "L0H0", "ov_gain": None}]), 0.01) == set()
    bad = frame.assign(ov_gain=["large", "small"])
    with pytest.raises(CircuitsError, match=r"^the result frame's head writes are not valid: heads\[0\]\.ov_gain"):
        assert_copying_heads_preserved(bad, frame)
    with pytest.raises(CircuitsError) as info:
        assert_copying_heads_preserved(bad, frame)
    assert "\n" not in str(info.value) and "ov_spectrum" in str(info.value)
