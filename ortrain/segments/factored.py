"""A segment's backward graph whose weight gradients are left as their product's factors.

A weight read as ``x @ W.T`` (a Linear layer, an LM head) gets the gradient
``dW = dY^T @ x``: ``[M, N]`` made from ``T`` rows of ``dY [T, M]`` and ``x [T, N]``.
Where few tokens meet a large weight (an LM head's table: ``M`` the vocabulary), the
factors are far smaller than the product. ``factored_variant`` outputs them instead of
the gradient (roles FACTOR_LEFT and FACTOR_RIGHT); under ZeRO-2/3 the reducer gathers
every rank's factors and multiplies out only the rows of its own shard
(``distributed/sharded_grads.py``), so the whole gradient is never made on any rank.

Rewritten: a parameter's gradient output made by a product of a transposed 2-D left
operand and a 2-D right one, and read by nothing else: ``Gemm`` (ONNX or
``ortrain.blas``) with ``transA=1``, ``transB=0``, ``alpha=1`` and no ``C``;
``FusedMatMul`` with the same; ``MatMul(Transpose(a, perm=[1, 0]), b)``.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping

import onnx_ir as ir
import onnx_ir.passes.common

from ortrain.core.names import BLAS_DOMAIN

LEFT_PREFIX = "left:"
RIGHT_PREFIX = "right:"
_STD = ("", "ai.onnx")
_MS = "com.microsoft"


def factored_variant(
    model: ir.Model, grad_outputs: Mapping[str, str], params: Collection[str]
) -> tuple[ir.Model, dict[str, tuple[str, str]]] | None:
    """(a copy of ``model`` whose gradients of ``params`` that are such products are output
    as their two factors, {parameter: (left output, right output)}, the gradient being
    ``left^T @ right``); None where none of them is."""
    if not _sites(model.graph, grad_outputs, params):
        return None
    variant = ir.serde.deserialize_model(ir.serde.serialize_model(model))
    graph = variant.graph
    made: dict[str, tuple[str, str]] = {}
    for param, (out, left, right) in _sites(graph, grad_outputs, params).items():
        names = []
        for prefix, value in ((LEFT_PREFIX, left), (RIGHT_PREFIX, right)):
            # an Identity: the factor may be a graph input or another output already
            made_value = ir.Value(name=prefix + param, shape=value.shape, type=value.type)
            copy = ir.Node("", "Identity", [value], outputs=[made_value], name=prefix + param)
            graph.append(copy)
            graph.outputs.append(made_value)
            names.append(prefix + param)
        graph.outputs.remove(out)
        made[param] = (names[0], names[1])
    onnx_ir.passes.common.RemoveUnusedNodesPass()(variant)
    return variant, made


def _sites(
    graph: ir.Graph, grad_outputs: Mapping[str, str], params: Collection[str]
) -> dict[str, tuple[ir.Value, ir.Value, ir.Value]]:
    """parameter -> (its gradient output, left factor, right factor)."""
    outputs = {v.name: v for v in graph.outputs}
    found = {}
    for param in params:
        out = outputs.get(grad_outputs.get(param, ""))
        if out is None or out.uses() or list(graph.outputs).count(out) != 1:
            continue
        factors = _factors(out)
        if factors is not None:
            found[param] = (out, *factors)
    return found


def _factors(out: ir.Value) -> tuple[ir.Value, ir.Value] | None:
    """(a, b) where ``out`` is ``a^T @ b`` of two 2-D operands, else None."""
    node = out.producer()
    if node is None:
        return None
    attrs = node.attributes
    if node.op_type == "Gemm" and node.domain in (*_STD, BLAS_DOMAIN):
        if len(node.inputs) > 2 and node.inputs[2] is not None:
            return None
        if attrs.get_int("transA", 0) != 1 or attrs.get_int("transB", 0) != 0:
            return None
        if attrs.get_float("alpha", 1.0) != 1.0:
            return None
        a, b = node.inputs[0], node.inputs[1]
    elif node.op_type == "FusedMatMul" and node.domain == _MS:
        if attrs.get_int("transA", 0) != 1 or attrs.get_int("transB", 0) != 0:
            return None
        if attrs.get_int("transBatchA", 0) or attrs.get_int("transBatchB", 0):
            return None
        if attrs.get_float("alpha", 1.0) != 1.0:
            return None
        a, b = node.inputs[0], node.inputs[1]
    elif node.op_type == "MatMul" and node.domain in _STD:
        transpose = node.inputs[0].producer() if node.inputs[0] is not None else None
        if transpose is None or transpose.op_type != "Transpose" or transpose.domain not in _STD:
            return None
        perm = transpose.attributes.get_ints("perm", None)
        if perm is not None and list(perm) != [1, 0]:
            return None
        a, b = transpose.inputs[0], node.inputs[1]
    else:
        return None
    if a is None or b is None or not _static_2d(a) or not _static_2d(b):
        return None
    if a.dtype != out.dtype or b.dtype != out.dtype:
        return None
    return a, b


def _static_2d(value: ir.Value) -> bool:
    shape = value.shape
    return shape is not None and len(shape) == 2 and all(isinstance(d, int) for d in shape.dims)
