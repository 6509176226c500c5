"""Shards as separate jobs: K processes that share no folder write parts; the merge is the unsharded record, bit for bit."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from pytest_circuits.cli import main
from pytest_circuits.gate.shards import ShardError, merge_parts, parse_shard, read_part

from .conftest import needs_embedded

ROOT = Path(__file__).resolve().parent.parent
PROBE = ["--probe-n", "4", "--probe-length", "16"]
CLI = "from pytest_circuits.cli import main; raise SystemExit(main())"


def _job(folder: Path, *words: str) -> subprocess.Popen:
    """``circuits WORDS`` in a process of its own, in its own empty folder with its own cache."""
    folder.mkdir(parents=True)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTEST_CIRCUITS_CACHE": str(folder / "cache")}
    return subprocess.Popen(
        [sys.executable, "-c", CLI, *words],
        cwd=folder,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


@pytest.fixture(scope="module")
def parts(tmp_path_factory):
    """Two shard jobs of the embedded model's fp32 record (run at once), their parts gathered in one folder."""
    root = tmp_path_factory.mktemp("jobs")
    jobs = [
        _job(
            root / f"job{i}",
            "record",
            "tiny-induction",
            "--build",
            "fp32",
            "--shard",
            f"{i}/2",
            "--out",
            f"part-{i}.json",
            *PROBE,
        )
        for i in (1, 2)
    ]
    gathered = root / "gathered"
    gathered.mkdir()
    for i, job in zip((1, 2), jobs):
        out, err = job.communicate(timeout=600)
        assert job.returncode == 0, err[-2000:]
        assert f"shard {i}/2 of fp32" in out
        (gathered / f"part-{i}.json").write_bytes((root / f"job{i}" / f"part-{i}.json").read_bytes())
    return gathered


@needs_embedded
def test_separate_shard_jobs_merge_to_the_unsharded_record_bit_for_bit(parts, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(["merge", str(parts / "part-2.json"), str(parts / "part-1.json"), "-o", "merged.json"]) == 0
    assert main(["record", "tiny-induction", "--build", "fp32", "--baselines", "whole", *PROBE]) == 0
    merged, whole = Path("merged.json").read_bytes(), Path("whole/tiny-induction--fp32.json").read_bytes()
    assert merged == whole
    record = json.loads(merged)
    assert all(row["knockout_delta"] is not None for row in record["heads"])  # every layer from its owner
    one = read_part(parts / "part-1.json")
    assert one["part"]["layers"] == [0] and any(r["knockout_delta"] is None for r in one["record"]["heads"])


@needs_embedded
def test_merge_refuses_parts_of_other_weights_settings_or_splits(parts, tmp_path, capsys):
    one, two = read_part(parts / "part-1.json"), read_part(parts / "part-2.json")
    other = copy.deepcopy(two)
    other["record"]["model"]["fingerprint"] = "sha256:" + "0" * 64
    with pytest.raises(ShardError, match=r"b differs from a in model.fingerprint \(other weights or another model\)"):
        merge_parts([("a", one), ("b", other)])
    other = copy.deepcopy(two)
    other["record"]["build"]["recipe"] = "bf16"
    with pytest.raises(ShardError, match=r"in build.recipe \(another build\)"):
        merge_parts([("a", one), ("b", other)])
    other = copy.deepcopy(two)
    other["record"]["probe"]["n"] = 8
    with pytest.raises(ShardError, match=r"in probe.n \(other probe settings\)"):
        merge_parts([("a", one), ("b", other)])
    with pytest.raises(ShardError, match="a and b are both shard 1/2"):
        merge_parts([("a", one), ("b", one)])
    with pytest.raises(ShardError, match="shard\\(s\\) 2/2 missing: merge all 2 parts"):
        merge_parts([("a", one)])
    (tmp_path / "plain.json").write_text(json.dumps(one["record"]))
    assert main(["merge", str(tmp_path / "plain.json"), "-o", str(tmp_path / "m.json")]) == 2
    err = capsys.readouterr().err
    assert "plain.json is not a shard part (circuits record --shard i/K --out FILE writes one)" in err
    assert len(err.strip().splitlines()) == 1 and not (tmp_path / "m.json").exists()


def test_shard_words_are_checked_in_one_line(capsys):
    assert parse_shard("2/4") == (2, 4)
    for bad in ("2", "0/4", "5/4", "a/b"):
        with pytest.raises(ShardError, match="--shard"):
            parse_shard(bad)
    assert main(["record", "tiny-induction", "--build", "fp32", "--shard", "1/2"]) == 2
    assert "--shard 1/2 needs --out FILE" in capsys.readouterr().err
    assert main(["record", "tiny-induction", "--build", "fp32", "--out", "x.json"]) == 2
    assert "--out writes a shard's part: give --shard I/K too" in capsys.readouterr().err
