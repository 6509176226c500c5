"""Rung 3's audit slice sharded over pytest-xdist workers, as a big model's knockouts are: case shards that
cover the slice once, their merge equal to the unsharded figures, each measured once per run in the
shared run folder; and (slow) the gate suite under ``-n 2`` running one test per shard."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

from pytest_circuits.cli import main
from pytest_circuits.rungs.audit import audit_figures, case_shards
from pytest_circuits.rungs.audit_slice import read_slice
from pytest_circuits.testing import requires_embedded_model

pytestmark = requires_embedded_model()
WORDS = [
    a + b for a in ("ka", "lo", "mi", "ren", "tos", "vel", "dra", "qui") for b in ("sun", "mar", "pel", "zor", "bri")
]


def big_slice(path, n_cases: int = 32):
    """``n_cases`` cases of invented words: the answer is the two words after the question's three in chunk 1."""
    lines = []
    for i in range(n_cases):
        chunks = [" ".join(WORDS[(i * 7 + j * 3 + k) % 40] for k in range(8)) for j in range(3)]
        words = chunks[1].split()
        lines.append(
            json.dumps(
                {"id": f"case-{i}", "chunks": chunks, "question": " ".join(words[2:5]), "answer": " ".join(words[5:7])}
            )
        )
    path.write_text("\n".join(lines) + "\n")
    return path


def test_case_shards_cover_every_case_once_in_order():
    for n, k in ((40, 2), (41, 3), (32, 32), (100, 7)):
        shards = case_shards(n, k)
        assert len(shards) == k and [i for s in shards for i in s] == list(range(n))
        assert max(map(len, shards)) - min(map(len, shards)) <= 1


def test_the_merged_shards_equal_the_whole_slice_and_are_measured_once_per_run(tmp_path, monkeypatch):
    from pytest_circuits.run.measure import audit_shard_count, measure_audit
    from pytest_circuits.run.run import Run
    from pytest_circuits.settings import CircuitsSettings

    audit = read_slice(big_slice(tmp_path / "big.jsonl"))
    small = read_slice("tiny-induction-audit")

    def run(slice_, workers: int, shared=None) -> Run:
        made = Run(CircuitsSettings(builds=("fp32",), device="cpu", audit=slice_))
        made.loaded.workers, made.loaded.shared_dir = workers, shared
        return made

    assert audit_shard_count(run(audit, 1).measured) == 1  # no workers: one shard
    assert audit_shard_count(run(small, 2).measured) == 1  # 8 cases: too few to shard
    whole = audit_figures(run(audit, 1).loaded.build("fp32"), audit)
    shared = tmp_path / "run"
    shared.mkdir()
    first = run(audit, 2, shared)
    assert audit_shard_count(first.measured) == 2
    assert measure_audit(first.measured, "fp32").section() == whole.section()
    assert sorted(p.name for p in shared.glob("*.json")) == [
        "tiny-induction--fp32.audit-1-of-2.json",
        "tiny-induction--fp32.audit-2-of-2.json",
    ]

    def measured_again(*args, **kwargs):
        raise AssertionError("a shard was measured twice in one run")

    monkeypatch.setattr("pytest_circuits.rungs.audit.audit_figures", measured_again)
    other_worker = run(audit, 2, shared)  # another process of the same run: reads the shards' files
    assert measure_audit(other_worker.measured, "fp32").section() == whole.section()


@pytest.mark.slow
def test_the_gate_suite_under_xdist_runs_one_test_per_case_shard(tmp_path):
    big = big_slice(tmp_path / "big.jsonl")
    small = ["--probe-n", "4", "--probe-length", "16"]
    record = ["record", "tiny-induction", "--build", "fp32", "--baselines", str(tmp_path), "--audit", str(big)]
    assert main([*record, "--device", "cpu", *small]) == 0
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "--pyargs", "pytest_circuits.probes", "-p", "no:cacheprovider", "-n", "2"]
        + ["-k", "document or audit_shard", "--circuits-builds", "fp32,rtn-int8", "--circuits-audit", str(big)]
        + ["--circuits-baselines", str(tmp_path), "--circuits-probe-n", "4", "--circuits-probe-length", "16"]
        + ["--circuits-device", "cpu", "-rA"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    for build in ("fp32", "rtn-int8"):
        for shard in ("audit1of2", "audit2of2"):
            assert re.search(rf"PASSED \S*test_registered.py::test_audit_shard\[{build}-{shard}\]", done.stdout)
    assert "8 passed" in done.stdout  # four shards; document_reliance and document_attribution of two builds
