"""fp32 ``ScatterElements`` along the last axis -> ``ortrain.cpu.ScatterLast``.

The cross-entropy gradient is the probabilities with -1 added at each row's label
(``lower_cross_entropy.py``'s softmax form): ONNX Runtime's ScatterElements copies all
[tokens x vocab] of them into a new buffer first while the probabilities die right
there. ortrain's kernel offers its output in the
data's buffer, so it writes only the labels' entries, and the head's backward starts with
one [tokens x vocab] buffer instead of two (``layout_kernels.c``).

A kernel choice like ``softmax.py``: CPU builds with ortrain's kernel library.
Rewritten: standard ``ScatterElements`` with reduction "none" (``ScatterLast``) or "add"
(``ScatterAddLast``; "mul" / "max" / "min" stay) along the last axis
(``axis`` -1 or rank - 1) of float32 data of a static shape, float32 updates and int64
indices (where their shapes are known: of data's rank, its other dims equal data's; the
kernel checks them at run time otherwise); anything else stays.
"""

from __future__ import annotations

import onnx_ir as ir

from ortrain.core.names import CPU_DOMAIN

_STD = ("", "ai.onnx")
_KERNELS = {"none": "ScatterLast", "add": "ScatterAddLast"}


def lower_scatter_last(model: ir.Model) -> int:
    """Returns the number of ScatterElements nodes rewritten."""
    count = 0
    for node in model.graph:
        kernel = _kernel(node)
        if kernel is None:
            continue
        node.op_type, node.domain, node.version = kernel, CPU_DOMAIN, None
        node.attributes.clear()
        # ONNX Runtime hands a custom op's output the data's buffer only where the graph
        # states both shapes (it cannot infer a custom op's)
        data, out = node.inputs[0], node.outputs[0]
        assert data is not None
        out.shape, out.type = ir.Shape(data.shape), data.type  # type: ignore[arg-type]
        count += 1
    if count:
        model.opset_imports[CPU_DOMAIN] = 1
    return count


def _dims(v: ir.Value | None) -> tuple[int, ...] | None:
    if v is None or v.shape is None or not all(isinstance(d, int) for d in v.shape.dims):
        return None
    return tuple(int(d) for d in v.shape.dims)


def _kernel(node: ir.Node) -> str | None:
    """The ortrain.cpu op for ``node``, or None where it stays."""
    if node.op_type != "ScatterElements" or node.domain not in _STD or len(node.inputs) != 3:
        return None
    data, indices, updates = node.inputs
    dd, di, du = _dims(data), _dims(indices), _dims(updates)
    if not dd:  # the kernel checks the shapes shape inference left open
        return None
    if di is not None and (len(di) != len(dd) or di[:-1] != dd[:-1]):
        return None
    if di is not None and du is not None and di != du:
        return None
    assert data is not None and indices is not None and updates is not None
    if data.dtype != ir.DataType.FLOAT or updates.dtype != ir.DataType.FLOAT:
        return None
    if indices.dtype != ir.DataType.INT64:
        return None
    reduction = node.attributes.get("reduction")
    kernel = _KERNELS.get(reduction.value if reduction is not None else "none")
    axis = node.attributes.get("axis")
    a = axis.value if axis is not None else 0
    return kernel if a in (-1, len(dd) - 1) else None
