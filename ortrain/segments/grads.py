"""Where the gradients of a step through segments land: the training state's buffers.

Torch's backward through the segments (and the eager code between them) accumulates into
each parameter's ``.grad``; the update engines read ``TrainingState.grads``. Before a step
``bind_grads`` points each reached parameter's ``.grad`` at its buffer, so torch adds in
place; after it ``take_grads`` copies what torch put elsewhere (a ``.grad`` the user set
to None meanwhile). The first step learns which parameters the loss reaches and
``lay_out`` lays out the gradients and the update for them; a later step may not reach
others. ZeRO-2 and -3 take each gradient as autograd makes it
(``distributed/sharded_grads.py``): ``take_reduced`` only learns and checks the set.
"""

from __future__ import annotations

from collections.abc import Callable, Collection

import torch

from ortrain.core.errors import BatchError
from ortrain.runtime.training_state import TrainingState

LayOut = Callable[[list[str]], None]  # the first step's reached parameters, in order


def bind_grads(state: TrainingState, named: dict[str, torch.nn.Parameter]) -> None:
    for p in state.grad_params or []:
        named[p].grad = state.grads[p]


def take_grads(state: TrainingState, named: dict[str, torch.nn.Parameter], lay_out: LayOut) -> None:
    """Torch's ``.grad`` into the state's gradient buffers."""
    if state.grad_params is None:
        reached = [n for n in state.trainable if named[n].grad is not None]
        if not reached:
            raise BatchError("the loss reaches no trainable parameter")
        first = {n: named[n].grad.detach().clone() for n in reached}  # type: ignore[union-attr]
        for n in reached:
            named[n].grad = None
        lay_out(reached)
        for n, g in first.items():
            state.grads.setdefault(n, torch.zeros_like(state.params[n])).copy_(g)
        return
    _refuse_others(state, [n for n in state.trainable if named[n].grad is not None])
    for n in state.grad_params:
        g, got = state.grads[n], named[n].grad
        if got is not None and got is not g:
            g.copy_(got)  # a new tensor (the user set .grad to None): the window's sum
            named[n].grad = g


def take_reduced(state: TrainingState, reached: Collection[str], lay_out: LayOut) -> None:
    """The gradients are reduced already (ZeRO-2, -3): the set they reach."""
    if state.grad_params is None:
        if not reached:
            raise BatchError("the loss reaches no trainable parameter")
        lay_out([n for n in state.trainable if n in reached])
        return
    _refuse_others(state, reached)


def _refuse_others(state: TrainingState, reached: Collection[str]) -> None:
    extra = set(reached) - set(state.grad_params or [])
    if extra:
        raise BatchError(
            f"this batch reaches parameters the first one did not ({sorted(extra)}); "
            "ortrain needs one set"
        )
