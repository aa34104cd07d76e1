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
import io
import os
import pickle
import tempfile
import weakref
from collections.abc import Iterable, Iterator, Mapping
from typing import IO, Any

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


# ---------------------------------------------------------------- a child's result, spilled


class SpillReader:
    """The parent's side of a child's spill file (``dumps_spilling``): tensors read back
    one at a time, when asked for. The file closes with the last tensor handle."""

    def __init__(self, file: IO[bytes]):
        self.file = file
        # closed when the reader goes, also where it goes in a garbage cycle (a finalizer
        # runs before the cycle's objects are cleared; ``__del__`` could run after the
        # file's own)
        weakref.finalize(self, file.close)

    def read(self, offset: int, nbytes: int, dtype: torch.dtype, shape: tuple[int, ...]):
        out = torch.empty(shape, dtype=dtype)
        view = memoryview(_bytes_of(out))
        if view.nbytes != nbytes:
            raise ValueError(f"spilled tensor: {nbytes} bytes for {view.nbytes}")
        done = 0
        while done < nbytes:
            n = os.preadv(self.file.fileno(), [view[done:]], offset + done)
            if not n:
                raise OSError(f"spilled tensor: the file ended after {done} of {nbytes} bytes")
            done += n
        return out


@dataclasses.dataclass(frozen=True)
class SpilledTensor:
    """A tensor a child wrote to its spill file: ``load()`` reads a fresh copy."""

    reader: SpillReader
    offset: int
    nbytes: int
    dtype: torch.dtype
    shape: tuple[int, ...]

    def load(self) -> torch.Tensor:
        return self.reader.read(self.offset, self.nbytes, self.dtype, self.shape)


def dumps_spilling(obj: Any, fd: int) -> bytes:
    """``obj`` pickled, each ``spillable`` plain tensor's bytes written to the file ``fd``
    instead (read back as a ``SpilledTensor`` by ``load_spilled``)."""
    end = 0

    class Spilling(pickle.Pickler):
        def persistent_id(self, o: Any) -> Any:
            nonlocal end
            if type(o) is not torch.Tensor or o.requires_grad or not spillable(o):
                return None
            data = memoryview(_bytes_of(o))
            start, done = end, 0
            while done < data.nbytes:
                done += os.pwrite(fd, data[done:], start + done)
            end += data.nbytes
            return ("spilled", start, data.nbytes, o.dtype, tuple(o.shape))

    buf = io.BytesIO()
    Spilling(buf).dump(obj)
    return buf.getvalue()


def load_spilled(f: IO[bytes], spill: IO[bytes]) -> Any:
    """What ``dumps_spilling`` pickled into ``f``, its spilled tensors as ``SpilledTensor``
    handles on ``spill`` (which they keep open)."""
    reader = SpillReader(spill)

    class Loading(pickle.Unpickler):
        def persistent_load(self, pid: Any) -> Any:
            kind, offset, nbytes, dtype, shape = pid
            if kind != "spilled":
                raise pickle.UnpicklingError(f"unknown persistent id {kind!r}")
            return SpilledTensor(reader, offset, nbytes, dtype, shape)

    return Loading(f).load()


class LoadedOnRead(Mapping[str, Any]):
    """A name -> tensor mapping whose spilled tensors are read from their file at each
    access (the caller holds one at a time: a check compares gradients of the model's
    size without holding them all)."""

    def __init__(self, items: Mapping[str, Any]):
        self._items = items

    def __getitem__(self, name: str) -> Any:
        value = self._items[name]
        return value.load() if isinstance(value, SpilledTensor) else value

    def __iter__(self) -> Iterator[str]:
        return iter(self._items)

    def __len__(self) -> int:
        return len(self._items)

    def only(self, names: Iterable[str]) -> LoadedOnRead:
        return LoadedOnRead({n: self._items[n] for n in names})


def loaded_on_read(value: Any) -> Any:
    """A dict holding ``SpilledTensor`` values as a ``LoadedOnRead``; anything else as is."""
    if isinstance(value, dict) and any(isinstance(v, SpilledTensor) for v in value.values()):
        return LoadedOnRead(value)
    return value
