"""Training over torch.distributed: data parallel (stage 0) and ZeRO-1 (stage 1).

The trainer holds one ``Reducer`` when torch.distributed is initialised (torchrun) and
the group has more than one rank; single-process training never touches this package.
The reducer sits between the backward and the update (``update``), owns how gradients
are laid out (``prepare_update``), and how state is saved and loaded.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, Protocol

import torch.distributed as dist

if TYPE_CHECKING:
    from ortrain.trainer import ORTTrainer


class Reducer(Protocol):
    world_size: int

    def prepare_update(self, trainer: ORTTrainer) -> bool:
        """Lay out ``trainer.grads``; True when it also built the update session."""
        ...

    def update(self, run_update: Callable[[], None]) -> None:
        """Reduce the gradients across ranks around ``run_update`` (the update graph)."""
        ...

    def state_dict(self, trainer: ORTTrainer) -> dict[str, Any]: ...

    def load_state_dict(self, trainer: ORTTrainer, state: Mapping[str, Any]) -> None: ...

    def save_checkpoint(self, trainer: ORTTrainer, path: str | os.PathLike) -> None: ...

    def load_checkpoint(self, trainer: ORTTrainer, path: str | os.PathLike) -> None: ...


def join_process_group(trainer: ORTTrainer) -> Reducer | None:
    """The reducer for ``trainer.options`` over the default (or given) process group."""
    options = trainer.options
    if not (dist.is_available() and dist.is_initialized()):
        if options.process_group is not None:
            raise ValueError("TrainerOptions.process_group is set but torch.distributed is not")
        return None
    # Imported here: a single process does not load ZeRO's graph builders.
    from ortrain.distributed.comm import Comm
    from ortrain.distributed.data_parallel import DataParallel
    from ortrain.distributed.fingerprint import agree_on_start
    from ortrain.distributed.sharded_state import ShardedState

    comm = Comm(options.process_group, options.dist_timeout)
    if comm.world_size == 1:
        return None
    if trainer.device.type != "cpu":
        raise ValueError(
            f"distributed training on {trainer.device} is not supported yet: ortrain's "
            "collectives run on gloo over host memory (use device='cpu' per rank)"
        )
    # Ranks holding other models/options stop here, all alike, before anything moves.
    agree_on_start(trainer, comm)
    if options.zero_stage == 1:
        return ShardedState(trainer, comm)
    return DataParallel(trainer, comm)
