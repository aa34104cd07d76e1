"""Hand the C heap's free memory back to the system (glibc's ``malloc_trim``).

ZeRO-2/3 steps allocate and free gradient buckets, gathered parameters and segment
outputs of many sizes from several threads (autograd, ONNX Runtime, gloo); glibc keeps
what they free in per-thread arenas, so the resident size climbs step after step although
the live bytes do not. Trimming once per optimizer step keeps the resident size at what is
live. Elsewhere than glibc this does nothing. ``available_bytes``: the room the system
has left, for what may only run where it fits.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import sys


@functools.cache
def _malloc_trim() -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return libc.malloc_trim
    except (OSError, AttributeError):  # not glibc (musl has no malloc_trim)
        return None


def trim_heap() -> bool:
    """Return free heap pages to the system; False where there is no ``malloc_trim``."""
    trim = _malloc_trim()
    if trim is None:
        return False
    trim(0)
    return True


def available_bytes() -> int | None:
    """The kernel's estimate of memory available without swapping (None: not Linux)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None
