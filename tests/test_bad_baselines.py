"""Bad baselines and bad options, table-driven: each ends in exit 2 with one line on stderr that
names the thing, or in exit 1 with a gate failure that says why; none passes silently, none
shows a traceback, and a good baseline already in place is byte-identical afterwards."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
import stat
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

from pytest_circuits.cli import main
from pytest_circuits.testing import save_tiny_model

from .conftest import PROBES, SHIPPED_BASELINES, beyond_progress
from .test_bad_inputs import unwritable_folder

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
    """The one line of stderr beyond progress lines (a load on a busy machine writes its heartbeat)."""
    lines = [line for line in beyond_progress(err) if line.strip()]
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


DEEP = b'{"schema_version": ' + b"[" * 2000 + b"]" * 2000 + b"}"  # past the parser's recursion limit
SHALLOW_DEEP = b'{"schema_version": ' + b"[" * 200 + b"]" * 200 + b"}"  # parses, but deeper than any record
LONG_INT = b'{"schema_version": ' + b"7" * 5000 + b"}"  # past Python's 4300-digit integer limit


@pytest.mark.parametrize(
    "content, expected",
    [
        (b"\x89PNG\r\n\x1a\n\x00\xff\xfe", "is not UTF-8 text"),
        (b"{not json", "is not valid JSON (line 1)"),
        (b"[1, 2]", "top level is not an object"),
        (DEEP, "nests deeper than 64 levels"),
        (SHALLOW_DEEP, "nests deeper than 64 levels"),
        (LONG_INT, "holds a value Python cannot read (Exceeds the limit (4300 digits)"),
    ],
    ids=["binary", "not json", "a list", "2000 levels", "200 levels", "5000 digits"],
)
def test_unreadable_baseline_files(recorded, tmp_path, capsys, monkeypatch, content, expected):
    """In every command that reads a baseline: gate, diff, report, and record over an existing file."""
    model, good = recorded
    bad = tmp_path / "m--fp32.json"
    bad.write_bytes(content)
    monkeypatch.chdir(tmp_path)
    for argv in (
        ["gate", str(model), "--build", "fp32", "--baseline", str(bad)],
        ["diff", str(good), str(bad)],
        ["report", str(bad), "--out", str(tmp_path / "report")],
        ["report", str(good), "--against", str(bad), "--out", str(tmp_path / "report")],
    ):
        code, _, err = run(capsys, argv)
        assert code == 2 and expected in one_line(err) and str(bad) in err, err
    # record over it: the unreadable file is replaced by the new record (a corrupt baseline is rewritten)
    code, out, err = run(capsys, ["record", str(model), "--build", "fp32", "--baselines", str(tmp_path), *SMALL])
    assert code == 0 and "Traceback" not in err and f"wrote {bad}" in out, err


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


def test_another_models_baseline_is_refused_unless_a_swap_is_asked_for(recorded, tmp_path, capsys, monkeypatch):
    """A baseline of another geometry is another base model (#51 item 2): refused in one line before any
    figure is measured, unless ``--across-models`` asks for the swap, which is then compared on the swap
    invariants, the per-head ones skipped saying why; other probe settings are refused either way."""
    from pytest_circuits.run.records import MeasuredRecords

    _, good = recorded
    other = save_tiny_model("gpt2", tmp_path / "wide", seed=0, n_embd=32)
    gate = ["gate", str(other), "--build", "fp32", "--baseline", str(good), "--device", "cpu"]
    with monkeypatch.context() as patched:  # refused before the build is measured
        patched.setattr(MeasuredRecords, "record", lambda *a, **k: pytest.fail("measured before refusing"))
        code, out, err = run(capsys, gate)
    line = one_line(err)
    assert code == 2 and "gate passed" not in out
    assert f"baseline {good.name} is of another model (geometry d_model 64 vs 32, d_head 16 vs 8" in line
    assert "ask for a base-model swap (circuits gate --across-models" in line
    code, out, err = run(capsys, [*gate, "--across-models"])
    assert code in (0, 1) and beyond_progress(err) == []
    assert "per-head invariants were not compared (geometry d_model 64 vs 32, d_head 16 vs 8" in out
    assert "SKIP copying_heads: per-head invariants are not compared across models (geometry d_model 64 vs 32" in out
    assert "swap_copy: wide fp32 " in out and "against m (the baseline m--fp32.json)" in out
    code, _, err = run(capsys, [*gate[:6], *SMALL[:2], "--probe-n", "5", "--across-models"])
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


def test_record_into_a_path_that_is_a_file_is_one_line(recorded, tmp_path, capsys, monkeypatch):
    """Refused before any measuring: a scan that could only end in a write error never starts."""
    from pytest_circuits.run.records import MeasuredRecords

    def measured(*args, **kwargs):
        raise AssertionError("the build was measured before the folder was checked")

    monkeypatch.setattr(MeasuredRecords, "record", measured)
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

    from pytest_circuits.record.store import read_baseline

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


# ---------------------------------------------------------------- issue 27: a hostile user's inputs, one row each
#
# Each row builds its input under tmp_path, runs one `circuits` command in this process (cwd: the row's
# folder) and ends in one of three ways: exit 2 with one stderr line naming the thing and the fix, exit 1
# with a gate failure saying why, or exit 0 doing what was asked. Never a traceback, never a write into
# the shipped baselines (a read-only copy stands in for them; its hashes are checked after every row).

SHIPPED_SOURCE = SHIPPED_BASELINES
FAST = ["--no-knockout", "--probe-n", "4", "--probe-length", "16", "--device", "cpu"]
TINY = ["--probe-n", "4", "--probe-length", "16", "--device", "cpu"]


def digests(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}


def unwritable(tmp: Path) -> Path:
    """An existing folder no one here can write into (a read-only one, or /sys as root)."""
    return unwritable_folder(tmp).parent


@dataclass
class Ctx:
    tmp: Path
    model: Path  # the tiny gpt2 folder `m`
    good: Path  # its fp32 baseline
    shipped: Path  # the read-only copy standing in for the shipped baselines
    cwd: Path
    check: Callable[[], bool] | None = None
    feed: Callable[[], None] | None = None  # run beside the command (a FIFO's reader)


@dataclass(frozen=True)
class CliCase:
    id: str
    make: Callable[[Ctx], list[str]]  # the argv; may set ctx.cwd, ctx.check, ctx.feed
    rc: int
    names: tuple[str, ...]  # substrings of the one stderr line (rc 2), else of stdout


def case_record_default_folder(ctx: Ctx) -> list[str]:
    ctx.check = lambda: (ctx.cwd / "baselines" / "tiny-induction--fp32.json").is_file()
    return ["record", "tiny-induction", "--build", "fp32", *TINY]


def case_record_default_probe(ctx: Ctx) -> list[str]:
    """The shipped baseline's own probe settings: compared with ./baselines (empty), so written there."""
    ctx.check = lambda: (ctx.cwd / "baselines" / "tiny-induction--rtn-int8.json").is_file()
    return ["record", "tiny-induction", "--build", "rtn-int8", "--device", "cpu"]


def case_record_read_only_cwd(ctx: Ctx) -> list[str]:
    ctx.cwd = unwritable(ctx.tmp)
    return ["record", "tiny-induction", "--build", "fp32", *TINY]


def case_record_into_shipped(ctx: Ctx) -> list[str]:
    return ["record", "tiny-induction", "--build", "fp32", "--baselines", str(ctx.shipped), *TINY]


def case_gate_fifo_baseline(ctx: Ctx) -> list[str]:
    fifo = ctx.tmp / "m--fp32.json"
    os.mkfifo(fifo)
    return ["gate", str(ctx.model), "--build", "fp32", "--baseline", str(fifo), "--device", "cpu"]


def case_scan_json_fifo(ctx: Ctx) -> list[str]:
    fifo = ctx.tmp / "scan.json"
    os.mkfifo(fifo)
    got: list[bytes] = []

    def feed():
        with open(fifo, "rb") as handle:  # blocks until the scan opens it for writing
            got.append(handle.read())

    ctx.feed = feed
    ctx.check = lambda: stat.S_ISFIFO(os.lstat(fifo).st_mode) and json.loads(got[0])["model"]["name"] == "m"
    return ["scan", str(ctx.model), *FAST, "--json", str(fifo)]


def case_scan_json_unread_fifo(ctx: Ctx) -> list[str]:
    fifo = ctx.tmp / "scan.json"
    os.mkfifo(fifo)
    ctx.check = lambda: stat.S_ISFIFO(os.lstat(fifo).st_mode)
    return ["scan", str(ctx.model), *FAST, "--json", str(fifo)]


def case_scan_json_stale_temp(ctx: Ctx) -> list[str]:
    left = ctx.tmp / ".scan.json.k1ll3d.tmp"  # what kill -9 during the write leaves
    left.write_text('{"half": ')
    os.utime(left, (time.time() - 3600, time.time() - 3600))
    other = ctx.tmp / ".notes.txt.abc.tmp"  # another file's temporary: not ours to remove
    other.write_text("x")
    os.utime(other, (time.time() - 3600, time.time() - 3600))
    ctx.check = lambda: not left.exists() and other.exists() and (ctx.tmp / "scan.json").is_file()
    return ["scan", str(ctx.model), *FAST, "--json", str(ctx.tmp / "scan.json")]


def spread_baseline(ctx: Ctx, spread: float) -> Path:
    """The baseline with copy_loss 1 nat higher (copy_gain 1 lower) than the model gives, its
    per-sequence values spread by +-``spread`` around the stored means (which they still average to)."""
    record = json.loads(ctx.good.read_text())
    for figure, shift in (("copy_loss", 1.0), ("copy_gain", -1.0)):
        record[figure] += shift
        record[f"{figure}_interval"] = [v + shift for v in record[f"{figure}_interval"]]
        values = record[f"{figure}_sequences"]
        record[f"{figure}_sequences"] = [v + shift + spread * (-1) ** i for i, v in enumerate(values)]
    path = ctx.tmp / "m--fp32.json"
    path.write_text(json.dumps(record))
    return path


def case_gate_spread_baseline(ctx: Ctx) -> list[str]:
    path = spread_baseline(ctx, 3.0)
    return ["gate", str(ctx.model), "--build", "fp32", "--baseline", str(path), "--device", "cpu"]


def case_gate_moved_baseline(ctx: Ctx) -> list[str]:
    """The same move without the spread: the paired interval excludes 0 and the gate fails as always."""
    path = spread_baseline(ctx, 0.0)
    return ["gate", str(ctx.model), "--build", "fp32", "--baseline", str(path), "--device", "cpu"]


def case_report_read_only_out(ctx: Ctx) -> list[str]:
    return ["report", str(ctx.good), "--out", str(unwritable(ctx.tmp) / "circuits-report")]


def case_report_out_is_a_file(ctx: Ctx) -> list[str]:
    blocker = ctx.tmp / "circuits-report"
    blocker.write_text("in the way")
    ctx.check = lambda: blocker.read_text() == "in the way"
    return ["report", str(ctx.good), "--out", str(blocker)]


def whole_or_absent(out: Path) -> bool:
    """No temporary file and no truncated PNG in ``out``."""
    files = list(out.iterdir()) if out.is_dir() else []
    return not any(p.name.endswith(".tmp") for p in files) and all(
        p.read_bytes().endswith(b"IEND\xaeB`\x82") for p in files if p.suffix == ".png"
    )


def case_report_file_size_limit(ctx: Ctx) -> list[str]:
    """RLIMIT_FSIZE: writes past 20 kB fail (EFBIG), as on a full disk."""
    ctx.check = lambda: whole_or_absent(ctx.tmp / "out")
    return ["report", str(ctx.good), "--against", str(ctx.good), "--out", str(ctx.tmp / "out")]


def case_report_disk_full(ctx: Ctx) -> list[str]:
    """ENOSPC from fsync (how a full disk answers a delayed write), simulated."""
    ctx.check = lambda: whole_or_absent(ctx.tmp / "out")
    return ["report", str(ctx.good), "--out", str(ctx.tmp / "out")]


def surrogate_named(ctx: Ctx) -> Path:
    text = ctx.good.read_text().replace('"name": "m"', '"name": "m\\ud800"', 1)
    assert "\\ud800" in text
    path = ctx.tmp / "m--int8.json"
    path.write_text(text)
    return path


def case_diff_lone_surrogate(ctx: Ctx) -> list[str]:
    return ["diff", str(ctx.good), str(surrogate_named(ctx))]


def case_report_lone_surrogate(ctx: Ctx) -> list[str]:
    out = ctx.tmp / "out"
    ctx.check = lambda: "m\\ud800" in (out / "report.html").read_text() and whole_or_absent(out)
    return ["report", str(surrogate_named(ctx)), "--out", str(out)]


CLI_CASES = [
    CliCase("record-without---baselines-writes-./baselines", case_record_default_folder, 0, ("wrote baselines/",)),
    CliCase("record-shipped-probe-is-not-compared-with-shipped", case_record_default_probe, 0, ("wrote baselines/",)),
    CliCase("record-in-a-read-only-folder", case_record_read_only_cwd, 2, ("cannot create the folder baselines",)),
    CliCase(
        "record-into-the-shipped-folder", case_record_into_shipped, 2, ("shipped with pytest-circuits", "read only")
    ),
    CliCase("gate---baseline-is-a-fifo", case_gate_fifo_baseline, 2, ("m--fp32.json is not a regular file",)),
    CliCase("scan---json-is-a-fifo", case_scan_json_fifo, 0, ("wrote ",)),
    CliCase("scan---json-fifo-no-reader", case_scan_json_unread_fifo, 2, ("scan.json", "no process reads that FIFO")),
    CliCase("scan---json-stale-temp-swept", case_scan_json_stale_temp, 0, ("wrote ",)),
    CliCase("gate-baseline-spread-implausible", case_gate_spread_baseline, 1, ("carry no evidence", "FAIL copy_loss")),
    CliCase("gate-baseline-moved-not-spread", case_gate_moved_baseline, 1, ("FAIL copy_loss",)),
    CliCase("report---out-read-only", case_report_read_only_out, 2, ("circuits-report",)),
    CliCase("report---out-is-a-file", case_report_out_is_a_file, 2, ("circuits-report", "it is a file")),
    CliCase("report-file-size-limit", case_report_file_size_limit, 2, ("out/", "no space left")),
    CliCase("report-disk-full-enospc", case_report_disk_full, 2, ("out/", "no space left", "errno 28")),
    CliCase("diff-lone-surrogate-in-model.name", case_diff_lone_surrogate, 0, ("m\\ud800",)),
    CliCase("report-lone-surrogate-in-model.name", case_report_lone_surrogate, 0, ("report.html",)),
]


@pytest.mark.parametrize("case", CLI_CASES, ids=[c.id for c in CLI_CASES])
def test_hostile_cli_input(recorded, tmp_path, monkeypatch, capsys, case):
    from pytest_circuits.model import named

    model, good = recorded
    good_bytes = good.read_bytes()
    shipped = tmp_path / "site-packages" / "baselines"
    shutil.copytree(SHIPPED_SOURCE, shipped)
    for path in shipped.iterdir():
        path.chmod(0o444)
    shipped.chmod(0o555)
    monkeypatch.setattr(named, "SHIPPED_BASELINES", shipped)
    before = digests(shipped)
    work = tmp_path / "work"
    work.mkdir()
    ctx = Ctx(tmp_path, model, good, shipped, work)
    argv = case.make(ctx)
    monkeypatch.chdir(ctx.cwd)
    if case.id == "report-disk-full-enospc":

        def full(fd):
            raise OSError(errno.ENOSPC, "No space left on device")

        monkeypatch.setattr(os, "fsync", full)
    feeder = threading.Thread(target=ctx.feed, daemon=True) if ctx.feed else None
    if feeder:
        feeder.start()
    code, out, err = run_guarded(capsys, argv, fsize=20_000 if case.id == "report-file-size-limit" else None)
    if feeder:
        feeder.join(timeout=30)
    assert "Traceback" not in out + err, err
    assert code == case.rc, f"rc {code}\n{out}\n{err}"
    if case.rc == 2:
        line = one_line(err)
        assert line.startswith(f"circuits {argv[0]}: "), line
        for name in case.names:
            assert name in line, line
    else:
        for name in case.names:
            assert name in out, out
    if ctx.check is not None:
        assert ctx.check(), f"{case.id}: after-check failed"
    assert digests(shipped) == before  # no command wrote into the shipped baselines
    assert good.read_bytes() == good_bytes


def run_guarded(capsys, argv: list[str], fsize: int | None = None, deadline_s: float = 120.0):
    """`run` with a deadline (a command that blocks, e.g. on a FIFO, fails the row instead of hanging
    the suite) and optionally RLIMIT_FSIZE (writes past ``fsize`` bytes fail with EFBIG)."""
    import resource
    import signal

    result: list = []
    old_limit = resource.getrlimit(resource.RLIMIT_FSIZE)
    old_handler = signal.getsignal(signal.SIGXFSZ)

    def call():
        try:
            result.append(main(argv))
        except BaseException as error:  # reported below as the row's failure
            result.append(error)

    try:
        if fsize:
            signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
            resource.setrlimit(resource.RLIMIT_FSIZE, (fsize, old_limit[1]))
        worker = threading.Thread(target=call, daemon=True)
        worker.start()
        worker.join(deadline_s)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, old_limit)
        signal.signal(signal.SIGXFSZ, old_handler)
    blocked = worker.is_alive()
    if blocked:  # unblock a reader stuck on a FIFO, so the thread ends
        for path in Path.cwd().parent.rglob("*.json"):
            if stat.S_ISFIFO(os.lstat(path).st_mode):
                os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))
    captured = capsys.readouterr()
    assert not blocked, f"the command blocked for {deadline_s} s"
    if isinstance(result[0], BaseException):
        raise result[0]
    return result[0], captured.out, captured.err


