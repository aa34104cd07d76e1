"""What the graph passes need to know about an optimizer to put its update in the graph
(``ortrain.optim.from_torch`` reads it off a torch optimizer)."""

from __future__ import annotations

import dataclasses

# An optimizer whose update ortrain does not compile: its own ``step()`` runs in eager
# PyTorch over ortrain's parameters and gradients (``EagerUpdate`` in
# ``ortrain/runtime/update_engines.py``), and it keeps its own state.
EAGER = "eager"
# Under ZeRO, an optimizer of torch's whose update is elementwise (RMSprop, Adagrad, Adam
# with amsgrad, ...): its own ``step()`` runs over this rank's shard pieces, and its
# per-element state (``OptimizerSpec.state``) is laid out in ZeRO's flat buffers like the
# compiled kinds' (``ortrain/optim/sharded_eager.py``).
SHARDED_EAGER = "sharded-eager"

# Per-group hyperparameters fed to the update graph each step (read from param_groups).
HYPERPARAMETERS = {
    EAGER: (),
    SHARDED_EAGER: (),  # its own step reads its param groups
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
    # kind SHARDED_EAGER: its per-element state, its other numbers per parameter (NAdam's
    # ``mu_product``: alike on every piece), whether it counts steps per parameter (torch's
    # ``step``), and each group's flags (bool keys) its state names rest on
    state: tuple[str, ...] = ()
    scalars: tuple[str, ...] = ()
    stepped: bool = True
    flags: tuple[tuple[tuple[str, bool], ...], ...] = ()

    @property
    def hyperparameters(self) -> tuple[str, ...]:
        return HYPERPARAMETERS[self.kind]

    @property
    def counts_steps(self) -> bool:
        """Whether torch's state of it holds a ``step`` per parameter (SGD's has none)."""
        return self.stepped if self.kind == SHARDED_EAGER else self.kind != "sgd"

    def state_names(self, group: GroupSpec) -> tuple[str, ...]:
        if self.kind == SHARDED_EAGER:
            return self.state
        if self.kind == "sgd" and not group.momentum:
            return ()
        return STATE_NAMES[self.kind]
