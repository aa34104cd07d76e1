"""Which stage a long build is in: a line once it has run a while, then one per stage."""

from __future__ import annotations

import contextlib
import sys
import threading
import time
from collections.abc import Iterator

PROGRESS_AFTER_S = 2.0

_current: BuildProgress | None = None


def stage(name: str) -> None:
    """The running build (in this process) has entered stage ``name``."""
    if _current is not None:
        _current.stage(name)


class BuildProgress:
    """Says which stage a build is in once it has run ``after`` seconds: a line when that
    time comes, then one per new stage, and how long it took in all (``done``)."""

    def __init__(self, what: str, enabled: bool, after: float | None = None) -> None:
        self.what = what
        self.enabled = enabled
        self.after = PROGRESS_AFTER_S if after is None else after
        self.start = time.monotonic()  # one clock for a forked build child and its parent
        self.current: str | None = None
        self.printed: set[str] = set()
        self.lock = threading.Lock()
        self.timer: threading.Timer | None = None

    def elapsed(self) -> float:
        return time.monotonic() - self.start

    def stage(self, name: str) -> None:
        with self.lock:
            self.current = name
        if self.elapsed() >= self.after:
            self._say()

    def _say(self) -> None:
        with self.lock:
            name = self.current
            if not self.enabled or name is None or name in self.printed:
                return
            self.printed.add(name)
            print(
                f"ortrain: {self.what}: {name}... ({self.elapsed():.1f} s)",
                file=sys.stderr,
                flush=True,
            )

    @contextlib.contextmanager
    def running(self) -> Iterator[BuildProgress]:
        """This process runs the build's stages meanwhile (``stage`` reaches it)."""
        global _current
        previous, _current = _current, self
        if self.enabled:
            self.timer = threading.Timer(max(0.0, self.after - self.elapsed()), self._say)
            self.timer.daemon = True
            self.timer.start()
        try:
            yield self
        finally:
            if self.timer is not None:
                self.timer.cancel()
            _current = previous

    def done(self, note: str = "") -> None:
        if self.enabled and self.elapsed() >= self.after:
            print(
                f"ortrain: {self.what}: ready in {self.elapsed():.1f} s{note}",
                file=sys.stderr,
                flush=True,
            )
