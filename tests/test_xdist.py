"""Builds over pytest-xdist workers: one worker per build, baselines written once, the same bytes.

The subprocess runs cost a few seconds each (two workers import torch); the embedded model
with a small probe keeps each build's figures to about a second.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from pytest_circuits.gate.invariants import per_build_invariants
from pytest_circuits.plugin.workers import group_name, load_lines
from pytest_circuits.testing import requires_embedded_model, requires_smollm2

from .conftest import PROBES

pytest.importorskip("xdist")

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
    """On a circuits run (here: a circuits option given) ``-n 2`` alone schedules by group; a
    project that asks nothing of circuits keeps xdist's default; an explicit ``--dist`` is kept."""
    pytester.makepyfile(test_one="def test_one():\n    pass\n")
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-n", "2", "-v", "--circuits-probe-n", "4")
    assert "LoadGroupScheduling" in _text(result)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-n", "2", "-v")
    assert "LoadScheduling" in _text(result) and "LoadGroupScheduling" not in _text(result)
    pytester.makeini("[pytest]\ncircuits_model = tiny-induction\n")
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
    gated = len(per_build_invariants()) * 2  # every gate test, once per build
    one.assert_outcomes(passed=gated)
    two.assert_outcomes(passed=gated)
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
        again.assert_outcomes(passed=gated)


# ------------------------------------------------------------------ knockout shards


def _best_max_cost(n_layers: int, shards: int) -> int:
    """The smallest possible largest shard cost over every contiguous split (brute force)."""
    from itertools import combinations

    costs = [n_layers - layer for layer in range(n_layers)]
    best = sum(costs)
    for cuts in combinations(range(1, n_layers), shards - 1):
        edges = (0, *cuts, n_layers)
        best = min(best, max(sum(costs[a:b]) for a, b in zip(edges, edges[1:])))
    return best


@pytest.mark.parametrize("n_layers, shards", [(2, 2), (5, 2), (10, 3), (12, 4), (9, 9), (3, 5), (7, 1)])
def test_layer_shards_are_contiguous_cover_every_layer_and_balance_the_replay_cost(n_layers, shards):
    from pytest_circuits.rungs.knockout_shards import layer_shards

    runs = layer_shards(n_layers, shards)
    assert len(runs) == min(shards, n_layers) and all(runs)
    assert [layer for run in runs for layer in run] == list(range(n_layers))
    largest = max(sum(n_layers - layer for layer in run) for run in runs)
    assert largest <= _best_max_cost(n_layers, min(shards, n_layers)) + n_layers  # within one layer's cost


def test_layer_shards_refuse_zero():
    from pytest_circuits.errors import CircuitsError
    from pytest_circuits.rungs.knockout_shards import layer_shards

    with pytest.raises(CircuitsError, match="--circuits-knockout-shards"):
        layer_shards(4, 0)


@pytest.fixture(scope="module")
def embedded_fp32():
    from pytest_circuits.run.run import Run
    from pytest_circuits.settings import CircuitsSettings, RepeatSettings

    return Run(CircuitsSettings(device="cpu", probe=RepeatSettings(0, 2, 16))).loaded.build("fp32")


@requires_embedded_model()
@pytest.mark.parametrize("mode, screen", [("zero", None), ("mean", None), ("zero", 2)])
def test_merged_shards_equal_the_unsharded_scan(embedded_fp32, mode, screen):
    from pytest_circuits.rungs.knockout import knockout_scan
    from pytest_circuits.rungs.knockout_shards import layer_shards, merge_knockout_shards
    from pytest_circuits.rungs.repeat_settings import RepeatSettings

    settings = RepeatSettings(1, 2, 16)
    kw = dict(mode=mode, screen_top_k=screen, progress=False)
    full = knockout_scan(embedded_fp32, settings, **kw)
    shards = [knockout_scan(embedded_fp32, settings, layers=run, **kw) for run in layer_shards(2, 2)]
    assert [s.attrs["layers"] for s in shards] == [[0], [1]]
    assert shards[0].loc[shards[0]["layer"] == 1, "knockout_delta"].isna().all()  # shard 0 left layer 1 alone
    merged = merge_knockout_shards(shards)
    assert merged.equals(full) and merged.attrs == full.attrs
    assert full["knockout_delta"].notna().sum() == (8 if screen is None else len(full.attrs["exact_heads"]))


@requires_embedded_model()
def test_shards_that_overlap_or_disagree_are_refused(embedded_fp32):
    from pytest_circuits.errors import CircuitsError
    from pytest_circuits.rungs.knockout import knockout_scan
    from pytest_circuits.rungs.knockout_shards import merge_knockout_shards
    from pytest_circuits.rungs.repeat_settings import RepeatSettings

    a = knockout_scan(embedded_fp32, RepeatSettings(1, 2, 16), layers=[0, 1], progress=False)
    b = knockout_scan(embedded_fp32, RepeatSettings(1, 2, 16), layers=[1], progress=False)
    c = knockout_scan(embedded_fp32, RepeatSettings(1, 2, 16), layers=[1], mode="mean", progress=False)
    with pytest.raises(CircuitsError, match="both hold layer 1"):
        merge_knockout_shards([a, b])
    with pytest.raises(CircuitsError, match="other settings"):
        merge_knockout_shards([knockout_scan(embedded_fp32, RepeatSettings(1, 2, 16), layers=[0], progress=False), c])
    with pytest.raises(CircuitsError, match="no knockout shards"):
        merge_knockout_shards([])
    with pytest.raises(CircuitsError, match="must lie in 0..1"):
        knockout_scan(embedded_fp32, RepeatSettings(1, 2, 16), layers=[2], progress=False)


