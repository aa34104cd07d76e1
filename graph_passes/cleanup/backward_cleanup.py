"""Clean up the backward part of a training graph, after autodiff.

Only gradient nodes (those autodiff tagged with ``ortrain.grad_of`` metadata) are
touched; the forward graph is left exactly as the forward passes made it.

Cases, in order:
1. Constant folding: a gradient node in the standard domain whose inputs are all
   constant initializers (no graph inputs) and whose output has at most
   ``FOLD_OUTPUT_LIMIT`` elements becomes an initializer (evaluated by ONNX's reference
   implementation). Ops that draw random numbers are never folded.
2. CSE: gradient nodes with the same op, attributes and inputs compute the same value;
   later ones are dropped and their readers read the first. Never merged: ops that draw
   random numbers or carry a seed (two Dropouts reading one input draw independent
   masks), nodes with subgraphs, nodes whose outputs are graph outputs.
3. Transposes: ``fold_transposes`` (fold_transpose_gemm.py) over gradient nodes: a
   Transpose of a Gemm/MatMul/FusedMatMul product or feeding one of their operands is
   folded into the trans flags.
4. Gradient sums: a Sum (or Add of two same-shaped values) of gradient contributions
   whose input is itself a single-use gradient Sum/Add of the same shape becomes one
   Sum over all the leaves (tied and multi-use values end with one Sum).
5. Scatter into the sum: a gradient Sum one of whose terms is a single-use
   ``ScatterElements(zeros, rows, updates, reduction="add")`` (an embedding's
   gradient) scatters the updates into the sum of the other terms instead: no zeros
   table, no extra full-size add. For a tied vocabulary-sized embedding (GPT-2 small's
   50257 x 768) this drops two table-sized temporaries, and the time spent filling and
   adding them, every step.
6. Nodes left without readers are removed (gradient nodes only).
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
from onnx.reference import ReferenceEvaluator

from ortrain.core.names import RANDOM_OPS
from ortrain.graph_passes.cleanup.fold_transpose_gemm import fold_transposes, replace_node
from ortrain.graph_passes.infra.tags import is_backward

FOLD_OUTPUT_LIMIT = 1024  # elements: larger constants stay computed (zeros, ones)
_STD = ("", "ai.onnx")


def _random(node: ir.Node) -> bool:
    return node.op_type in RANDOM_OPS or "seed" in node.attributes


def _has_subgraph(node: ir.Node) -> bool:
    return any(a.type in (ir.AttributeType.GRAPH, ir.AttributeType.GRAPHS)
               for a in node.attributes.values())  # fmt: skip


def _numel(v: ir.Value) -> int | None:
    if v.shape is None or not all(isinstance(d, int) for d in v.shape.dims):
        return None
    return int(np.prod(v.shape.dims, dtype=np.int64))


def _evaluate(node: ir.Node, model: ir.Model) -> list[np.ndarray]:
    inputs = [ir.Value(name=f"in{i}", type=v.type, shape=v.shape) if v is not None else None
              for i, v in enumerate(node.inputs)]  # fmt: skip
    attrs = list(node.attributes.values())
    copy = ir.Node(node.domain, node.op_type, inputs, attributes=attrs,
                   num_outputs=len(node.outputs))  # fmt: skip
    for k, (o, v) in enumerate(zip(copy.outputs, node.outputs, strict=True)):
        o.name, o.type, o.shape = f"out{k}", v.type, v.shape
    graph = ir.Graph([v for v in inputs if v is not None], list(copy.outputs), nodes=[copy],
                     opset_imports={"": model.opset_imports.get("", 20)})  # fmt: skip
    proto = ir.serde.serialize_model(ir.Model(graph, ir_version=10))
    feeds = {f"in{i}": v.const_value.numpy() for i, v in enumerate(node.inputs) if v is not None}
    return ReferenceEvaluator(proto).run(None, feeds)


def fold_constants(model: ir.Model) -> int:
    """Case 1."""
    graph = model.graph
    count = 0
    for node in list(graph):
        if not is_backward(node) or node.domain not in _STD or _random(node):
            continue
        if _has_subgraph(node) or not node.inputs:
            continue
        if any(v is not None and (v.const_value is None or v.is_graph_input())
               for v in node.inputs):  # fmt: skip
            continue
        sizes = [_numel(o) for o in node.outputs]
        if any(n is None or n > FOLD_OUTPUT_LIMIT for n in sizes):
            continue
        if any(o.is_graph_output() for o in node.outputs):
            continue
        try:
            results = _evaluate(node, model)
        except Exception:  # an op the reference implementation lacks: keep the node
            continue
        for o, arr in zip(node.outputs, results, strict=True):
            name = o.name
            o.name = f"{name}__folded"
            const = ir.Value(
                name=name,
                shape=ir.Shape(list(np.shape(arr))),
                type=o.type,
                const_value=ir.tensor(np.asarray(arr), name=name),
            )
            graph.register_initializer(const)
            o.replace_all_uses_with(const)
        graph.remove(node, safe=True)
        count += 1
    return count


def _key(node: ir.Node) -> tuple:
    attrs = tuple(sorted((k, repr(a.value)) for k, a in node.attributes.items()))
    ins = tuple(id(v) if v is not None else None for v in node.inputs)
    return node.domain or "", node.op_type, node.overload, len(node.outputs), attrs, ins


def eliminate_common_subexpressions(model: ir.Model) -> int:
    """Case 2."""
    graph = model.graph
    seen: dict[tuple, ir.Node] = {}
    count = 0
    for node in list(graph):
        if not is_backward(node) or _random(node) or _has_subgraph(node):
            continue
        if any(o.is_graph_output() for o in node.outputs):
            continue
        first = seen.setdefault(_key(node), node)
        if first is node:
            continue
        for old, new in zip(node.outputs, first.outputs, strict=True):
            old.replace_all_uses_with(new)
        graph.remove(node, safe=True)
        count += 1
    return count


def _is_sum(node: ir.Node | None) -> bool:
    if node is None or node.domain not in _STD or not is_backward(node):
        return False
    if node.op_type == "Sum":
        return True
    if node.op_type == "Add" and len(node.inputs) == 2:
        a, b = node.inputs
        return a is not None and b is not None and a.shape is not None and a.shape == b.shape
    return False


def merge_gradient_sums(model: ir.Model) -> int:
    """Case 4; returns the number of Sum/Add nodes merged away."""
    graph = model.graph
    count = 0
    for node in reversed(list(graph)):
        if node.graph is None or not _is_sum(node):
            continue
        out_shape = node.outputs[0].shape
        leaves: list[ir.Value] = []
        merged: list[ir.Node] = []
        stack = list(reversed(node.inputs))
        while stack:
            v = stack.pop()
            p = v.producer() if v is not None else None
            inner = (
                p is not None
                and _is_sum(p)
                and v.shape == out_shape
                and len(v.uses()) == 1
                and not v.is_graph_output()
            )
            if inner:
                merged.append(p)
                stack.extend(reversed(p.inputs))
            else:
                leaves.append(v)
        if not merged:
            continue
        new = ir.Node(
            "",
            "Sum",
            leaves,
            name=f"{node.name}/merged",
            metadata_props=dict(node.metadata_props),
        )
        replace_node(graph, node, new, node, *merged)
        count += len(merged)
    return count


def _zeros(v: ir.Value | None) -> bool:
    """``v`` is Expand(a constant 0, shape) or a constant of zeros."""
    if v is None:
        return False
    p = v.producer()
    if p is not None and p.op_type == "Expand" and p.domain in _STD:
        v = p.inputs[0]
    t = v.const_value if v is not None else None
    return t is not None and not np.any(t.numpy())


def _scatter_of_zeros(v: ir.Value, shape: ir.Shape | None) -> ir.Node | None:
    p = v.producer()
    ok = (
        p is not None
        and p.op_type == "ScatterElements"
        and p.domain in _STD
        and is_backward(p)
        and p.attributes.get("reduction") is not None
        and p.attributes["reduction"].value == "add"
        and len(v.uses()) == 1
        and not v.is_graph_output()
        and v.shape == shape
        and _zeros(p.inputs[0])
    )
    return p if ok else None


def scatter_into_sums(model: ir.Model) -> int:
    """Case 5; returns the number of zero tables dropped."""
    graph = model.graph
    count = 0
    for node in list(graph):
        if node.graph is None or not _is_sum(node) or len(node.inputs) < 2:
            continue
        out = node.outputs[0]
        found = [
            (i, p)
            for i, v in enumerate(node.inputs)
            if v is not None and (p := _scatter_of_zeros(v, out.shape)) is not None
        ]
        if not found:
            continue
        i, scatter = found[0]
        rest = [v for j, v in enumerate(node.inputs) if j != i]
        nodes: list[ir.Node] = []
        base = rest[0]
        if len(rest) > 1:
            nodes.append(ir.Node("", "Sum", rest, name=f"{node.name}/rest",
                                 metadata_props=dict(node.metadata_props)))  # fmt: skip
            base = nodes[-1].outputs[0]
            base.name, base.dtype, base.shape = f"{out.name}/rest", out.dtype, out.shape
        nodes.append(
            ir.Node(
                "",
                "ScatterElements",
                [base, scatter.inputs[1], scatter.inputs[2]],
                attributes=list(scatter.attributes.values()),
                name=f"{scatter.name}/into_sum",
                metadata_props=dict(node.metadata_props),
            )
        )
        if len(nodes) > 1:
            graph.insert_before(node, nodes[:-1])
        replace_node(graph, node, nodes[-1], node)
        count += 1
    return count


def remove_dead_gradient_nodes(model: ir.Model) -> int:
    """Case 6."""
    graph = model.graph
    count = 0
    for node in reversed(list(graph)):
        if not is_backward(node):
            continue
        if any(o.uses() or o.is_graph_output() for o in node.outputs):
            continue
        graph.remove(node, safe=True)
        count += 1
    return count


def clean_backward(model: ir.Model) -> int:
    """Cases 1-6 over the gradient nodes; returns the number of changes."""
    count = fold_constants(model)
    count += eliminate_common_subexpressions(model)
    count += fold_transposes(model, is_backward)
    count += merge_gradient_sums(model)
    count += scatter_into_sums(model)
    count += remove_dead_gradient_nodes(model)
    return count
