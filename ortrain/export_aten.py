"""ONNX translations for aten ops the exporter has no function for.

1. ``aten::_cdist_forward`` (``torch.cdist``: prototype networks, metric learning,
   k-means-style layers): the p-norm of every pairwise difference, ``x1 [..., P, M]``
   against ``x2 [..., R, M]`` -> ``[..., P, R]``, spelled with the differences
   (``[..., P, R, M]``, as torch's own path for small sets and its backward): p = 2 and 1
   as ReduceL2 / ReduceL1 (whose gradient is 0 at a zero distance, as torch's), p = inf
   as the largest absolute difference, p = 0 as the count of differing coordinates, any
   other p as ``(sum |d|^p)^(1/p)`` with zeros kept out of the powers' gradients.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch


def _cdist(x1: Any, x2: Any, p: float = 2.0, compute_mode: Any = None) -> Any:
    from onnxscript import opset18 as op

    last = op.Constant(value_ints=[-1])
    diff = op.Sub(
        op.Unsqueeze(x1, op.Constant(value_ints=[-2])),
        op.Unsqueeze(x2, op.Constant(value_ints=[-3])),
    )
    if p == 2.0:
        return op.ReduceL2(diff, last, keepdims=0)
    if p == 1.0:
        return op.ReduceL1(diff, last, keepdims=0)
    if math.isinf(p):
        return op.ReduceMax(op.Abs(diff), last, keepdims=0)
    if p == 0.0:  # through Sign, whose gradient is zeros: torch's (not None) for x1 and x2
        return op.ReduceSum(op.Sign(op.Abs(diff)), last, keepdims=0)
    # |d|^p and the root kept off zero: their gradients there are 0 (torch's), not inf
    zero = op.CastLike(op.Constant(value_float=0.0), diff)
    one = op.CastLike(op.Constant(value_float=1.0), diff)
    same = op.Equal(diff, zero)
    powered = op.Pow(
        op.Where(same, one, op.Abs(diff)), op.CastLike(op.Constant(value_float=p), diff)
    )
    total = op.ReduceSum(op.Where(same, zero, powered), last, keepdims=0)
    at_zero = op.Equal(total, zero)
    root = op.Pow(
        op.Where(at_zero, one, total), op.CastLike(op.Constant(value_float=1.0 / p), diff)
    )
    return op.Where(at_zero, zero, root)


def aten_translations() -> dict[Callable, Callable]:
    return {torch.ops.aten._cdist_forward.default: _cdist}
