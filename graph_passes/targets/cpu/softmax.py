"""Masked fp32 ``Softmax`` (with the mask's ``Add``) -> ``ortrain.cpu.Softmax``.

ONNX Runtime's CPU Softmax runs several times slower on rows that hold masked logits
(the ``finfo.min`` an attention mask adds: anything whose exp is below float32's normal
range). ``ortrain.cpu.Softmax(X, bias)`` (``ortrain/runtime/softmax.c``) runs masked rows
as fast as any, and takes the mask's ``Add`` in the same pass: ``Softmax(Add(scores,
mask))`` -> ``Softmax(scores, mask)``, one full-size temporary and one pass fewer. On
dense rows ONNX Runtime's own is faster (its exp is hand-written assembly), so a Softmax
moves where the graph shows it is masked or where the cost model says dense rows pay:

1. masked: its input can hold a logit below exp's range, as the graph states it: a
   constant of such values (a causal mask, a masked fill's ``finfo.min`` or ``-inf``, a
   ``(1 - mask) * -10000`` scale) reaches the input through ``Add`` / ``Sub`` / ``Min``,
   ``Where``, ``Mul`` by it, or shape and dtype ops (Expand, Reshape, Cast, ...).
2. a loss head's dense Softmax (the one ``lower_cross_entropy.py`` makes, tagged
   ``LOWERED_FROM``) whose rows are at least ``CpuCostModel.softmax_loss_min_row``:
   rows that long are memory-bound on both kernels, and ortrain's runs on the BLAS
   products' threads (``kernel_util.h``: for_blocks) where ONNX Runtime's would compete
   with them.

A kernel choice like ``scatter_rows.py``: made last (after autodiff, whose Softmax rule
reads the standard op), on CPU builds with ortrain's kernel library. Rewritten: float32
Softmax whose axis is the last one (any opset: for the last axis opset 11's flattening
changes nothing). The ``Add`` is taken in when the Softmax is its only reader and one
operand has the sum's (static) shape and the other broadcasts to it with the same last
dimension.
"""

from __future__ import annotations

import math

import numpy as np
import onnx_ir as ir

from ortrain.core.names import CPU_DOMAIN
from ortrain.graph_passes.fusions.lower_cross_entropy import LOWERED_FROM
from ortrain.graph_passes.infra.constant_value import constant_tensor
from ortrain.graph_passes.targets.cpu.cost_model import CpuCostModel, cost_or_default

_STD = ("", "ai.onnx")
_F32 = ir.DataType.FLOAT
# a logit below this has an exp under float32's normal range: the rows ONNX Runtime's
# Softmax is slow on (a fact of float32, not tuning)
BELOW_EXP = math.log(float(np.finfo(np.float32).tiny))
# ops whose output holds (some of) the values of the inputs listed, unchanged
_CARRY = {
    "Add": (0, 1), "Sub": (0,), "Min": None, "Where": (1, 2), "Expand": (0,),
    "Reshape": (0,), "Unsqueeze": (0,), "Squeeze": (0,), "Flatten": (0,), "Identity": (0,),
    "Transpose": (0,), "Cast": (0,), "Slice": (0,), "Tile": (0,), "Concat": None,
    "Gather": (0,), "GatherND": (0,), "GatherElements": (0,),
}  # fmt: skip
_FOLLOW = 12  # values followed back from a Softmax's input before giving up


def lower_softmax(model: ir.Model, cost: CpuCostModel | None = None) -> int:
    """Returns the number of Softmax nodes rewritten (``cost`` None: this machine's
    model)."""
    min_row = cost_or_default(cost).softmax_loss_min_row
    graph = model.graph
    opset = model.opset_imports.get("", 13)
    outputs = set(graph.outputs)
    count = 0
    for node in list(graph):
        if not _eligible(node, opset, min_row):
            continue
        x = node.inputs[0]
        assert x is not None
        add = _mask_add(x, outputs)
        node.op_type, node.domain, node.version = "Softmax", CPU_DOMAIN, None
        node.attributes.clear()
        if add is not None:
            scores, mask = add
            producer = x.producer()
            node.replace_input_with(0, scores)
            node.resize_inputs(2)
            node.replace_input_with(1, mask)
            if producer is not None and not x.uses():
                graph.remove(producer, safe=True)
        count += 1
    if count:
        model.opset_imports[CPU_DOMAIN] = 1
    return count


