"""Bytes of model states per rank: estimated before a run, measured during one.

``estimate_memory(model, world_size, zero_stage, optimizer)`` sizes a run before it
starts (fp32 parameters and gradients, the optimizer's state tensors per parameter);
``ORTTrainer.state_bytes()`` measures what a trainer's rank holds, from the storages of
its tensors, in the same classes:

    parameters       every rank holds them whole (stages 0-2); its shard of them (3)
    gradients        whole under data parallel and ZeRO-1; this rank's shard of their
                     sums under ZeRO-2; none where the update runs inside the backward
                     (``update_engine="backward"``: the estimate does not assume it)
    in flight        ZeRO-2: gradient buckets held during a backward (estimated: the
                     largest block's gradients, in buckets that end at its edges, and
                     those on their way; measured: the peak so far); ZeRO-3: also the
                     parameters of the largest segment gathered, and the next one's
    optimizer state  whole under data parallel; this rank's shard under ZeRO-1 and -2

Activations come on top (``ORTTrainer.memory_report()`` plans them for a whole-model graph).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import TYPE_CHECKING

import torch

from ortrain.core.errors import UnsupportedOptimizerError
from ortrain.core.optimizer_spec import EAGER
from ortrain.distributed.shard_config import IN_FLIGHT

if TYPE_CHECKING:
    from ortrain.runtime.training_state import TrainingState

MIB = 2**20


@dataclasses.dataclass(frozen=True)
class StateBytes:
    world_size: int
    zero_stage: int
    parameters: int
    gradients: int
    in_flight: int
    optimizer_state: int

    @property
    def total(self) -> int:
        return self.parameters + self.gradients + self.in_flight + self.optimizer_state

    def format(self) -> str:
        rows = [
            ("parameters", self.parameters),
            ("gradients", self.gradients),
            ("gradients in flight", self.in_flight),
            ("optimizer state", self.optimizer_state),
            ("total", self.total),
        ]
        head = (
            f"model states per rank (world size {self.world_size}, ZeRO stage {self.zero_stage}):"
        )
        return "\n".join([head, *(f"  {k:<20} {v / MIB:10.1f} MiB" for k, v in rows)])


def _states_per_param(optimizer: torch.optim.Optimizer | str) -> int:
    """State tensors the size of a parameter that the optimizer keeps."""
    if isinstance(optimizer, str):
        kind = optimizer.lower()
        table = {"adam": 2, "adamw": 2, "lamb": 2, "sgd": 0, "sgd-momentum": 1, "adagrad": 1}
        if kind not in table:
            raise ValueError(
                f"estimate_memory: optimizer {optimizer!r}: use one of {sorted(table)}"
            )
        return table[kind]
    from ortrain.optim.from_torch import optimizer_spec

    params = [p for g in optimizer.param_groups for p in g["params"]]
    spec = optimizer_spec(optimizer, {id(p): str(i) for i, p in enumerate(params)})
    if spec.kind == EAGER:  # its own step: which state, read off a step on a probe
        from ortrain.optim.sharded_eager import sharded_eager_spec

        try:
            spec = sharded_eager_spec(spec, optimizer)
        except UnsupportedOptimizerError as exc:
            raise ValueError(
                f"estimate_memory: {spec.source} keeps a state ortrain cannot size ({exc}): "
                "name the optimizer's kind as a string instead"
            ) from None
    per_group = [len(spec.state_names(g)) for g in spec.groups]
    return max(per_group, default=0)


def _repeated_block_numel(model: torch.nn.Module) -> tuple[int, int]:
    """(the largest repeated block's trainable elements, its largest parameter's)."""
    from ortrain.segments.blocks import repeated_blocks

    blocks = [
        [p.numel() for p in model.get_submodule(n).parameters() if p.requires_grad]
        for n in repeated_blocks(model)
    ]
    return max((sum(b) for b in blocks), default=0), max(
        (max(b, default=0) for b in blocks), default=0
    )


def estimate_memory(
    model: torch.nn.Module,
    world_size: int = 1,
    zero_stage: int = 0,
    optimizer: torch.optim.Optimizer | str = "adamw",
    reduce_bucket_mb: float = 25.0,
) -> StateBytes:
    """Model-state bytes one rank of ``world_size`` will hold under ``zero_stage`` (fp32);
    a shard is rounded up to a whole element per rank."""
    if world_size < 1 or zero_stage not in (0, 1, 2, 3):
        raise ValueError(
            f"estimate_memory: world_size must be >= 1 and zero_stage 0, 1, 2 or 3, got "
            f"{world_size} and {zero_stage}"
        )
    trained = _unique(p for p in model.parameters() if p.requires_grad)
    psi = sum(p.numel() for p in trained)
    whole = sum(p.numel() for p in _unique(model.parameters()))
    n = world_size if world_size > 1 else 1
    stage = zero_stage if n > 1 else 0
    shard = -(-psi // n)
    k = _states_per_param(optimizer)
    in_flight = 0
    block, block_largest = _repeated_block_numel(model)
    if stage >= 2:
        # a block's backward writes its gradients into their buckets at once (buckets
        # end at its edges) while the ones before are on their way, each closed at the
        # first parameter boundary past the bucket size; on its way a bucket's owners
        # receive the other ranks' stretches of it beside it, one at a time (at most a
        # bucket's worth: ``Comm._send_to_owners``)
        bucket = int(reduce_bucket_mb * MIB) // 4 + block_largest
        in_flight = 4 * min(psi, IN_FLIGHT * 2 * bucket + block)
    if stage == 3:  # a segment's parameters gathered, and the next one's on its way
        largest = max((p.numel() for p in model.parameters()), default=0)
        in_flight += 2 * 4 * max(block, largest)
    return StateBytes(
        world_size=n,
        zero_stage=stage,
        parameters=4 * (-(-whole // n) if stage == 3 else whole),
        gradients=4 * (shard if stage >= 2 else psi),
        in_flight=in_flight,
        optimizer_state=4 * k * (shard if stage >= 1 else psi),
    )


def _unique(params: Iterable[torch.Tensor]) -> list[torch.Tensor]:
    seen: dict[int, torch.Tensor] = {}
    for p in params:
        seen.setdefault(id(p), p)
    return list(seen.values())


def storage_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind ``tensors`` (views of one flat buffer count
    once, whole)."""
    seen: dict[int, int] = {}
    for t in tensors:
        s = t.untyped_storage()
        seen[s.data_ptr()] = s.nbytes()
    return sum(seen.values())


