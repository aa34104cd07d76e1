"""An ``OptimizerSpec`` read off a torch optimizer, and its per-step hyperparameters."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from ortrain.core.errors import UnsupportedOptimizerError
from ortrain.core.optimizer_spec import EAGER, SHARDED_EAGER, GroupSpec, OptimizerSpec
from ortrain.optim.lamb import Lamb
from ortrain.optim.own_step import own_step
from ortrain.optim.sharded_eager import changed_flags

# optimizers whose own step cannot run on ortrain's gradients, and why
_CANNOT = {
    torch.optim.LBFGS: "it re-evaluates the model inside its step (a closure), which a "
    "training step of compiled graphs cannot do",
    torch.optim.SparseAdam: "it takes sparse gradients and ortrain computes dense ones "
    "(an Embedding with sparse=False and Adam or AdamW train the same model)",
}

# torch's optimizers whose step takes sparse gradients (made by ``Embedding(sparse=True)``);
# the others raise in eager, and so does ortrain, before a step
_TAKE_SPARSE = (torch.optim.SGD, torch.optim.Adagrad, torch.optim.SparseAdam)


def check_sparse_gradients(optimizer: torch.optim.Optimizer, module: torch.nn.Module) -> None:
    """Raises where ``module`` makes sparse gradients (an ``Embedding`` or ``EmbeddingBag``
    with ``sparse=True`` that trains) and ``optimizer``'s eager step would refuse them:
    ortrain's gradients are dense, so it would train a run eager stops."""
    if isinstance(optimizer, _TAKE_SPARSE):
        return
    sparse = [
        name or type(module).__name__
        for name, m in module.named_modules()
        if isinstance(m, (torch.nn.Embedding, torch.nn.EmbeddingBag))
        and m.sparse
        and m.weight.requires_grad
    ]
    if sparse:
        cls = type(optimizer).__name__
        raise UnsupportedOptimizerError(
            f"{cls} does not take sparse gradients, which {', '.join(sparse[:4])} "
            f"(sparse=True) make: eager's {cls}.step() raises on them. Set sparse=False "
            "(ortrain computes dense gradients anyway), or use SGD or Adagrad"
        )


def _kind(optimizer: torch.optim.Optimizer) -> tuple[str, str]:
    """(kind, why its update runs in eager: "" where ortrain compiles it)."""
    for cls, why in _CANNOT.items():
        if isinstance(optimizer, cls):
            raise UnsupportedOptimizerError(f"{cls.__name__} cannot train through ortrain: {why}")
    kinds = ((Lamb, "lamb"), (torch.optim.AdamW, "adamw"), (torch.optim.Adam, "adam"))
    for base, kind in (*kinds, (torch.optim.SGD, "sgd")):
        if isinstance(optimizer, base):
            own = own_step(optimizer, base)
            if own:
                return EAGER, f"{own} overrides step()"
            if kind == "adam" and optimizer.defaults.get("decoupled_weight_decay", False):
                return "adamw", ""
            return kind, ""
    return EAGER, "ortrain compiles the updates of AdamW, Adam, SGD and Lamb"


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


def optimizer_spec(
    optimizer: torch.optim.Optimizer, names: dict[int, str], eager_because: str = ""
) -> OptimizerSpec:
    """Describe ``optimizer``; ``names`` maps id(parameter) -> parameter name. An optimizer
    whose update ortrain cannot compile (another class, its own ``step()``, a flag the
    update graph lacks, or ``eager_because``) is kind ``EAGER``: its own step runs in eager
    PyTorch."""
    kind, why = (EAGER, eager_because) if eager_because else _kind(optimizer)
    name = type(optimizer).__name__
    for gi, group in enumerate(optimizer.param_groups):
        if kind == EAGER:
            break
        try:
            group_spec(kind, group)
        except UnsupportedOptimizerError as exc:
            kind, why = EAGER, f"param group {gi}: {exc}"
    groups = []
    seen: set[str] = set()
    for gi, group in enumerate(optimizer.param_groups):
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
        groups.append(
            GroupSpec(tuple(pnames)) if kind == EAGER else group_spec(kind, group, tuple(pnames))
        )
    if kind != EAGER:
        return OptimizerSpec(kind, tuple(groups))
    source = f"{type(optimizer).__module__}.{type(optimizer).__qualname__}"
    return OptimizerSpec(kind, tuple(groups), source=source, why_eager=why)


def group_values(optimizer: torch.optim.Optimizer, spec: OptimizerSpec) -> list[dict[str, float]]:
    """This step's hyperparameters per group (so LR schedulers work unchanged)."""
    out = []
    for group in optimizer.param_groups:
        values: dict[str, float] = {}
        for h in spec.hyperparameters:
            if h in ("beta1", "beta2"):
                values[h] = float(group["betas"][0 if h == "beta1" else 1])
            else:
                values[h] = float(group.get(h, 0.0))
        out.append(values)
    return out


def check_groups(optimizer: torch.optim.Optimizer, spec: OptimizerSpec) -> None:
    """Raises where the optimizer's param groups changed shape since the trainer was made
    (``add_param_group``; a flag that selects another update: ``nesterov``, momentum
    switched to or from zero, ``maximize``, ``amsgrad``, Adam's
    ``decoupled_weight_decay``): the update was laid out for what they were then, and
    would go on ignoring the change. Learning rates, betas, weight decay and the other
    numbers may change at any step (schedulers); those are read every step."""
    made = "after the ORTTrainer was made"
    fix = "make a new ORTTrainer (trainer.sync_to_module() first): nothing of this step ran"
    if len(optimizer.param_groups) != len(spec.groups):
        raise UnsupportedOptimizerError(
            f"the optimizer has {len(optimizer.param_groups)} param groups, "
            f"{len(spec.groups)} when the ORTTrainer was made (add_param_group {made}); "
            f"its gradients and update are laid out for those; {fix}"
        )
    if spec.kind == EAGER:  # the optimizer's own step() reads its groups as they are
        return
    if spec.kind == SHARDED_EAGER:  # so does it under ZeRO, its state laid out by flags
        if changed := changed_flags(optimizer, spec):
            raise UnsupportedOptimizerError(
                f"{type(optimizer).__name__}: {', '.join(changed)} changed {made}; ZeRO laid "
                f"out the state the step keeps for what they were then; {fix}"
            )
        return
    for gi, (group, gs) in enumerate(zip(optimizer.param_groups, spec.groups, strict=True)):
        where = f"{type(optimizer).__name__} param group {gi}"
        try:
            now = group_spec(spec.kind, group, gs.params)
        except UnsupportedOptimizerError as exc:
            raise UnsupportedOptimizerError(f"{where}: {exc} (set {made}); {fix}") from None
        flags = [
            f
            for f in ("nesterov", "momentum", "bias_correction")
            if getattr(now, f) != getattr(gs, f)
        ]
        decoupled = group.get("decoupled_weight_decay")
        if spec.kind in ("adam", "adamw") and decoupled is not None:
            if bool(decoupled) != (spec.kind == "adamw"):
                flags.append("decoupled_weight_decay")
        if flags:
            raise UnsupportedOptimizerError(
                f"{where}: {', '.join(flags)} changed {made}; the compiled update does "
                f"what they selected then; {fix}"
            )
