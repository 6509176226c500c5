"""Freed memory handed back to the operating system between the rungs of a scan.

glibc's allocator keeps the pages of freed blocks: a rung's float32 layer matrices and
activations, once freed, stay resident (fragments between live blocks cannot be returned by
trimming the top of the heap), and the next rung's allocations do not all land in them, so a
scan's peak resident memory carried what earlier rungs had freed (Llama-3.2-1B shape: the screen
alone 4.51 GB, after rung 1 and the probe in the same process 4.59 GB; docs/scale.md).
"""

from __future__ import annotations

import ctypes
import gc
import sys
from functools import cache


@cache
def _malloc_trim():
    """glibc's ``malloc_trim``, or None (another C library, another system)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        return getattr(ctypes.CDLL("libc.so.6"), "malloc_trim", None)
    except OSError:
        return None


def release_freed_memory() -> bool:
    """Collect garbage, then ``malloc_trim(0)``: glibc returns every whole free page of its heaps
    (``madvise(MADV_DONTNEED)``), not only the top. True when glibc released some memory."""
    gc.collect()
    trim = _malloc_trim()
    return bool(trim(0)) if trim is not None else False
