"""fp32 ``LayerNormalization`` (with the residual ``Add`` before it) -> ``ortrain.cpu.LayerNorm``.

In a CPU training graph the products run on torch's OpenMP team (``ortrain.blas``), whose
workers spin a while after each product; ONNX Runtime's own LayerNormalization runs on
its intra-op threads, which then share the cores with the spinning workers and run
slower than alone.
``ortrain.cpu.LayerNorm`` (``ortrain/runtime/forward_kernels.c``) runs on the team, and
takes in the residual stream's ``Add``: a pre-LN transformer normalizes
``h = x + sublayer(x)`` and keeps ``h`` for the next residual, so the kernel writes ``h``
as its fourth output and normalizes each row while it is in cache (one pass over ``h``
fewer, and no Add node).

A kernel choice like ``softmax.py``: made last, on CPU builds with ortrain's kernel
library (training and eval graphs). Rewritten: float32 LayerNormalization over the last
axis only, with float32 scale (and bias). The ``Add`` is taken in when both its operands
have its (static) shape, no broadcasting, its output is not a graph output, and the
LayerNorm's scale and bias exist where the ``Add`` runs (graph inputs, initializers or
values made before it). Of several LayerNorms reading one ``Add`` (a recomputed copy in
the backward), the first takes it in; the others read its sum output.
"""

from __future__ import annotations

import onnx_ir as ir

from ortrain.core.names import CPU_DOMAIN

_STD = ("", "ai.onnx")
_F32 = ir.DataType.FLOAT


def lower_layer_norm(model: ir.Model) -> int:
    """Returns the number of LayerNormalization nodes rewritten."""
    graph = model.graph
    outputs = set(graph.outputs)
    count = 0
    for node in list(graph):
        if not _eligible(node):
            continue
        eps = node.attributes.get("epsilon")
        epsilon = float(eps.value) if eps is not None else 1e-5
        x, scale = node.inputs[0], node.inputs[1]
        bias = node.inputs[2] if len(node.inputs) > 2 else None
        assert x is not None and scale is not None
        add = _residual_add(graph, x, outputs, [scale, bias])
        inputs: list[ir.Value | None] = [x, scale] + ([bias] if bias is not None else [])
        if add is not None:
            inputs = [add.inputs[0], scale, bias, add.inputs[1]]
        fused = ir.Node(
            CPU_DOMAIN,
            "LayerNorm",
            inputs,
            attributes=[ir.AttrFloat32("epsilon", epsilon)],
            num_outputs=4 if add is not None else len(node.outputs),
            name=node.name,
            metadata_props=dict(node.metadata_props),
        )
        for old, new in zip(node.outputs, fused.outputs, strict=False):
            _move_uses(old, new)
        if add is not None:
            _move_uses(add.outputs[0], fused.outputs[3])
            graph.insert_before(add, fused)
            graph.remove(add, safe=True)
        else:
            graph.insert_before(node, fused)
        graph.remove(node, safe=True)
        count += 1
    if count:
        model.opset_imports[CPU_DOMAIN] = 1
    return count


def _eligible(node: ir.Node) -> bool:
    if node.op_type != "LayerNormalization" or node.domain not in _STD:
        return False
    if len(node.inputs) < 2 or any(v is None for v in node.inputs[:2]):
        return False
    if any(v is not None and v.dtype != _F32 for v in node.inputs):
        return False
    x = node.inputs[0]
    assert x is not None
    if x.shape is None or len(x.shape) < 1:
        return False
    rank = len(x.shape)
    axis = node.attributes.get("axis")
    stash = node.attributes.get("stash_type")
    if (axis.value if axis is not None else -1) % rank != rank - 1:
        return False
    return stash is None or stash.value == 1


def _residual_add(
    graph: ir.Graph, x: ir.Value, outputs: set[ir.Value], needed: list[ir.Value | None]
) -> ir.Node | None:
    """The ``Add`` that makes ``x``, when the kernel can take it in, else None."""
    add = x.producer()
    if add is None or add.op_type != "Add" or add.domain not in _STD or len(add.inputs) != 2:
        return None
    if x in outputs or x.shape is None or not x.shape.is_static():
        return None
    if any(v is None or v.dtype != _F32 or v.shape != x.shape for v in add.inputs):
        return None
    position = {n: i for i, n in enumerate(graph)}
    for v in needed:
        producer = v.producer() if v is not None else None
        if producer is not None and position[producer] > position[add]:
            return None
    return add


def _move_uses(old: ir.Value, new: ir.Value) -> None:
    """``new`` takes ``old``'s readers, graph-output slots, name, type and shape."""
    new.type, new.shape = old.type, old.shape
    old.replace_all_uses_with(new, replace_graph_outputs=True)
    name = old.name
    old.name = None
    new.name = name
