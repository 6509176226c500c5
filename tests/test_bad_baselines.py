"""Bad baselines and bad options, table-driven: each ends in exit 2 with one line on stderr that
names the thing, or in exit 1 with a gate failure that says why; none passes silently, none
shows a traceback, and a good baseline already in place is byte-identical afterwards."""

from __future__ import annotations

import json

import pytest

from pytest_circuits.cli import main
from pytest_circuits.testing import save_tiny_model

from .conftest import beyond_progress

SMALL = ["--device", "cpu", "--probe-n", "4", "--probe-length", "16"]


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    """A tiny gpt2 folder ``m`` and its recorded fp32 baseline."""
    root = tmp_path_factory.mktemp("bad")
    model = save_tiny_model("gpt2", root / "m", seed=0)
    baselines = root / "baselines"
    assert main(["record", str(model), "--build", "fp32", "--baselines", str(baselines), *SMALL]) == 0
    return model, baselines / "m--fp32.json"


def run(capsys, argv: list[str]) -> tuple[int, str, str]:
    code = main(argv)
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def one_line(err: str) -> str:
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, f"expected one line on stderr, got:\n{err}"
    assert "Traceback" not in err
    return lines[0]


def _set(path: list, value):
    def mutate(record):
        target = record
        for key in path[:-1]:
            target = target[key]
        target[path[-1]] = value

    return mutate


def _drop_layer(record):
    record["heads"][0].pop("layer")


BAD_RECORDS = [  # (case, mutation of a good baseline, what the one line must say)
    ("no heads", _set(["heads"], []), "heads holds 0 of the geometry's 8 heads"),
    ("head that does not exist", _set(["heads", 7, "head"], "L9H9"), "heads[7].head L9H9 does not exist"),
    ("kappa is a string", _set(["heads", 0, "kappa"], "0.5"), "heads[0].kappa: Input should be a valid number"),
    ("knockout is a string", _set(["heads", 2, "knockout_delta"], "big"), "heads[2].knockout_delta"),
    ("head without layer", _drop_layer, "heads[0].layer: Field required"),
    ("eigenvalues too short", _set(["eigenvalues", "L0H0"], [[1.0, 0.0]]), "eigenvalues.L0H0 holds 1 values"),
    ("eigenvalue not a number", _set(["eigenvalues", "L0H0", 0], ["x", 0.0]), "eigenvalues.L0H0[0][0]"),
    ("copy loss is a string", _set(["copy_loss"], "high"), "copy_loss: Input should be a valid number"),
    ("fingerprint is an int", _set(["model", "fingerprint"], 7), "model.fingerprint"),
    ("probe is a string", _set(["probe"], "x"), "probe: Input should be"),
    ("build is null", _set(["build"], None), "build: Input should be"),
    ("schema from the future", _set(["schema_version"], 99), "schema version 99"),
]


@pytest.mark.parametrize("case, mutate, expected", BAD_RECORDS, ids=[c for c, _, _ in BAD_RECORDS])
@pytest.mark.parametrize("command", ["gate", "diff"])
def test_bad_baseline_is_one_line_exit_2(recorded, tmp_path, capsys, case, mutate, expected, command):
    model, good = recorded
    before = good.read_bytes()
    record = json.loads(before)
    mutate(record)
    bad = tmp_path / "m--fp32.json"
    bad.write_text(json.dumps(record))
    argv = (
        ["gate", str(model), "--build", "fp32", "--baseline", str(bad), "--device", "cpu"]
        if command == "gate"
        else ["diff", str(good), str(bad)]
    )
    code, out, err = run(capsys, argv)
    assert code == 2, out
    line = one_line(err)
    assert expected in line and str(bad) in line and "record it again with circuits record" in line
    assert "gate passed" not in out and "all invariants hold" not in out
    assert good.read_bytes() == before


@pytest.mark.parametrize(
    "content, expected",
    [
        (b"\x89PNG\r\n\x1a\n\x00\xff\xfe", "is not UTF-8 text"),
        (b"{not json", "is not valid JSON (line 1)"),
        (b"[1, 2]", "top level is not an object"),
    ],
    ids=["binary", "not json", "a list"],
)
def test_unreadable_baseline_files(recorded, tmp_path, capsys, content, expected):
    model, good = recorded
    bad = tmp_path / "m--fp32.json"
    bad.write_bytes(content)
    for argv in (["gate", str(model), "--build", "fp32", "--baseline", str(bad)], ["diff", str(good), str(bad)]):
        code, _, err = run(capsys, argv)
        assert code == 2 and expected in one_line(err)


OPTION_CASES = [  # (argv after the model, what the one line must name)
    (["--probe-seed", "-1"], "--probe-seed must be at least 0, got -1"),
    (["--probe-n", "1000000000"], "--probe-n must be at most 1000000"),
    (["--probe-n", "0"], "--probe-n must be at least 1"),
    (["--probe-length", "x"], "--probe-length must be an integer, got 'x'"),
    (["--batch-size", "0"], "--batch-size must be at least 1"),
    (["--knockout-mode", "half"], "--knockout-mode must be one of zero, mean"),
    (["--knockout-screen", "-3"], "--knockout-screen must be at least 0"),
    (["--build", "int3"], "unknown build recipe 'int3'"),
]


