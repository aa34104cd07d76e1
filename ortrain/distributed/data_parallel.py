"""Data parallel (ZeRO stage 0): every rank holds the whole state and runs the whole update.

Between the backward and the update, the gradients of all ranks are summed with
all-reduces over contiguous buckets of one flat gradient buffer (each parameter's
gradient is a view into it, bound to ONNX Runtime zero-copy); the update graph scales
them by ``1 / (accumulation steps * world size)``, so it sees the mean over ranks.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import torch

from ortrain import checkpoint
from ortrain.core.errors import CheckpointError
from ortrain.distributed import sharded_checkpoint
from ortrain.distributed.comm import Comm
from ortrain.runtime.flat_layout import FlatLayout

if TYPE_CHECKING:
    from ortrain.runtime.training_state import TrainingState
    from ortrain.runtime.update_engines import GraphUpdate


@dataclasses.dataclass(frozen=True)
class DataParallelConfig:
    bucket_numel: int = 25 * 2**20 // 4  # 25 MiB of fp32, DDP's default bucket size
    align: int = 16  # elements: every gradient view starts on a 64-byte boundary


class DataParallel:
    """Stage 0 (a ``Reducer``): flat gradients, bucketed all-reduce, local state."""

    def __init__(
        self, training: TrainingState, comm: Comm, config: DataParallelConfig | None = None
    ):
        self.comm = comm
        self.config = config or DataParallelConfig()
        self.world_size = comm.world_size
        self.flat_grads: torch.Tensor | None = None
        self.buckets: list[torch.Tensor] = []
        self._grads: Mapping[str, torch.Tensor] = {}
        # Replicas start equal whatever each rank's seed was (as DDP does).
        state = training
        comm.broadcast_tensors([*state.params.values(), *state.buffers.values()])

    def prepare_update(self, state: TrainingState, engine: GraphUpdate) -> bool:
        assert state.grad_params is not None
        shapes = {p: tuple(state.params[p].shape) for p in state.grad_params}
        layout = FlatLayout.build(shapes, align=self.config.align)
        self.flat_grads = torch.zeros(layout.numel, device=self.comm.device)
        state.adopt_grads(layout.views(self.flat_grads))
        self._grads = state.grads  # checked at the first update (see there)
        n = self.config.bucket_numel
        self.buckets = [self.flat_grads[i : i + n] for i in range(0, layout.numel, n)]
        return False  # the engine builds the ordinary update graph over these gradients

    def update(self, run_update: Callable[[], None]) -> None:
        if self._grads:  # the update graph must read the very buffer that is all-reduced
            if any(g._base is not self.flat_grads for g in self._grads.values()):
                raise AssertionError("the trainer re-homed the gradients off the flat buffer")
            self._grads = {}
        self.comm.all_reduce_buckets(self.buckets)
        run_update()

    # Every rank holds the same state: state dicts are local, rank 0 writes checkpoints.
    def state_dict(self, training: TrainingState) -> dict[str, Any]:
        return checkpoint.trainer_state_dict(training)

    def load_state_dict(self, training: TrainingState, state: Mapping[str, Any]) -> None:
        checkpoint.load_trainer_state_dict(training, state)

    def save_checkpoint(self, training: TrainingState, path: str | os.PathLike) -> None:
        error: Exception | None = None
        if self.comm.rank == 0:
            try:
                checkpoint.save(training, path)
            except Exception as exc:
                error = exc
        if self.comm.any(error is not None):  # every rank learns whether it was written
            raise CheckpointError(f"rank 0 could not write the checkpoint {path}") from error

    def load_checkpoint(self, training: TrainingState, path: str | os.PathLike) -> None:
        sharded_checkpoint.load_any(training, path)
