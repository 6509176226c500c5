"""Progress of a long scan that tells the truth: items done, the current stage, a cost-aware ETA.

On a terminal a tqdm bar; elsewhere (CI, stderr not a terminal) one plain line every
``interval`` seconds, or through ``write`` (e.g. the pytest terminal reporter's
``write_line``). Items need not cost the same: each carries a ``cost`` (for a knockout in
layer ``l`` of an ``n_layers`` model, the replay runs ``n_layers - l`` blocks), and

    ETA = elapsed * (cost remaining) / (cost done)

so a scan that starts with the expensive shallow layers does not promise too much.

A phase with no steps to count (a build load, rung 1, the repeat probe) runs inside `phase`:
a heartbeat line every ``INTERVAL`` seconds while it lasts, nothing for a short one. A
`Progress` used as a context manager beats too: one item can take many minutes (a knockout pass
of many heads of a 135M model on a CPU), and its plain line still comes every ``interval``.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

INTERVAL = 5.0  # seconds between two plain lines of one scan or phase


def stderr_line(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def format_seconds(seconds: float) -> str:
    """``"1h02m"``, ``"3m05s"`` or ``"42s"``."""
    seconds = max(0, int(round(seconds)))
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    if hours:
        return f"{hours}h{minutes:02d}m"
    if minutes:
        return f"{minutes}m{secs:02d}s"
    return f"{secs}s"


class Progress:
    """``total`` items of total cost ``total_cost`` (default: one per item).

    ``update(n, cost, stage)``: ``n`` more items done, costing ``cost`` (default ``n``),
    now at ``stage`` (e.g. ``"L12"``). ``enabled=False``: silent. ``write``: where plain
    lines go (default stderr); given, it is used even on a terminal. ``clock``: seconds
    (``time.monotonic``; tests pass a fake).
    """

    def __init__(
        self,
        total: int,
        label: str,
        *,
        total_cost: float | None = None,
        unit: str = "head",
        enabled: bool = True,
        write: Callable[[str], None] | None = None,
        interval: float | None = None,
        clock: Callable[[], float] = time.monotonic,
        terminal: bool | None = None,
    ):
        self.total, self.label, self.unit = total, label, unit
        self.total_cost = float(total if total_cost is None else total_cost)
        self.done, self.cost_done, self.stage, self.lines = 0, 0.0, "", 0
        self.enabled, self.clock = enabled, clock
        self.interval = INTERVAL if interval is None else interval
        self.write = write
        self.start = clock()
        self.last_line = self.start
        self._lock = threading.Lock()  # the heartbeat thread and update() both write lines
        self._stop: threading.Event | None = None
        self._thread: threading.Thread | None = None
        on_terminal = sys.stderr.isatty() if terminal is None else terminal
        self.bar = None
        if enabled and write is None and on_terminal:
            from tqdm.auto import tqdm

            self.bar = tqdm(total=total, unit=unit, desc=label, leave=False)
        elif enabled and write is None:
            self.write = stderr_line

    def eta(self) -> float | None:
        """Seconds left: elapsed times the cost still to run over the cost run so far (None before any)."""
        if self.cost_done <= 0:
            return None
        return (self.clock() - self.start) * max(self.total_cost - self.cost_done, 0.0) / self.cost_done

    def line(self) -> str:
        eta = self.eta()
        stage = f", at {self.stage}" if self.stage else ""
        left = "ETA ?" if eta is None else f"ETA {format_seconds(eta)}"
        elapsed = format_seconds(self.clock() - self.start)
        return f"{self.label}: {self.done}/{self.total} {self.unit}s{stage}, {elapsed} elapsed, {left}"

    def update(self, n: int = 1, cost: float | None = None, stage: str | None = None) -> None:
        if not self.enabled:
            return
        self.done += n
        self.cost_done += n if cost is None else cost
        if stage is not None:
            self.stage = stage
        with self._lock:
            if self.bar is not None:
                eta = self.eta()
                self.bar.set_postfix_str(
                    f"{self.stage} ETA {format_seconds(eta) if eta is not None else '?'}", refresh=False
                )
                self.bar.update(n)
                return
            # a line every ``interval`` seconds, and a closing one only for a scan that printed before
            self._line_if(
                lambda now: now - self.last_line >= self.interval or (self.done >= self.total and self.lines > 0)
            )

    def _line_if(self, due: Callable[[float], bool]) -> None:
        now = self.clock()
        if due(now):
            self.last_line = now
            self.lines += 1
            if self.write is not None:
                self.write(self.line())

    def beat(self) -> None:
        """The heartbeat: a plain line when none came for ``interval`` seconds (the item under way is
        long), or the terminal bar redrawn so its clock moves."""
        if not self.enabled:
            return
        with self._lock:
            if self.bar is not None:
                self.bar.refresh()
            else:
                self._line_if(lambda now: now - self.last_line >= self.interval)

    def close(self) -> None:
        if self._stop is not None and self._thread is not None:
            self._stop.set()
            self._thread.join()
            self._stop = self._thread = None
        if self.bar is not None:
            self.bar.close()
            self.bar = None

    def __enter__(self) -> Progress:
        """Start the heartbeat thread (`beat` every ``interval`` seconds) until `close`; an interval of
        0 (a line at every update) needs none."""
        if self.enabled and self.interval > 0 and (self.bar is not None or self.write is not None):
            stop = self._stop = threading.Event()

            def run() -> None:
                while not stop.wait(self.interval):
                    self.beat()

            self._thread = threading.Thread(target=run, name="circuits-progress", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.close()


@contextmanager
def phase(
    label: str, write: Callable[[str], None] | None = None, interval: float | None = None, enabled: bool = True
) -> Iterator[None]:
    """``label: 10s elapsed`` every ``interval`` seconds (default `INTERVAL`) while the block runs,
    from a heartbeat thread, and ``label: done in 12s`` after it if any line was written; a
    phase shorter than ``interval`` prints nothing. ``write``: where lines go (default stderr);
    ``enabled=False``: silent."""
    if not enabled:
        yield
        return
    out = stderr_line if write is None else write
    every = INTERVAL if interval is None else interval
    start, stop, wrote = time.monotonic(), threading.Event(), []

    def beat() -> None:
        while not stop.wait(every):
            out(f"{label}: {format_seconds(time.monotonic() - start)} elapsed")
            wrote.append(True)

    thread = threading.Thread(target=beat, name="circuits-progress", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()
        if wrote:
            out(f"{label}: done in {format_seconds(time.monotonic() - start)}")
