"""Copies of large host tensors kept in a file instead of in memory, for as long as a
first-step check needs them.

The check puts back what the graph's checked run writes (``verify.restoring``); with the
update in the backward that is every parameter, and a copy in memory would raise the
training process's peak by the model's size at every new graph's first step. An unlinked
temporary file holds the bytes instead: the page cache, which the kernel writes out and
drops under pressure, where process memory could only grow. Putting back reads them into
the tensor's own storage: no second copy exists at any time.
"""

from __future__ import annotations

import dataclasses
import tempfile
from typing import IO

import torch

# smaller copies stay in memory: a file write each would cost more than the bytes they take
SPILL_MIN_BYTES = 1 << 20


@dataclasses.dataclass(frozen=True)
class Spilled:
    """Where a tensor's bytes are in the file."""

    offset: int
    nbytes: int


def _bytes_of(t: torch.Tensor):  # -> numpy.ndarray of uint8 sharing ``t``'s memory
    return t.detach().reshape(-1).view(torch.uint8).numpy()


def spillable(t: torch.Tensor) -> bool:
    """A dense host tensor laid out as one run of bytes, large enough to be worth a file."""
    return (
        t.device.type == "cpu"
        and t.layout == torch.strided
        and t.is_contiguous()
        and not (t.is_conj() or t.is_neg())
        and t.numel() * t.element_size() >= SPILL_MIN_BYTES
    )


class SpillFile:
    """An unlinked temporary file that takes tensors' bytes (``keep``) and writes them
    back into them (``put_back``); closed (and gone) with ``close``."""

    def __init__(self) -> None:
        self._file: IO[bytes] | None = None
        self._end = 0

    def keep(self, t: torch.Tensor) -> Spilled | None:
        """``t``'s bytes written to the file; None where ``t`` is not ``spillable`` or the
        file cannot take them (a full disk): the caller copies it in memory."""
        if not spillable(t):
            return None
        data = memoryview(_bytes_of(t))
        try:
            if self._file is None:
                self._file = tempfile.TemporaryFile(prefix="ortrain-check-")
            self._file.seek(self._end)
            self._file.write(data)
            self._file.flush()
        except OSError:
            return None
        kept = Spilled(self._end, data.nbytes)
        self._end += data.nbytes
        return kept

    def put_back(self, kept: Spilled, t: torch.Tensor) -> None:
        """Read ``kept``'s bytes back into ``t`` (the tensor they were taken from, its
        shape as it was)."""
        assert self._file is not None and spillable(t)
        view = memoryview(_bytes_of(t))
        if view.nbytes != kept.nbytes:
            raise ValueError(f"put_back: {view.nbytes} bytes to fill, {kept.nbytes} kept")
        self._file.seek(kept.offset)
        done = 0
        while done < kept.nbytes:
            n = self._file.readinto(view[done:])
            if not n:
                raise OSError(f"put_back: the spill file ended after {done} of {kept.nbytes}")
            done += n

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
