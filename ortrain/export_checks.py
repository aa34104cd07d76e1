"""Value checks eager raises on, kept in the exported graph as a NaN loss.

``F.gaussian_nll_loss`` (``nn.GaussianNLLLoss``) raises ``ValueError`` where the variance
has a negative entry: a branch on the tensor's values, which stopped every export of a
model with that loss. While a model exports, the function here computes the same loss
(torch's order of operations: the variance clamped to ``eps`` without its gradient
seeing the clamp, ``full``'s constant, every reduction, a homoscedastic variance one axis
short) with the check kept as data: a negative entry becomes NaN, so the step's loss is
NaN and the finite-loss check (``TrainerOptions.check_finite``, on by default) refuses the
step before its update, where eager raises. Eager PyTorch is untouched.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator

import torch
import torch.nn.functional as F


def _gaussian_nll_loss(
    input: torch.Tensor,
    target: torch.Tensor,
    var: torch.Tensor | float,
    full: bool = False,
    eps: float = 1e-6,
    reduction: str = "mean",
) -> torch.Tensor:
    if isinstance(var, float):
        if var < 0:
            raise ValueError("var has negative entry/entries")
        var = var * torch.ones_like(input)
    if var.size() != input.size():
        if input.size()[:-1] == var.size():
            var = torch.unsqueeze(var, -1)
        elif not (
            input.ndim == var.ndim
            and sum(y for x, y in zip(input.size(), var.size(), strict=True) if x != y) == 1
        ):
            raise ValueError("var is of incorrect size")
    if reduction not in ("none", "mean", "sum"):
        raise ValueError(reduction + " is not valid")
    var = torch.where(var < 0, torch.full_like(var, math.nan), var)  # eager raises
    # torch clamps a clone in place under no_grad: the values clamped, the gradient not
    var = var + (var.clamp(min=eps) - var).detach()
    loss = 0.5 * (torch.log(var) + (input - target) ** 2 / var)
    if full:
        loss = loss + 0.5 * math.log(2 * math.pi)
    if reduction == "mean":
        return loss.mean()
    if reduction == "sum":
        return loss.sum()
    return loss


@contextlib.contextmanager
def value_checks_as_data() -> Iterator[None]:
    """The trace's view of the checks above (module docstring)."""
    original = F.gaussian_nll_loss
    F.gaussian_nll_loss = _gaussian_nll_loss
    try:
        yield
    finally:
        F.gaussian_nll_loss = original