# ---------------------------------------------------------------- issue 27: the pytest front end, Ctrl-C


def probes_suite(pytester, model: Path, baselines: Path):
    """The shipped probes gating ``model`` (run in this process: torch is imported already)."""
    for test in sorted(PROBES.glob("test_*.py")):
        pytester.makepyfile(**{test.stem: test.read_text()})
    pytester.makeini(
        f"[pytest]\ncircuits_model = {model}\ncircuits_builds = fp32\ncircuits_baselines = {baselines}\n"
        "circuits_device = cpu\ncircuits_probe_n = 4\ncircuits_probe_length = 16\n"
    )


@pytest.mark.parametrize("shards", ["3", "4096"])
def test_knockout_shards_above_the_layer_count_run_one_per_layer(recorded, pytester, shards):
    """--circuits-knockout-shards above the model's 2 layers (3: an IndexError before; 4096, the documented
    maximum: thousands of erroring tests before) gives one shard test per layer, and they pass."""
    model, good = recorded
    probes_suite(pytester, model, good.parent)
    flags = ["-p", "no:cacheprovider", "--circuits-knockout-shards", shards, "-k", "shard"]
    collected = pytester.runpytest(*flags, "--collect-only", "-q")
    assert [line for line in collected.outlines if "test_knockout_shard[" in line] == [
        "test_rung2_knockout.py::test_knockout_shard[fp32-shard1of2]",
        "test_rung2_knockout.py::test_knockout_shard[fp32-shard2of2]",
    ], collected.outlines
    pytester.runpytest(*flags).assert_outcomes(passed=2)


