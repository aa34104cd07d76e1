"""What the graph passes need to know about an optimizer to put its update in the graph
(``ortrain.optim.from_torch`` reads it off a torch optimizer)."""

from __future__ import annotations

import dataclasses

# An optimizer whose update ortrain does not compile: its own ``step()`` runs in eager
# PyTorch over ortrain's parameters and gradients (``EagerUpdate`` in
# ``ortrain/runtime/update_engines.py``), and it keeps its own state.
EAGER = "eager"

# Per-group hyperparameters fed to the update graph each step (read from param_groups).
HYPERPARAMETERS = {
    EAGER: (),
    "adam": ("lr", "beta1", "beta2", "eps", "weight_decay"),
    "adamw": ("lr", "beta1", "beta2", "eps", "weight_decay"),
    "lamb": ("lr", "beta1", "beta2", "eps", "weight_decay"),
    "sgd": ("lr", "momentum", "dampening", "weight_decay"),
}

# Optimizer state tensors per parameter, named as torch names them in optimizer.state.
STATE_NAMES = {
    EAGER: (),  # the torch optimizer's own, in its ``state``
    "adam": ("exp_avg", "exp_avg_sq"),
    "adamw": ("exp_avg", "exp_avg_sq"),
    "lamb": ("exp_avg", "exp_avg_sq"),
    "sgd": ("momentum_buffer",),
}


@dataclasses.dataclass(frozen=True)
class GroupSpec:
    params: tuple[str, ...]
    nesterov: bool = False  # SGD
    momentum: bool = False  # SGD: keeps a momentum buffer
    bias_correction: bool = True  # LAMB


@dataclasses.dataclass(frozen=True)
class OptimizerSpec:
    kind: str
    groups: tuple[GroupSpec, ...]
    # kind EAGER: the optimizer's class, and why its update is not compiled
    source: str = ""
    why_eager: str = ""

    @property
    def hyperparameters(self) -> tuple[str, ...]:
        return HYPERPARAMETERS[self.kind]

    def state_names(self, group: GroupSpec) -> tuple[str, ...]:
        if self.kind == "sgd" and not group.momentum:
            return ()
        return STATE_NAMES[self.kind]
