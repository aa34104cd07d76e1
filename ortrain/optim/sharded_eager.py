"""Under ZeRO, a torch optimizer whose update ortrain does not compile but which works
element by element: its own ``step()`` over this rank's pieces of the parameters.

A shard holds pieces of tensors, so only an update that treats every element on its own
(with per-parameter counters that every piece shares) gives on the pieces what it gives
on the whole tensors. That holds for the torch classes in ``_ELEMENTWISE`` (a subclass
that keeps their ``step()``), not for one that reads a whole tensor (a norm, a matrix's
rows: LAMB's trust ratio, Adafactor's factored moments) or for one whose class ortrain
does not know. Their state, read off one step on a probe tensor, must be per-element
tensors, a ``step`` count and numbers per parameter that only the steps change (NAdam's
``mu_product``, ASGD's ``eta`` and ``mu``): the tensors live in ZeRO's flat state buffers
(so checkpoints are sharded, and gathered into torch's format, as the compiled kinds'),
the count is the trainer's step, and the numbers, alike on every piece of a parameter,
are kept per parameter by the reducer (every rank steps a piece of every parameter, an
empty one where its shard holds none, so every rank has them all).
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from ortrain.core.errors import UnsupportedOptimizerError
from ortrain.core.optimizer_spec import SHARDED_EAGER, OptimizerSpec
from ortrain.optim.own_step import own_step

_ELEMENTWISE: tuple[type[torch.optim.Optimizer], ...] = (
    torch.optim.Adam,
    torch.optim.AdamW,
    torch.optim.Adamax,
    torch.optim.RAdam,
    torch.optim.NAdam,
    torch.optim.Adagrad,
    torch.optim.Adadelta,
    torch.optim.RMSprop,
    torch.optim.Rprop,
    torch.optim.SGD,
    torch.optim.ASGD,
)


def _elementwise_class(optimizer: torch.optim.Optimizer) -> type | None:
    """The class of ``_ELEMENTWISE`` whose ``step()`` ``optimizer`` runs, or None."""
    for base in _ELEMENTWISE:
        if isinstance(optimizer, base) and not own_step(optimizer, base):
            return base
    return None


def hyperparameters(group: Mapping[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in group.items() if k != "params"}


def make_like(optimizer: torch.optim.Optimizer, groups: Sequence[Sequence[torch.Tensor]]):
    """A new optimizer of ``optimizer``'s class over ``groups`` (one list of tensors per
    param group), each group with the same hyperparameters."""
    cls = type(optimizer)
    takes = inspect.signature(cls.__init__).parameters
    defaults = {k: v for k, v in optimizer.defaults.items() if k in takes and k != "params"}
    param_groups = [
        {**hyperparameters(g), "params": list(ts)}
        for g, ts in zip(optimizer.param_groups, groups, strict=True)
    ]
    return cls(param_groups, **defaults)


def _flags(optimizer: torch.optim.Optimizer) -> tuple[tuple[tuple[str, bool], ...], ...]:
    return tuple(
        tuple(sorted((k, v) for k, v in hyperparameters(g).items() if isinstance(v, bool)))
        for g in optimizer.param_groups
    )


def sharded_eager_spec(spec: OptimizerSpec, optimizer: torch.optim.Optimizer) -> OptimizerSpec:
    """``spec`` (kind EAGER) as kind ``SHARDED_EAGER``; raises ``UnsupportedOptimizerError``
    naming why where the optimizer's update cannot run on pieces of tensors."""
    name = spec.source or type(optimizer).__qualname__
    if _elementwise_class(optimizer) is None:
        raise UnsupportedOptimizerError(
            f"ZeRO (TrainerOptions.zero_stage>=1) updates each rank's pieces of the "
            f"parameters; {name} runs its own step() ({spec.why_eager}), and ortrain runs an "
            "optimizer's own step on pieces only for torch's that work element by element "
            "(Adagrad, Adadelta, Adamax, ASGD, NAdam, RAdam, RMSprop, Rprop; Adam, AdamW and "
            "SGD with any flags): use zero_stage=0 (data parallel), or one of those"
        )
    # one step on a probe: which state it keeps (torch makes it at the first step), on
    # the parameters' device (flags such as capturable need it)
    device = next((p.device for g in optimizer.param_groups for p in g["params"]), None)
    probe = [torch.zeros(3, device=device, requires_grad=True) for _ in optimizer.param_groups]
    try:
        trial = make_like(optimizer, [[p] for p in probe])
        for p in probe:
            p.grad = torch.ones(3, device=device)
        trial.step()
    except Exception as exc:  # its own constructor's or step's reason
        raise UnsupportedOptimizerError(
            f"ZeRO: {name} could not be laid out over shard pieces: a step on a probe "
            f"raised {type(exc).__name__}: {exc}"
        ) from exc
    state: dict[str, None] = {}
    scalars: dict[str, None] = {}
    stepped = False
    for p in probe:
        for s, t in trial.state[p].items():
            if s == "step":
                stepped = True
            elif isinstance(t, torch.Tensor) and tuple(t.shape) == (3,):
                state[s] = None
            elif isinstance(t, torch.Tensor) and t.dim() == 0 and t.is_floating_point():
                scalars[s] = None  # a number per parameter its step alone changes
            else:
                is_tensor = isinstance(t, torch.Tensor)
                what = f"shape {tuple(t.shape)}" if is_tensor else type(t).__name__
                raise UnsupportedOptimizerError(
                    f"ZeRO (TrainerOptions.zero_stage>=1): {name} keeps {s!r} per parameter "
                    f"({what} for a parameter of 3 elements), neither one value per element "
                    "nor one number: a shard holds pieces of parameters, which would each "
                    "keep their own; use zero_stage=0 (data parallel)"
                )
    return dataclasses.replace(
        spec,
        kind=SHARDED_EAGER,
        state=tuple(state),
        scalars=tuple(scalars),
        stepped=stepped,
        flags=_flags(optimizer),
    )


def changed_flags(optimizer: torch.optim.Optimizer, spec: OptimizerSpec) -> list[str]:
    """The bool hyperparameters (amsgrad, nesterov, ...) that changed since ``spec`` was
    made: they select which state the step keeps, laid out for what they were."""
    now = _flags(optimizer)
    out = []
    for gi, (a, b) in enumerate(zip(spec.flags, now, strict=False)):
        if a != b:
            was, got = dict(a), dict(b)
            keys = sorted(set(was) | set(got))
            out += [f"group {gi} {k}" for k in keys if was.get(k) != got.get(k)]
    return out
