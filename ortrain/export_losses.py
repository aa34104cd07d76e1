"""Loss translations for the ONNX exporter that keep every option's meaning.

The exporter's own translation of ``aten::cross_entropy_loss`` is one
``SoftmaxCrossEntropyLoss`` and drops ``label_smoothing`` (ONNX's op has no such
attribute): a model with ``CrossEntropyLoss(label_smoothing=...)`` would train another
loss. Here ``cross_entropy_loss`` keeps the single op where smoothing is 0 (what the
passes and the gradient rule know), and adds torch's smoothing term where it is not,
read from the op's second output (the log-probabilities, differentiated by the same
rule):

    loss = (1 - e) * nll + e / C * smooth,   smooth_i = -sum_c w_c * logp_ic

with ignored targets out of both and torch's reductions ("mean" divides the smoothing
sum by the targets' summed weights, or their count without weights). Targets that are
class probabilities (floating) are smoothed as torch does, ``t * (1 - e) + e / C``, and
the loss is ``-sum_c w_c t_ic logp_ic`` ("mean": over the positions, not the weights).
An input without a batch axis (``[C]``, a scalar target) is given one.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

_REDUCTIONS = {0: "none", 1: "mean", 2: "sum"}


def _cross_entropy_loss(
    self: Any,
    target: Any,
    weight: Any = None,
    reduction: int = 1,
    ignore_index: int = -100,
    label_smoothing: float = 0.0,
) -> Any:
    import onnx_ir as ir
    from onnxscript import opset18 as op

    floats = (ir.DataType.FLOAT, ir.DataType.FLOAT16, ir.DataType.BFLOAT16, ir.DataType.DOUBLE)
    soft = target.dtype in floats  # class probabilities, not indices
    rank = len(self.shape)
    unbatched = rank == 1
    if unbatched:
        self = op.Unsqueeze(self, op.Constant(value_ints=[0]))
        target = op.Unsqueeze(target, op.Constant(value_ints=[0]))
        rank = 2
    mode = _REDUCTIONS[reduction]
    if soft:
        result = _soft_targets(op, self, target, weight, rank, mode, label_smoothing)
    else:
        nll, logp = op.SoftmaxCrossEntropyLoss(
            self, target, weight, reduction=mode, ignore_index=ignore_index
        )
        result = nll
        if label_smoothing > 0.0:
            smooth = _smoothing(op, self, target, weight, rank, logp, mode, ignore_index)
            one = op.CastLike(op.Constant(value_float=1.0 - label_smoothing), nll)
            eps = op.CastLike(op.Constant(value_float=label_smoothing), nll)
            result = op.Add(op.Mul(one, nll), op.Div(op.Mul(eps, smooth), _classes(op, self)))
    if unbatched and mode == "none":
        result = op.Squeeze(result, op.Constant(value_ints=[0]))
    return result


def _classes(op: Any, scores: Any) -> Any:
    """C, the class axis' size, as a scalar of the scores' type."""
    c = op.Gather(op.Shape(scores), op.Constant(value_int=1), axis=0)
    return op.CastLike(c, scores)


def _class_weights(op: Any, weight: Any, rank: int) -> Any:
    """``weight`` [C] shaped to broadcast over the class axis of scores [N, C, d...]."""
    return op.Reshape(weight, op.Constant(value_ints=[1, -1] + [1] * (rank - 2)))


def _smoothing(
    op: Any,
    scores: Any,
    target: Any,
    weight: Any,
    rank: int,
    logp: Any,
    mode: str,
    ignore_index: int,
) -> Any:
    """The smoothing term of class-index targets, reduced as ``mode``."""
    weighted = logp if weight is None else op.Mul(logp, _class_weights(op, weight, rank))
    per = op.Neg(op.ReduceSum(weighted, op.Constant(value_ints=[1]), keepdims=0))  # [N, d...]
    valid = op.Not(op.Equal(target, op.CastLike(op.Constant(value_int=ignore_index), target)))
    zero = op.CastLike(op.Constant(value_float=0.0), per)
    per = op.Where(valid, per, zero)
    if mode == "none":
        return per
    total = op.ReduceSum(per, keepdims=0)
    if mode == "sum":
        return total
    if weight is None:
        count = op.ReduceSum(op.CastLike(valid, per), keepdims=0)
    else:
        safe = op.Where(valid, target, op.CastLike(op.Constant(value_int=0), target))
        count = op.ReduceSum(op.Where(valid, op.Gather(weight, safe, axis=0), zero), keepdims=0)
    return op.Div(total, count)


def _soft_targets(
    op: Any, scores: Any, target: Any, weight: Any, rank: int, mode: str, label_smoothing: float
) -> Any:
    """Cross entropy against class probabilities."""
    logp = op.LogSoftmax(scores, axis=1)
    if label_smoothing > 0.0:
        keep = op.CastLike(op.Constant(value_float=1.0 - label_smoothing), target)
        eps = op.CastLike(op.Constant(value_float=label_smoothing), target)
        target = op.Add(op.Mul(target, keep), op.Div(eps, _classes(op, scores)))
    prod = op.Mul(logp, target)
    if weight is not None:
        prod = op.Mul(prod, _class_weights(op, weight, rank))
    per = op.Neg(op.ReduceSum(prod, op.Constant(value_ints=[1]), keepdims=0))  # [N, d...]
    if mode == "none":
        return per
    total = op.ReduceSum(per, keepdims=0)
    if mode == "sum":
        return total
    return op.Div(total, op.CastLike(op.Size(per), per))


def loss_translations() -> dict[Callable, Callable]:
    return {torch.ops.aten.cross_entropy_loss.default: _cross_entropy_loss}
