"""One step of the sensitivity sweep against a plain full gate of the same build, on tiny-induction.

The step (`sensitivity.gate_record` inside a damage): apply a damage, measure the build the
baseline's way with knockouts of the baseline's key heads only, gate it, put every weight back
and check it bit for bit. The reference: what ``circuits gate`` does for the same build, a
record with the full knockout scan, then `gate_all`. The reference is timed in the untimed
``setup`` of every round, so the two alternate and share the machine's noise.
``extra_info["time_ratio"]`` = min step / min reference (below 1: the sweep's restriction to
key heads pays for the damage and the restore). One torch thread.

Run: pytest benchmarks/test_bench_sensitivity.py --run-slow -p no:randomly -s
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

from pytest_circuits.gate.invariants import gate_all
from pytest_circuits.gate.tolerances import Tolerances
from pytest_circuits.record import kappa_method
from pytest_circuits.record.store import read_baseline
from pytest_circuits.run.run import Run
from pytest_circuits.run.sensitivity import Damage, Restorer, gate_record
from pytest_circuits.settings import CircuitsSettings
from pytest_circuits.testing import requires_embedded_model

pytestmark = [pytest.mark.slow, requires_embedded_model()]
BASELINE = Path(__file__).resolve().parent.parent / "baselines" / "tiny-induction--fp32.json"


def test_one_damage_step_against_a_full_gate(benchmark):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    session = Run(CircuitsSettings(model="tiny-induction", device="cpu"))
    session.loaded.progress_write = lambda line: None
    baseline, tol = read_baseline(BASELINE), Tolerances()
    model = session.loaded.build("fp32").model
    restorer = Restorer(model)
    damage = Damage("ov_scale", 0.5, "L1H0")
    reference: list[float] = []
    verdicts: list[list[str]] = []

    def full_gate():
        start = time.perf_counter()
        session.loaded.forget_figures("fp32")
        record = session.records.record("fp32", knockout=True, method=kappa_method.of_record(baseline))
        results = gate_all(baseline, record, tol, "fp32", "baseline")
        reference.append(time.perf_counter() - start)
        assert all(r.status != "failed" for r in results)

    def step():
        damage.apply(model)
        try:
            results, _ = gate_record(session, "fp32", baseline, tol)
        finally:
            restorer.restore()
        verdicts.append([r.invariant for r in results if r.status == "failed"])

    try:
        benchmark.pedantic(step, setup=full_gate, rounds=5, iterations=1)
    finally:
        torch.set_num_threads(threads)
    assert all("copy_loss" in failed for failed in verdicts)  # the damage is caught every round
    benchmark.extra_info.update(
        {
            "step_min_s": benchmark.stats.stats.min,
            "full_gate_min_s": min(reference),
            "time_ratio": benchmark.stats.stats.min / min(reference),
        }
    )
