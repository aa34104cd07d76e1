"""Sub-modules whose outputs the forward itself differentiates with ``create_graph=True``
(a gradient penalty, second-order MAML, a physics-informed loss on du/dx, an input-gradient
regulariser): a compiled segment's backward graph gives first-order gradients only, so
such a module runs in eager, as do the modules around it.

``TwiceWatch`` finds them during the recording forward: a pre-hook on the autograd node
that made each sub-module call's outputs fires only when a backward passes through that
node, and the recording forward runs no backward of its own, so any that fires is the
forward's own ``torch.autograd.grad`` or ``backward``. Grad mode is on inside such a pass
exactly when it builds a graph of the gradients (``create_graph=True``); a first-order
one (its result used as a constant) is what a compiled backward gives too.

``SegmentFunction.backward`` raises ``SecondOrderError`` where a compiled segment is
differentiated with ``create_graph=True`` after all (a penalty the first step did not
take): its first-order gradients would leave the second-order terms out with no error.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

from ortrain.core.errors import OrtrainError
from ortrain.segments.calls import flatten

WHY = (
    "the forward differentiates its output again (torch.autograd.grad or backward with "
    "create_graph=True), and a compiled segment's backward gives first-order gradients only"
)


class SecondOrderError(OrtrainError):
    """A compiled segment's gradient was asked with ``create_graph=True``."""


class TwiceWatch:
    """Names of the sub-modules whose outputs a ``create_graph`` pass went through."""

    def __init__(self) -> None:
        self.names: set[str] = set()

    def watch(self, name: str, out: Any) -> None:
        """After ``name``'s call returned ``out``: hook the nodes that made its tensors."""
        nodes = {
            id(t.grad_fn): t.grad_fn
            for t in flatten(out)[0]  # (dataclass outputs opened)
            if isinstance(t, torch.Tensor) and t.grad_fn is not None
        }
        for node in nodes.values():
            node.register_prehook(self._fired(name))

    def _fired(self, name: str) -> Callable[[Any], None]:
        def fired(grads: Any) -> None:
            if torch.is_grad_enabled():  # create_graph=True: second-order terms wanted
                self.names.add(name)

        return fired


def refuse_twice(name: str, twice: Mapping[str, str] | frozenset[str]) -> str | None:
    """Why ``name`` cannot be compiled (it or a module inside it is differentiated twice
    in the forward), or None."""
    inside = sorted(n for n in twice if n == name or n.startswith(name + "."))
    if not inside:
        return None
    whose = "its output" if inside[0] == name else f"the output of {inside[0][len(name) + 1 :]}"
    return f"{whose}: {WHY}"


def second_order_error(module: torch.nn.Module) -> SecondOrderError:
    return SecondOrderError(
        f"ortrain: a gradient of the compiled segment {type(module).__name__} was asked with "
        "create_graph=True (a gradient penalty, a second-order method) after the first step, "
        "which did not differentiate it twice and compiled it; its backward graph gives "
        "first-order gradients only, so the second-order terms would be lost. Take that "
        "gradient on the first step too (the planning then runs the module in eager); this "
        "step's update was not applied"
    )
