"""`memory.release_freed_memory`: freed heap pages between live blocks go back to the system."""

from __future__ import annotations

import os
import sys

import pytest

from pytest_circuits.memory import _malloc_trim, release_freed_memory


def resident_bytes() -> int:
    with open("/proc/self/statm") as handle:
        return int(handle.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.skipif(not sys.platform.startswith("linux") or _malloc_trim() is None, reason="needs glibc's malloc_trim")
def test_freed_fragments_between_live_blocks_are_returned():
    # 64 KB blocks (under glibc's mmap threshold: heap) with a small live block after each, so
    # freeing the big ones leaves holes that trimming the heap's top alone cannot return
    big, keep = [], []
    for _ in range(3000):
        big.append(bytearray(64 * 1024))
        keep.append(bytearray(2048))
    del big
    before = resident_bytes()
    assert release_freed_memory()
    after = resident_bytes()
    assert before - after > 100 * 1024**2, (before, after)  # ~190 MB were freed
    assert len(keep) == 3000


def test_release_is_harmless_without_glibc(monkeypatch):
    import pytest_circuits.memory as memory

    monkeypatch.setattr(memory, "_malloc_trim", lambda: None)
    assert memory.release_freed_memory() is False
