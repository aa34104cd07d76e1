"""An ``OptimizerSpec`` read off a torch optimizer, and its per-step hyperparameters."""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import Any

import torch

from ortrain.core.errors import UnsupportedOptimizerError
from ortrain.core.optimizer_spec import GroupSpec, OptimizerSpec
from ortrain.optim.lamb import Lamb


def _refuse_own_step(optimizer: torch.optim.Optimizer, base: type) -> None:
    """A subclass's own ``step()`` would never run: the update is ``base``'s, in the graph."""
    for cls in type(optimizer).__mro__:
        if cls is base:
            return
        step = cls.__dict__.get("step")  # torch wraps step() in a profiling hook: unwrap
        if step is not None and inspect.unwrap(step) is not inspect.unwrap(base.step):
            raise UnsupportedOptimizerError(
                f"optimizer {cls.__qualname__} overrides step(), which ortrain never calls (it "
                f"runs {base.__qualname__}'s update inside its graphs); use {base.__qualname__} "
                "itself (hyperparameters in param_groups are read every step)"
            )


def _kind(optimizer: torch.optim.Optimizer) -> str:
    kinds = ((Lamb, "lamb"), (torch.optim.AdamW, "adamw"), (torch.optim.Adam, "adam"))
    for base, kind in (*kinds, (torch.optim.SGD, "sgd")):
        if isinstance(optimizer, base):
            _refuse_own_step(optimizer, base)
            if kind == "adam" and optimizer.defaults.get("decoupled_weight_decay", False):
                return "adamw"
            return kind
    raise UnsupportedOptimizerError(
        f"optimizer {type(optimizer).__module__}.{type(optimizer).__qualname__} is not supported "
        "by ortrain; use torch.optim.AdamW, Adam, SGD or ortrain.optim.Lamb"
    )


def group_spec(kind: str, group: Mapping[str, Any], params: tuple[str, ...] = ()) -> GroupSpec:
    """The ``GroupSpec`` of one torch param group of an optimizer of ``kind``: the flags
    that shape the update graph. Raises ``UnsupportedOptimizerError`` (without saying
    where: callers do) for a flag ortrain cannot honour; a state dict's param groups go
    through here too (``ortrain/optim/state_check.py``)."""
    for opt in ("amsgrad", "maximize"):
        if group.get(opt):
            raise UnsupportedOptimizerError(f"{opt}=True is not supported")
    if kind == "sgd" and group.get("nesterov") and group.get("dampening", 0) != 0:
        raise UnsupportedOptimizerError("nesterov momentum requires dampening=0")
    return GroupSpec(
        params,
        nesterov=bool(group.get("nesterov", False)),
        momentum=float(group.get("momentum", 0.0)) != 0.0,
        bias_correction=bool(group.get("bias_correction", True)),
    )


def optimizer_spec(optimizer: torch.optim.Optimizer, names: dict[int, str]) -> OptimizerSpec:
    """Describe ``optimizer``; ``names`` maps id(parameter) -> parameter name."""
    kind = _kind(optimizer)
    name = type(optimizer).__name__
    groups = []
    seen: set[str] = set()
    for gi, group in enumerate(optimizer.param_groups):
        try:
            group_spec(kind, group)
        except UnsupportedOptimizerError as exc:
            raise UnsupportedOptimizerError(f"{name} param group {gi}: {exc}") from None
        pnames = []
        for p in group["params"]:
            if id(p) not in names:
                raise UnsupportedOptimizerError(
                    f"{name} param group {gi} holds a tensor of shape {tuple(p.shape)} that is "
                    "not a parameter of the model"
                )
            if names[id(p)] in seen:
                raise UnsupportedOptimizerError(f"parameter {names[id(p)]} is in two param groups")
            seen.add(names[id(p)])
            if p.requires_grad:
                pnames.append(names[id(p)])
        groups.append(group_spec(kind, group, tuple(pnames)))
    return OptimizerSpec(kind, tuple(groups))


def group_values(optimizer: torch.optim.Optimizer, spec: OptimizerSpec) -> list[dict[str, float]]:
    """This step's hyperparameters per group (so LR schedulers work unchanged)."""
    out = []
    for gi, group in enumerate(optimizer.param_groups):
        values: dict[str, float] = {}
        for h in spec.hyperparameters:
            if h in ("beta1", "beta2"):
                values[h] = float(group["betas"][0 if h == "beta1" else 1])
            else:
                values[h] = float(group.get(h, 0.0))
        gs = spec.groups[gi]
        if spec.kind == "sgd" and (float(group.get("momentum", 0.0)) != 0.0) != gs.momentum:
            raise UnsupportedOptimizerError(
                f"SGD param group {gi}: momentum switched between zero and non-zero after the "
                "training graph was built"
            )
        out.append(values)
    return out