def held_state_bytes(state: TrainingState, reducer: object, zero_stage: int) -> StateBytes:
    """What a trainer's rank holds now (``ORTTrainer.state_bytes``), from the storages of
    its state's tensors and ``reducer``'s peaks in flight (None in a single process)."""
    in_flight = getattr(reducer, "peak_open_numel", 0) + getattr(reducer, "peak_gathered_numel", 0)
    return StateBytes(
        world_size=getattr(reducer, "world_size", 1),
        zero_stage=zero_stage if reducer is not None else 0,
        # (ZeRO-3's shard: its own bytes, the pages of the buffer around it handed back)
        parameters=storage_bytes(state.params.values()) + sum(t.nbytes for t in state.shard_params),
        gradients=storage_bytes([*state.grads.values(), *state.shard_grads]),
        in_flight=4 * in_flight,
        optimizer_state=storage_bytes([*state.opt_state.values(), *_eager_state(state)]),
    )


def _eager_state(state: TrainingState) -> list[torch.Tensor]:
    """What an optimizer whose own step runs in eager keeps (ortrain's ``opt_state`` is
    empty then)."""
    if state.spec.kind != EAGER or state.optimizer is None:
        return []
    return [t for e in state.optimizer.state.values() for t in e.values() if torch.is_tensor(t)]
