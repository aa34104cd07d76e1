"""How a peer process ended: aborted by a signal (gloo's fatal checks abort the process),
killed, stopped, or exited, as far as this host can tell.

A rank that gloo aborts (``SIGABRT`` from a failed ``GLOO_ENFORCE`` on one of its threads)
cannot tell anyone: no Python code runs. So each rank leaves a record, on its own host,
under a folder named after the job (``MASTER_ADDR``/``MASTER_PORT``, torchrun's run id):
its pid, and a file Python's ``faulthandler`` writes its fatal signal into (only where the
process has not enabled faulthandler itself). A survivor diagnosing a dead peer on the
same host reads that file, or the peer's ``/proc`` entry (a zombie not yet reaped by its
launcher holds its wait status); on another host it can say nothing more.

The records live under the temporary folder, in a folder of this user's alone
(``ortrain-ranks-<uid>``, created 0700; ``ortrain/safe_files.py``): the job's name is no
secret, and in a folder another user could write first, a link planted at a record's name
would make a rank overwrite whatever it points to. Where that folder is not this user's
alone, a rank keeps no record (and says so once): the diagnosis is a courtesy.
"""

from __future__ import annotations

import atexit
import contextlib
import faulthandler
import json
import os
import re
import shutil
import signal
import socket
import tempfile
import time
import warnings
from pathlib import Path
from typing import IO

from ortrain.safe_files import atomic_write, private_dir

# faulthandler's first line -> the signal
_FATAL = {
    "Aborted": "SIGABRT",
    "Segmentation fault": "SIGSEGV",
    "Bus error": "SIGBUS",
    "Floating point exception": "SIGFPE",
    "Illegal instruction": "SIGILL",
}


def _job_dir() -> Path | None:
    addr, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if not addr or not port:
        return None
    run = os.environ.get("TORCHELASTIC_RUN_ID", "")
    name = re.sub(r"[^A-Za-z0-9_.-]", "_", f"{addr}-{port}-{run}")
    return Path(tempfile.gettempdir()) / f"ortrain-ranks-{os.getuid()}" / name


class ExitRecorder:
    """This process's record (pid, fault file) and the reading of the peers'."""

    def __init__(self, rank: int, folder: Path | None):
        self.rank = rank
        self.folder = folder
        self._fault: IO[str] | None = None
        if folder is None:
            return
        try:
            private_dir(folder)
        except OSError as exc:  # UntrustedPathError included: no record, and why
            warnings.warn(f"ortrain: rank {rank} keeps no exit record: {exc}", stacklevel=3)
            self.folder = None
            return
        _prune(folder.parent)
        fault = folder / f"rank{rank}.fault"
        # an earlier job's file (same address and port) must not speak for this one
        fault.unlink(missing_ok=True)
        owned = not faulthandler.is_enabled()  # the user's own faulthandler setup wins
        if owned:  # open while the process lives; a new file, never through a link
            flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
            self._fault = os.fdopen(os.open(fault, flags, 0o600), "w")
            faulthandler.enable(self._fault)
        self.record = folder / f"rank{rank}.json"
        where = str(fault) if owned else None
        info = json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "fault": where})
        atomic_write(self.record, lambda f: f.write(info.encode()), private=True)
        atexit.register(self.close)

    @classmethod
    def for_rank(cls, rank: int) -> ExitRecorder:
        return cls(rank, _job_dir())

    def close(self) -> None:
        """A clean exit: no fault to report, nothing left behind."""
        if self._fault is not None:
            with contextlib.suppress(Exception):
                faulthandler.disable()
                self._fault.close()
                Path(self._fault.name).unlink()
            self._fault = None
        if self.folder is not None:
            with contextlib.suppress(OSError):
                self.record.unlink()
                self.folder.rmdir()  # the last rank out removes the job's folder

    def how_ended(self, rank: int) -> str | None:
        """A clause on how ``rank``'s process ended (None: unknown here)."""
        if self.folder is None:
            return None
        try:
            record = json.loads((self.folder / f"rank{rank}.json").read_text())
        except (OSError, ValueError):
            return None
        if record.get("host") != socket.gethostname():
            return None
        fatal = _fatal_signal(Path(record["fault"])) if record.get("fault") else None
        if fatal is not None:
            return (
                f"rank {rank} was aborted by {fatal} (pid {record['pid']}): a fatal error in "
                "native code, e.g. gloo's check that the ranks' collectives match (its stderr "
                f"holds the error; its Python stack is in {record['fault']})"
            )
        return _proc_state(rank, int(record["pid"]))


def _prune(root: Path, age_s: float = 24 * 3600) -> None:
    """Remove the folders of jobs a day old whose processes are all gone (killed ranks
    leave their record behind)."""
    with contextlib.suppress(OSError):
        for job in root.iterdir():
            if time.time() - job.stat().st_mtime < age_s:
                continue
            pids = []
            for rec in job.glob("rank*.json"):
                with contextlib.suppress(OSError, ValueError, KeyError):
                    pids.append(int(json.loads(rec.read_text())["pid"]))
            if not any(Path(f"/proc/{pid}").exists() for pid in pids):
                shutil.rmtree(job, ignore_errors=True)


def _fatal_signal(path: Path) -> str | None:
    try:
        first = path.read_text(errors="replace").lstrip().splitlines()[0]
    except (OSError, IndexError):
        return None
    m = re.match(r"Fatal Python error: (.+)", first)
    return _FATAL.get(m.group(1).strip(), m.group(1).strip()) if m else None


def _proc_state(rank: int, pid: int) -> str | None:
    """From /proc: a zombie's wait status, or a stopped process."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return f"rank {rank}'s process (pid {pid}) has exited"
    fields = stat.rsplit(")", 1)[1].split()
    state = fields[0]
    if state == "T":
        return f"rank {rank}'s process (pid {pid}) is stopped (SIGSTOP or a debugger)"
    if state == "Z" and len(fields) >= 50:
        status = int(fields[49])  # field 52 of stat: the wait status (Linux >= 3.5)
        if os.WIFSIGNALED(status):
            sig = signal.Signals(os.WTERMSIG(status)).name
            return f"rank {rank}'s process (pid {pid}) was killed by {sig}"
        if os.WIFEXITED(status):
            return f"rank {rank}'s process (pid {pid}) exited with code {os.WEXITSTATUS(status)}"
    return None
