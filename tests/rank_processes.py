"""Rank processes for the multi-process tests, forked from a warm server.

Each rank of tests/dist_worker.py used to be a new Python: it imported torch,
transformers' GPT-2 and ortrain, and its first graph build's forked child made the
exporter's modules and table again (``ortrain/build_warmup.py``), several seconds of
CPU per rank before a step, most of the distributed tests' time. Here the ranks come from
a ``multiprocessing`` fork server started once per test process, which imports all of
that and warms the builds before it forks anything (``tests/rank_server.py``); a rank
then sets the environment torchrun would give it, sends its output where the test reads
it and runs its module as ``python -m`` would. What a rank does is unchanged: its
own process, its own gloo connections and graph builds, killed or stopped as a process.

A forked rank is the server's child, not the test's: ``Rank`` hands the test the
``subprocess.Popen`` calls it used, and each rank's CPU time (its own and its build
children's, written as it ends) goes into the test's cost (tests/conftest.py's budget).
"""

from __future__ import annotations

import multiprocessing
import os
import resource
import runpy
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import IO, Any

_SERVER_MODULE = "tests.rank_server"
_context: Any = None


def _ctx() -> Any:
    global _context
    if _context is None:
        _context = multiprocessing.get_context("forkserver")
        _context.set_forkserver_preload([_SERVER_MODULE])
    return _context


def _rank_main(
    module: str, argv: list[str], env: dict[str, str], log: str, piped: str | None
) -> None:
    """In the forked rank: torchrun's environment, output to the log (stdout to the
    test's pipe where it reads it), then ``module`` run as ``python -m`` runs it (a path
    ending in ``.py``: as ``python <path>`` runs it); its CPU time written to
    ``<log>.cpu`` at the end, whatever the exit."""
    os.environ.clear()
    os.environ.update(env)
    tempfile.tempdir = None  # from TMPDIR again (a test gives its ranks their own)
    err = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    out = os.open(piped, os.O_WRONLY) if piped else err
    os.dup2(out, 1)
    os.dup2(err, 2)
    sys.argv = [module, *argv]
    try:
        if module.endswith(".py"):
            runpy.run_path(module, run_name="__main__")
        else:
            runpy.run_module(module, run_name="__main__", alter_sys=True)
    finally:
        sys.stdout.flush()
        mine = resource.getrusage(resource.RUSAGE_SELF)
        children = resource.getrusage(resource.RUSAGE_CHILDREN)
        cpu = mine.ru_utime + mine.ru_stime + children.ru_utime + children.ru_stime
        Path(f"{log}.cpu").write_text(f"{cpu:.3f}")


class Rank:
    """A forked rank, with the ``subprocess.Popen`` methods the tests call."""

    def __init__(self, process: Any, log: Path, stdout: IO[bytes] | None) -> None:
        self.process, self.log, self.stdout = process, log, stdout
        self.pid = process.pid

    @property
    def returncode(self) -> int | None:
        return self.process.exitcode

    def poll(self) -> int | None:
        return self.process.exitcode

    def wait(self, timeout: float | None = None) -> int:
        self.process.join(timeout)
        if self.process.exitcode is None:
            raise subprocess.TimeoutExpired(f"rank pid {self.pid}", timeout or 0.0)
        _charge(self.log)
        return self.process.exitcode

    def send_signal(self, sig: int) -> None:
        os.kill(self.pid, sig)

    def kill(self) -> None:
        self.process.kill()


_charged: set[Path] = set()
# CPU seconds of the ranks that ended so far: tests/conftest.py adds them to the process's
# own (the ranks are the server's children, not this process's)
CHARGED = [0.0]


def _charge(log: Path) -> None:
    """The ended rank's CPU time to the running test's cost, once."""
    cpu_file = Path(f"{log}.cpu")
    if log in _charged or not cpu_file.exists():
        return
    _charged.add(log)
    CHARGED[0] += float(cpu_file.read_text())


def start_rank(
    module: str, argv: list[str], env: dict[str, str], log: Path, piped: bool = False
) -> Rank:
    """One rank running ``python -m module *argv`` (``python module *argv`` for a path
    ending in ``.py``) in ``env``; stdout and stderr to ``log``, or stdout to
    ``Rank.stdout`` (a pipe) where ``piped``."""
    ctx = _ctx()
    fifo, stdout = None, None
    if piped:
        fifo = str(log) + ".stdout"
        os.mkfifo(fifo, 0o600)
        # non-blocking: opened before the rank opens its end; select sees nothing until
        # the rank writes or, having opened it, ends
        stdout = os.fdopen(os.open(fifo, os.O_RDONLY | os.O_NONBLOCK), "rb", buffering=0)
    process = ctx.Process(target=_rank_main, args=(module, argv, env, str(log), fifo), daemon=False)
    process.start()
    return Rank(process, log, stdout)