INTERRUPT_AT_IMPORT = """\
import sys


class Interrupt:  # Ctrl-C arriving while this module is being imported
    def find_spec(self, name, path=None, target=None):
        if name == sys.argv[1]:
            raise KeyboardInterrupt
        return None


sys.meta_path.insert(0, Interrupt())
from pytest_circuits.cli import main  # what the console script `circuits` does

sys.exit(main(sys.argv[2:]))
"""


@pytest.mark.parametrize(
    "module, argv",
    [
        ("argparse", ["--help"]),
        ("pytest_circuits.options", ["--help"]),
        ("pytest_circuits.report", ["report", "m--fp32.json"]),
    ],
    ids=["argparse", "options", "report"],
)
def test_ctrl_c_while_importing_is_one_line_exit_130(tmp_path, module, argv):
    import subprocess
    import sys

    env = {**os.environ, "PYTHONPATH": str(PROBES.parent.parent)}
    done = subprocess.run(
        [sys.executable, "-c", INTERRUPT_AT_IMPORT, module, *argv],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 130, done.stderr
    assert done.stderr.strip() == "circuits: interrupted" and done.stdout == ""


# ---------------------------------------------------------------- issue 38


def _planted_link(folder: Path, name: str) -> tuple[Path, Path]:
    """``folder/name`` a link to a victim file beside ``folder``: what a planted link would overwrite."""
    folder.mkdir(exist_ok=True)
    victim = folder.parent / "victim.txt"
    victim.write_text("VICTIM\n")
    (folder / name).symlink_to(victim)
    return folder / name, victim


def test_record_update_all_never_writes_through_a_planted_link(recorded, tmp_path, capsys, pytester):
    """``circuits record --update-all`` and pytest ``--circuits-update-all`` wrote the baseline into
    any file a link in the baselines folder named; now one line each, before the scan, and the
    victim and the link are as they were."""
    model, _ = recorded
    link, victim = _planted_link(tmp_path / "bl", "m--fp32.json")
    code, out, err = run(
        capsys, ["record", str(model), "--build", "fp32", "--baselines", str(link.parent), "--update-all"]
    )
    assert code == 2 and out == ""
    assert f"cannot write {link}: it is a symbolic link (to {victim})" in one_line(err)
    probes_suite(pytester, model, link.parent)
    result = pytester.runpytest("-p", "no:cacheprovider", "--circuits-update-all", "-k", "copying_heads")
    assert f"cannot write {link}: it is a symbolic link" in result.stdout.str()
    assert result.ret != 0 and "Traceback" not in result.stdout.str()
    assert victim.read_text() == "VICTIM\n" and link.is_symlink()


def test_a_folder_named_as_a_baseline_is_one_line(recorded, tmp_path, capsys, pytester):
    """A folder where a baseline file belongs: an IsADirectoryError traceback in gate, diff and pytest,
    a TypeError in report; now one line naming it and the fix, everywhere."""
    model, good = recorded
    folder = tmp_path / "bl" / "m--fp32.json"
    folder.mkdir(parents=True)
    for argv in (
        ["gate", str(model), "--build", "fp32", "--baseline", str(folder)],
        ["diff", str(good), str(folder)],
        ["report", str(folder), "--out", str(tmp_path / "report")],
        ["report", str(good), "--against", str(folder), "--out", str(tmp_path / "report")],
    ):
        code, _, err = run(capsys, argv)
        assert code == 2 and f"baseline {folder} is a folder, not a file; pass a baseline .json file" in one_line(err)
    probes_suite(pytester, model, folder.parent)
    result = pytester.runpytest("-p", "no:cacheprovider", "-k", "copying_heads")
    assert f"baseline {folder} is a folder, not a file" in result.stdout.str()
    assert result.ret == 1 and "IsADirectoryError" not in result.stdout.str()


def test_a_baseline_of_another_model_type_is_another_model(recorded, tmp_path, capsys):
    """A same-shape baseline recorded from another model type (a llama record under this gpt2's name)
    gated with only "the weights differ"; now refused naming both types, unless a swap is asked for."""
    model, good = recorded
    record = json.loads(good.read_text())
    record["model"]["model_type"] = "llama"
    other = tmp_path / "m--fp32.json"
    other.write_text(json.dumps(record))
    code, out, err = run(capsys, ["gate", str(model), "--build", "fp32", "--baseline", str(other), *SMALL])
    assert code == 2 and "gate passed" not in out
    line = one_line(err)
    assert f"baseline {other.name} was recorded from another model (model type llama vs gpt2)" in line
    assert "circuits gate --across-models" in line
    code, out, _ = run(
        capsys, ["gate", str(model), "--build", "fp32", "--baseline", str(other), "--across-models", *SMALL]
    )
    assert code in (0, 1) and "swap_copy" in out and "SKIP copying_heads: per-head invariants are not compared" in out
    code, out, err = run(capsys, ["diff", str(good), str(other)])  # diff compares them as two base models
    assert code == 0 and "per-head figures not compared: A and B are two base models" in out


def test_sensitivity_refuses_what_it_cannot_damage_before_any_work(recorded, capsys, monkeypatch):
    """``circuits sensitivity --build bnb-int8`` tracebacked after the intact gate (~100 s); a baseline of
    another geometry was reported after all 20 damages. Both are one line before any gate runs."""
    from pytest_circuits.model.named import SHIPPED_BASELINES
    from pytest_circuits.run import sensitivity

    model, _ = recorded
    gated = []
    monkeypatch.setattr(sensitivity, "gate_outcome", lambda *a, **k: gated.append(a) or pytest.fail("gated"))
    code, out, err = run(capsys, ["sensitivity", "tiny-induction", "--build", "bnb-int8"])
    line = one_line(err)
    assert code == 2 and "--build bnb-int8: sensitivity damages float weights" in line and "fp32" in line
    wide = Path(SHIPPED_BASELINES) / "smollm2-135m--fp32.json"
    code, out, err = run(capsys, ["sensitivity", str(model), "--build", "fp32", "--baseline", str(wide)])
    assert code == 2 and "the baseline is of another model (geometry n_layers 30 vs 2" in one_line(err)
    assert gated == [] and out == ""


def test_wording_names_what_the_user_typed(tmp_path, capsys):
    """``--shard 1/99999999999999999999`` was refused naming --knockout-shards; an unknown model type
    suggested --trust-remote-code when it was given."""
    code, _, err = run(capsys, ["record", "m", "--build", "fp32", "--shard", "1/99999999999999999999", "--out", "p"])
    line = one_line(err)
    assert code == 2 and "--shard 1/99999999999999999999: K must be at most 4096" in line
    assert "--knockout-shards" not in line
    folder = save_tiny_model("llama", tmp_path / "odd")
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "model_type": "not-a-known-type"}))
    code, _, err = run(capsys, ["scan", str(folder), "--no-knockout", "--trust-remote-code"])
    line = one_line(err)
    assert code == 2 and "not-a-known-type" in line and "pass --trust-remote-code" not in line
    assert "--trust-remote-code was given and cannot help" in line
    code, _, err = run(capsys, ["scan", str(folder), "--no-knockout"])
    assert code == 2 and "pass --trust-remote-code only if you trust it" in one_line(err)


