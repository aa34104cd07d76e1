"""Causal attention's products over their triangles: ``triA`` on ``ortrain.blas.BatchMatMul``.

Under a causal mask (key j > query i masked) the attention probabilities ``P`` are
exactly 0 above the diagonal: each row attends to its own position, so the row's
maximum is a real score and ``exp(score + finfo.min - max)`` underflows to 0. So is the
Softmax gradient ``dS = P * (dP - sum(dP * P))``. Of attention's six [S, S] products,
``P @ V`` and ``dS @ K`` read a lower-triangular left operand (``triA = 1``), ``P^T @
dO`` and ``dS^T @ Q`` an upper one (``triA = 2``); ``ortrain/runtime/blas_batch.c``
skips the blocks of zeros, 3/8 of the work at S = 256 (64-row blocks). The other two,
the scores ``Q @ K^T`` and ``dP = dO @ V^T``, are read only on and below the diagonal,
but computing that part alone measured no faster (their K is the head size, 64).

Proved from the graph, not assumed: the Softmax's mask must be a constant causal one
(``Where(C, 0, finfo.min)`` with ``C`` a constant boolean, possibly Expanded, True on
and below the diagonal and False above it, or an additive constant with ``finfo.min``
or ``-inf`` above the diagonal and values under half its magnitude on and below it).
A padding mask And-ed into it is not followed (a fully masked row is uniform, not triangular): such
graphs keep dense products. The values followed from ``P``: ``Dropout`` (output 0) and
``Mul`` of the same shape keep zeros, and so does the masked-rows guard
``Where(c, 0, P)``.

A kernel choice made after ``cpu_softmax`` (it reads ortrain's Softmax / SoftmaxGrad),
on CPU builds with both ortrain's kernels and the batched BLAS op.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import onnx_ir as ir

from ortrain.core.names import BLAS_DOMAIN, CPU_DOMAIN
from ortrain.graph_passes.infra.constant_value import constant_tensor
from ortrain.graph_passes.prepare.masked_attention_rows import bool_mask, is_zero

_STD = ("", "ai.onnx")


def mark_causal_products(model: ir.Model) -> int:
    """Returns the number of ``ortrain.blas.BatchMatMul`` nodes given ``triA``."""
    marked: set[ir.Node] = set()
    for node in list(model.graph):
        if _causal_softmax(node):
            _follow_lower(node.outputs[0], marked, set())
    return len(marked)


def _causal_softmax(node: ir.Node) -> bool:
    """A last-axis Softmax of scores plus a constant causal mask."""
    if node.op_type != "Softmax" or node.inputs[0] is None:
        return False
    if node.domain == CPU_DOMAIN:  # ortrain.cpu.Softmax(scores, mask)
        if len(node.inputs) != 2 or node.inputs[1] is None:
            return False
        scores, mask = node.inputs
        return _causal_mask(mask, scores)
    if node.domain not in _STD or node.attributes.get_int("axis", -1) not in (-1, _rank(node) - 1):
        return False
    add = node.inputs[0].producer()
    if add is None or add.op_type != "Add" or add.domain not in _STD:
        return False
    return any(
        s is not None and m is not None and _causal_mask(m, s)
        for s, m in (add.inputs, add.inputs[::-1])
    )


def _causal_mask(mask: ir.Value, scores: ir.Value) -> bool:
    """``mask`` adds finfo.min (or -inf) above the diagonal of ``scores``' last two axes
    and a finite value on and below it, whatever the other axes."""
    if not _square_tail(scores) or mask.shape is None or len(mask.shape) < 2:
        return False
    if tuple(mask.shape[-2:]) != tuple(scores.shape[-2:]):  # type: ignore[index]
        return False
    cond = bool_mask(mask)
    if cond is not None:
        return _causal_condition(cond)
    t = constant_tensor(mask)
    if t is None or t.dtype is None or not t.dtype.is_floating_point():
        return False
    values = np.asarray(t.numpy(), dtype=np.float64)
    if values.ndim < 2 or values.shape[-1] != values.shape[-2]:
        return False
    lowest = float(ml_dtypes.finfo(t.dtype.numpy()).min)
    upper = np.triu(np.ones(values.shape[-2:], dtype=bool), 1)
    kept = values[..., ~upper]  # finite and far above the masked value: each row's max
    return bool((values[..., upper] <= lowest).all() and (np.abs(kept) < -lowest / 2).all())


def _causal_condition(cond: ir.Value) -> bool:
    """``cond`` (True = attend) is a constant, possibly Expanded, True exactly on and below
    the diagonal of its last two axes."""
    node = cond.producer()
    while node is not None and node.op_type == "Expand" and node.domain in _STD:
        if node.inputs[0] is None or not _square_tail(node.inputs[0]):
            return False
        cond = node.inputs[0]
        node = cond.producer()
    t = constant_tensor(cond)
    if t is None or t.dtype != ir.DataType.BOOL:
        return False
    values = np.asarray(t.numpy())
    if values.ndim < 2 or values.shape[-1] != values.shape[-2]:
        return False
    lower = np.tril(np.ones(values.shape[-2:], dtype=bool))
    return bool((values == lower).all())


def _follow_lower(v: ir.Value, marked: set[ir.Node], seen: set[ir.Value]) -> None:
    """``v`` is lower triangular (zero above the diagonal): mark the products reading it as
    their left operand, and follow it through ops that keep the zeros."""
    if v in seen:
        return
    seen.add(v)
    for use in v.uses():
        node, index = use.node, use.idx
        if node.op_type == "BatchMatMul" and node.domain == BLAS_DOMAIN:
            if index == 0 and _plain_product(node, marked):
                tri = 2 if node.attributes.get_int("transA", 0) else 1
                node.attributes["triA"] = ir.AttrInt64("triA", tri)
                marked.add(node)
        elif node.op_type == "SoftmaxGrad" and node.domain == CPU_DOMAIN and index == 1:
            _follow_lower(node.outputs[0], marked, seen)  # dX = Y (dY - sum(dY Y))
        elif node.domain in _STD and _keeps_zeros(node, index):
            _follow_lower(node.outputs[0], marked, seen)


def _keeps_zeros(node: ir.Node, index: int) -> bool:
    """A zero at this input makes a zero at the same place of the output."""
    out = node.outputs[0]
    if node.op_type == "Dropout":
        return index == 0
    if node.op_type == "Mul":  # 0 * finite; the other operand only broadcasts
        return index in (0, 1) and _same_shape(node.inputs[index], out)
    if node.op_type == "Where":  # the masked-rows guard Where(c, 0, P)
        return index == 2 and is_zero(node.inputs[1]) and _same_shape(node.inputs[2], out)
    return False


def _plain_product(node: ir.Node, marked: set[ir.Node]) -> bool:
    return (
        node.op_type == "BatchMatMul"
        and node.domain == BLAS_DOMAIN
        and node not in marked
        and not node.attributes.get_int("triA", 0)
    )


def _square_tail(v: ir.Value) -> bool:
    shape = v.shape
    if shape is None or len(shape) < 2 or not shape.is_static():
        return False
    return int(shape[-1]) == int(shape[-2]) and int(shape[-1]) > 1


def _same_shape(a: ir.Value | None, b: ir.Value) -> bool:
    return (
        a is not None
        and a.shape is not None
        and b.shape is not None
        and a.shape.is_static()
        and tuple(a.shape) == tuple(b.shape)
    )


def _rank(node: ir.Node) -> int:
    shape = node.inputs[0].shape if node.inputs[0] is not None else None
    return len(shape) if shape is not None else 0
