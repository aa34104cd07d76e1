"""Which shard of the flat layout a rank owns under ZeRO, and which optimizer-state
buffers it keeps for it (``sharded_state.py`` runs it; ``sharded_checkpoint.py`` saves it)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from ortrain.core.optimizer_spec import OptimizerSpec
from ortrain.runtime.flat_layout import FlatLayout, Piece

ALIGN = 16  # elements: every tensor and every shard starts on a 64-byte boundary
# ZeRO-2/3's bucket reduces on their way while the backward computes: one overlaps the
# backward that fills the next bucket, which lands it before going out itself. More would
# hold more buckets' memory for the same overlap.
IN_FLIGHT = 1


@dataclasses.dataclass(frozen=True)
class ShardConfig:
    """Which flat layout, which shard of it, and which optimizer-state buffers."""

    layout: FlatLayout
    rank: int
    state_names: tuple[str, ...]  # one shard-sized buffer each (exp_avg, exp_avg_sq, ...)

    @classmethod
    def build(
        cls, spec: OptimizerSpec, shapes: Mapping[str, tuple[int, ...]], rank: int, world: int
    ) -> ShardConfig:
        names = dict.fromkeys(s for g in spec.groups for s in spec.state_names(g))
        layout = FlatLayout.build(shapes, align=ALIGN, world_size=world)
        return cls(layout, rank, tuple(names))

    @property
    def shard(self) -> slice:
        lo, hi = self.layout.shard(self.rank)
        return slice(lo, hi)

    def local(self, piece: Piece) -> slice:
        """Where ``piece`` sits in this rank's shard buffers."""
        lo = self.shard.start
        return slice(piece.start - lo, piece.stop - lo)
