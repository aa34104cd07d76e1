"""Flat buffers a step takes and gives back, kept for the next step instead of freed.

A ZeRO rank allocates the same buffers every micro-step: each segment's gathered
parameters, each gradient bucket. Sizes above glibc's mmap threshold come from a fresh
mapping each time, so every page of them faults in and is zeroed by the kernel again,
step after step (at GPT-2 medium's shape, 2.4 GB of gathers a step). The pool keeps
what was given back and hands it out again for the same size.

It never makes the process hold more than its busiest moment so far: the bytes it keeps
free plus those handed out stay within the most ever handed out at once, evicting free
buffers of other sizes when a new one is made. A buffer is reused only when nothing but
the pool refers to its storage (a view kept by eager code keeps it out of the pool).
"""

from __future__ import annotations

import math
import threading
import weakref
from collections.abc import Callable, Sequence

import numpy as np
import torch

from ortrain.runtime.zero_pages import populate


def _storage_users() -> Callable[[torch.Tensor], int] | None:
    count = getattr(torch._C, "_storage_Use_Count", None)
    if count is None:  # without it no buffer can be proved free: the pool stays empty
        return None
    return lambda t: count(t.untyped_storage()._cdata)


_USERS = _storage_users()

# every pool alive, for ``release_kept``
_POOLS: weakref.WeakSet[BufferPool | ReusePool] = weakref.WeakSet()


def release_kept() -> None:
    """Let every pool's kept buffers go (once, before a ZeRO rank's first update takes its
    optimizer state's pages: ``zero_pages.py``); the pools fill again from the next step."""
    for pool in list(_POOLS):
        pool.clear()


class BufferPool:
    """1-D buffers of one dtype on one device, reused by size."""

    def __init__(self, device: torch.device, dtype: torch.dtype = torch.float32):
        self.device, self.dtype = device, dtype
        self._free: dict[int, list[torch.Tensor]] = {}
        self.free_numel = 0  # elements kept for reuse
        self.out_numel = 0  # elements handed out and not given back
        self.peak_numel = 0  # most elements handed out at once so far
        self.reused = 0  # buffers handed out again (a benchmark's and a test's figure)
        self.made: dict[int, int] = {}  # buffers made, by size (a test's figure)
        _POOLS.add(self)

    def take(self, numel: int, zero: bool = False) -> torch.Tensor:
        """A buffer of ``numel`` elements (zeros with ``zero``, else whatever it held)."""
        kept = self._free.get(numel, [])
        # the latest given back that nothing else refers to any more (one still read
        # stays kept until its reader lets go)
        at = next((i for i in range(len(kept) - 1, -1, -1) if self._sole(kept[i])), None)
        buf = None
        if at is not None:
            buf = kept.pop(at)
            self.free_numel -= numel
        if buf is not None:
            self.reused += 1
            if zero:
                buf.zero_()
        else:
            self.peak_numel = max(self.peak_numel, self.out_numel + numel)
            self._evict(self.peak_numel - self.out_numel - numel)
            buf = torch.empty(numel, dtype=self.dtype, device=self.device)
            self.made[numel] = self.made.get(numel, 0) + 1
            populate(buf)
            if zero:
                buf.zero_()
        self.out_numel += numel
        return buf

    def give(self, buf: torch.Tensor) -> None:
        """``buf`` (from ``take``) is no longer used by its taker."""
        numel = buf.numel()
        self.out_numel -= numel
        if _USERS is None:
            return  # no buffer can be proved free: it goes when its last user does
        # Kept even where something else still refers to it: autograd holds the views
        # that a backward's gradients were written into until the step's graph goes,
        # after their bucket has landed. ``take`` hands it out only once it is sole.
        self._free.setdefault(numel, []).append(buf)
        self.free_numel += numel
        self._evict(self.peak_numel - self.out_numel)

    def forget(self, buf: torch.Tensor) -> None:
        """``buf`` (from ``take``) is not coming back for reuse (a collective may still
        write it)."""
        self.out_numel -= buf.numel()

    def clear(self) -> None:
        self._free.clear()
        self.free_numel = 0

    def _evict(self, room: int) -> None:
        """Free the largest kept buffers until at most ``room`` elements are kept."""
        for numel in sorted(self._free, reverse=True):
            kept = self._free[numel]
            while kept and self.free_numel > max(room, 0):
                kept.pop()
                self.free_numel -= numel
            if not kept:
                del self._free[numel]

    @staticmethod
    def _sole(buf: torch.Tensor) -> bool:
        # the buffer itself and the temporary storage object asking
        return _USERS is not None and _USERS(buf) <= 2


class ReusePool:
    """CPU tensors for a graph's outputs, made from memory that an earlier output of the
    same size and dtype gave back when its last user let go of it.

    Outputs have no single owner to give them back (autograd keeps some for the backward,
    a gradient may become ``.grad`` or a bucket), so each is made over a fresh numpy
    view of a kept array: the tensor's storage is the only thing holding that view, and
    when the storage goes the view's finalizer returns the array. Nothing else refers to
    the storage, so autograd still adds into a gradient in place where it may (it does
    so only for a tensor nobody else holds). The arrays kept never add up to more than
    the most ever handed out at once.
    """

    def __init__(self) -> None:
        self._free: dict[tuple[int, torch.dtype], list[np.ndarray]] = {}
        self.free_bytes = 0  # kept for reuse
        self.out_bytes = 0  # handed out and alive
        self.peak_bytes = 0  # most ever handed out at once
        self.reused = 0  # outputs made over a kept array (a test's figure)
        # an output's last user may let go on another thread (a collective's worker holds
        # a gradient it reduces), and its finalizer may run inside ``empty`` (reentrant)
        self._lock = threading.RLock()
        _POOLS.add(self)

    def clear(self) -> None:
        with self._lock:
            self._free.clear()
            self.free_bytes = 0

    def empty(self, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        with self._lock:
            return self._empty(shape, dtype)

    def _empty(self, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        numel = math.prod(shape)
        key = (numel, dtype)
        kept = self._free.get(key)
        if kept:
            raw = kept.pop()
            self.free_bytes -= raw.nbytes
            self.reused += 1
        else:
            fresh = torch.empty(numel, dtype=dtype)
            populate(fresh)  # a graph writes it whole
            raw = fresh.numpy()
            self.peak_bytes = max(self.peak_bytes, self.out_bytes + raw.nbytes)
            self._evict(self.peak_bytes - self.out_bytes - raw.nbytes)
        self.out_bytes += raw.nbytes
        # a view of its own, which lives exactly as long as the tensor's storage (shaped
        # by numpy: a torch view would keep a second tensor on the storage)
        view = raw.reshape(tuple(shape))
        weakref.finalize(view, self._back, key, raw)
        return torch.from_numpy(view)

    def _back(self, key: tuple[int, torch.dtype], raw: np.ndarray) -> None:
        with self._lock:
            self.out_bytes -= raw.nbytes
            self._free.setdefault(key, []).append(raw)
            self.free_bytes += raw.nbytes

    def _evict(self, room: int) -> None:
        for key in sorted(self._free, key=lambda k: k[0] * k[1].itemsize, reverse=True):
            kept = self._free[key]
            while kept and self.free_bytes > max(room, 0):
                self.free_bytes -= kept.pop().nbytes
            if not kept:
                del self._free[key]
