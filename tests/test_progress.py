"""The scan's progress: heads done, the stage, and an ETA weighted by each head's cost."""

from __future__ import annotations

import pytest

from pytest_circuits.progress import Progress, format_seconds
from pytest_circuits.rungs.replay import replay_cost

from .conftest import IMPORT_ROOT


class FakeClock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def test_eta_weights_deeper_layers_as_cheaper():
    """4 layers x 2 heads; a head in layer l replays 4 - l blocks. After layer 0 (8 of 20 cost
    units in 8 s), the ETA is 8 * 12/8 = 12 s, not the 24 s a per-head rate would say."""
    clock, lines = FakeClock(), []
    costs = [replay_cost(4, layer) for layer in range(4) for _ in range(2)]
    assert sum(costs) == 20
    bar = Progress(8, "knockout x", total_cost=20, write=lines.append, interval=5.0, clock=clock)
    for step in range(2):
        clock.now += 4.0
        bar.update(1, costs[step], f"L0H{step}")
    assert bar.eta() == pytest.approx(8.0 * 12 / 8)
    assert lines == ["knockout x: 2/8 heads, at L0H1, 8s elapsed, ETA 12s"]


def test_plain_lines_every_interval_and_a_closing_one():
    clock, lines = FakeClock(), []
    bar = Progress(10, "scan", write=lines.append, interval=5.0, clock=clock)
    for _ in range(10):
        clock.now += 2.0
        bar.update(1, stage="L0")
    # lines at 6 s (3 heads: 6 >= 5 since start), 12 s (6 heads), 18 s (9 heads), then the closing one
    assert [line.split(":")[1].split(",")[0].strip() for line in lines] == [
        "3/10 heads",
        "6/10 heads",
        "9/10 heads",
        "10/10 heads",
    ]
    assert lines[-1].endswith("ETA 0s")


def test_short_scans_stay_quiet_and_disabled_is_silent():
    clock, lines = FakeClock(), []
    bar = Progress(3, "scan", write=lines.append, interval=5.0, clock=clock)
    for _ in range(3):
        clock.now += 0.1
        bar.update(1)
    assert lines == []
    off = Progress(3, "scan", enabled=False, write=lines.append, clock=clock)
    clock.now += 60
    off.update(3)
    assert lines == [] and off.done == 0


def test_stderr_lines_when_not_a_terminal(capsys):
    clock = FakeClock()
    bar = Progress(2, "scan", interval=1.0, clock=clock, terminal=False)
    clock.now += 2
    bar.update(1, stage="L3")
    assert capsys.readouterr().err == "scan: 1/2 heads, at L3, 2s elapsed, ETA 2s\n"


def test_format_seconds():
    assert [format_seconds(s) for s in (0, 42.4, 185, 3720)] == ["0s", "42s", "3m05s", "1h02m"]


def test_a_phase_without_steps_beats_while_it_lasts_and_a_short_one_is_quiet():
    import time

    from pytest_circuits.progress import phase

    lines: list[str] = []
    with phase("loading m:fp32", lines.append, interval=0.05):
        time.sleep(0.3)
    assert len(lines) >= 3 and lines[0] == "loading m:fp32: 0s elapsed"
    assert lines[-1] == "loading m:fp32: done in 0s"
    quiet: list[str] = []
    with phase("short", quiet.append, interval=60):
        pass
    with phase("off", quiet.append, interval=0.01, enabled=False):
        time.sleep(0.05)
    assert quiet == []


