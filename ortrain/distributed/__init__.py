"""Training over torch.distributed: data parallel (stage 0), ZeRO-1, -2 and -3.

The trainer holds one ``Reducer`` when torch.distributed is initialised (torchrun) and
the group has more than one rank; single-process training never touches this package.
The same code runs on CPU (gloo) and CUDA (NCCL for the device tensors): only
``comm.Comm`` knows the difference.
The reducer sits between the backward and the update (``update``), owns how gradients
are laid out (``prepare_update``), and how state is saved and loaded.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, Protocol

import torch.distributed as dist

if TYPE_CHECKING:
    from ortrain.distributed.comm import Comm
    from ortrain.runtime.training_state import TrainingState
    from ortrain.runtime.update_engines import GraphUpdate
    from ortrain.trainer import ORTTrainer


class Reducer(Protocol):
    world_size: int

    def prepare_update(self, state: TrainingState, engine: GraphUpdate) -> bool:
        """Lay out ``state.grads``; True when it also bound ``engine``'s update session."""
        ...

    def update(self, run_update: Callable[[], None]) -> None:
        """Reduce the gradients across ranks around ``run_update`` (the update graph)."""
        ...

    def state_dict(self, trainer: ORTTrainer) -> dict[str, Any]: ...

    def load_state_dict(self, trainer: ORTTrainer, state: Mapping[str, Any]) -> None: ...

    def save_checkpoint(self, trainer: ORTTrainer, path: str | os.PathLike) -> None: ...

    def load_checkpoint(self, trainer: ORTTrainer, path: str | os.PathLike) -> None: ...


def join_process_group(trainer: ORTTrainer) -> Reducer | None:
    """The reducer for ``trainer.options`` over the default (or given) process group; None
    in a single process or a group of one."""
    options = trainer.options
    if not (dist.is_available() and dist.is_initialized()):
        if options.process_group is not None:
            raise ValueError("TrainerOptions.process_group is set but torch.distributed is not")
        return None
    if dist.get_world_size(options.process_group) == 1:  # no groups (nor NCCL) for one rank
        return None
    from ortrain.distributed.comm import Comm  # loaded only where there are ranks

    return make_reducer(trainer, Comm(options.process_group, options.dist_timeout, trainer.device))


def make_reducer(trainer: ORTTrainer, comm: Comm) -> Reducer:
    """Data parallel, ZeRO-1 or ZeRO-2 (``TrainerOptions.zero_stage``) over ``comm``, on the
    trainer's device: host tensors over gloo, CUDA tensors over NCCL (``Comm.group_for``).
    Any world size, one included."""
    # Imported here: a single process does not load ZeRO's graph builders.
    from ortrain.distributed.data_parallel import DataParallel, DataParallelConfig
    from ortrain.distributed.fingerprint import agree_on_start
    from ortrain.distributed.sharded_state import ShardedState

    if comm.device != trainer.device:
        raise ValueError(f"the trainer runs on {trainer.device}, its collectives on {comm.device}")
    # Ranks holding other models/options stop here, all alike, before anything moves.
    agree_on_start(trainer, comm)
    buckets = bucket_numel(trainer.options.reduce_bucket_mb)
    if trainer.options.zero_stage == 3:
        from ortrain.distributed.sharded_params import ShardedParams

        return ShardedParams(trainer, comm, buckets)
    if trainer.options.zero_stage == 2:
        from ortrain.distributed.sharded_grads import ShardedGradients

        return ShardedGradients(trainer, comm, buckets)
    if trainer.options.zero_stage == 1:
        return ShardedState(trainer, comm)
    config = DataParallelConfig(bucket_numel=bucket_numel(trainer.options.reduce_bucket_mb))
    return DataParallel(trainer, comm, config)


def bucket_numel(mib: float) -> int:
    """fp32 gradient elements in a bucket of ``mib`` MiB (at least one)."""
    return max(1, int(mib * 2**20) // 4)
