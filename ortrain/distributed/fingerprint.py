"""Ranks that disagree stop at the start, on every rank, with one error naming the difference.

Data parallel and ZeRO-1 assume every rank holds the same model, optimizer and options.
Where they do not, training goes silently wrong (same-size models of other shapes; a
``max_grad_norm`` set on one rank: the replicas drift apart) or a collective of
different-sized tensors aborts a rank inside gloo. So before the first collective that
moves the model (``agree_on_start``), and again after the first training graph is built
(``agree_on_graph``), the ranks compare a fingerprint:

1. a fixed-size digest (32 bytes) goes to every rank: payloads of different sizes cannot
   abort gloo; equal digests end the check;
2. only where they differ, each rank's (field, value) list goes to every rank (lengths
   first, then the padded payloads), and every rank raises ``RankMismatchError`` naming
   the first field that differs, its value on each rank, and the ranks that differ from
   group rank 0.

The fields: each parameter's and buffer's name, shape, dtype and ``requires_grad``; the
optimizer's kind, its groups (parameters, flags) and hyperparameters; the options that
must agree (``AGREED_OPTIONS``); after the first build the training graph's inputs and
outputs (names, roles, dtypes, shapes; a batch input's shape may differ between ranks).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from ortrain.core.errors import OrtrainError
from ortrain.optim.from_torch import group_values

if TYPE_CHECKING:
    from ortrain.build import BuiltGraph
    from ortrain.distributed.comm import Comm
    from ortrain.options import TrainerOptions
    from ortrain.runtime.training_state import TrainingState

Fields = list[tuple[str, str]]
# what changes the numbers the ranks exchange, or whether a rank stops or skips a step
AGREED_OPTIONS = (
    "zero_stage",
    "grad_accumulation_steps",
    "max_grad_norm",
    "mixed_precision",
    "check_finite",
    "update_engine",
    "verify",
    "fallback",
    "segments",
    "reduce_bucket_mb",
)
DIGEST_BYTES = 32
ABSENT = "<absent>"


class RankMismatchError(OrtrainError, ValueError):
    """The ranks of a distributed trainer hold different models, optimizers or options.

    ``field`` is the first field that differs; ``ranks`` the group ranks whose value
    differs from group rank 0's; ``values`` each rank's value of it."""

    def __init__(self, message: str, field: str, ranks: list[int], values: list[str]):
        super().__init__(message)
        self.field = field
        self.ranks = ranks
        self.values = values


# --------------------------------------------------------------------------- fields
def _tensor(t: torch.Tensor) -> str:
    return f"{list(t.shape)} {str(t.dtype).replace('torch.', '')}"


def _number(v: Any) -> str:
    if isinstance(v, torch.Tensor) and v.numel() == 1:
        v = v.item()
    return repr(v)


def run_fields(training: TrainingState, options: TrainerOptions) -> Fields:
    """The model and optimizer of ``training``, and ``options``, as (field, value) pairs."""
    fields: Fields = []
    for name, p in sorted(training.module.named_parameters()):
        fields.append((f"parameter {name}", f"{_tensor(p)} requires_grad={p.requires_grad}"))
    for name, b in sorted(training.module.named_buffers()):
        fields.append((f"buffer {name}", _tensor(b)))
    spec = training.spec
    fields.append(("optimizer", spec.kind + (f" {spec.source}" if spec.source else "")))
    values = group_values(training.optimizer, spec)
    for gi, (group, hyper) in enumerate(zip(spec.groups, values, strict=True)):
        fields.append((f"optimizer group {gi} parameters", ", ".join(group.params)))
        flags = f"nesterov={group.nesterov} momentum={group.momentum}"
        fields.append((f"optimizer group {gi} flags", f"{flags} bias={group.bias_correction}"))
        fields += [(f"optimizer group {gi} {h}", _number(v)) for h, v in sorted(hyper.items())]
    for name in AGREED_OPTIONS:
        fields.append((f"TrainerOptions.{name}", _number(getattr(options, name))))
    scaling = options.resolved_loss_scale
    fields.append(("TrainerOptions.loss_scale", "None" if scaling is None else repr(scaling)))
    return fields


def graph_fields(built: BuiltGraph, grad_params: Sequence[str]) -> Fields:
    """The first training graph's signature; a batch input's shape left out (ranks may
    take batches of different sizes)."""
    roles = {r.name: r.role.value for r in built.io}
    fields: Fields = [("parameters with gradients", ", ".join(grad_params))]
    for name, value in built.signature:
        io_name = name.split(" ", 1)[1]
        role = roles.get(io_name, "output" if name.startswith("output") else "?")
        if role == "batch":
            value = value.split(" ", 1)[0]  # the dtype only
        fields.append((f"training graph {name} ({role})", value))
    return fields


# --------------------------------------------------------------------------- comparing
def first_difference(per_rank: Sequence[Fields]) -> tuple[str, list[str], list[int]] | None:
    """(field, value per rank, ranks differing from rank 0) of the first field that is not
    the same on every rank; None: none. Fields come in the order the ranks list them (a
    field only some ranks have sits where they have it: a parameter of an extra layer
    comes before the optimizer fields it also changes)."""
    maps = [dict(f) for f in per_rank]
    pos: dict[str, tuple[int, int]] = {}
    for rank, fields in enumerate(per_rank):
        for i, (name, _) in enumerate(fields):
            pos[name] = min(pos.get(name, (i, rank)), (i, rank))
    for name in sorted(pos, key=pos.__getitem__):
        values = [m.get(name, ABSENT) for m in maps]
        if len(set(values)) > 1:
            return name, values, [r for r, v in enumerate(values) if v != values[0]]
    return None


def _digest(fields: Fields) -> torch.Tensor:
    data = hashlib.sha256(json.dumps(fields).encode()).digest()
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


def _everyone(comm: Comm, mine: torch.Tensor) -> list[torch.Tensor]:
    """Every rank's ``mine`` (the same size on every rank) on every rank."""
    flat = torch.zeros(comm.world_size * mine.numel(), dtype=mine.dtype)
    flat.view(comm.world_size, -1)[comm.rank] = mine
    comm.all_gather(flat)
    return list(flat.view(comm.world_size, -1))


