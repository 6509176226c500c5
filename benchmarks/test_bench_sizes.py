"""Time and memory at the sizes users ship: each rung of the scan on a random-weight checkpoint of a
real shape (Llama-3.2-1B by default), each in a fresh process, its peak RSS against the goal
``weights x 1.25 + 1.5 GB``, with per-rung CPU and wall seconds, counted FLOPs and the rate.

Run:  PYTEST_CIRCUITS_SIZES=llama-3.2-1b,llama-3.2-3b python -m pytest benchmarks/test_bench_sizes.py --run-slow -s

The checkpoint is built (seeded, about 2.5 GB for the 1B shape) under ``$CIRCUITS_SIZES_DIR``
(default: pytest's temporary folder) and deleted after. `scripts/measure_sizes.py` is the same
measurement as one command that also writes the table into docs/scale.md. The plain reference of
this benchmark is the loaded build itself: the goal bounds what the scan holds beyond it.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "measure_sizes.py"
SHAPES = os.environ.get("PYTEST_CIRCUITS_SIZES", "llama-3.2-1b").split(",")


def _script():
    spec = importlib.util.spec_from_file_location("measure_sizes", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
@pytest.mark.parametrize("shape", SHAPES)
def test_scan_peak_memory_within_the_goal(shape, tmp_path_factory):
    sizes = _script()
    root = Path(os.environ.get("CIRCUITS_SIZES_DIR") or tmp_path_factory.mktemp("sizes"))
    folder = root / shape
    try:
        weights = sizes.build_checkpoint(shape, folder, seed=0)
        options = sizes.parse_options([])  # the gate's default plan
        row = {"shape": shape, "weights_bytes": weights, "probe": sizes.probe_words(options), "rungs": {}}
        row.update(ceiling=sizes.matmul_ceiling(), machine_load=sizes.machine_load())
        for rung in sizes.RUNGS:
            row["rungs"][rung] = sizes.run_stage(shape, folder, rung, options)
        print("\n" + sizes.table([row], options))
        goal = 1.25 * weights + 1.5e9
        for rung, result in row["rungs"].items():
            assert "error" not in result, f"{shape} {rung}: {result.get('error')}"
            assert result["rss"] <= goal, f"{shape} {rung}: peak RSS {result['rss'] / 1e9:.2f} GB > {goal / 1e9:.2f} GB"
        assert row["rungs"]["scan"]["exit"] == 0 and row["rungs"]["gate"]["exit"] == 0  # the build gates against itself
    finally:
        shutil.rmtree(folder, ignore_errors=True)


@pytest.mark.slow
def test_a_long_probe_stays_bounded(tmp_path_factory):
    """The repeat probe alone at 8k tokens (L 4096, n 1) on the Llama-3.2-1B shape runs in blocks of
    queries (`rungs.query_blocks`): it holds at most 2 GB beyond the loaded build (measured 1.72 GB,
    docs/kv-cache.md, "Long probes at size: memory"), where one forward's pattern and logits alone
    would take about 21 GB."""
    sizes = _script()
    root = Path(os.environ.get("CIRCUITS_SIZES_DIR") or tmp_path_factory.mktemp("sizes"))
    folder = root / "llama-3.2-1b"
    try:
        sizes.build_checkpoint("llama-3.2-1b", folder, seed=0)
        options = sizes.parse_options(["--probe-n", "1", "--probe-length", "4096", "--build", "bf16"])
        result = sizes.run_stage("llama-3.2-1b", folder, "probe", options)
        assert "error" not in result, result.get("error")
        grown = result["rss"] - result["load_rss"]
        assert grown <= 2e9, f"the probe held {grown / 1e9:.2f} GB beyond the loaded build"
    finally:
        shutil.rmtree(folder, ignore_errors=True)
