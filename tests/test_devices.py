"""Devices: worker i on cuda:(i mod count), accelerate's device_map, bitsandbytes on CUDA.

What a CPU can check runs here (the choice of device with the count and the worker patched,
the option's validation, a device_map that places every block on the CPU, the replay's moves of
recorded calls); the rest is marked ``cuda`` and skipped with its reason when no GPU is present.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from pytest_circuits.errors import CircuitsError, RecipeError
from pytest_circuits.model.builds import auto_device, check_device_map, check_not_offloaded, resolve_device
from pytest_circuits.run.run import Run
from pytest_circuits.settings import CircuitsSettings, RepeatSettings, build_settings
from pytest_circuits.testing import requires_embedded_model, requires_smollm2

NO_GPU = "needs a CUDA device; none here"
SMALL = RepeatSettings(0, 2, 16)


@pytest.mark.parametrize(
    "count, worker, expected",
    [
        (0, "gw3", "cpu"),
        (0, None, "cpu"),
        (1, None, "cuda:0"),
        (1, "gw7", "cuda:0"),
        (4, "gw0", "cuda:0"),
        (4, "gw5", "cuda:1"),
        (3, "gw2", "cuda:2"),
        (2, "master", "cuda:0"),
    ],
)
def test_auto_gives_worker_i_the_gpu_i_mod_count(count, worker, expected):
    assert auto_device(count, worker) == expected


def test_auto_reads_the_visible_count_and_the_worker(monkeypatch):
    """``torch.cuda.device_count`` counts only what CUDA_VISIBLE_DEVICES shows; patched here."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 3)
    assert resolve_device("auto", "gw4") == torch.device("cuda:1")
    monkeypatch.setenv("PYTEST_XDIST_WORKER", "gw2")
    assert resolve_device("auto") == torch.device("cuda:2")
    session = Run(CircuitsSettings(device="auto"))
    session.loaded.worker = "gw5"
    assert session.loaded.device == torch.device("cuda:2")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    assert resolve_device("auto", "gw4") == torch.device("cpu")


def test_the_device_map_option_is_checked():
    with pytest.raises(CircuitsError, match=r"--circuits-device-map must be one of none, auto, balanced"):
        build_settings({"device-map": "everywhere"}, baselines=None, front_end="pytest")
    assert build_settings({"device-map": "balanced"}, baselines=None).device_map == "balanced"
    with pytest.raises(CircuitsError, match="places the model over every visible GPU itself"):
        check_device_map("auto", torch.device("cuda:1"))
    check_device_map("auto", torch.device("cpu"))
    check_device_map("none", torch.device("cuda:1"))


def test_a_placement_that_offloads_next_to_gpus_is_refused():
    class Placed:
        hf_device_map = {"model.embed_tokens": 0, "model.layers.0": 1, "model.layers.1": "cpu", "lm_head": "disk"}

    with pytest.raises(
        RecipeError, match="does not fit the visible GPUs: accelerate offloaded part of it to cpu and disk"
    ):
        check_not_offloaded(Placed(), "build fp32 of m")
    Placed.hf_device_map = {"model.embed_tokens": 0, "model.layers.0": 1}
    check_not_offloaded(Placed(), "build fp32 of m")


def _record(device_map: str, recipe: str) -> str:
    session = Run(CircuitsSettings(device="cpu", device_map=device_map, probe=SMALL))
    return json.dumps(session.records.record(recipe).data, sort_keys=True)


@requires_embedded_model()
@pytest.mark.parametrize("recipe", ["fp32", "rtn-int8"])
def test_a_device_map_on_the_cpu_gives_identical_figures(recipe):
    """With no GPU accelerate places every block on the CPU: the record is the same, figure for figure."""
    assert _record("auto", recipe) == _record("none", recipe)
    assert _record("balanced", recipe) == _record("none", recipe)


@requires_embedded_model()
def test_the_replay_moves_each_recorded_call_to_its_blocks_device(monkeypatch):
    """The moves a spread model needs (every recorded tensor to its block's device) leave the deltas
    exactly as they were; here every block's device is the CPU, so the moves run and change nothing."""
    from pytest_circuits.rungs import knockout, replay

    session = Run(CircuitsSettings(device="cpu", probe=SMALL))
    build = session.loaded.build("fp32")
    plain = knockout.knockout_scan(build, SMALL, progress=False)
    moved = []
    real_moved = replay.moved

    def spy(obj, device):
        moved.append(device)
        return real_moved(obj, device)

    monkeypatch.setattr(replay, "block_devices", lambda model: [torch.device("cpu")] * build.geometry.n_layers)
    monkeypatch.setattr(replay, "moved", spy)
    spread = knockout.knockout_scan(build, SMALL, progress=False)
    assert moved and set(moved) == {torch.device("cpu")}
    assert spread["knockout_delta"].tolist() == plain["knockout_delta"].tolist()