def _eligible(node: ir.Node, opset: int, min_row: int) -> bool:
    if node.op_type != "Softmax" or node.domain not in _STD or len(node.inputs) != 1:
        return False
    x, y = node.inputs[0], node.outputs[0]
    if x is None or x.dtype != _F32 or y.dtype != _F32 or x.shape is None:
        return False
    rank = len(x.shape)
    attr = node.attributes.get("axis")
    axis = attr.value if attr is not None else (-1 if opset >= 13 else 1)
    if rank < 1 or axis % rank != rank - 1:
        return False
    if can_hold_masked(x):
        return True
    width = x.shape[-1]
    loss_head = node.metadata_props.get(LOWERED_FROM) == "SoftmaxCrossEntropyLoss"
    return loss_head and isinstance(width, int) and width >= min_row


def can_hold_masked(v: ir.Value) -> bool:
    """Whether the graph shows ``v`` may hold a value below ``BELOW_EXP``: a constant
    holding one reaches it through ops that carry values (``_CARRY``) or a ``Mul`` by a
    constant of that magnitude (``(1 - mask) * -10000``)."""
    stack, seen = [v], set()
    while stack and len(seen) < _FOLLOW:
        value = stack.pop()
        if value in seen:
            continue
        seen.add(value)
        t = constant_tensor(value)
        if t is not None:
            if _constant_below(t, BELOW_EXP):
                return True
            continue
        node = value.producer()
        if node is None or node.domain not in _STD:
            continue
        if node.op_type == "Mul":
            if any(_constant_below(constant_tensor(i), -abs(BELOW_EXP), magnitude=True)
                   for i in node.inputs):  # fmt: skip
                return True
            continue
        if node.op_type not in _CARRY:
            continue
        carried = _CARRY[node.op_type]
        indices = range(len(node.inputs)) if carried is None else carried
        stack.extend(node.inputs[i] for i in indices if i < len(node.inputs) and node.inputs[i])
    return False


def _constant_below(t: ir.TensorProtocol | None, bound: float, magnitude: bool = False) -> bool:
    """A floating-point constant with a value below ``bound`` (``magnitude``: whose
    magnitude is above ``-bound``)."""
    if t is None or t.dtype is None or not t.dtype.is_floating_point():
        return False
    values = np.asarray(t.numpy(), dtype=np.float64)
    if magnitude:
        values = -np.abs(values)
    return bool(values.size) and bool((values < bound).any())


def _mask_add(x: ir.Value, outputs: set[ir.Value]) -> tuple[ir.Value, ir.Value] | None:
    """(scores, mask) of the Add that makes ``x``, when it can be taken in, else None."""
    add = x.producer()
    if add is None or add.op_type != "Add" or add.domain not in _STD or len(add.inputs) != 2:
        return None
    if len(x.uses()) != 1 or x in outputs:
        return None
    shape = _static(x)
    if shape is None or not shape:
        return None
    for scores, mask in (add.inputs, add.inputs[::-1]):
        if scores is None or mask is None or scores.dtype != _F32 or mask.dtype != _F32:
            continue
        s, m = _static(scores), _static(mask)
        if s != shape or m is None or not m or len(m) > len(shape) or m[-1] != shape[-1]:
            continue
        if all(b in (1, d) for b, d in zip(m[::-1], shape[::-1], strict=False)):
            return scores, mask
    return None


def _static(v: ir.Value) -> tuple[int, ...] | None:
    if v.shape is None or not v.shape.is_static():
        return None
    return tuple(int(d) for d in v.shape)
