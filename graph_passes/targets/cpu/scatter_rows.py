"""Row scatter-adds (embedding gradients) -> ``ortrain.cpu.ScatterAddRows``.

The Gather rule spells an embedding's gradient as ``ScatterElements(base, Expand(rows,
[N, D]), updates, axis=0, reduction="add")`` (rules/shape.py: standard ONNX has no row
scatter-add that ONNX Runtime's CPU kernels run correctly with repeated rows). That
kernel handles one int64 index per element, on one thread.
``ortrain.cpu.ScatterAddRows(base, rows, updates)`` (``ortrain/runtime/grad_kernels.c``)
adds whole rows, split over the intra-op threads by columns (deterministic), and the
[N, D] int64 index tensor is no longer built.

A kernel choice like ``blas_gemm.py``: made last, on CPU builds with ortrain's kernel
library (``TrainingBuild.cpu_kernels``). Rewritten: float32 ``ScatterElements`` with
``reduction="add"`` on axis 0 whose indices are an ``Expand`` of a column [N, 1, ..., 1]
to the updates' shape [N, *base.shape[1:]] (static shapes).
"""

from __future__ import annotations

import onnx_ir as ir

from ortrain.core.names import CPU_DOMAIN

_STD = ("", "ai.onnx")
_F32 = ir.DataType.FLOAT


def lower_scatter_add_rows(model: ir.Model) -> int:
    """Returns the number of scatters rewritten."""
    graph = model.graph
    count = 0
    for node in list(graph):
        rows = _row_indices(node)
        if rows is None:
            continue
        expand = node.inputs[1].producer()  # type: ignore[union-attr]
        node.op_type, node.domain, node.version = "ScatterAddRows", CPU_DOMAIN, None
        node.attributes.clear()
        node.replace_input_with(1, rows)
        if expand is not None and not expand.outputs[0].uses():
            graph.remove(expand, safe=True)
        count += 1
    if count:
        model.opset_imports[CPU_DOMAIN] = 1
    return count


def _row_indices(node: ir.Node) -> ir.Value | None:
    """The [N, 1, ...] row column of an eligible scatter, else None."""
    if node.op_type != "ScatterElements" or node.domain not in _STD or len(node.inputs) != 3:
        return None
    reduction = node.attributes.get("reduction")
    axis = node.attributes.get("axis")
    if reduction is None or reduction.value != "add" or (axis is not None and axis.value != 0):
        return None
    base, idx, updates = node.inputs
    if base is None or idx is None or updates is None:
        return None
    if base.dtype != _F32 or updates.dtype != _F32 or node.outputs[0].dtype != _F32:
        return None
    expand = idx.producer()
    if expand is None or expand.op_type != "Expand" or expand.domain not in _STD:
        return None
    column = expand.inputs[0]
    shapes = [v.shape for v in (base, idx, updates, column)]
    if (
        column is None
        or column.dtype != ir.DataType.INT64
        or any(s is None or not s.is_static() for s in shapes)
    ):
        return None
    b, i, u, c = (tuple(int(d) for d in s) for s in shapes)  # type: ignore[union-attr]
    if len(b) < 1 or i != u or u[1:] != b[1:] or len(c) != len(u) or c[0] != u[0]:
        return None
    if any(d != 1 for d in c[1:]):
        return None
    return column
