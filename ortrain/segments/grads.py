"""Where the gradients of a step through segments land: the training state's buffers.

Torch's backward through the segments (and the eager code between them) accumulates into
each parameter's ``.grad``; the update engines read ``TrainingState.grads``. Before a step
``bind_grads`` points each reached parameter's ``.grad`` at its buffer, so torch adds in
place; after it ``take_grads`` copies what torch put elsewhere (a ``.grad`` the user set
to None meanwhile). The first step learns which parameters the loss reaches and
``lay_out`` lays out the gradients and the update for them. A model whose steps reach
different parameters (a LayerDrop skips a layer at random) is followed: ``Reached``
records which parameters each accumulation window's backward gave a gradient; one that
reaches a parameter the first did not widens the layout (``widen``), one that leaves a
laid-out parameter unreached has it skipped by the update (``state.unreached``); both
move the update to the optimizer's own step (``ProgramContext.update_in_eager``). Under
data parallel the ranks agree on the set first (one small all-reduce per micro-step):
a parameter any rank reached has a gradient in the sum, as on the combined batch.
ZeRO-2 and -3 take each gradient as autograd makes it (``distributed/sharded_grads.py``):
``take_reduced`` only learns and checks the set.
"""

from __future__ import annotations

from collections.abc import Callable, Collection

import torch

from ortrain.core.errors import BatchError
from ortrain.core.own_hooks import own_hook
from ortrain.runtime.training_state import TrainingState

LayOut = Callable[[list[str]], None]  # the first step's reached parameters, in order


class Reached:
    """The trainable parameters that torch's backward gave a gradient since ``clear``:
    a hook after each accumulation into ``.grad`` (which a bound buffer would not show,
    and ortrain's own checks, through ``torch.autograd.grad``, do not fire). It fires for
    an undefined gradient too (a backward that gives the parameter none, after which
    eager's ``.grad`` stays None): the gradient hook just before it says which."""

    def __init__(self, named: dict[str, torch.nn.Parameter], trainable: list[str]):
        self.names: set[str] = set()
        self._defined: dict[str, bool] = {}
        self._handles = []
        for n in trainable:
            self._handles.append(named[n].register_hook(own_hook(self._seer(n))))
            self._handles.append(
                named[n].register_post_accumulate_grad_hook(own_hook(self._marker(n)))
            )

    def _seer(self, name: str) -> Callable[[torch.Tensor | None], None]:
        def see(grad: torch.Tensor | None) -> None:
            self._defined[name] = grad is not None

        return see

    def _marker(self, name: str) -> Callable[[torch.Tensor], None]:
        def mark(_: torch.Tensor) -> None:
            if self._defined.pop(name, True):
                self.names.add(name)

        return mark

    def clear(self) -> None:
        self.names.clear()


def bind_grads(state: TrainingState, named: dict[str, torch.nn.Parameter]) -> None:
    for p in state.grad_params or []:
        named[p].grad = state.grads[p]


def take_grads(
    state: TrainingState,
    named: dict[str, torch.nn.Parameter],
    lay_out: LayOut,
    widen: LayOut | None = None,
    agreed: Collection[str] | None = None,
) -> None:
    """Torch's ``.grad`` into the state's gradient buffers; ``widen``: lays out the
    parameters this step reached and the first did not (None: refused); ``agreed``: the
    parameters any rank's window reached so far (data parallel: every rank lays out the
    same set), default this process's."""
    local = [n for n in state.trainable if named[n].grad is not None]
    reached = local if agreed is None else [n for n in state.trainable if n in agreed]
    if state.grad_params is None:
        if not reached:
            raise BatchError("the loss reaches no trainable parameter")
        first = {n: named[n].grad.detach().clone() for n in local}  # type: ignore[union-attr]
        for n in local:
            named[n].grad = None
        lay_out(reached)
        for n in reached:
            g = state.grads.setdefault(n, torch.zeros_like(state.params[n]))
            if n in first:
                g.copy_(first[n])
        return
    if widen is None:
        _refuse_others(state, reached)
    else:
        laid = set(state.grad_params)
        if extra := [n for n in reached if n not in laid]:
            widen(extra)
    for n in state.grad_params:
        g, got = state.grads[n], named[n].grad
        if got is not None and got is not g:
            g.copy_(got)  # a new tensor (the user set .grad to None, a widened layout)
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
