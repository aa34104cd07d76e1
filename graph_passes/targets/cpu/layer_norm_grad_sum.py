"""The residual stream's gradient sums taken into ``ortrain.cpu.LayerNormGrad``.

In a pre-LN transformer the residual ``h`` feeds both the next sublayer's LayerNorm and
the next residual ``Add``, so its gradient is ``Sum(d_residual, LayerNormGrad(...).dX)``:
a full-size pass that reads two tensors and writes a third right after the kernel wrote
``dX``, twice per layer. ``LayerNormGrad``'s
optional sixth input ``dsum`` is added to ``dX`` as it is written, and the Sum goes.

Made last, on CPU builds with ortrain's kernels. Rewritten: a two-input ``Sum`` or
``Add`` of float32 tensors of one static shape, one of which is a ``LayerNormGrad``'s
``dX`` that nothing else reads and that is not a graph output, and whose kernel has no
``dsum`` yet. When the other operand is made after the kernel, the kernel moves to the
Sum's place (and the graph is sorted again: its weight gradients' readers may sit in
between).
"""

from __future__ import annotations

import onnx_ir as ir

from ortrain.core.names import CPU_DOMAIN

_STD = ("", "ai.onnx")
_F32 = ir.DataType.FLOAT


def fold_layer_norm_grad_sums(model: ir.Model) -> int:
    """Returns the number of sums taken into a LayerNormGrad."""
    graph = model.graph
    outputs = set(graph.outputs)
    count, moved = 0, False
    position = {n: i for i, n in enumerate(graph)}
    for node in list(graph):
        found = _kernel_and_other(node, outputs)
        if found is None:
            continue
        kernel, other = found
        kernel.resize_inputs(6)
        kernel.replace_input_with(5, other)
        result = node.outputs[0]
        dx = kernel.outputs[0]
        dx.shape, dx.type = result.shape, result.type
        result.replace_all_uses_with(dx, replace_graph_outputs=True)
        name = result.name
        result.name = None
        graph.remove(node, safe=True)
        dx.name = name
        producer = other.producer()
        if producer is not None and position[producer] > position[kernel]:
            graph.remove(kernel)
            graph.insert_after(producer, kernel)
            moved = True
        count += 1
    if moved:
        graph.sort()
    return count


def _kernel_and_other(node: ir.Node, outputs: set[ir.Value]) -> tuple[ir.Node, ir.Value] | None:
    if node.op_type not in ("Sum", "Add") or node.domain not in _STD or len(node.inputs) != 2:
        return None
    a, b = node.inputs
    if a is None or b is None or a is b:
        return None
    shape = node.outputs[0].shape
    if shape is None or not shape.is_static():
        return None
    if any(v.dtype != _F32 or v.shape != shape for v in (a, b)):
        return None
    for dx, other in ((a, b), (b, a)):
        kernel = dx.producer()
        if kernel is None or kernel.op_type != "LayerNormGrad" or kernel.domain != CPU_DOMAIN:
            continue
        if dx is not kernel.outputs[0] or len(dx.uses()) != 1 or dx in outputs:
            continue
        if len(kernel.inputs) > 5 and kernel.inputs[5] is not None:
            continue
        return kernel, other
    return None
