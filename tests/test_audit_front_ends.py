"""Rung 3 from both front ends: ``circuits record/gate --audit`` and ``pytest --circuits-audit`` on the
shipped example and the embedded model; a bad slice is one line before anything loads."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from pytest_circuits.cli import main
from pytest_circuits.testing import requires_embedded_model

pytestmark = requires_embedded_model()
SMALL = ["--device", "cpu", "--probe-n", "4", "--probe-length", "16"]
EXAMPLE = "tiny-induction-audit"


@pytest.fixture(scope="module")
def baselines(tmp_path_factory):
    """The fp32 baseline of tiny-induction recorded with the example slice."""
    folder = tmp_path_factory.mktemp("audit-baselines")
    assert (
        main(["record", "tiny-induction", "--build", "fp32", "--baselines", str(folder), "--audit", EXAMPLE, *SMALL])
        == 0
    )
    return folder


def test_record_writes_the_audit_section_of_the_slice(baselines):
    import hashlib

    from pytest_circuits.rungs.audit_slice import slice_file

    record = json.loads((baselines / "tiny-induction--fp32.json").read_text())
    audit = record["audit"]
    assert audit["slice_sha256"] == hashlib.sha256(slice_file(EXAMPLE).read_bytes()).hexdigest()
    assert (audit["n_cases"], audit["tokens"], audit["slice_name"]) == (8, "words", "tiny-induction-audit.jsonl")


def test_gate_fails_a_broken_induction_head_on_reliance_naming_the_cases(baselines, broken, capsys):
    baseline = str(baselines / "tiny-induction--fp32.json")
    build = f"broken={broken}"
    code = main(
        [
            "gate",
            "tiny-induction",
            "--build",
            build,
            "--baseline",
            baseline,
            "--audit",
            EXAMPLE,
            "--no-knockout",
            *SMALL[:2],
        ]
    )
    out = capsys.readouterr().out
    assert code == 1
    assert "FAIL document_reliance: 7 cases mean cited drop" in out
    assert "ledger-vault drop" in out and "reported, not gated: no-document-needed" in out
    assert "FAIL document_attribution" in out and "FAIL answer_logprob" in out


def test_gate_passes_a_benign_build_and_refuses_another_slice(baselines, tmp_path, capsys):
    baseline = str(baselines / "tiny-induction--fp32.json")
    code = main(
        ["gate", "tiny-induction", "--build", "rtn-int8", "--baseline", baseline, "--audit", EXAMPLE, *SMALL[:2]]
    )
    out = capsys.readouterr().out
    assert code == 0, out
    for name in ("document_reliance", "document_attribution", "answer_logprob"):
        assert f"PASS {name}: answers of rtn-int8" in out
    assert "gate passed (9 of 9 invariants hold)" in out
    other = tmp_path / "other.jsonl"
    other.write_text('{"chunks": ["a b c"], "question": "a b", "answer": "c"}\n')
    code = main(
        ["gate", "tiny-induction", "--build", "fp32", "--baseline", baseline, "--audit", str(other), *SMALL[:2]]
    )
    out = capsys.readouterr().out
    assert (
        code == 1
        and "audited slice tiny-induction-audit.jsonl" in out
        and "record the baseline again with this slice" in out
    )


def test_a_bad_slice_is_one_line_before_anything_loads(tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"chunks": ["a"], "question": "q", "answer": "a", "cited": [1]}\n')
    assert main(["scan", "tiny-induction", "--audit", str(bad), *SMALL]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        f"circuits scan: {bad}:1: cited index 1 is out of range: the case has 1 chunks (0..0); indices count from 0"
    ]
    long = tmp_path / "long.jsonl"  # fine as JSON; too long for the model: refused in the preflight, no weight loaded
    long.write_text(
        json.dumps({"chunks": [" ".join(f"w{i}" for i in range(300))], "question": "q", "answer": "a"}) + "\n"
    )
    assert main(["scan", "tiny-induction", "--audit", str(long), *SMALL]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        f"circuits scan: {long}:1: prompt and answer are 302 tokens, over the model's context of 256; shorten the "
        "case's chunks or split it"
    ]
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "--pyargs",
            "pytest_circuits.probes",
            "-p",
            "no:cacheprovider",
            "-q",
            "--circuits-audit",
            str(bad),
            "--circuits-builds",
            "fp32",
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 4 and f"{bad}:1: cited index 1 is out of range" in done.stderr
    assert "Traceback" not in done.stderr + done.stdout


def test_the_gate_suite_runs_the_audit_invariants_only_with_a_slice(baselines, tmp_path):
    def suite(*extra: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [
                sys.executable,
                "-m",
                "pytest",
                "--pyargs",
                "pytest_circuits.probes",
                "-p",
                "no:cacheprovider",
                "-q",
                "-k",
                "document or answer_logprob",
                "--circuits-builds",
                "rtn-int8",  # against the fp32 baseline: one build measured, the default run kept short
                "--circuits-baselines",
                str(baselines),
                "--circuits-probe-n",
                "4",
                "--circuits-probe-length",
                "16",
                "--circuits-device",
                "cpu",
                *extra,
            ],
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=600,
        )

    done = suite("--circuits-audit", EXAMPLE)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    assert "3 passed" in done.stdout  # three invariants, one build
    unasked = suite()
    assert unasked.returncode == 5 and "deselected" in unasked.stdout  # no slice: not collected, not skipped
    assert "passed" not in unasked.stdout and "skipped" not in unasked.stdout
