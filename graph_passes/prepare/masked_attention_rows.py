"""Attention rows whose keys are all masked give 0, as in torch's SDPA.

``torch.nn.functional.scaled_dot_product_attention`` with a boolean mask returns zeros
for a query row whose keys are all masked (HF's left-padded causal LMs with the default
``attn_implementation="sdpa"``: every pad position). torch.onnx exports the mask as
``Where(mask, 0, finfo.min)`` added to the scores, then ``Softmax`` and a guard
``Where(IsNaN(p), 0, p)``. The guard was meant for ``-inf``; with the finite minimum a
fully masked row is uniform, not NaN, so the exported graph attends to every key there
and the model's outputs (and loss, through the shifted labels) differ from torch's.

The guard is rewritten to test the mask itself: ``Where(row_masked, 0, p)`` with
``row_masked = ReduceMax(Cast(mask, float), last axis) < 0.5``. ``p`` stays finite, so
the gradient through the Where is exact (0 in masked rows, as torch's). A correctness
fix of the export, so it runs in every build, not only with the optimization passes;
``ortrain optimize`` leaves it out (it must keep the input model's outputs).
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import onnx_ir as ir

from ortrain.graph_passes.infra.constant_value import constant_tensor
from ortrain.graph_passes.infra.emitter import Emitter

_STD = ("", "ai.onnx")


def fix_masked_attention_rows(model: ir.Model) -> int:
    """Returns the number of guards rewritten."""
    count = 0
    for node in list(model.graph):
        if _is(node, "Where") and _rewrite(model.graph, node):
            count += 1
    return count


def _rewrite(graph: ir.Graph, guard: ir.Node) -> bool:
    if len(guard.inputs) != 3:
        return False
    cond, zero, probs = guard.inputs
    isnan = cond.producer() if cond is not None else None
    if not _is(isnan, "IsNaN") or isnan.inputs[0] is not probs or not is_zero(zero):
        return False
    softmax = probs.producer() if probs is not None else None
    axis = softmax.attributes.get_int("axis", -1) if softmax is not None else None
    if not _is(softmax, "Softmax") or axis not in (-1, _last(probs)):
        return False
    add = softmax.inputs[0].producer()
    if not _is(add, "Add"):
        return False
    mask = next((m for m in (bool_mask(v) for v in add.inputs) if m is not None), None)
    if mask is None:
        return False
    e = Emitter(graph, guard.name or "masked_rows")
    kept = e.op("ReduceMax", e.op("Cast", mask, to=ir.DataType.FLOAT), e.ints([-1]), keepdims=1)
    row_masked = e.op("Less", kept, e.const(0.5, ir.DataType.FLOAT))
    e.flush_before(guard)
    guard.replace_input_with(0, row_masked)
    if not isnan.outputs[0].uses():
        graph.remove(isnan, safe=True)
    return True


def bool_mask(additive: ir.Value | None) -> ir.Value | None:
    """``mask`` when ``additive = Where(mask, 0, lowest)`` (boolean mask, True = attend)."""
    node = additive.producer() if additive is not None else None
    if not _is(node, "Where") or len(node.inputs) != 3:
        return None
    mask, keep, drop = node.inputs
    if mask is None or mask.dtype != ir.DataType.BOOL or not is_zero(keep):
        return None
    t = constant_tensor(drop)
    if t is None or t.dtype is None or not t.dtype.is_floating_point():
        return None
    values = np.asarray(t.numpy(), dtype=np.float64).reshape(-1)
    lowest = float(ml_dtypes.finfo(t.dtype.numpy()).min)
    if values.size != 1 or not values[0] <= lowest:
        return None
    return mask


def _is(node: ir.Node | None, op_type: str) -> bool:
    return node is not None and node.op_type == op_type and node.domain in _STD


def is_zero(v: ir.Value | None) -> bool:
    t = constant_tensor(v)
    return t is not None and t.size == 1 and float(t.numpy().reshape(-1)[0]) == 0.0


def _last(v: ir.Value) -> int | None:
    return len(v.shape) - 1 if v.shape is not None else None