def test_the_attribution_screen_reports_its_chunks(monkeypatch, tiny_folder):
    """The AtP* screen counts its chunks of sequences (it printed nothing, even in the CLI)."""
    import pytest_circuits.progress as progress
    from pytest_circuits.model.builds import load_build
    from pytest_circuits.model.loading import resolve_model
    from pytest_circuits.rungs.knockout import knockout_scan
    from pytest_circuits.rungs.repeat_settings import RepeatSettings

    monkeypatch.setattr(progress, "INTERVAL", 0.0)  # every step a line
    build = load_build(resolve_model(str(tiny_folder("llama"))), "fp32", "cpu")
    lines: list[str] = []
    knockout_scan(build, RepeatSettings(1, 6, 8), screen_top_k=2, batch_size=2, write=lines.append)
    screen = [line for line in lines if line.startswith("screen (atp*) ")]
    assert [line.split(": ")[1].split(",")[0] for line in screen] == ["1/3 chunks", "2/3 chunks", "3/3 chunks"]
    assert any(line.startswith("knockout ") for line in lines)


def test_the_screen_counts_the_chunks_it_runs_when_a_large_model_splits_them(monkeypatch, tiny_folder):
    """Above 1 GB of weights the screen runs fewer rows per chunk (`screen.screen_layout`); the bar's
    total follows (a Llama-3.2-3B-shaped scan printed '4/1 chunks')."""
    import pytest_circuits.progress as progress
    import pytest_circuits.rungs.screen as screen
    from pytest_circuits.model.builds import load_build
    from pytest_circuits.model.loading import resolve_model
    from pytest_circuits.rungs.knockout import knockout_scan
    from pytest_circuits.rungs.repeat_settings import RepeatSettings

    monkeypatch.setattr(progress, "INTERVAL", 0.0)
    one_row = screen.ScreenLayout(1)  # as a large model's
    monkeypatch.setattr(screen, "screen_layout", lambda build, batch_size, L: one_row)
    build = load_build(resolve_model(str(tiny_folder("llama"))), "fp32", "cpu")
    lines: list[str] = []
    knockout_scan(build, RepeatSettings(1, 4, 8), screen_top_k=2, batch_size=4, write=lines.append)
    counts = [line.split(": ")[1].split(",")[0] for line in lines if line.startswith("screen (atp*) ")]
    assert counts == ["1/4 chunks", "2/4 chunks", "3/4 chunks", "4/4 chunks"]


PROGRESS_TEST = """
def test_long_scan(circuits_run):
    circuits_run.loaded.progress_write("knockout m:fp32: 4/8 heads, at L0H3, 10s elapsed, ETA 5s")
"""


def test_progress_shows_with_pytest_capture_on(pytester, monkeypatch):
    """Output capture is on (pytest's default): the lines still reach the terminal, for a test that passes."""
    monkeypatch.setenv("PYTHONPATH", IMPORT_ROOT)  # the package under test
    pytester.makepyfile(test_long=PROGRESS_TEST)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "--circuits-model", "tiny-induction")
    result.assert_outcomes(passed=1)
    out = "\n".join(result.outlines)
    assert "circuits: knockout m:fp32: 4/8 heads, at L0H3, 10s elapsed, ETA 5s" in out
    assert "Captured stdout" not in out


def test_a_long_item_still_gets_a_line_every_interval():
    """Issue 42: one knockout pass of many heads ran 25 minutes with no line (lines came only as items
    finished). Inside ``with``, the heartbeat writes the plain line every interval meanwhile, and
    stops at the end; a bar used without ``with`` starts no thread."""
    import threading
    import time

    lines: list[str] = []
    with Progress(8, "knockout m:fp32", write=lines.append, interval=0.05) as bar:
        time.sleep(0.35)  # the first item still under way
        assert len(lines) >= 3 and all(line.startswith("knockout m:fp32: 0/8 heads") for line in lines)
        bar.update(1, stage="L0H0")
    after = len(lines)
    time.sleep(0.2)
    assert len(lines) == after  # the heartbeat stopped with the scan
    assert not any(t.name == "circuits-progress" for t in threading.enumerate())
    plain = Progress(8, "scan", write=lines.append, interval=0.01)
    time.sleep(0.05)
    assert len(lines) == after and plain._thread is None
