"""``optimizer.step()`` called by the training loop where it can change nothing.

``train_step`` runs the update itself. A loop carried over from eager PyTorch that still
calls ``torch.nn.utils.clip_grad_norm_(...)`` and ``optimizer.step()`` after it finds no
gradients there: the clipping returns 0 and the step does nothing, so the clipping the
user asked for never happened, with no error. The first such call warns, naming what
does it in ortrain (``max_grad_norm``, ``grad_accumulation_steps``). A step that finds
gradients (eager steps after ``sync_to_module()``) is the user's own and says nothing;
ortrain's own calls of the optimizer's step (``EagerUpdate``, background builds' eager
steps) are marked with ``own_step``.
"""

from __future__ import annotations

import contextlib
import threading
import warnings
from collections.abc import Iterator
from typing import Any

import torch

_OWN = threading.local()


@contextlib.contextmanager
def own_step() -> Iterator[None]:
    """Around ortrain's own ``optimizer.step()``."""
    before = getattr(_OWN, "depth", 0)
    _OWN.depth = before + 1
    try:
        yield
    finally:
        _OWN.depth = before


class OutsideSteps:
    """Warns once when the loop steps ``optimizer`` with no gradient anywhere."""

    def __init__(self, optimizer: torch.optim.Optimizer):
        self.optimizer = optimizer
        self.told = False
        self.handle = optimizer.register_step_pre_hook(self._pre_step)

    def _pre_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if self.told or getattr(_OWN, "depth", 0):
            return
        params = [p for g in optimizer.param_groups for p in g["params"]]
        if any(p.grad is not None for p in params):
            return  # an eager step of the user's own (after sync_to_module)
        self.told = True
        warnings.warn(
            "ortrain: optimizer.step() outside train_step finds no gradients and changes "
            "nothing: train_step ran the update (and zeroed nothing you need to zero). "
            "Gradient clipping there (clip_grad_norm_) did nothing either: pass "
            "TrainerOptions(max_grad_norm=...); an update every N batches: "
            "grad_accumulation_steps=N",
            stacklevel=4,
        )