def test_block_devices_read_accelerates_placement():
    from pytest_circuits.rungs.replay import block_devices
    from pytest_circuits.testing import make_tiny_model

    model = make_tiny_model("llama")
    assert block_devices(model) is None  # not spread
    model.hf_device_map = {"model.embed_tokens": 0, "model.layers.0": 0, "model.layers.1": 1}
    for index, block in enumerate(model.model.layers):
        block._hf_hook = type("Hook", (), {"execution_device": index % 2})()
    assert block_devices(model) == [torch.device("cuda", i % 2) for i in range(len(model.model.layers))]


# ------------------------------------------------------------------ on a GPU


cuda = pytest.mark.cuda
needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_GPU)
needs_two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")


def _gate_against_cpu(session, recipe: str) -> list[str]:
    """Invariants of ``recipe`` on ``session``'s device that fail against the CPU fp32 record."""
    from pytest_circuits.gate.invariants import gate_all

    cpu = Run(CircuitsSettings(device="cpu", probe=session.settings.probe))
    results = gate_all(
        cpu.records.record("fp32"), session.records.record(recipe), session.tolerances, recipe, "cpu fp32"
    )
    assert any(r.passed for r in results)  # something was compared
    return [r.invariant for r in results if r.status == "failed"]


@requires_embedded_model()
def test_the_cpu_gate_helper_passes_a_benign_build_and_fails_a_broken_one():
    """`_gate_against_cpu` itself, on the CPU: the cuda test above trusts it."""
    session = Run(CircuitsSettings(device="cpu", probe=SMALL))
    assert _gate_against_cpu(session, "rtn-int8") == []
    from pytest_circuits.testing import negate_head_ov

    negate_head_ov(session.loaded.build("fp32").model, 1, 0)  # the induction head's OV reversed
    assert "copying_heads" in _gate_against_cpu(session, "fp32")


@cuda
@needs_gpu
@requires_embedded_model()
def test_auto_on_a_gpu_machine_puts_worker_i_on_its_gpu(monkeypatch):
    count = torch.cuda.device_count()
    monkeypatch.setenv("PYTEST_XDIST_WORKER", "gw1")
    session = Run(CircuitsSettings(device="auto", probe=SMALL))
    assert session.loaded.device == torch.device(f"cuda:{1 % count}")
    assert session.loaded.build("fp32").identity.device == f"cuda:{1 % count}"


@cuda
@needs_gpu
@requires_embedded_model()
@pytest.mark.parametrize("recipe", ["fp32", "bnb-int8", "bnb-nf4"])
def test_builds_on_cuda_gate_against_the_cpu_record(recipe):
    session = Run(CircuitsSettings(device="cuda"))  # the default probe, as the baselines
    assert session.loaded.build(recipe).device.type == "cuda"
    assert _gate_against_cpu(session, recipe) == []


@cuda
@needs_gpu
@requires_embedded_model()
def test_a_device_map_on_gpus_gives_the_single_gpu_figures():
    one = Run(CircuitsSettings(device="cuda", probe=SMALL)).records.record("fp32").data
    spread_session = Run(CircuitsSettings(device="auto", device_map="balanced", probe=SMALL))
    spread = spread_session.records.record("fp32").data
    for a, b in zip(one["heads"], spread["heads"]):
        for key in ("kappa", "prefix_matching", "knockout_delta"):
            if isinstance(a.get(key), float) and not math.isnan(a[key]):
                assert b[key] == pytest.approx(a[key], abs=1e-4), (a["head"], key)


@cuda
@needs_two_gpus
@requires_embedded_model()
def test_a_model_spread_over_two_gpus_replays_on_each_blocks_device():
    from pytest_circuits.rungs.knockout import knockout_scan
    from pytest_circuits.rungs.replay import block_devices

    spread = Run(CircuitsSettings(device="auto", device_map="balanced", probe=SMALL)).loaded.build("fp32")
    devices = block_devices(spread.model)
    assert devices is not None and len(set(devices)) == 2
    one = Run(CircuitsSettings(device="cuda:0", probe=SMALL)).loaded.build("fp32")
    a = knockout_scan(one, SMALL, progress=False)["knockout_delta"]
    b = knockout_scan(spread, SMALL, progress=False)["knockout_delta"]
    assert (a - b).abs().max() < 1e-4


GPU_CHECK = Path(__file__).resolve().parent.parent / "scripts" / "gpu_check.py"


def _gpu_check_module():
    import importlib.util

    spec = importlib.util.spec_from_file_location("gpu_check", GPU_CHECK)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_gpu_check_without_a_gpu_is_one_line_and_exit_3(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert _gpu_check_module().main([]) == 3
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and "no CUDA device here" in err and "nothing was checked" in err


@cuda
@needs_gpu
@pytest.mark.slow
@pytest.mark.real
@requires_smollm2()
def test_gpu_check_runs_on_a_gpu(capsys):
    """The whole check (under five minutes on a GPU): every recipe against its CPU baseline."""
    code = _gpu_check_module().main([])
    out = capsys.readouterr().out
    assert "exact scan, 270 heads" in out and "plain loop, 270 heads" in out
    assert code == 0, out
