"""fp32 ``Split`` / ``Concat`` along the last axis -> ``ortrain.cpu.SplitLast`` / ``ConcatLast``.

A fused QKV projection's output is split into Q, K and V, and their gradients are
concatenated back for the projection's backward. ONNX Runtime copies both on one
thread; ortrain's kernels
(``ortrain/runtime/layout_kernels.c``) copy rows in blocks on the kernels' threads.

A kernel choice like ``softmax.py``: made last, on CPU builds with ortrain's kernel
library. Rewritten: float32 ``Split`` into 1 to ``MAX_PARTS`` equal parts
(``num_outputs``, or a ``split`` input / attribute of equal constant sizes) and ``Concat``
of 2 to ``MAX_PARTS`` inputs, along the last axis of a tensor of known rank.
"""

from __future__ import annotations

import onnx_ir as ir

from ortrain.core.names import CPU_DOMAIN

_STD = ("", "ai.onnx")
_F32 = ir.DataType.FLOAT
MAX_PARTS = 8  # kernel ABI, not tuning: the parts the kernels take (layout_kernels.c)


def lower_split_concat(model: ir.Model) -> int:
    """Returns the number of Split and Concat nodes rewritten."""
    count = 0
    for node in model.graph:
        if node.domain not in _STD:
            continue
        if node.op_type == "Split" and _split_ok(node):
            node.op_type = "SplitLast"
            node.resize_inputs(1)
        elif node.op_type == "Concat" and _concat_ok(node):
            node.op_type = "ConcatLast"
        else:
            continue
        node.domain, node.version = CPU_DOMAIN, None
        node.attributes.clear()
        count += 1
    if count:
        model.opset_imports[CPU_DOMAIN] = 1
    return count


def _last_axis(node: ir.Node, value: ir.Value | None) -> bool:
    if value is None or value.dtype != _F32 or value.shape is None or len(value.shape) < 1:
        return False
    axis = node.attributes.get("axis")
    rank = len(value.shape)
    return (axis.value if axis is not None else 0) % rank == rank - 1


def _split_ok(node: ir.Node) -> bool:
    x = node.inputs[0] if node.inputs else None
    n = len(node.outputs)
    if not _last_axis(node, x) or not 1 <= n <= MAX_PARTS:
        return False
    if any(y.dtype != _F32 for y in node.outputs):
        return False
    sizes = None
    if len(node.inputs) > 1 and node.inputs[1] is not None:
        const = node.inputs[1].const_value
        if const is None:
            return False
        sizes = [int(s) for s in const.numpy().reshape(-1)]
    elif (attr := node.attributes.get("split")) is not None:
        sizes = [int(s) for s in attr.value]
    assert x is not None and x.shape is not None
    width = x.shape[-1]
    if sizes is not None:
        return len(sizes) == n and len(set(sizes)) == 1
    # no sizes: equal parts by the op's definition (opset 18: the last may be smaller)
    return isinstance(width, int) and width % n == 0


def _concat_ok(node: ir.Node) -> bool:
    inputs = node.inputs
    if not 2 <= len(inputs) <= MAX_PARTS or node.outputs[0].dtype != _F32:
        return False
    if not all(_last_axis(node, v) for v in inputs):
        return False
    ranks = {len(v.shape) for v in inputs if v is not None and v.shape is not None}
    return len(ranks) == 1
