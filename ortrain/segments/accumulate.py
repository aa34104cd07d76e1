"""A segment's backward graph that adds its embedding rows into a gradient already there.

An embedding's gradient is its rows scattered into zeros
(``ortrain.cpu.ScatterAddRows(zeros, rows, updates)``): a table-sized buffer made and
zeroed on every backward for a few rows. Where another segment's backward has already
made the same parameter's gradient (a tied embedding: the LM head's backward runs
before the embedding's), autograd would add the two table-sized tensors. The variant
made here takes the zeros as an input instead (``acc:<parameter>``, role ACCUMULATOR);
the runner binds it and the gradient output to the gradient already made, and the rows
are added there in place (the kernel skips its copy when ``out`` is ``base``).

Under ZeRO-2/3 the rows need not become a table at all: ``rows_variant`` outputs them
as they are (which rows, role ROW_INDICES; what is added to them, role ROW_UPDATES), and
the reducer adds every rank's rows into its own shard of the gradient
(``distributed/sharded_grads.py``), so a tied table's dense gradient from the LM head can
be reduced as soon as the head's backward makes it.

Rewritten: a parameter's gradient output made by ``ScatterAddRows`` whose base is zeros
(a constant, an ``Expand`` or ``ConstantOfShape`` of zero) that nothing else reads.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import onnx_ir as ir
import onnx_ir.passes.common

from ortrain.core.names import CPU_DOMAIN

ACC_PREFIX = "acc:"
ROWS_PREFIX = "rows:"
UPDATES_PREFIX = "updates:"


def accumulating_variant(
    model: ir.Model, grad_outputs: Mapping[str, str]
) -> tuple[ir.Model, dict[str, str]] | None:
    """(a copy of ``model`` whose rows-into-zeros gradients add into an input, {parameter:
    that input's name}); None where no gradient of ``grad_outputs`` (parameter -> output
    name) is made that way."""
    if not _sites(model.graph, grad_outputs):
        return None
    variant = ir.serde.deserialize_model(ir.serde.serialize_model(model))
    graph = variant.graph
    made: dict[str, str] = {}
    for param, (node, out) in _sites(graph, grad_outputs).items():
        acc = ir.Value(name=ACC_PREFIX + param, shape=out.shape, type=ir.TensorType(out.dtype))
        graph.inputs.append(acc)
        node.replace_input_with(0, acc)
        made[param] = str(acc.name)
    onnx_ir.passes.common.RemoveUnusedNodesPass()(variant)
    return variant, made


def rows_variant(
    model: ir.Model, grad_outputs: Mapping[str, str]
) -> tuple[ir.Model, dict[str, tuple[str, str]]] | None:
    """(a copy of ``model`` whose rows-into-zeros gradients are output as their rows and
    updates instead, {parameter: (rows output, updates output)}); None where no gradient
    of ``grad_outputs`` is made that way. Rows are int64 [N, 1] (negative ones count from
    the end, as ``Gather``'s), updates [N, *table.shape[1:]]."""
    if not _sites(model.graph, grad_outputs):
        return None
    variant = ir.serde.deserialize_model(ir.serde.serialize_model(model))
    graph = variant.graph
    made: dict[str, tuple[str, str]] = {}
    for param, (node, out) in _sites(graph, grad_outputs).items():
        names = []
        for prefix, value in ((ROWS_PREFIX, node.inputs[1]), (UPDATES_PREFIX, node.inputs[2])):
            assert value is not None
            # an Identity: the value may be a graph input or another output already
            made_value = ir.Value(name=prefix + param, shape=value.shape, type=value.type)
            copy = ir.Node("", "Identity", [value], outputs=[made_value], name=prefix + param)
            graph.append(copy)
            graph.outputs.append(made_value)
            names.append(prefix + param)
        graph.outputs.remove(out)
        made[param] = (names[0], names[1])
    onnx_ir.passes.common.RemoveUnusedNodesPass()(variant)
    return variant, made


def _sites(graph: ir.Graph, grad_outputs: Mapping[str, str]) -> dict[str, tuple[ir.Node, ir.Value]]:
    """parameter -> (its scatter, its gradient output) for each rows-into-zeros gradient."""
    outputs = {v.name: v for v in graph.outputs}
    found = {}
    for param, name in grad_outputs.items():
        out = outputs.get(name)
        if param.startswith("in:") or out is None:
            continue
        node = out.producer()
        if node is None or node.op_type != "ScatterAddRows" or node.domain != CPU_DOMAIN:
            continue
        base = node.inputs[0]
        if base is None or base.shape != out.shape or base.dtype != out.dtype:
            continue
        if len(base.uses()) != 1 or base.name in outputs or not _zeros(base):
            continue
        found[param] = (node, out)
    return found


def _zeros(value: ir.Value) -> bool:
    """Whether ``value`` is all zeros: a constant (folded from the zeros), an ``Expand`` of
    a zero constant, or a ``ConstantOfShape`` of zero."""
    const = ir.convenience.get_const_tensor(value)
    if const is not None:
        return not np.any(const.numpy())
    node = value.producer()
    if node is None or node.domain not in ("", "ai.onnx"):
        return False
    if node.op_type == "ConstantOfShape":
        value = node.attributes.get("value")
        return value is None or not np.any(value.as_tensor().numpy())
    if node.op_type != "Expand" or node.inputs[0] is None:
        return False
    const = ir.convenience.get_const_tensor(node.inputs[0])
    return const is not None and not np.any(const.numpy())
