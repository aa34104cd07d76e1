"""Whether a module still holds, where it held them, the tensors the training state holds.

Every step checks that the module's parameters are the optimizer's objects under their
names and that none was rebound (``p.data = ...``) or put in anew (``ProgramContext.
check_trainable``, ``TrainingState.adopt_rebound``): walks of ``named_parameters`` and
``named_buffers``, which make every name again. ``TensorSlots.unchanged`` answers "nothing
of that changed since the last look" from the dicts the walks read (each module's
``_modules``, ``_parameters`` and ``_buffers``) compared by identity, and each tensor's
storage against the state's; anything else takes the walks.
"""

from __future__ import annotations

import operator
from collections.abc import Callable

import torch


class TensorSlots:
    """``take()`` after a full check that passed; ``unchanged()`` then says whether the
    walks would find what they found then. ``held(kind, name)``: the state's tensor of a
    parameter or buffer (read at every look, so a state that rebinds its own is seen)."""

    def __init__(
        self, module: torch.nn.Module, held: Callable[[str, str], torch.Tensor | None]
    ) -> None:
        self.module = module
        self.held = held
        self._dicts: list[tuple[dict, tuple]] | None = None
        self._tensors: list[tuple[torch.Tensor, str, str]] = []

    def take(self) -> None:
        modules = list(self.module.modules())
        self._dicts = [
            (d, tuple(d.values())) for m in modules for d in (m._modules, m._parameters, m._buffers)
        ]
        own = [
            *(("parameter", n, t) for n, t in self.module.named_parameters()),
            *(("buffer", n, t) for n, t in self.module.named_buffers()),
        ]
        self._tensors = [(t, kind, n) for kind, n, t in own if self.held(kind, n) is not None]

    def forget(self) -> None:
        """The next look walks (something changed that the dicts do not show)."""
        self._dicts = None

    def unchanged(self) -> bool:
        if self._dicts is None:
            return False
        for d, values in self._dicts:
            if len(d) != len(values) or not all(map(operator.is_, d.values(), values)):
                return False
        for t, kind, name in self._tensors:
            held = self.held(kind, name)
            if held is None or t.data_ptr() != held.data_ptr():
                return False
        return True
