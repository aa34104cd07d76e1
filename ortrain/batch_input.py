"""A step's arguments as the batch its program runs on: ``BatchInput``.

Positional and keyword arguments become one name -> value mapping
(``export.normalize_batch``); what eager would take but a graph cannot is refused here
with the input's name: a ``forward(*args)`` given another count of positional inputs than
on the first step (a different model call, most likely a collate bug). Floating inputs of
any dtype go on to the export: a float64 target (numpy's default) promotes the loss as in
eager, and an input eager would refuse (a float64 batch into a float32 ``Linear``) fails
the export, which says that eager fails too.
"""

from __future__ import annotations

from typing import Any

import torch

from ortrain.core.errors import BatchError
from ortrain.export import normalize_batch, var_positional_keys


class BatchInput:
    def __init__(self, module: torch.nn.Module, *, allow_extra: bool):
        self.module = module
        self.allow_extra = allow_extra  # a loss_fn may read inputs the forward does not take
        self.var_positional: int | None = None  # the first step's count of *args inputs

    def __call__(self, args: tuple, kwargs: dict) -> dict[str, Any]:
        batch = normalize_batch(self.module, args, kwargs, allow_extra=self.allow_extra)
        keys = var_positional_keys(self.module, batch)
        if keys is not None:
            if self.var_positional is None:
                self.var_positional = len(keys)
            if len(keys) != self.var_positional:
                raise BatchError(
                    f"{type(self.module).__name__}.forward got {len(keys)} positional inputs "
                    f"for its *args ({', '.join(keys) or 'none'}), the first step "
                    f"{self.var_positional}: its graphs take the same positional inputs every "
                    "step"
                )
        return batch
