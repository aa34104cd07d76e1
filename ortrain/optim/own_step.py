"""Whether a torch optimizer runs a class's ``step()`` or one of its own."""

from __future__ import annotations

import inspect

import torch


def own_step(optimizer: torch.optim.Optimizer, base: type) -> str:
    """Where a subclass has its own ``step()`` (which a compiled update would never run):
    which class; "" where the update is ``base``'s."""
    for cls in type(optimizer).__mro__:
        if cls is base:
            return ""
        step = cls.__dict__.get("step")  # torch wraps step() in a profiling hook: unwrap
        if step is not None and inspect.unwrap(step) is not inspect.unwrap(base.step):
            return cls.__qualname__
    return ""
