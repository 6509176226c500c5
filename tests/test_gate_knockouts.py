"""What a gate knocks out (run/flow.py, run/records.py, run/looks.py): the baselines' key heads only,
each with the figures the full scan gives it, and on further looks only the heads still undecided."""

from __future__ import annotations

import json
from importlib.resources import files

import numpy as np
import pytest

from pytest_circuits.run.flow import gate_against
from pytest_circuits.run.run import Run
from pytest_circuits.settings import CircuitsSettings

SEQUENCES = "knockout_delta_sequences"


def _gate(recipe: str, **settings):
    run = Run(CircuitsSettings(builds=(recipe,), device="cpu", **settings))
    baseline = json.loads(files("pytest_circuits").joinpath("baselines", "tiny-induction--fp32.json").read_text())
    record, verdicts = gate_against(run.records, recipe, baseline, "fp32 baseline", run.tolerances, None)
    return run, record, verdicts


@pytest.mark.parametrize("recipe", ["rtn-int4", "bnb-nf4"])
def test_a_gate_knocks_out_the_key_heads_only_with_the_full_scans_figures(recipe):
    run, record, verdicts = _gate(recipe)
    keys = run.key_heads()
    measured = sorted(h.head for h in record.heads if h.knockout_delta is not None)
    assert record.knockout is not None and record.knockout.heads == "key heads" and record.knockout.screened is None
    assert keys and measured == keys and len(measured) < len(record.heads)  # 4 of the embedded model's 8
    _, full, full_verdicts = _gate(recipe, knockout_full=True)  # every head, as a recording measures
    assert full.knockout is not None and full.knockout.heads is None
    assert all(h.knockout_delta is not None for h in full.heads)
    by_head = {h.head: h for h in full.heads}
    for head in record.heads:  # a head's figures do not depend on the other heads scanned with it
        if head.knockout_delta is not None:
            assert getattr(head, SEQUENCES) == getattr(by_head[head.head], SEQUENCES)
    assert [(r.invariant, r.status, r.message) for r in verdicts.results] == [
        (r.invariant, r.status, r.message) for r in full_verdicts.results
    ]


def test_a_run_that_records_the_build_scans_every_head():
    """A recording needs every head (its key heads are not known before): the gate reads that record."""
    run = Run(CircuitsSettings(builds=("fp32",), device="cpu", update=True))
    record = run.records.record("fp32", knockout=True, key_heads=True)
    assert record.knockout is not None and record.knockout.heads is None
    assert all(h.knockout_delta is not None for h in record.heads)


def test_a_key_heads_record_as_a_baseline_is_not_read_as_lost_knockouts():
    """`knockouts_lost` says a full scan lost heads; a record of key heads left the others out, said."""
    from pytest_circuits.gate.builtin_invariants import knockouts_lost

    _, record, _ = _gate("rtn-int8")
    assert knockouts_lost(record) == []
    data = {**record.data, "knockout": {k: v for k, v in record.data["knockout"].items() if k != "heads"}}
    from pytest_circuits.record.schema import Record

    assert knockouts_lost(Record.of(data))  # the same heads under a claim of every head: lost


def test_a_look_measures_each_head_once_a_run():
    """`MeasuredRecords.look`: the probe once per look, each head's knockouts once, whatever subsets
    the verdicts ask for; a subset's values are the whole set's."""
    run = Run(CircuitsSettings(builds=("rtn-int4",), device="cpu"))
    records = run.records
    both = records.look("rtn-int4", 2, 7, 8, ["L0H1", "L1H0"], "zero")
    one = records.look("rtn-int4", 2, 7, 8, ["L1H0"], "zero")
    assert one[SEQUENCES] == {"L1H0": both[SEQUENCES]["L1H0"]}
    assert one["copy_loss_sequences"] == both["copy_loss_sequences"]
    cache = run.loaded.memoised(("look knockouts", "rtn-int4", 2, 8, "zero"))
    assert sorted(cache) == ["L0H1", "L1H0"]
    none = records.look("rtn-int4", 2, 7, 8, [], "zero")
    assert SEQUENCES not in none and np.isfinite(none["copy_loss_sequences"]).all()


def test_an_invariant_that_reads_other_heads_keeps_the_full_scan():
    """`Invariant.knockout_heads`: the default, "every head", keeps a gate's full scan for any
    invariant (a team's own) that may read heads other than the baseline's key heads."""
    from pytest_circuits.gate.invariants import Invariant, get
    from pytest_circuits.run.flow import reads_key_heads_only

    class EveryKnockout(Invariant):
        name = "every_knockout"
        needs = frozenset({"knockout"})

    assert reads_key_heads_only(get("knockout_deltas")) and reads_key_heads_only(get("copy_loss"))
    assert reads_key_heads_only(None)  # the built-in per-build invariants
    assert not reads_key_heads_only(EveryKnockout())
