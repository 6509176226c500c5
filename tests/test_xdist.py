"""Builds over pytest-xdist workers: one worker per build, baselines written once, the same bytes.

The subprocess runs cost a few seconds each (two workers import torch); the embedded model
with a small probe keeps each build's figures to about a second.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from pytest_circuits.plugin.workers import group_name, load_lines
from pytest_circuits.testing import requires_embedded_model

pytest.importorskip("xdist")

PROBES = Path(__file__).resolve().parent.parent / "pytest_circuits" / "probes"
SMALL = ("--circuits-probe-n", "2", "--circuits-probe-length", "16", "--circuits-device", "cpu")


def _suite(pytester) -> None:
    for test in sorted(PROBES.glob("test_*.py")):
        pytester.makepyfile(**{test.stem: test.read_text()})


def _text(result) -> str:
    return "\n".join(result.outlines + result.errlines)


def _workers_of(text: str) -> dict[str, set[str]]:
    """build -> the workers that ran one of its tests, from ``-v`` lines ``[gw0] ... PASSED x[fp32]@...``."""
    seen: dict[str, set[str]] = {}
    for worker, build in re.findall(r"\[(gw\d+)\][^\n]*? (?:PASSED|FAILED|SKIPPED)[^\n]*?\[([^\]]+)\]", text):
        seen.setdefault(build, set()).add(worker)
    return seen


def test_static_xdist_group_marks_keep_a_group_on_one_worker(pytester):
    """The pytest 9 / xdist 3.8 trap (xdist #1386): xdist writes the group into ``item._nodeid``,
    pytest 9 reads ``item._id``, so every group was spread. The plugin carries the suffix over."""
    body = "\n".join(
        f"@pytest.mark.xdist_group('g{i % 2}')\ndef test_{i}():\n    open('log', 'a').write('g{i % 2} ' + os.environ['PYTEST_XDIST_WORKER'] + '\\n')\n"
        for i in range(8)
    )
    pytester.makepyfile(test_groups="import os\nimport pytest\n\n" + body)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-n", "2", "--dist", "loadgroup")
    result.assert_outcomes(passed=8)
    workers: dict[str, set[str]] = {}
    for line in (pytester.path / "log").read_text().splitlines():
        group, worker = line.split()
        workers.setdefault(group, set()).add(worker)
    assert set(workers) == {"g0", "g1"} and all(len(w) == 1 for w in workers.values()), workers


def test_n_alone_means_loadgroup_and_an_explicit_dist_is_kept(pytester):
    pytester.makepyfile(test_one="def test_one():\n    pass\n")
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-n", "2", "-v")
    assert "LoadGroupScheduling" in _text(result)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-n", "2", "--dist", "load", "-v")
    assert "LoadScheduling" in _text(result) and "LoadGroupScheduling" not in _text(result)


def test_load_lines_count_loads_per_build_and_name_the_cause():
    loads = [{"recipe": "fp32", "worker": "gw0"}, {"recipe": "bnb-int8", "worker": "gw1"}]
    assert load_lines(loads, "loadgroup") == ["builds loaded: fp32 once (gw0), bnb-int8 once (gw1)"]
    twice = loads + [{"recipe": "fp32", "worker": "gw1"}]
    lines = load_lines(twice, "load")
    assert lines[0] == "builds loaded: fp32 2 times (gw0, gw1), bnb-int8 once (gw1)"
    assert "fp32 loaded on several workers: --dist load" in lines[1]
    assert load_lines([{"recipe": "fp32", "worker": None}], None) == ["builds loaded: fp32 once (main)"]
    assert load_lines([], "loadgroup") == [] and group_name("bnb-nf4") == "circuits-bnb-nf4"


@pytest.mark.slow
@requires_embedded_model()
def test_two_workers_record_the_same_bytes_each_build_loaded_once(pytester, tmp_path):
    """``pytest probes -n 2 --circuits-update`` and ``-n 0`` write byte-identical baselines of the
    embedded model; under xdist each build is loaded by one worker (the reference's record is not
    recomputed by the worker gating the other build: it waits on the file lock and reads the file),
    every baseline is written once, and the verdicts are the same."""
    _suite(pytester)
    builds = ("--circuits-model", "tiny-induction", "--circuits-builds", "fp32,rtn-int8")
    plain, spread = tmp_path / "n0", tmp_path / "n2"
    one = pytester.runpytest_subprocess(
        "-p", "no:cacheprovider", *builds, *SMALL, "--circuits-update", f"--circuits-baselines={plain}", "-n", "0"
    )
    two = pytester.runpytest_subprocess(
        "-p",
        "no:cacheprovider",
        *builds,
        *SMALL,
        "--circuits-update",
        f"--circuits-baselines={spread}",
        "-n",
        "2",
        "-v",
    )
    one.assert_outcomes(passed=10)
    two.assert_outcomes(passed=10)
    names = sorted(p.name for p in plain.iterdir())
    assert names == ["tiny-induction--fp32.json", "tiny-induction--rtn-int8.json"]
    assert names == sorted(p.name for p in spread.iterdir())
    for name in names:
        assert (plain / name).read_bytes() == (spread / name).read_bytes(), name
    text = _text(two)
    loaded = re.search(r"builds loaded: (.*)", text).group(1)
    assert re.fullmatch(r"fp32 once \(gw\d\), rtn-int8 once \(gw\d\)", loaded), loaded
    workers = _workers_of(text)
    assert all(len(w) == 1 for w in workers.values()) and workers["fp32"] != workers["rtn-int8"], workers
    written = re.search(r"baselines written: (.*)", text).group(1).split(", ")
    assert sorted(Path(p).name for p in written) == names  # each file written once, by one worker
    # gated against what they just recorded, without update: the same verdicts in both modes
    for folder, n in ((plain, "0"), (spread, "2")):
        again = pytester.runpytest_subprocess(
            "-p", "no:cacheprovider", *builds, *SMALL, f"--circuits-baselines={folder}", "-n", n
        )
        again.assert_outcomes(passed=10)
