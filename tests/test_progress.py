"""The scan's progress: heads done, the stage, and an ETA weighted by each head's cost."""

from __future__ import annotations

import pytest

from pytest_circuits.progress import Progress, format_seconds
from pytest_circuits.rungs.knockout import replay_cost


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