def _gather_fields(comm: Comm, fields: Fields) -> list[Fields]:
    payload = json.dumps(fields).encode()
    sizes = _everyone(comm, torch.tensor([len(payload)], dtype=torch.int64))
    longest = max(int(s) for s in sizes)
    padded = torch.zeros(longest, dtype=torch.uint8)
    padded[: len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
    parts = _everyone(comm, padded)
    return [
        [tuple(f) for f in json.loads(bytes(p[: int(n)].tolist()).decode())]  # type: ignore[misc]
        for p, n in zip(parts, sizes, strict=True)
    ]


def agree(comm: Comm, fields: Fields, what: str) -> None:
    """Raise ``RankMismatchError`` on every rank unless every rank holds ``fields``."""
    digests = _everyone(comm, _digest(fields))
    if all(torch.equal(d, digests[0]) for d in digests):
        return
    per_rank = _gather_fields(comm, fields)
    diff = first_difference(per_rank)
    if diff is None:  # the same fields in another order: a bug of ours, not the user's
        raise RankMismatchError(f"the ranks' {what} fingerprints differ in order", what, [], [])
    name, values, ranks = diff
    shown = "; ".join(f"rank {_global(comm, r)}: {v}" for r, v in enumerate(values))
    blamed = [_global(comm, r) for r in ranks]
    raise RankMismatchError(
        f"rank {_global(comm, comm.rank)}: the ranks' {what} differ, first at {name} ({shown}); "
        f"data-parallel ranks must hold the same model, optimizer and options: "
        f"{_ranks(blamed)} differ from rank {_global(comm, 0)}. Nothing was trained",
        name,
        blamed,
        values,
    )


def _global(comm: Comm, group_rank: int) -> int:
    return comm.global_ranks[group_rank]


def _ranks(ranks: Sequence[int]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(str(r) for r in ranks)


def agree_on_start(training: TrainingState, options: TrainerOptions, comm: Comm) -> None:
    """Before the first collective that moves the model: model, optimizer, options."""
    agree(comm, run_fields(training, options), "models, optimizers or options")


def agree_on_graph(comm: Comm, built: BuiltGraph, grad_params: Sequence[str]) -> None:
    """After the first training graph is built, before the first gradient collective."""
    agree(comm, graph_fields(built, grad_params), "training graphs")


def reducer_comm(reducer: Any) -> Comm | None:
    return getattr(reducer, "comm", None)


__all__ = ["RankMismatchError", "agree_on_graph", "agree_on_start", "first_difference"]
