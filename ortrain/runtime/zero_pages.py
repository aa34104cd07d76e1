"""Zero-filled buffers whose memory is not resident until written.

A ZeRO rank makes its optimizer-state shard and gradient shard when the trainer is
built, but writes the state only at the first update and the gradients only at the
first backward. ``torch.zeros`` writes every page at once, so on CPU the rank holds
them through the first step's planning, where its parameters are still whole (ZeRO-3)
and the recording forward runs: that was the rank's peak. A private anonymous mapping
reads as zeros and takes a page only when it is first written.

When such a buffer (or any fresh one) is about to be written whole, ``populate`` takes
its pages in one call instead of one fault each.
"""

from __future__ import annotations

import ctypes
import errno
import functools
import mmap
import sys
from collections.abc import Callable

import torch


def is_lazy(device: torch.device) -> bool:
    """Whether ``lazy_zeros`` on ``device`` takes its memory only as it is written."""
    return device.type == "cpu"


def lazy_zeros(numel: int, device: torch.device) -> torch.Tensor:
    """A float32 tensor of ``numel`` zeros; on CPU its pages are taken as they are
    first written (elsewhere: ``torch.zeros``)."""
    if not is_lazy(device) or numel == 0:
        return torch.zeros(numel, device=device)
    mapping = mmap.mmap(-1, numel * 4, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    # the tensor keeps the mapping alive (frombuffer holds a reference to its buffer)
    return torch.frombuffer(mapping, dtype=torch.float32, count=numel)


# Linux 5.14+: fault a range in, writable, in one call (``madvise(2)``)
_MADV_POPULATE_WRITE = 23
# smaller buffers come from the C heap, whose pages are resident already
_MIN_PAGES = 64


@functools.cache
def _madvise() -> Callable[[int, int, int], int] | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


_populating = True  # until the kernel refuses (older than 5.14)


def populate(t: torch.Tensor) -> bool:
    """Take the pages of ``t`` (a CPU tensor about to be written whole) in one call.

    A fresh buffer's pages are otherwise faulted in one at a time as they are first
    written, and a read before the write (``add_`` into lazy zeros, the optimizer's
    moments) faults each twice: the kernel's zero page, then its own copy. Where ranks
    share a machine those faults are a step's system time. Returns whether the range was
    populated; the contents are unchanged."""
    global _populating
    madvise = _madvise()
    if not _populating or madvise is None or t.device.type != "cpu" or not t.is_contiguous():
        return False
    page = mmap.PAGESIZE
    start = -(-t.data_ptr() // page) * page  # whole pages inside the tensor only
    stop = (t.data_ptr() + t.numel() * t.element_size()) // page * page
    if stop - start < _MIN_PAGES * page:
        return False
    if madvise(start, stop - start, _MADV_POPULATE_WRITE) == 0:
        return True
    if ctypes.get_errno() == errno.EINVAL:
        _populating = False  # not this kernel: pages fault in as they are written
    return False


_MADV_DONTNEED = 4


def release(t: torch.Tensor, zero_rest: bool = True) -> None:
    """Zero ``t``, handing its whole pages back to the system where it is a ``lazy_zeros``
    buffer (a private anonymous mapping: they read as zeros again and take memory only
    when next written); the rest (elsewhere, all of it) is written with zeros.
    ``zero_rest=False``: only whole pages go, nothing is written (the pages ``t`` shares
    with its neighbours keep all their values)."""
    madvise = _madvise()
    size = t.element_size()
    lazy = madvise is not None and is_lazy(t.device) and t.is_contiguous()
    if not lazy or t.numel() == 0:
        if zero_rest:
            t.zero_()
        return
    page = mmap.PAGESIZE
    first = t.data_ptr()
    start = -(-first // page) * page
    stop = (first + t.numel() * size) // page * page
    if stop <= start or madvise(start, stop - start, _MADV_DONTNEED) != 0:
        if zero_rest:
            t.zero_()
        return
    if zero_rest:  # the pages it shares with its neighbours
        t[: (start - first) // size].zero_()
        t[(stop - first) // size :].zero_()
