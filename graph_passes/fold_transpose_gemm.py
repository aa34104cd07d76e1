"""Fold ``Transpose(Gemm(A, B))`` into one Gemm: ``(op(A) op(B))^T = op(B)^T op(A)^T``.

The backward of ``MatMul(x, Transpose(W))`` (how torch Linear exports) produces the
weight gradient as a Gemm followed by a Transpose; this swaps the operands and flips
the trans flags instead, so no transposed copy of every weight gradient is made.

Cases: 1. Transpose with perm [1, 0] (or none) of a 2-D Gemm without C whose result
has no other consumer and is not a graph output → one Gemm; 2. anything else is kept.
"""

from __future__ import annotations

import onnx_ir as ir


def fold_transpose_into_gemm(model: ir.Model) -> int:
    graph = model.graph
    count = 0
    for node in list(graph):
        if node.op_type != "Transpose" or node.domain not in ("", "ai.onnx"):
            continue
        perm = node.attributes.get("perm")
        if perm is not None and list(perm.value) != [1, 0]:
            continue
        src = node.inputs[0]
        gemm = src.producer() if src is not None else None
        if gemm is None or gemm.op_type != "Gemm" or gemm.domain not in ("", "ai.onnx"):
            continue
        if len(gemm.inputs) > 2 and gemm.inputs[2] is not None:
            continue
        if len(src.uses()) != 1 or src.is_graph_output():
            continue
        a, b = gemm.inputs[0], gemm.inputs[1]
        ta = gemm.attributes.get("transA")
        tb = gemm.attributes.get("transB")
        alpha = gemm.attributes.get("alpha")
        attrs = [
            ir.AttrInt64("transA", 1 - (tb.value if tb is not None else 0)),
            ir.AttrInt64("transB", 1 - (ta.value if ta is not None else 0)),
        ]
        if alpha is not None:
            attrs.append(alpha)
        new = ir.Node(
            "",
            "Gemm",
            [b, a],
            attributes=attrs,
            name=f"{gemm.name}/transposed",
            metadata_props=dict(gemm.metadata_props),
        )
        out = node.outputs[0]
        new.outputs[0].dtype, new.outputs[0].shape = out.dtype, out.shape
        graph.insert_before(node, new)
        name = out.name
        out.name = f"{name}__folded"
        out.replace_all_uses_with(new.outputs[0], replace_graph_outputs=True)
        new.outputs[0].name = name
        graph.remove(node, safe=True)
        graph.remove(gemm, safe=True)
        count += 1
    return count
