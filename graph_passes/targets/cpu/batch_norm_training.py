"""A BatchNorm fed its batch statistics -> its backward one BatchNormGrad.

The exporter spells a training BatchNorm as an inference-mode ``BatchNormalization``
fed the batch's statistics, computed beside it:

    mean = ReduceMean(x, axes)                    [C]
    var  = ReduceMean(d * d, axes), d = x - ReduceMean(x, axes, keepdims=1)
    y    = BatchNormalization(x, scale, bias, mean, var)

so the backward differentiates the normalization and, through mean and var, the
statistics' own ops: about twenty full-size element-wise ops and reductions per
BatchNorm. Here the statistics reach the node through ``StopGradient`` and the node is
marked (``BATCH_STATISTICS``): its gradient is one ``ortrain.cpu.BatchNormGrad``
(``autodiff/rules/batch_norm.py``), which recomputes them per channel in cache, two-pass
in double. The forward stays the exporter's: its two-pass statistics are torch's to float
rounding, where ONNX Runtime's training-mode kernel (used here before) loses digits to
cancellation in a channel whose mean is large against its spread (MobileNet's late
depthwise layers: gradients 4% off).

On CPU builds with ortrain's kernel library, before autodiff; rewritten: float32
BatchNorms of rank >= 2 with static shapes whose mean and variance are exactly the
pattern above over every axis but the channel's (axis 1), biased.
"""

from __future__ import annotations

import onnx_ir as ir

from ortrain.core.names import BATCH_STATISTICS, GRAD_DOMAIN, STOP_GRADIENT

_STD = ("", "ai.onnx")
_F32 = ir.DataType.FLOAT


def train_batch_norms(model: ir.Model) -> int:
    """Returns the number of BatchNormalization nodes marked."""
    graph = model.graph
    count = 0
    for node in list(graph):
        if node.op_type != "BatchNormalization" or node.domain not in _STD:
            continue
        if _attr(node, "training_mode", 0) or len(node.inputs) != 5:
            continue
        if node.metadata_props.get(BATCH_STATISTICS):
            continue
        x = node.inputs[0]
        shape = _shape(x)
        if shape is None or len(shape) < 2 or x.dtype != _F32:
            continue
        axes = [0, *range(2, len(shape))]
        if not (_is_mean(node.inputs[3], x, axes, keep=False) and _is_variance(node, x, axes)):
            continue
        for k in (3, 4):
            stat = node.inputs[k]
            stop = ir.Node(GRAD_DOMAIN, STOP_GRADIENT, [stat], name=f"{stat.name}_stop_gradient")
            stop.outputs[0].name = f"{stat.name}_stopped"
            stop.outputs[0].dtype, stop.outputs[0].shape = stat.dtype, stat.shape
            graph.insert_before(node, stop)
            node.replace_input_with(k, stop.outputs[0])
        node.metadata_props[BATCH_STATISTICS] = "1"
        count += 1
    return count


def _attr(node: ir.Node, name: str, default: float | int) -> float | int:
    a = node.attributes.get(name)
    return default if a is None else a.value


def _shape(v: ir.Value) -> list[int] | None:
    if v.shape is None or not all(isinstance(d, int) for d in v.shape):
        return None
    return list(v.shape)


def _axes(node: ir.Node) -> list[int] | None:
    """A ReduceMean's axes (attribute before opset 18, input after), or None."""
    if len(node.inputs) > 1 and node.inputs[1] is not None:
        const = node.inputs[1].const_value
        return None if const is None else [int(a) for a in const.numpy().reshape(-1)]
    a = node.attributes.get("axes")
    return None if a is None else [int(v) for v in a.value]


def _is_mean(v: ir.Value | None, x: ir.Value, axes: list[int], *, keep: bool) -> bool:
    """``v`` = ReduceMean(x, axes) with keepdims ``keep``."""
    node = None if v is None else v.producer()
    if node is None or node.op_type != "ReduceMean" or node.domain not in _STD:
        return False
    got = _axes(node)
    rank = len(_shape(x) or [])
    if node.inputs[0] is not x or got is None or sorted(a % rank for a in got) != axes:
        return False
    return bool(_attr(node, "keepdims", 1)) == keep


def _is_variance(bn: ir.Node, x: ir.Value, axes: list[int]) -> bool:
    """BatchNorm ``bn``'s variance input = ReduceMean(d * d, axes), d = x - mean(x)."""
    var = bn.inputs[4]
    node = None if var is None else var.producer()
    if node is None or node.op_type != "ReduceMean" or node.domain not in _STD:
        return False
    got = _axes(node)
    if got is None or sorted(a % len(_shape(x) or [1]) for a in got) != axes:
        return False
    if _attr(node, "keepdims", 1):
        return False
    square = node.inputs[0].producer() if node.inputs[0] is not None else None
    if square is None or square.op_type != "Mul" or square.inputs[0] is not square.inputs[1]:
        return False
    diff = square.inputs[0].producer() if square.inputs[0] is not None else None
    if diff is None or diff.op_type != "Sub" or diff.inputs[0] is not x:
        return False
    return _is_mean(diff.inputs[1], x, axes, keep=True)
