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
killed by a SIGKILL not ours (the out-of-memory killer, most often) raises
``BuildKilledError``: the same job here would kill the training process; one that
otherwise dies or sends nothing runs the job in this process instead, with a warning.
``ORTRAIN_BUILD_IN_PROCESS=1`` (or the older ``ORTRAIN_EXPORT_IN_PROCESS=1``) runs every
job here; so does a process that uses CUDA (no fork after CUDA is initialised) or holds
non-CPU tensors.
"""

from __future__ import annotations

import contextlib
import gc
import importlib
import os
import pickle
import select
import signal
import sys
import tempfile
import time
import traceback
import warnings
from collections.abc import Callable, Iterable, Iterator
from typing import Generic, TypeVar

import torch

from ortrain.core.errors import BuildKilledError
from ortrain.spill import dumps_spilling, load_spilled

T = TypeVar("T")
# A child's first byte, written as soon as the fork returns in it. Python 3.11.7 and
# earlier (CPython gh-112275) can deadlock a child inside ``os.fork`` itself when another
# thread held the interpreter's thread-list lock at that moment (a rank's heartbeat or a
# library's thread starting or ending): such a child never gets here, and is killed and
# forked again after ``START_TIMEOUT_S`` instead of waited on for the build's timeout.
STARTED = b"\x01"
# Its last byte, after the result is in the file the parent made before the fork (an
# unlinked temporary file both share): a result of megabytes does not wait in a pipe for
# a parent that reads it only between steps.
DONE = b"\x02"
START_TIMEOUT_S = 30.0
# Imported here while this process first waits for a child (idle then; a background build
# does not wait): every later child inherits it instead of importing it again. ONNX's
# numpy types are a few MB, and some ml_dtypes releases take half a second to import
# them (pyproject.toml excludes the one seen); the exporter itself stays out of this
# process.
PRELOAD_WHILE_WAITING = ("ml_dtypes",)
_preloaded = [False]
FORK_TRIES = 3
# A child makes one graph and exits. The export and the passes keep hundreds of thousands
# of objects alive until the job ends: at Python's default (a young collection every 700
# allocations) they are promoted within moments, and full collections over them come
# again and again. Young collections this much rarer let most of them die young; what
# cycles the job drops go a little later.
CHILD_GC_THRESHOLD0 = 10_000
# A started child that gains no CPU time for this long while asleep (not runnable, not in
# the disk, no process of its own running) waits on something that will not come: most
# often a lock or a pool's worker that a thread of this process held or ran at the fork,
# which the child does not have. It is killed and the job runs here, instead of after the
# build's whole timeout. A child starved by a busy machine stays runnable, so waits on.
STALL_S = 120.0
POLL_S = 5.0
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


def _progress(pid: int) -> tuple[int, ...] | None:
    """What changes while a process works: its CPU ticks (its threads' and its reaped
    children's), or a state other than asleep (running, runnable, in the disk), or the
    processes it started that still run; None where /proc does not say."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    state, ticks = fields[0], sum(int(v) for v in fields[11:15])
    if state != "S":
        return (ticks, time.monotonic_ns())  # never equal twice: counts as progress
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            children = tuple(int(c) for c in f.read().split())
    except OSError:
        children = ()
    if children:
        return (ticks, time.monotonic_ns())
    return (ticks,)


def _portable(exc: BaseException) -> BaseException:
    """``exc`` if it survives a pickle round trip, else a RuntimeError naming it."""
    try:
        pickle.loads(pickle.dumps(exc))
        return exc
    except Exception:
        return RuntimeError(f"{type(exc).__name__}: {exc}")


def _child(job: Callable[[], T], write_fd: int, out_fd: int, spill_fd: int | None = None) -> None:
    # Nothing inherited may be finalized here: an ONNX Runtime session in uncollected
    # garbage would join its thread pool's threads, which do not exist after a fork.
    gc.freeze()
    gc.set_threshold(CHILD_GC_THRESHOLD0, *gc.get_threshold()[1:])
    torch.set_num_threads(1)  # OpenMP's thread team does not survive a fork
    # Jobs run on CPU tensors only (can_fork), but torch.export saves and restores the CUDA
    # RNG state whenever CUDA is available; after the parent asked torch for the device
    # count (torch.cuda.is_available()), CUDA cannot start in a forked child.
    torch.cuda.is_available = lambda: False
    _compile_in_this_thread()
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
        sent = (*payload, notes)
        data = pickle.dumps(sent) if spill_fd is None else dumps_spilling(sent, spill_fd)
    except Exception as exc:  # a result that does not pickle is a bug: say so
        data = pickle.dumps(("error", RuntimeError(f"build result not picklable: {exc}"), notes))
    with os.fdopen(out_fd, "wb", closefd=False) as f:
        f.write(data)
    os.write(write_fd, DONE)


def _compile_in_this_thread() -> None:
    """Make inductor compile synchronously in a forked child. A model holding a
    ``torch.compile``'d module compiles again in the child (the first step's eager
    reference, a new shape); inductor would hand that to the thread pool the parent
    started, whose threads do not exist after the fork, and wait on it forever. Torch
    resets its process pools at a fork, not that thread pool."""
    config = sys.modules.get("torch._inductor.config")
    if config is None:  # inductor never ran in the parent: it starts clean here
        return
    config.compile_threads = 1
    async_compile = sys.modules.get("torch._inductor.async_compile")
    if async_compile is not None:
        async_compile.AsyncCompile.pool.cache_clear()


def _preload() -> None:
    for name in PRELOAD_WHILE_WAITING:
        try:
            importlib.import_module(name)
        except ImportError:  # not installed: its child imports nothing of it either
            pass


@contextlib.contextmanager
def rarer_collections() -> Iterator[None]:
    """Young collections ``CHILD_GC_THRESHOLD0`` allocations apart for the duration, then
    the process's own setting again: a build that runs in this process (CUDA, or
    ``ORTRAIN_BUILD_IN_PROCESS``) makes what a child's would, and full collections here
    would walk everything the training process holds too."""
    before = gc.get_threshold()
    if before[0] == 0 or before[0] >= CHILD_GC_THRESHOLD0:  # off, or rarer already
        yield
        return
    gc.set_threshold(CHILD_GC_THRESHOLD0, *before[1:])
    try:
        yield
    finally:
        gc.set_threshold(*before)


def run_here(job: Callable[[], T]) -> T:
    """``job()`` in this process, with a build child's collections."""
    with rarer_collections():
        return job()


def call_forked(job: Callable[[], T], *, what: str) -> T:
    """``job()``, run in a forked child (see the module docstring)."""
    return ForkedJob(job, what=what).result()


class ForkedJob(Generic[T]):
    """``job()`` started in a forked child: ``done()`` reads what it has sent so far
    without waiting (a step can go on while a graph builds), ``result()`` waits for it.
    Started only where ``can_fork`` says so; ``nice``: the child's niceness increment
    (a build beside training takes only the CPU time the training leaves); ``spill``:
    the result's large host tensors come back as ``spill.SpilledTensor`` handles on a
    file, read when asked for (a reference step's gradients, the model's size)."""

    def __init__(self, job: Callable[[], T], *, what: str, nice: int = 0, spill: bool = False):
        self.job, self.what, self.nice, self.spill = job, what, nice, spill
        self.timeout = float(os.environ.get("ORTRAIN_EXPORT_TIMEOUT", "1800"))
        self.tries = 0
        self._start()

    def _start(self) -> None:
        self.tries += 1
        read_fd, write_fd = os.pipe()
        self.out = tempfile.TemporaryFile(prefix="ortrain-build-")
        self.spilled = tempfile.TemporaryFile(prefix="ortrain-spill-") if self.spill else None
        pid = os.fork()
        if pid == 0:
            os.close(read_fd)
            try:
                if self.nice:
                    os.nice(self.nice)
                os.write(write_fd, STARTED)
                spill_fd = None if self.spilled is None else self.spilled.fileno()
                _child(self.job, write_fd, self.out.fileno(), spill_fd)
            finally:
                os._exit(0)
        os.close(write_fd)
        os.set_blocking(read_fd, False)
        self.pid, self.fd = pid, read_fd
        self.received = b""
        self.started, self.complete = False, False
        self.began = time.monotonic()
        self.status: int | None = None
        self.cancelled = False
        self.stalled = False
        self.progress: tuple[int, ...] | None = None
        self.progress_at: float | None = None

    def _stalled(self, now: float) -> bool:
        """Whether the started child has been asleep without progress for ``STALL_S``."""
        sample = _progress(self.pid)
        if sample is None:  # no /proc here: only the timeout applies
            return False
        if sample != self.progress or self.progress_at is None:
            self.progress, self.progress_at = sample, now
            return False
        return now - self.progress_at >= STALL_S

    def done(self) -> bool:
        """Whether the child has sent everything (or died, or ran out of time: ``result``
        then runs the job here)."""
        return self._wait(0.0)

    def result_ready(self) -> None:
        """Wait until ``result`` returns without waiting."""
        self._wait(None)

    def cancel(self) -> None:
        """Stop the child (its result is not wanted)."""
        if self.status is None:
            self.cancelled = True
            os.kill(self.pid, signal.SIGKILL)
            self._reap()
        self.complete = False
        self.out.close()  # (nothing in them is read now)
        if self.spilled is not None:
            self.spilled.close()

    def result(self) -> T:
        """The job's result (its exception raised here); waits for the child."""
        self._wait(None)
        # read from the file as it is unpickled: the whole of it never held twice (a
        # reference step's gradients are the model's size)
        sent = self.complete and self.out.seek(0, os.SEEK_END) > 0
        if not sent:
            self.out.close()
            if self.spilled is not None:
                self.spilled.close()
        if not sent and self._killed_from_outside():
            # most often the out-of-memory killer: the same job here would take the
            # training process (and what it trained) with it
            raise BuildKilledError(
                f"{self.what} in a child process was killed by signal "
                f"{signal.Signals(os.WTERMSIG(self.status)).name} after "  # type: ignore[arg-type]
                f"{time.monotonic() - self.began:.0f} s, most likely by the kernel's "
                "out-of-memory killer (dmesg says); not rerun in this process, which would "
                "lose the training state with it. Free memory (a smaller batch or model), "
                f"or set {IN_PROCESS_ENV}=1 to build in this process anyway"
            )
        if not sent and self.stalled:
            warnings.warn(
                f"{self.what} in a child process made no progress for {STALL_S:.0f} s "
                "(asleep on a lock or a worker thread that the fork did not copy); "
                "running it in this process",
                stacklevel=3,
            )
            return run_here(self.job)
        if not sent:  # the child died, hung or crashed: run it here
            warnings.warn(
                f"{self.what} in a child process failed (wait status {self.status}); running "
                "it in this process",
                stacklevel=3,
            )
            return run_here(self.job)
        with warnings.catch_warnings():
            # torch's pytree specs (a segment's call and result structure) warn about their
            # own pickled form on load; nothing the user can act on
            warnings.filterwarnings("ignore", message=r".*LeafSpec", category=FutureWarning)
            try:
                self.out.seek(0)
                if self.spilled is None:
                    kind, value, notes = pickle.load(self.out)
                else:  # the handles keep the spill file open
                    spilled, self.spilled = self.spilled, None
                    kind, value, notes = load_spilled(self.out, spilled)
            finally:
                self.out.close()
        for category, message in notes:
            warnings.warn(message, category, stacklevel=3)
        if kind == "error":
            raise value
        return value

    def _killed_from_outside(self) -> bool:
        """The child started and then died of SIGKILL that ``cancel`` did not send."""
        status = self.status
        return (
            self.started
            and not self.cancelled
            and status is not None
            and os.WIFSIGNALED(status)
            and os.WTERMSIG(status) == signal.SIGKILL
        )

    def _wait(self, wait_s: float | None) -> bool:
        """Read what the child sends for up to ``wait_s`` seconds (None: until it ends);
        True once it ended. A child that never says it started is forked again (up to
        ``FORK_TRIES``); one over its time is killed."""
        while self.status is None:
            now = time.monotonic()
            limit = self.began + (self.timeout if self.started else START_TIMEOUT_S)
            if now >= limit:
                self.cancel()
                if not self.started and self.tries < FORK_TRIES:
                    self._start()
                    continue
                return True
            if self.started and self._stalled(now):
                self.stalled = True
                self.cancel()
                return True
            if wait_s is None and self.started and not _preloaded[0]:
                _preloaded[0] = True
                _preload()
                continue  # the time it took counts against the child's
            left = min(POLL_S, limit - now) if wait_s is None else min(wait_s, limit - now)
            if not select.select([self.fd], [], [], left)[0]:
                if wait_s is not None:
                    return False
                continue
            self._read()
        return True

    def _read(self) -> None:
        while True:
            try:
                chunk = os.read(self.fd, 1 << 20)
            except BlockingIOError:
                return
            if not chunk:  # EOF: the child ended (its result written where it sent DONE)
                self.complete = self.received == STARTED + DONE
                self._reap()
                return
            self.received += chunk
            self.started = True

    def _reap(self) -> None:
        os.close(self.fd)
        _, self.status = os.waitpid(self.pid, 0)
