"""One export for every size of a batch signature, specialized per size.

A batch signature whose sizes change from batch to batch (the sequence length of
variable-length data, a shorter last batch) needs a graph per size: the passes and the
memory plan work on static shapes. Each graph used to start from its own export, the
longest stage of a build. Once a second size of a signature is built, its export is
traced with the sizes that differ symbolic (``torch.export``'s ``Dim.AUTO``: a size the
code fixes stays fixed, one it bounds keeps the bound); every later size takes that
export with the batch's sizes put in and the shape arithmetic folded again
(``clean_export``), which gives what a static export of that size gives, node for node,
in a small part of its time. A size outside a symbol's traced range (a forward that
branches on it, ``if T > k``), or an expression this module cannot evaluate, is exported
as before. Every graph's first step is checked against eager as any.
"""

from __future__ import annotations

import ast
import dataclasses
import operator
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from ortrain.export import ExportedForward


class NotSpecialized(Exception):
    """A symbolic export that does not give this batch's graph (sizes out of range)."""


@dataclasses.dataclass
class LengthFamily:
    """The sizes of one batch signature: which axes vary, and their symbolic export."""

    axes: dict[str, tuple[int, ...]]  # batch tensor -> its axes whose size varies
    wire: tuple | None = None  # ExportedForward.to_wire() of the symbolic export
    failed: str = ""  # why the symbolic export failed (each size exported then)


def varying_axes(
    shapes: Mapping[str, tuple[int, ...]], other: Mapping[str, tuple[int, ...]]
) -> dict[str, tuple[int, ...]]:
    """Per tensor, the axes where two batches of one signature differ in size."""
    out = {}
    for key, shape in shapes.items():
        seen = other.get(key)
        if seen is None or len(seen) != len(shape):
            continue
        axes = tuple(i for i, (a, b) in enumerate(zip(shape, seen, strict=True)) if a != b)
        if axes:
            out[key] = axes
    return out


_OPS = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
}
_CALLS = {"Max": max, "Min": min, "FloorDiv": operator.floordiv, "Mod": operator.mod}


def evaluate(expr: str, values: Mapping[str, int]) -> int:
    """A symbolic size (``s72``, ``8*s72``, ``s72 + 1``, ``Max(1, s72)``) at ``values``;
    NotSpecialized for anything else."""
    try:
        tree = ast.parse(expr, mode="eval").body
    except SyntaxError as exc:
        raise NotSpecialized(f"size {expr!r} is not an expression of sizes") from exc

    def ev(node: ast.AST) -> int:
        if isinstance(node, ast.Constant) and isinstance(node.value, int):
            return node.value
        if isinstance(node, ast.Name) and node.id in values:
            return values[node.id]
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](ev(node.left), ev(node.right))
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -ev(node.operand)
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in _CALLS
            and not node.keywords
        ):
            return _CALLS[node.func.id](*(ev(a) for a in node.args))
        raise NotSpecialized(f"size {expr!r}: cannot evaluate {ast.dump(node)[:60]}")

    return ev(tree)


def specialize(ex: ExportedForward, batch: Mapping[str, Any]) -> ExportedForward:
    """The symbolic export ``ex`` (its own copy: ``ExportedForward.from_wire``) with
    ``batch``'s sizes: every symbolic size set, the shape arithmetic folded."""
    import onnx_ir as ir

    from ortrain.graph_passes.cleanup.export_cleanup import clean_export

    graph = ex.model.graph
    values: dict[str, int] = {}
    for v in graph.inputs:
        t = batch.get(v.name)
        if not isinstance(t, torch.Tensor) or v.shape is None:
            continue
        if len(v.shape) != t.dim():
            raise NotSpecialized(f"input {v.name}: rank {len(v.shape)}, the batch's {t.dim()}")
        for axis, (dim, size) in enumerate(zip(v.shape, t.shape, strict=True)):
            if isinstance(dim, int):
                if dim != size:  # the trace fixed it
                    raise NotSpecialized(f"input {v.name} axis {axis}: traced at {dim}, got {size}")
                continue
            name = str(dim.value)
            if not name.isidentifier():  # a size the trace fixed, named by its value
                fixed = evaluate(name, {})
                if fixed != size:
                    raise NotSpecialized(f"input {v.name} axis {axis}: traced at {fixed}")
                continue
            if values.setdefault(name, size) != size:
                raise NotSpecialized(f"size {name}: {values[name]} and {size} in one batch")
    for name, value in values.items():
        lo, hi = ex.ranges.get(name, (0, None))
        if value < lo or (hi is not None and value > hi):
            raise NotSpecialized(f"size {name}={value} outside the traced range {lo}..{hi}")

    def concrete(shape: ir.Shape | None) -> ir.Shape | None:
        if shape is None or all(isinstance(d, int) for d in shape):
            return shape
        if any(not isinstance(d, int) and d.value is None for d in shape):
            return None  # a size the exporter did not name: inferred again below
        sizes = [d if isinstance(d, int) else evaluate(str(d.value), values) for d in shape]
        return ir.Shape(sizes)

    for v in graph.inputs:
        v.shape = concrete(v.shape)
    for node in ir.traversal.RecursiveGraphIterator(graph):
        for out in node.outputs:
            out.shape = concrete(out.shape)
    clean_export(ex.model)
    left = [
        out.name
        for node in graph
        for out in node.outputs
        if out.shape is not None and not all(isinstance(d, int) for d in out.shape)
    ]
    if left:
        raise NotSpecialized(f"sizes left symbolic after folding: {left[:3]}")
    ex.ranges = {}
    return ex
