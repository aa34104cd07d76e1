"""Tensors laid out in one flat buffer, and the contiguous shards ranks own of it.

Every tensor starts at a multiple of ``align`` elements (views stay cache-line aligned)
and the total is padded to a multiple of ``world_size * align``, so that the buffer
splits into ``world_size`` equal, aligned shards: rank r owns
``[r * shard_numel, (r + 1) * shard_numel)``. A tensor that straddles a shard boundary
has one *piece* on each rank it touches.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import torch

# Elements (1 MiB of fp32) per chain of an element-wise update graph: ONNX Runtime runs
# the chains one after the other, so a chain's temporaries stay the size of a piece of
# this length, not of the tensor or the model (``runtime/flat_update.py``, ZeRO's shard).
UPDATE_CHAIN_NUMEL = 1 << 18


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


@dataclasses.dataclass(frozen=True)
class Entry:
    name: str
    shape: tuple[int, ...]
    offset: int  # first element in the flat buffer

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def stop(self) -> int:
        return self.offset + self.numel


@dataclasses.dataclass(frozen=True)
class Piece:
    """The part of tensor ``name`` in one shard: flat elements ``[start, stop)``."""

    name: str
    start: int
    stop: int
    entry_offset: int  # where the tensor starts in the flat buffer

    @property
    def numel(self) -> int:
        return self.stop - self.start


@dataclasses.dataclass(frozen=True)
class FlatLayout:
    entries: tuple[Entry, ...]
    align: int  # elements
    world_size: int
    numel: int  # padded total

    @classmethod
    def build(
        cls, shapes: Mapping[str, tuple[int, ...]], *, align: int = 1, world_size: int = 1
    ) -> FlatLayout:
        entries, offset = [], 0
        for name, shape in shapes.items():
            entry = Entry(name, tuple(int(d) for d in shape), offset)
            entries.append(entry)
            offset = _round_up(entry.stop, align)
        return cls(tuple(entries), align, world_size, _round_up(offset, align * world_size))

    @property
    def names(self) -> list[str]:
        return [e.name for e in self.entries]

    @property
    def shard_numel(self) -> int:
        return self.numel // self.world_size

    @property
    def padding(self) -> int:
        """Elements that belong to no tensor (alignment gaps and the tail)."""
        return self.numel - sum(e.numel for e in self.entries)

    def shard(self, rank: int) -> tuple[int, int]:
        return rank * self.shard_numel, (rank + 1) * self.shard_numel

    def pieces(self, rank: int) -> list[Piece]:
        lo, hi = self.shard(rank)
        out = []
        for e in self.entries:
            start, stop = max(e.offset, lo), min(e.stop, hi)
            if start < stop:
                out.append(Piece(e.name, start, stop, e.offset))
        return out

    def views(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        """Each tensor as a view of ``flat`` (which must hold ``numel`` elements)."""
        if flat.numel() != self.numel:
            raise ValueError(f"flat buffer has {flat.numel()} elements, layout needs {self.numel}")
        return {e.name: flat[e.offset : e.stop].view(e.shape) for e in self.entries}

    def to_json(self) -> dict[str, Any]:
        return {
            "align": self.align,
            "world_size": self.world_size,
            "numel": self.numel,
            "entries": [[e.name, list(e.shape), e.offset] for e in self.entries],
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> FlatLayout:
        entries = tuple(Entry(n, tuple(s), int(o)) for n, s, o in data["entries"])
        return cls(entries, int(data["align"]), int(data["world_size"]), int(data["numel"]))
