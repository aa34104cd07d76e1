"""Run one build job in a forked child process and take its result back.

The ONNX export and the graph passes allocate a lot that Python and the C libraries
never hand back to the OS (dynamo's and the exporter's caches, onnxscript's rewriter,
protobuf arenas), and importing the pass libraries alone costs the process memory it
keeps. A job run in a fork of the training process sees the module and the
batch as they are (copy-on-write) and sends back only its pickled result, so none of
that lands in the process that trains.

Exceptions raised by the job come back with their own type (a type that does not
survive pickling comes back as ``RuntimeError`` naming it) and the child's traceback as
a note; warnings it raised are re-issued here. A child that dies or sends nothing runs
the job in this process instead, with a warning. ``ORTRAIN_BUILD_IN_PROCESS=1`` (or
the older ``ORTRAIN_EXPORT_IN_PROCESS=1``) runs every job here; so does a process that
uses CUDA (no fork after CUDA is initialised) or holds non-CPU tensors.
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
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read_fd)
        try:
            _child(job, write_fd)
        finally:
            os._exit(0)
    os.close(write_fd)
    timeout = float(os.environ.get("ORTRAIN_EXPORT_TIMEOUT", "1800"))
    data = _read_all(read_fd, timeout)
    if data is None:  # no answer in time: do not wait on a stuck child forever
        os.kill(pid, signal.SIGKILL)
    _, status = os.waitpid(pid, 0)
    if not data:  # the child died, hung or crashed: run the job here instead
        warnings.warn(
            f"{what} in a child process failed (wait status {status}); running it in this process",
            stacklevel=3,
        )
        return job()
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


def _read_all(fd: int, timeout_s: float) -> bytes | None:
    """Everything written to ``fd`` until EOF; None after ``timeout_s`` without EOF."""
    chunks = []
    deadline = time.monotonic() + timeout_s
    with os.fdopen(fd, "rb", buffering=0) as f:
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([f], [], [], left)[0]:
                return None
            chunk = f.read(1 << 20)
            if not chunk:
                return b"".join(chunks)
            chunks.append(chunk)