@requires_embedded_model()
def test_a_sharded_session_records_the_same_and_a_shard_is_measured_once_per_run(tmp_path):
    """Two shards through the shared run folder: the record is the unsharded one's, byte for byte,
    and a second process of the run reads the shards' JSON instead of loading the build."""
    from pytest_circuits.run.run import Run
    from pytest_circuits.settings import CircuitsSettings, RepeatSettings

    def session(**kw):
        return Run(CircuitsSettings(device="cpu", probe=RepeatSettings(0, 2, 16), **kw))

    plain = session()
    one = session(knockout_shards=2)
    one.loaded.shared_dir = tmp_path
    assert one.measured.shards == 2 and one.measured.shard_layers() == [[0], [1]]
    dumps = [json.dumps(s.records.record("fp32").data, sort_keys=True) for s in (plain, one)]
    assert dumps[0] == dumps[1]
    assert sorted(p.name for p in tmp_path.glob("*.json")) == [
        "tiny-induction--fp32.knockout-1-of-2.json",
        "tiny-induction--fp32.knockout-2-of-2.json",
    ]
    other = session(knockout_shards=2)
    other.loaded.shared_dir = tmp_path
    assert (
        other.measured.head_knockout("fp32").equals(plain.measured.head_knockout("fp32")) and other.loaded.loads == []
    )


def test_shards_are_automatic_only_under_xdist_for_big_models(monkeypatch):
    from types import SimpleNamespace

    from pytest_circuits.run.run import Run
    from pytest_circuits.settings import CircuitsSettings

    def shards(workers, n_layers, n_heads, given=None):
        session = Run(CircuitsSettings(knockout_shards=given))
        session.loaded.workers = workers
        monkeypatch.setattr(session.loaded, "preflight", lambda: SimpleNamespace(n_layers=n_layers, n_heads=n_heads))
        return session.measured.shards

    assert shards(1, 32, 32) == 1  # one process: nothing to spread over
    assert shards(4, 32, 32) == 4  # an 8B-sized model (1,024 heads) under -n 4
    assert shards(4, 30, 9) == 1  # SmolLM2-135M (270 heads): one worker per build is enough
    assert shards(4, 30, 9, given=3) == 3 and shards(1, 2, 4, given=2) == 2


@pytest.mark.real
@pytest.mark.slow
@requires_smollm2()
def test_two_shards_of_smollm2_equal_one():
    """SmolLM2-135M, the heads of six layers across the depth, n 2, L 16: the two-shard scan
    (layer_shards(30, 2) = layers 0-8 and 9-29) merges into the one-shard scan exactly."""
    from pytest_circuits.run.run import Run
    from pytest_circuits.rungs.knockout import knockout_scan
    from pytest_circuits.rungs.knockout_shards import layer_shards, merge_knockout_shards
    from pytest_circuits.rungs.repeat_settings import RepeatSettings
    from pytest_circuits.settings import CircuitsSettings

    build = Run(CircuitsSettings(model="smollm2-135m", device="cpu")).loaded.build("fp32")
    heads = [f"L{layer}H{head}" for layer in (0, 5, 10, 17, 18, 29) for head in range(build.geometry.n_heads)]
    settings = RepeatSettings(1, 2, 16)
    full = knockout_scan(build, settings, heads=heads, progress=False)
    runs = layer_shards(build.geometry.n_layers, 2)
    merged = merge_knockout_shards(
        [knockout_scan(build, settings, heads=heads, layers=r, progress=False) for r in runs]
    )
    assert merged.equals(full) and merged.attrs == full.attrs
    assert full["knockout_delta"].notna().sum() == len(heads)


@pytest.mark.slow
@requires_embedded_model()
def test_shards_over_two_workers_record_the_unsharded_bytes(pytester, tmp_path):
    """``-n 2 --circuits-knockout-shards 2 --circuits-update`` writes the bytes ``-n 0`` writes
    unsharded: the shard tests run, their partial results merge into the same knockout record."""
    _suite(pytester)
    builds = ("--circuits-model", "tiny-induction", "--circuits-builds", "fp32")
    plain, sharded = tmp_path / "n0", tmp_path / "shards"
    one = pytester.runpytest_subprocess(
        "-p", "no:cacheprovider", *builds, *SMALL, "--circuits-update", f"--circuits-baselines={plain}", "-n", "0"
    )
    two = pytester.runpytest_subprocess(
        "-p", "no:cacheprovider", *builds, *SMALL, "--circuits-update", f"--circuits-baselines={sharded}",
        "-n", "2", "--circuits-knockout-shards", "2", "-v",
    )  # fmt: skip
    gate_tests = len(per_build_invariants())
    one.assert_outcomes(passed=gate_tests)
    two.assert_outcomes(passed=gate_tests + 2)  # the gate tests and the two shards
    assert "test_knockout_shard[fp32-shard2of2]" in _text(two)
    name = "tiny-induction--fp32.json"
    assert (plain / name).read_bytes() == (sharded / name).read_bytes()
