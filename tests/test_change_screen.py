"""The change screen of knockout_deltas (gate/change_screen.py): plain AtP on both records picks which
key heads a gate knocks out; a head it clears passes on the estimate, said, and a head not measured
for any other reason is an error, never a pass."""

from __future__ import annotations

import json
import math
from importlib.resources import files

import numpy as np
import pytest

from pytest_circuits.gate.change_screen import ChangeScreen, needs_exact
from pytest_circuits.gate.check import check
from pytest_circuits.gate.invariants import get, key_heads
from pytest_circuits.gate.tolerances import Tolerances
from pytest_circuits.record.schema import Record
from pytest_circuits.run.flow import gate_against
from pytest_circuits.run.run import Run
from pytest_circuits.settings import CircuitsSettings


def _shipped() -> dict:
    return json.loads(files("pytest_circuits").joinpath("baselines", "tiny-induction--fp32.json").read_text())


@pytest.fixture(scope="module")
def recorded() -> Record:
    """A fresh fp32 recording of the embedded model: every head knocked out and estimated."""
    run = Run(CircuitsSettings(builds=("fp32",), device="cpu", update=True))
    return run.records.record("fp32", knockout=True)


def _gate(recipe: str, baseline: Record, change_screen: float):
    tolerances = {"change_screen": change_screen}
    run = Run(CircuitsSettings(builds=(recipe,), device="cpu", tolerances=tolerances), key_heads_of=(baseline,))
    record, verdicts = gate_against(run.records, recipe, baseline, "fp32 baseline", run.tolerances, None)
    return record, verdicts, run.tolerances


def _result(verdicts, name: str):
    return next(r for r in verdicts.results if r.invariant == name)


def test_a_recording_stores_the_plain_atp_estimate_of_every_head(recorded):
    """knockout_atp is the ``atp`` screen's estimate (checked against central differences in
    tests/test_knockout.py) on the same held-out sequences, for every head."""
    from pytest_circuits.model.builds import load_build
    from pytest_circuits.model.loading import resolve_model
    from pytest_circuits.rungs.knockout import knockout_scan
    from pytest_circuits.rungs.repeat_settings import RepeatSettings

    assert recorded.knockout is not None
    build = load_build(resolve_model("tiny-induction"), "fp32", "cpu")
    settings = RepeatSettings(seed=recorded.knockout.seed, n=recorded.knockout.n, L=recorded.knockout.L)
    frame = knockout_scan(build, settings, screen_top_k=0, screen_method="atp", progress=False).set_index("head")
    for head in recorded.heads:
        assert head.knockout_atp == pytest.approx(frame.loc[head.head, "knockout_estimate"], rel=1e-5, abs=1e-7)


@pytest.mark.parametrize(("method", "measured"), [("atp", True), ("atp*", False)])
def test_a_screened_scan_keeps_its_own_atp_and_adds_no_pass_for_atp_star(method, measured):
    """A scan screened by plain AtP stores its screen's estimate as knockout_atp (no second pass);
    one screened by AtP* leaves the column unmeasured rather than pay a second backward for it."""
    from pytest_circuits.model.builds import load_build
    from pytest_circuits.model.loading import resolve_model
    from pytest_circuits.rungs.knockout import knockout_scan
    from pytest_circuits.rungs.repeat_settings import RepeatSettings

    build = load_build(resolve_model("tiny-induction"), "fp32", "cpu")
    frame = knockout_scan(
        build, RepeatSettings(n=4, L=16), screen_top_k=2, screen_method=method, atp=True, progress=False
    )
    if measured:
        assert frame["knockout_atp"].tolist() == frame["knockout_estimate"].tolist()
    else:
        assert frame["knockout_atp"].isna().all() and frame["knockout_estimate"].notna().all()


def test_the_same_build_is_cleared_head_by_head_and_the_pass_says_so(recorded):
    record, verdicts, _ = _gate("fp32", recorded, 0.25)
    keys = key_heads(recorded, "knockout_delta", 0, 0.1)
    assert keys  # the embedded model's 4 key heads
    assert all(h.knockout_delta is None and h.knockout_atp is not None for h in record.heads)
    result = _result(verdicts, "knockout_deltas")
    assert result.status == "passed" and result.compared == len(keys)
    assert f"0 key heads knocked out exactly, {len(keys)} passed by the change screen" in result.message
    rows = get("knockout_deltas").compare(recorded, record, Tolerances(change_screen=0.25)).rows
    assert all("passed it" in r.note and math.isnan(r.after) and not r.broken for r in rows)


def test_a_damage_the_estimate_sees_is_knocked_out_exactly_and_fails():
    """The induction head's OV at half: the estimated changes reach the screen's share of the
    tolerance, so those heads are measured, and the exact verdict is the unscreened one."""
    from pytest_circuits.run.sensitivity import scale_head_ov

    base = Run(CircuitsSettings(builds=("fp32",), device="cpu", update=True))
    baseline = base.records.record("fp32", knockout=True)
    run = Run(
        CircuitsSettings(builds=("fp32",), device="cpu", tolerances={"change_screen": 0.1}), key_heads_of=(baseline,)
    )
    scale_head_ov(run.loaded.build("fp32").model, 1, 0, 0.5)
    record, verdicts = gate_against(run.records, "fp32", baseline, "fp32 baseline", run.tolerances, None)
    measured = {h.head for h in record.heads if h.knockout_delta is not None}
    result = _result(verdicts, "knockout_deltas")
    assert result.status == "failed" and measured
    rows = get("knockout_deltas").compare(baseline, record, run.tolerances).rows
    assert {r.subject for r in rows if r.broken} <= measured  # only measured heads fail, never a cleared one


