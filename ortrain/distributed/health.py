"""Which rank failed? A heartbeat per process in the c10d store, read when a collective fails.

A gloo collective that fails says "connection closed by peer <address>" or "timed out",
never which rank; a monitored barrier cannot run on the broken group afterwards. So
every process publishes ``"<beats> <collectives entered>"`` under its global rank every
``interval`` seconds from a daemon thread. After a failure, a rank reads the peers'
entries twice, a few intervals apart:

1. a peer whose beat count did not move has died or is stopped;
2. a peer that still beats but has entered fewer collectives hangs before this one;
3. if the store itself is gone, the process hosting it (rank 0 or the launcher) exited.
"""

from __future__ import annotations

import atexit
import threading
import time
from collections.abc import Sequence

import torch.distributed as dist

from ortrain.distributed.exits import ExitRecorder

_PREFIX = "ortrain/health/"


class RankHealth:
    """This process's heartbeat and the diagnosis of its peers (one per process)."""

    _instance: RankHealth | None = None

    def __init__(self, store: dist.Store, rank: int, interval: float):
        self._store = dist.PrefixStore(_PREFIX, store)
        self.rank = rank
        self.interval = interval
        self.exits = ExitRecorder.for_rank(rank)  # how a dead peer ended (distributed/exits.py)
        self.seq = 0  # collectives entered; every rank enters them in the same order
        self._beats = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="ortrain-heartbeat", daemon=True)
        self._thread.start()
        # A daemon thread still inside a store call while the interpreter tears the
        # store down aborts the process: stop and join it first.
        atexit.register(self.stop)

    @classmethod
    def for_process(cls, interval: float = 0.5) -> RankHealth:
        store = dist.distributed_c10d._get_default_store()
        rank = dist.get_rank()
        if cls._instance is None or cls._instance._stop.is_set() or cls._instance.rank != rank:
            cls._instance = cls(store, rank, interval)
        return cls._instance

    def _run(self) -> None:
        while True:
            try:
                self._store.set(str(self.rank), f"{self._beats} {self.seq}")
            except Exception:  # the store is gone (its host exited): nobody left to tell
                self._stop.set()
                return
            self._beats += 1
            if self._stop.wait(self.interval):
                return

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=10)

    def _read(self, ranks: Sequence[int]) -> dict[int, tuple[int, int] | None]:
        out: dict[int, tuple[int, int] | None] = {}
        for r in ranks:
            key = str(r)
            if not self._store.check([key]):
                out[r] = None
                continue
            beats, seq = self._store.get(key).decode().split()
            out[r] = (int(beats), int(seq))
        return out

    def diagnose(self, peers: Sequence[int]) -> tuple[list[int], str]:
        """(the global ranks to blame, a sentence saying why)."""
        wait = 3 * self.interval
        try:
            first = self._read(peers)
            time.sleep(wait)
            second = self._read(peers)
        except Exception as exc:
            host = 0 if 0 in peers else None
            return [host] if host is not None else [], (
                f"the c10d store is unreachable ({type(exc).__name__}): the process hosting it "
                "(rank 0, or the launcher) has exited"
            ) + self._ended([0] if host is not None else [])
        stopped = [r for r in peers if second[r] is None or second[r] == first[r]]
        behind = [
            r
            for r in peers
            if r not in stopped and (entry := second[r]) is not None and entry[1] < self.seq
        ]
        parts = []
        if stopped:
            parts.append(
                f"{_ranks(stopped)} stopped responding (no heartbeat for {wait:.1f} s: the "
                "process died or is stopped)" + self._ended(stopped)
            )
        if behind:
            at = ", ".join(f"rank {r} at #{second[r][1]}" for r in behind)  # type: ignore[index]
            parts.append(
                f"{_ranks(behind)} still alive but never reached collective #{self.seq} ({at}): "
                "hung or diverged before it"
            )
        if not parts:
            return [], "every peer is alive and reached this collective"
        return stopped + behind, "; ".join(parts)

    def _ended(self, ranks: Sequence[int]) -> str:
        """How those ranks' processes ended, where this host can tell (aborted, killed...)."""
        told = [t for r in ranks if (t := self.exits.how_ended(r)) is not None]
        return "".join(f"; {t}" for t in told)


def _ranks(ranks: Sequence[int]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(str(r) for r in ranks)