@pytest.mark.parametrize("extra, expected", OPTION_CASES, ids=[" ".join(a) for a, _ in OPTION_CASES])
def test_bad_options_are_refused_before_any_work(recorded, capsys, extra, expected):
    model, _ = recorded
    code, out, err = run(capsys, ["scan", str(model), "--device", "cpu", *extra])
    assert code == 2 and out == ""  # nothing was computed or printed
    line = one_line(err)
    assert expected in line and "--circuits-" not in line  # the CLI's own flag names


def test_probe_longer_than_the_context_is_refused_before_the_scan(recorded, capsys):
    model, _ = recorded
    code, out, err = run(capsys, ["scan", str(model), "--device", "cpu", "--probe-length", "100"])
    assert code == 2 and out == ""
    line = one_line(err)
    assert "needs 200 positions but the model's context is 128" in line and "--probe-length 64" in line


def test_other_geometry_is_gated_across_models_not_refused(recorded, tmp_path, capsys):
    """Another geometry is another base model (issue 13): compared on the swap invariants, the
    per-head ones skipped saying why; other probe settings are still refused (exit 2)."""
    _, good = recorded
    other = save_tiny_model("gpt2", tmp_path / "wide", seed=0, n_embd=32)
    code, out, err = run(capsys, ["gate", str(other), "--build", "fp32", "--baseline", str(good), "--device", "cpu"])
    assert code in (0, 1) and beyond_progress(err) == []
    assert "per-head invariants were not compared (geometry d_model 64 vs 32, d_head 16 vs 8" in out
    assert "SKIP copying_heads: per-head invariants are not compared across models (geometry d_model 64 vs 32" in out
    assert "swap_copy: wide fp32 " in out and "against m (the baseline m--fp32.json)" in out
    code, _, err = run(
        capsys, [*["gate", str(other), "--build", "fp32", "--baseline", str(good)], *SMALL[:2], "--probe-n", "5"]
    )
    assert code == 2 and "recorded with other probe settings (n=4 vs 5)" in one_line(err)


def test_screened_gate_measures_the_baseline_files_key_heads(tmp_path, capsys):
    """The CLI gate with --knockout-screen knocks out the key heads of the FILE it gates against,
    wherever that file lives: a figure that was not measured never reads as a change."""
    baselines = tmp_path / "elsewhere"
    assert (
        main(
            [
                "record",
                "tiny-induction",
                "--build",
                "fp32",
                "--baselines",
                str(baselines),
                "--probe-n",
                "4",
                "--device",
                "cpu",
            ]
        )
        == 0
    )
    capsys.readouterr()
    code, out, _ = run(
        capsys,
        [
            "gate",
            "tiny-induction",
            "--build",
            "fp32",
            "--baseline",
            str(baselines / "tiny-induction--fp32.json"),
            "--knockout-screen",
            "0",
            "--device",
            "cpu",
        ],
    )
    assert code == 0, out
    assert "PASS knockout_deltas" in out and "nan" not in out and "NOT MEASURED" not in out


def test_scan_json_write_is_atomic(recorded, tmp_path, capsys, monkeypatch):
    model, _ = recorded
    out = tmp_path / "scan.json"
    out.write_text('{"good": true}\n')
    import os

    def crash(src, dst):
        raise KeyboardInterrupt

    monkeypatch.setattr(os, "replace", crash)
    assert main(["scan", str(model), "--no-knockout", "--json", str(out), *SMALL]) == 130
    assert out.read_text() == '{"good": true}\n' and [p.name for p in tmp_path.iterdir()] == ["scan.json"]


def test_record_into_a_path_that_is_a_file_is_one_line(recorded, tmp_path, capsys):
    model, _ = recorded
    blocker = tmp_path / "baselines"
    blocker.write_text("not a folder")
    for folder in (blocker, blocker / "sub"):
        code, _, err = run(capsys, ["record", str(model), "--build", "fp32", "--baselines", str(folder), *SMALL])
        assert code == 2
        line = one_line(err)
        assert str(blocker) in line
    assert blocker.read_text() == "not a folder"


def test_record_cleans_what_a_killed_writer_left(recorded, tmp_path, capsys):
    """A kill -9 mid-write leaves a temporary file beside the baseline; the next record removes it."""
    import os
    import time

    model, good = recorded
    folder = tmp_path / "baselines"
    folder.mkdir()
    (folder / good.name).write_bytes(good.read_bytes())
    left = folder / f".{good.name}.k1ll3d.tmp"
    left.write_text('{"half": ')
    old = time.time() - 3600
    os.utime(left, (old, old))
    code, _, err = run(capsys, ["record", str(model), "--build", "fp32", "--baselines", str(folder), *SMALL])
    assert code == 0, err
    assert sorted(p.name for p in folder.iterdir()) == [good.name]


@pytest.mark.slow
def test_kill_9_during_record_keeps_the_old_baseline(recorded, tmp_path):
    """kill -9 of `circuits record` at several moments: the old baseline stays whole and valid."""
    import os
    import signal
    import subprocess
    import sys
    import time

    from pytest_circuits.gate.store import read_baseline

    model, good = recorded
    folder = tmp_path / "baselines"
    folder.mkdir()
    target = folder / good.name
    target.write_bytes(good.read_bytes())
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    for delay in (0.5, 2.0, 4.0, 6.0):
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "pytest_circuits.cli",
                "record",
                str(model),
                "--build",
                "fp32",
                "--baselines",
                str(folder),
                *SMALL,
            ],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        time.sleep(delay)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        read_baseline(target)  # whole and valid, old or new
    assert not [p for p in folder.iterdir() if p.name != target.name and not p.name.endswith(".tmp")]
