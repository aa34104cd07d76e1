"""``F.linear_cross_entropy`` with ``options`` (its chunked path) for the export.

With ``options`` torch computes the loss through two custom ops,
``torch_nn::_linear_cross_entropy_batch_chunked`` (mean and sum: the loss and the three
gradients, all computed in its forward) and ``..._no_reduction`` (one loss per row),
which the exporter has no function for: a model calling it ran that module in eager.
Each is decomposed here into what torch documents it equals,
``cross_entropy(linear(input, linear_weight, linear_bias), target, ...)``, and autodiff
takes the gradient of that. The scalar op's gradient outputs are returned as the empty
shapes its fake gives for gradients not asked for: nothing in a graph reads them (the
functional returns the loss alone), and the export asks for none (its parameters are
traced detached).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F


def _loss(
    input: torch.Tensor,
    linear_weight: torch.Tensor,
    target: torch.Tensor,
    linear_bias: torch.Tensor | None,
    weight: torch.Tensor | None,
    reduction: str,
    ignore_index: int,
    label_smoothing: float,
) -> torch.Tensor:
    logits = F.linear(input, linear_weight, linear_bias)
    return F.cross_entropy(
        logits,
        target,
        weight=weight,
        ignore_index=ignore_index,
        reduction=reduction,
        label_smoothing=label_smoothing,
    )


def _reduced(
    input: torch.Tensor,
    linear_weight: torch.Tensor,
    target: torch.Tensor,
    linear_bias: torch.Tensor | None,
    weight: torch.Tensor | None,
    reduction: str,
    ignore_index: int,
    label_smoothing: float,
    *_: Any,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    loss = _loss(
        input, linear_weight, target, linear_bias, weight, reduction, ignore_index,
        label_smoothing,
    )  # fmt: skip
    empty = input.new_zeros((0, 0))
    return loss, empty, empty, input.new_zeros((0,))


def _unreduced(
    input: torch.Tensor,
    linear_weight: torch.Tensor,
    target: torch.Tensor,
    linear_bias: torch.Tensor | None,
    weight: torch.Tensor | None,
    ignore_index: int,
    *_: Any,
) -> torch.Tensor:
    return _loss(input, linear_weight, target, linear_bias, weight, "none", ignore_index, 0.0)


def linear_ce_decompositions() -> dict[Any, Callable]:
    """The two chunked ops, where this torch has them (torch >= 2.13)."""
    try:  # registers them (F.linear_cross_entropy imports it on its first chunked call)
        import torch.nn.modules.linear_cross_entropy
    except ImportError:
        return {}
    ops = torch.ops.torch_nn
    table: dict[Any, Callable] = {}
    for name, fn in (
        ("_linear_cross_entropy_batch_chunked", _reduced),
        ("_linear_cross_entropy_batch_chunked_no_reduction", _unreduced),
    ):
        try:
            table[getattr(ops, name).default] = fn
        except (AttributeError, RuntimeError):
            continue  # not registered: this torch has no chunked path
    return table
