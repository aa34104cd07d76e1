"""``torch.nn.functional`` functions whose eager meaning a trace loses, swapped while a
model exports (``functional_for_export``; eager PyTorch is untouched):

1. ``F.gaussian_nll_loss`` (``nn.GaussianNLLLoss``) raises ``ValueError`` where the
   variance has a negative entry: a branch on the tensor's values, which stopped every
   export of a model with that loss. The version here computes the same loss (torch's
   order of operations: the variance clamped to ``eps`` without its gradient seeing the
   clamp, ``full``'s constant, every reduction, a homoscedastic variance one axis short)
   with the check kept as data: a negative entry becomes NaN, so the step's loss is NaN
   and the finite-loss check (``TrainerOptions.check_finite``, on by default) refuses the
   step before its update, where eager raises.
2. ``F.cosine_similarity`` (``nn.CosineSimilarity``) clamps each norm to ``eps`` under
   no_grad: the gradient flows as if unclamped. Traced, the clamp is an ordinary one,
   whose gradient is zero where it clamps (a model with a large ``eps`` trained another
   gradient; the first-step check sent it to eager). The version here clamps the value
   and passes the gradient straight through, as eager does.
3. ``F.embedding`` with ``scale_grad_by_freq=True`` divides each occurrence's gradient
   by how often its index occurs in the batch, a backward-only option the exporter
   drops (the rows' gradient came out unscaled). The version here reads the rows as
   without it and scales the path the gradient takes by 1 / count, the value unchanged.
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
    var = _clamped_value_only(var, eps)
    loss = 0.5 * (torch.log(var) + (input - target) ** 2 / var)
    if full:
        loss = loss + 0.5 * math.log(2 * math.pi)
    if reduction == "mean":
        return loss.mean()
    if reduction == "sum":
        return loss.sum()
    return loss


def _clamped_value_only(t: torch.Tensor, low: float) -> torch.Tensor:
    """``t`` clamped below at ``low``, its gradient that of ``t`` (torch clamps a clone in
    place under no_grad)."""
    return t + (t.clamp(min=low) - t).detach()


def _cosine_similarity(
    x1: torch.Tensor, x2: torch.Tensor, dim: int = 1, eps: float = 1e-8
) -> torch.Tensor:
    x1, x2 = torch.broadcast_tensors(x1, x2)
    n1 = torch.linalg.vector_norm(x1, 2, dim=dim, keepdim=True)
    n2 = torch.linalg.vector_norm(x2, 2, dim=dim, keepdim=True)
    return ((x1 / _clamped_value_only(n1, eps)) * (x2 / _clamped_value_only(n2, eps))).sum(dim)


_EMBEDDING = F.embedding


def _embedding(
    input: torch.Tensor,
    weight: torch.Tensor,
    padding_idx: int | None = None,
    max_norm: float | None = None,
    norm_type: float = 2.0,
    scale_grad_by_freq: bool = False,
    sparse: bool = False,
) -> torch.Tensor:
    rows = _EMBEDDING(input, weight, padding_idx, max_norm, norm_type, False, sparse)
    if not scale_grad_by_freq:
        return rows
    flat = input.reshape(-1)
    counts = torch.zeros(weight.shape[0], dtype=weight.dtype, device=weight.device)
    counts = counts.scatter_add(0, flat, torch.ones_like(flat, dtype=weight.dtype))
    scale = (1.0 / counts[input]).unsqueeze(-1)
    return rows.detach() + (rows - rows.detach()) * scale


SWAPS = {
    "gaussian_nll_loss": _gaussian_nll_loss,
    "cosine_similarity": _cosine_similarity,
    "embedding": _embedding,
}


@contextlib.contextmanager
def functional_for_export() -> Iterator[None]:
    """``SWAPS`` in ``torch.nn.functional`` for the duration (module docstring)."""
    originals = {name: getattr(F, name) for name in SWAPS}
    for name, fn in SWAPS.items():
        setattr(F, name, fn)
    try:
        yield
    finally:
        for name, fn in originals.items():
            setattr(F, name, fn)
