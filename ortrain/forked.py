"""Run one build job in a forked child process and take its result back.

The ONNX export and the graph passes allocate a lot that Python and the C libraries
never hand back to the OS (dynamo's and the exporter's caches, onnxscript's rewriter,
protobuf arenas), and importing the pass libraries alone costs the process memory it
keeps. A job run in a fork of the training process sees the module and the
batch as they are (copy-on-write) and sends back only its pickled result, so none of
that lands in the process that trains.

Exceptions raised by the job come back with their own type (a type that does not
survive pickling comes back as ``RuntimeError`` naming it) and the child's traceback as
a note; warnings it raised are re-issued here. A child that does not say it started
within ``START_TIMEOUT_S`` (stuck inside the fork itself) is killed and forked again; one
that dies or sends nothing runs the job in this process instead, with a warning.
``ORTRAIN_BUILD_IN_PROCESS=1`` (or the older ``ORTRAIN_EXPORT_IN_PROCESS=1``) runs every
job here; so does a process that uses CUDA (no fork after CUDA is initialised) or holds
non-CPU tensors.
"""

from __future__ import annotations

import gc
import os
import pickle
import select
import signal
import time
import traceback
import warnings
from collections.abc import Callable, Iterable
from typing import TypeVar

import torch

T = TypeVar("T")
# A child's first byte, written as soon as the fork returns in it. Python 3.11.7 and
# earlier (CPython gh-112275) can deadlock a child inside ``os.fork`` itself when another
# thread held the interpreter's thread-list lock at that moment (a rank's heartbeat or a
# library's thread starting or ending): such a child never gets here, and is killed and
# forked again after ``START_TIMEOUT_S`` instead of waited on for the build's timeout.
STARTED = b"\x01"
START_TIMEOUT_S = 30.0
FORK_TRIES = 3
_NOT_STARTED = object()
IN_PROCESS_ENV = "ORTRAIN_BUILD_IN_PROCESS"
_IN_PROCESS = (IN_PROCESS_ENV, "ORTRAIN_EXPORT_IN_PROCESS")


def can_fork(tensors: Iterable[torch.Tensor]) -> bool:
    """Whether a job over ``tensors`` may run in a forked child."""
    if not hasattr(os, "fork"):
        return False
    if any(os.environ.get(k) == "1" for k in _IN_PROCESS):
        return False
    if torch.cuda.is_initialized():
        return False
    return all(t.device.type == "cpu" for t in tensors)


def _portable(exc: BaseException) -> BaseException:
    """``exc`` if it survives a pickle round trip, else a RuntimeError naming it."""
    try:
        pickle.loads(pickle.dumps(exc))
        return exc
    except Exception:
        return RuntimeError(f"{type(exc).__name__}: {exc}")


def _child(job: Callable[[], T], write_fd: int) -> None:
    # Nothing inherited may be finalized here: an ONNX Runtime session in uncollected
    # garbage would join its thread pool's threads, which do not exist after a fork.
    gc.freeze()
    torch.set_num_threads(1)  # OpenMP's thread team does not survive a fork
    # Jobs run on CPU tensors only (can_fork), but torch.export saves and restores the CUDA
    # RNG state whenever CUDA is available; after the parent asked torch for the device
    # count (torch.cuda.is_available()), CUDA cannot start in a forked child.
    torch.cuda.is_available = lambda: False
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            payload = ("ok", job())
        except BaseException as exc:  # everything goes back to the parent
            sent = _portable(exc)
            sent.add_note("in ortrain's build process:\n" + traceback.format_exc().rstrip())
            payload = ("error", sent)
    notes = [(w.category, str(w.message)) for w in caught]
    try:
        data = pickle.dumps((*payload, notes))
    except Exception as exc:  # a result that does not pickle is a bug: say so
        data = pickle.dumps(("error", RuntimeError(f"build result not picklable: {exc}"), notes))
    with os.fdopen(write_fd, "wb") as f:
        f.write(data)


def call_forked(job: Callable[[], T], *, what: str) -> T:
    """``job()``, run in a forked child (see the module docstring)."""
    timeout = float(os.environ.get("ORTRAIN_EXPORT_TIMEOUT", "1800"))
    for _ in range(FORK_TRIES):
        read_fd, write_fd = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(read_fd)
            try:
                os.write(write_fd, STARTED)
                _child(job, write_fd)
            finally:
                os._exit(0)
        os.close(write_fd)
        data = _read_all(read_fd, timeout, START_TIMEOUT_S)
        if data is None or data is _NOT_STARTED:  # do not wait on a stuck child forever
            os.kill(pid, signal.SIGKILL)
        _, status = os.waitpid(pid, 0)
        if data is not _NOT_STARTED:
            break
    if not data or data is _NOT_STARTED:  # the child died, hung or crashed: run it here
        warnings.warn(
            f"{what} in a child process failed (wait status {status}); running it in this process",
            stacklevel=3,
        )
        return job()
    assert isinstance(data, bytes)
    with warnings.catch_warnings():
        # torch's pytree specs (a segment's call and result structure) warn about their
        # own pickled form on load; nothing the user can act on
        warnings.filterwarnings("ignore", message=r".*LeafSpec", category=FutureWarning)
        kind, value, notes = pickle.loads(data)
    for category, message in notes:
        warnings.warn(message, category, stacklevel=3)
    if kind == "error":
        raise value
    return value


def _read_all(fd: int, timeout_s: float, start_s: float) -> bytes | object | None:
    """Everything the child wrote to ``fd`` after its ``STARTED`` byte, until EOF;
    ``_NOT_STARTED`` without that byte after ``start_s``, None after ``timeout_s``."""
    chunks = []
    now = time.monotonic()
    deadline, start_by = now + timeout_s, now + start_s
    started = False
    with os.fdopen(fd, "rb", buffering=0) as f:
        while True:
            left = (deadline if started else min(deadline, start_by)) - time.monotonic()
            if left <= 0 or not select.select([f], [], [], left)[0]:
                return None if started else _NOT_STARTED
            chunk = f.read(1 << 20)
            if not chunk:  # EOF (before the first byte: the child crashed, b"")
                return b"".join(chunks)
            if not started:
                started, chunk = True, chunk[len(STARTED) :]
            chunks.append(chunk)
