"""Training over torch.distributed: data parallel (stage 0), ZeRO-1, -2 and -3.

The trainer holds one ``Reducer`` when torch.distributed is initialised (torchrun) and
the group has more than one rank; single-process training never touches this package.
The same code runs on CPU (gloo) and CUDA (NCCL for the device tensors): only
``comm.Comm`` knows the difference.
The reducer sits between the backward and the update (``update``), owns how gradients
are laid out (``prepare_update``), and how state is saved and loaded; its interface
(``Reducer``) is defined with the update engines that call it (``runtime/update_engines.py``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from ortrain.core.optimizer_spec import EAGER

if TYPE_CHECKING:
    from ortrain.distributed.comm import Comm
    from ortrain.options import TrainerOptions
    from ortrain.runtime.training_state import TrainingState
    from ortrain.runtime.update_engines import Reducer


def join_process_group(training: TrainingState, options: TrainerOptions) -> Reducer | None:
    """The reducer for ``options`` over the default (or given) process group; None
    in a single process or a group of one."""
    if not (dist.is_available() and dist.is_initialized()):
        if options.process_group is not None:
            raise ValueError("TrainerOptions.process_group is set but torch.distributed is not")
        return None
    if dist.get_world_size(options.process_group) == 1:  # no groups (nor NCCL) for one rank
        return None
    from ortrain.distributed.comm import Comm  # loaded only where there are ranks

    return make_reducer(
        training, options, Comm(options.process_group, options.dist_timeout, training.device)
    )


def make_reducer(training: TrainingState, options: TrainerOptions, comm: Comm) -> Reducer:
    """Data parallel, ZeRO-1 or ZeRO-2 (``TrainerOptions.zero_stage``) over ``comm``, on the
    trainer's device: host tensors over gloo, CUDA tensors over NCCL (``Comm.group_for``).
    Any world size, one included."""
    # Imported here: a single process does not load ZeRO's graph builders.
    from ortrain.distributed.data_parallel import DataParallel, DataParallelConfig
    from ortrain.distributed.fingerprint import agree_on_start
    from ortrain.distributed.sharded_state import ShardedState
    from ortrain.optim.sharded_eager import sharded_eager_spec

    if comm.device != training.device:
        raise ValueError(f"the trainer runs on {training.device}, its collectives on {comm.device}")
    # Ranks holding other models/options stop here, all alike, before anything moves.
    agree_on_start(training, options, comm)
    fp32 = all(training.params[n].dtype == torch.float32 for n in training.trainable)
    if options.zero_stage and training.spec.kind == EAGER and fp32:
        # an optimizer of torch's that works element by element: its step on the pieces
        training.spec = sharded_eager_spec(training.spec, training.optimizer)
    buckets = bucket_numel(options.reduce_bucket_mb)
    if options.zero_stage == 3:
        from ortrain.distributed.sharded_params import ShardedParams

        return ShardedParams(training, comm, buckets)
    if options.zero_stage == 2:
        from ortrain.distributed.sharded_grads import ShardedGradients

        return ShardedGradients(training, comm, buckets)
    if options.zero_stage == 1:
        return ShardedState(training, comm)
    config = DataParallelConfig(bucket_numel=bucket_numel(options.reduce_bucket_mb))
    return DataParallel(training, comm, config)


def bucket_numel(mib: float) -> int:
    """fp32 gradient elements in a bucket of ``mib`` MiB (at least one)."""
    return max(1, int(mib * 2**20) // 4)
