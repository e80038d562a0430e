"""Giving the C heap's free pages back to the OS while weights are made or loaded on a CPU.

Why: a CPU run draws each synthetic tensor in fp32 and quantises it, and the model stacks the routed experts' per-expert
tensors into one per matrix. glibc keeps the freed temporaries' and originals' pages in its heap (its mmap threshold
rises to a freed block's size, up to 32 MiB, so those blocks are heap blocks), between the tensors that stay, and the
stacked matrices (mmapped) cannot reuse them: the resident set outgrew the weights that the app's host-memory check
counts. V4-Flash on a 24 GiB CPU machine (experiments/session66_no_device.md): one layer's synthetic weights (5.29 GiB)
peaked at 8.0 GiB, 5.8 GiB with a trim every 16 tensors; the README's four-layer run (15.3 GiB counted) was killed at
21.7 GiB while still making weights, and completes with the trims (peak 18.4 GiB).
"""
from __future__ import annotations

import ctypes
import ctypes.util
import functools


@functools.cache
def _malloc_trim():
    """glibc's malloc_trim, or None (another C library)."""
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return None


def trim_heap() -> None:
    """malloc_trim(0): the heap's free pages back to the OS (a no-op where the C library has no malloc_trim)."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)