INTERRUPT_AT_ENTRY = INTERRUPT_AT_IMPORT.replace(
    "from pytest_circuits.cli import main  # what the console script `circuits` does\n\nsys.exit(main(sys.argv[2:]))",
    "from pytest_circuits.entry import main  # what the console script `circuits` does\n\nsys.exit(main())",
)


def test_ctrl_c_while_the_console_script_loads_the_command_is_one_line(tmp_path):
    """Ctrl-C in a command's first milliseconds landed in the console script's own ``from
    pytest_circuits.cli import main``, outside any guard (a traceback, exit -2): the script now
    imports `pytest_circuits.entry`, which loads the command under the guard."""
    import subprocess
    import sys
    from importlib.metadata import entry_points

    (script,) = entry_points(group="console_scripts", name="circuits")  # as installed: editable or wheel
    assert script.value == "pytest_circuits.entry:main"
    assert INTERRUPT_AT_ENTRY != INTERRUPT_AT_IMPORT
    done = subprocess.run(
        [sys.executable, "-c", INTERRUPT_AT_ENTRY, "pytest_circuits.cli", "--help"],
        env={**os.environ, "PYTHONPATH": str(PROBES.parent.parent)},
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 130 and done.stderr.strip() == "circuits: interrupted" and done.stdout == ""