def test_a_baseline_without_estimates_gets_every_key_head_knocked_out():
    """The shipped baselines predate knockout_atp: the screen cannot clear a head of theirs."""
    shipped = Record.of(_shipped())
    record, verdicts, _ = _gate("rtn-int8", shipped, 0.5)
    keys = key_heads(shipped, "knockout_delta", 0, 0.1)
    assert sorted(h.head for h in record.heads if h.knockout_delta is not None) == sorted(keys)
    assert "passed by the change screen" not in _result(verdicts, "knockout_deltas").message


def _pair(before_atp, after_atp, after_delta=None):
    """A baseline with one key head L0H0 (delta 1.0) and a build's record of it."""
    shipped = _shipped()
    no_sequences = {"knockout_delta_sequences": None, "knockout_delta_interval": None}
    heads = [{**h, "knockout_delta": 0.0, **no_sequences} for h in shipped["heads"]]  # no key head but L0H0
    heads[0] = {**heads[0], "knockout_delta": 1.0}
    before = {
        **shipped,
        "heads": [{**h, "knockout_atp": before_atp if i == 0 else None} for i, h in enumerate(heads)],
        "looks": None,
    }
    after_rows = [dict(h) for h in before["heads"]]
    after_rows[0] = {**after_rows[0], "knockout_delta": after_delta, "knockout_atp": after_atp}
    return Record.of(before), Record.of({**before, "heads": after_rows})


@pytest.mark.parametrize(
    ("fraction", "before_atp", "after_atp", "cleared"),
    [
        (0.25, 0.30, 0.30 + 0.12, True),  # |e| 0.12 < 0.25 x 0.5 x 1.0
        (0.25, 0.30, 0.30 + 0.13, False),  # 0.13 reaches it: not measured is an error
        (0.25, 0.30, 0.30 - 0.13, False),  # either sign
        (0.25, None, 0.30, False),  # the baseline holds no estimate
        (0.25, 0.30, None, False),  # the build holds none (its backward failed)
        (0.0, 0.30, 0.30, False),  # the screen off: every key head exactly
    ],
)
def test_a_head_not_knocked_out_passes_only_when_the_screen_cleared_it(fraction, before_atp, after_atp, cleared):
    before, after = _pair(before_atp, after_atp)
    tol = Tolerances(change_screen=fraction)
    (row,) = get("knockout_deltas").compare(before, after, tol).rows
    assert row.broken is not cleared
    assert ("change screen passed it" in row.note) is cleared
    if not cleared:
        assert "NOT MEASURED" in row.note
    verdicts = check(before, after, tol, build_name="b", label="baseline", invariants_checked=["knockout_deltas"])
    assert verdicts.results[0].status == ("passed" if cleared else "failed")


def test_a_measured_head_is_judged_on_its_delta_whatever_the_estimate_says():
    before, after = _pair(0.30, 0.30, after_delta=0.2)  # the estimate: no change; the knockout: -0.8
    (row,) = get("knockout_deltas").compare(before, after, Tolerances(change_screen=0.5)).rows
    assert row.broken and row.after == pytest.approx(0.2)


def test_the_screen_keeps_a_head_any_baseline_needs_exactly():
    rule = ChangeScreen(0.5, {"L0H0": ((0.0, 1.0), (0.0, 0.1)), "L0H1": ((0.0, 1.0),)})
    kept = rule.confirm({"L0H0": 0.2, "L0H1": 0.2, "L0H2": 0.0})
    assert kept == ["L0H0", "L0H2"]  # L0H0: 0.2 >= 0.5 x 0.1; L0H2: no baseline's key head, kept as asked
    assert needs_exact(float("nan"), 1.0, 0.5) and needs_exact(0.0, 1.0, 0.0) and not needs_exact(0.1, 1.0, 0.5)
    assert not np.isnan(rule.fraction)


def test_circuits_gate_takes_the_screen_from_tol_and_says_what_it_cleared(tmp_path, capsys):
    """``--tol change_screen=F`` reaches what the run knocks out, not only the verdict."""
    from pytest_circuits.cli import main

    assert main(["record", "tiny-induction", "--build", "fp32", "--baselines", str(tmp_path)]) == 0
    baseline = str(tmp_path / "tiny-induction--fp32.json")
    capsys.readouterr()
    assert (
        main(["gate", "tiny-induction", "--build", "fp32", "--baseline", baseline, "--tol", "change_screen=0.5"]) == 0
    )
    out = capsys.readouterr()
    said = out.out + out.err
    assert "the change screen cleared 4 of 4 key heads" in said
    assert "0 key heads knocked out exactly, 4 passed by the change screen" in said
    assert main(["gate", "tiny-induction", "--build", "fp32", "--baseline", baseline]) == 0
    assert "passed by the change screen" not in capsys.readouterr().out
