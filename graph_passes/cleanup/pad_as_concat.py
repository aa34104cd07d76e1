"""Constant-mode ``Pad`` of integer or bool tensors -> ``Concat`` with constant blocks.

ONNX Runtime's CUDA execution provider registers ``Pad`` for floating-point types only:
an integer Pad (HF GPT-2's loss pads its int64 labels with -100 before shifting them)
runs on the CPU, which costs a device-to-host round trip per step and keeps the session
from being captured as a CUDA graph. ``Concat`` runs on CUDA for every type. With a
static input shape and constant pads the blocks are small constant initializers.

Floating-point Pads stay (the CUDA kernel exists, and their gradient rule reads them);
so do negative pads (cropping), non-constant modes and dynamic shapes.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from ortrain.graph_passes.infra.constant_value import constant_tensor
from ortrain.graph_passes.infra.emitter import Emitter

_STD = ("", "ai.onnx")


def pad_as_concat(model: ir.Model) -> int:
    """Returns the number of Pads rewritten."""
    count = 0
    for node in list(model.graph):
        if node.op_type == "Pad" and node.domain in _STD and _rewrite(model.graph, node):
            count += 1
    return count


def _rewrite(graph: ir.Graph, node: ir.Node) -> bool:
    x = node.inputs[0]
    if x is None or x.dtype is None or x.dtype.is_floating_point():
        return False
    if node.attributes.get_string("mode", "constant") != "constant":
        return False
    if x.shape is None or not all(isinstance(d, int) for d in x.shape.dims):
        return False
    shape = [int(d) for d in x.shape.dims]
    pads = _const(node, 1)
    value = _const(node, 2)
    axes = _const(node, 3)
    if pads is None or (len(node.inputs) > 2 and node.inputs[2] is not None and value is None):
        return False
    if len(node.inputs) > 3 and node.inputs[3] is not None and axes is None:
        return False
    axes_list = [int(a) % len(shape) for a in axes.reshape(-1)] if axes is not None else None
    axes_list = axes_list if axes_list is not None else list(range(len(shape)))
    pads_list = [int(p) for p in pads.reshape(-1)]
    if len(pads_list) != 2 * len(axes_list) or min(pads_list, default=0) < 0:
        return False
    fill = value.reshape(-1)[0] if value is not None and value.size else 0
    e = Emitter(graph, node.name)
    out, cur = x, list(shape)
    for i, axis in enumerate(axes_list):
        begin, end = pads_list[i], pads_list[i + len(axes_list)]
        if begin == 0 and end == 0:
            continue
        parts = []
        for width in (begin, end):
            block = [*cur[:axis], width, *cur[axis + 1 :]]
            parts.append(e.const(np.full(block, fill), x.dtype) if width else None)
        cur[axis] += begin + end
        pieces = [p for p in (parts[0], out, parts[1]) if p is not None]
        out = e.op("Concat", *pieces, axis=axis, shape=cur)
    e.flush_before(node)
    old = node.outputs[0]
    if out is x:  # all pads zero
        out = e.op("Identity", x, shape=cur)
        e.flush_before(node)
    name, typ = old.name, old.type
    old.name = f"{name}__padded"
    old.replace_all_uses_with(out, replace_graph_outputs=True)
    out.name, out.type, out.shape = name, typ, ir.Shape(cur)
    graph.remove(node, safe=True)
    return True


def _const(node: ir.Node, i: int) -> np.ndarray | None:
    if len(node.inputs) <= i or node.inputs[i] is None:
        return None
    t = constant_tensor(node.inputs[i])
    return t.numpy() if t is not None else None
