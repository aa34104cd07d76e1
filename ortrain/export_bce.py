"""``binary_cross_entropy`` kept as one aten op through the export, so that the index
check (``ortrain/index_check.py``) can range-check what it takes from the batch.

Eager refuses an input or a target outside ``[0, 1]`` ("all elements of target should be
between 0 and 1"). A decomposition (ortrain's had replaced torch's, whose gradient of its
clamped logs is NaN at a saturated sigmoid) spells the loss in element-wise ops that no
longer say which input was the target: a batch of soft labels above 1 trained on a loss
of another meaning. This translation writes the value as torch's kernel computes it
(each log clamped at -100) and the gradients of torch's own backward,
``(p - y) / max(p (1 - p), 1e-12)`` for the probabilities and ``-logit(p)`` (its logs
clamped) for the targets, read off terms that are exactly zero (``sg``: the export's
stop-gradient, ``ortrain/stop_gradient.py``), in ONNX ops the exporter tags with this
aten op:

    loss = sg(value) + (p - sg(p)) sg(dp) + (y - sg(y)) sg(dy)     [* weight]

so that the probabilities p and the target y each enter at input 0 of a node of this op
(``Log``, ``Sub``, ``Mul``) and the weight at input 1 of its ``Mul`` only.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

ATEN = "aten.binary_cross_entropy.default"


def _binary_cross_entropy(p: Any, y: Any, weight: Any = None, reduction: int = 1) -> Any:
    from onnxscript import opset18 as op

    from ortrain.export_precise import _const
    from ortrain.stop_gradient import _translate

    def sg(v: Any) -> Any:  # the export's stop-gradient; its type and shape are p's
        held = _translate(v)
        held.dtype, held.shape = p.dtype, p.shape
        return held

    one, floor = _const(op, p, 1.0), _const(op, p, -100.0)
    q = op.Sub(one, p)
    log_p = op.Max(op.Log(p), floor)
    log_q = op.Max(op.Log(q), floor)
    value = op.Neg(op.Add(op.Mul(y, log_p), op.Mul(op.Sub(one, y), log_q)))
    dp = op.Div(op.Sub(p, y), op.Max(op.Mul(p, q), _const(op, p, 1e-12)))
    dy = op.Sub(log_q, log_p)  # -logit(p), its logs clamped: finite where p saturates
    loss = op.Add(sg(value), op.Mul(op.Sub(p, sg(p)), sg(dp)))
    loss = op.Add(loss, op.Mul(op.Sub(y, sg(y)), sg(dy)))
    if weight is not None:
        loss = op.Mul(loss, weight)
    if reduction == 1:
        return op.ReduceMean(loss, keepdims=0)
    if reduction == 2:
        return op.ReduceSum(loss, keepdims=0)
    return loss


def bce_translations() -> dict[Callable, Callable]:
    return {torch.ops.aten.binary_cross_entropy.default: _binary_cross_entropy}
