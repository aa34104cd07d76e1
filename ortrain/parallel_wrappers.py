"""A model handed over inside torch's own data-parallel wrapper.

``DistributedDataParallel`` all-reduces gradients from autograd hooks and its forward is
a ``torch.compiler.disable``'d function that no export can trace; ``DataParallel``
scatters the batch over devices in Python. ortrain reduces gradients over ranks itself
(``ortrain/distributed``) and runs the graphs on one device, so the wrapper would only
turn the whole model into an eager segment (and, across ranks, reduce every gradient
twice). The trainer takes the wrapped module instead, and says so once.
"""

from __future__ import annotations

import warnings

import torch


def unwrapped(model: torch.nn.Module) -> torch.nn.Module:
    """``model`` without torch's data-parallel wrappers around it (warned once)."""
    wrappers = (torch.nn.parallel.DistributedDataParallel, torch.nn.DataParallel)
    inner = model
    while isinstance(inner, wrappers):
        inner = inner.module
    if inner is not model:
        warnings.warn(
            f"ortrain: the model came inside {type(model).__name__}; ortrain trains its "
            f"module ({type(inner).__name__}) and reduces gradients over ranks itself "
            "(TrainerOptions.zero_stage), so the wrapper is not used",
            stacklevel=3,
        )
    return inner
