"""Fold Transposes into the Gemm / MatMul / FusedMatMul next to them.

The backward of ``MatMul(x, Transpose(W))`` (how torch Linear exports) produces the
weight gradient as a Gemm followed by a Transpose; ``(op(A) op(B))^T = op(B)^T op(A)^T``
swaps the operands and flips the trans flags instead, so no transposed copy of every
weight gradient is made.

Cases:
1. Transpose with perm [1, 0] (or none) of a 2-D Gemm without C whose result has no
   other consumer and is not a graph output → one Gemm (``fold_transpose_into_gemm``).
2. Transpose swapping the last two axes of a MatMul or FusedMatMul product (same
   conditions, no transBatch) → ``FusedMatMul(B, A)`` with flipped flags and the alpha.
3. Transpose swapping the last two axes (2-D: [1, 0] or none) that feeds an operand of a
   Gemm (A or B, 2-D), MatMul or FusedMatMul → the flag of that operand flips and it
   reads the untransposed value; the Transpose goes once nothing else reads it.
4. Anything else is kept: other perms (head permutations), a Gemm with C (case 1: the
   sum would need C transposed), a product read elsewhere.
``fold_transposes`` applies cases 1-3, optionally to the nodes ``scope`` accepts only
(backward cleanup: gradient nodes); ``fold_transpose_into_gemm`` applies case 1.
"""

from __future__ import annotations

from collections.abc import Callable

import onnx_ir as ir

from ortrain.graph_passes.infra.emitter import MS_DOMAIN

Scope = Callable[[ir.Node], bool]
_STD = ("", "ai.onnx")


def _is(node: ir.Node | None, op_type: str, domain: tuple[str, ...] = _STD) -> bool:
    return node is not None and node.op_type == op_type and node.domain in domain


def _is_product(node: ir.Node | None) -> bool:
    return _is(node, "MatMul") or _is(node, "FusedMatMul", (MS_DOMAIN,))


def _trans_batch(node: ir.Node) -> bool:
    get = node.attributes.get_int
    return bool(get("transBatchA", 0) or get("transBatchB", 0))


def _swaps_last_two(node: ir.Node) -> bool:
    """The Transpose swaps the last two axes only (the default perm, for rank 2)."""
    shape = node.inputs[0].shape if node.inputs[0] is not None else None
    rank = len(shape) if shape is not None else None
    perm = node.attributes.get("perm")
    if perm is None:
        return rank == 2
    perm = list(perm.value)
    n = len(perm)
    return n >= 2 and perm == [*range(n - 2), n - 1, n - 2]


def replace_node(graph: ir.Graph, old: ir.Node, new: ir.Node, *remove: ir.Node) -> None:
    """``new`` (inserted before ``old``) takes over ``old``'s first output: its name, type,
    uses and graph-output place; the ``remove`` nodes then go."""
    out = old.outputs[0]
    new.outputs[0].dtype, new.outputs[0].shape = out.dtype, out.shape
    graph.insert_before(old, new)
    name = out.name
    out.name = f"{name}__folded"
    out.replace_all_uses_with(new.outputs[0], replace_graph_outputs=True)
    new.outputs[0].name = name
    for node in remove:
        graph.remove(node, safe=True)


def _single_use(v: ir.Value) -> bool:
    return len(v.uses()) == 1 and not v.is_graph_output()


def _swapped_attributes(product: ir.Node) -> list[ir.Attr]:
    """(A·B)^T = B^T·A^T: the flags of the product with its operands swapped."""
    attrs = [
        ir.AttrInt64("transA", 1 - product.attributes.get_int("transB", 0)),
        ir.AttrInt64("transB", 1 - product.attributes.get_int("transA", 0)),
    ]
    if "alpha" in product.attributes:
        attrs.append(product.attributes["alpha"])
    return attrs


def _swap_into(
    graph: ir.Graph, transpose: ir.Node, product: ir.Node, domain: str, op_type: str
) -> None:
    """``transpose(product(A, B))`` becomes one ``op_type`` node ``(B, A)`` with swapped
    flags; both old nodes go."""
    new = ir.Node(
        domain,
        op_type,
        [product.inputs[1], product.inputs[0]],
        attributes=_swapped_attributes(product),
        name=f"{product.name}/transposed",
        metadata_props=dict(product.metadata_props),
    )
    replace_node(graph, transpose, new, transpose, product)


def _fold_gemm_output(graph: ir.Graph, node: ir.Node) -> bool:
    """Case 1; ``node`` is the Transpose."""
    perm = node.attributes.get("perm")
    if perm is not None and list(perm.value) != [1, 0]:
        return False
    src = node.inputs[0]
    gemm = src.producer() if src is not None else None
    if not _is(gemm, "Gemm") or (len(gemm.inputs) > 2 and gemm.inputs[2] is not None):
        return False
    if not _single_use(src):
        return False
    _swap_into(graph, node, gemm, "", "Gemm")
    return True


def _fold_product_output(graph: ir.Graph, node: ir.Node) -> bool:
    """Case 2; ``node`` is the Transpose."""
    src = node.inputs[0]
    mm = src.producer() if src is not None else None
    if not _is_product(mm) or not _swaps_last_two(node) or not _single_use(src):
        return False
    if _trans_batch(mm):
        return False
    _swap_into(graph, node, mm, MS_DOMAIN, "FusedMatMul")
    return True


def _fold_operands(graph: ir.Graph, node: ir.Node, scope: Scope) -> int:
    """Case 3; ``node`` is the Transpose: every product in scope reading it folds it."""
    if not _swaps_last_two(node):
        return 0
    t_out, src = node.outputs[0], node.inputs[0]
    count = 0
    for user, idx in list(t_out.uses()):
        if idx > 1 or not scope(user):
            continue
        flag = ("transA", "transB")[idx]
        if _is(user, "Gemm"):
            rank = len(src.shape) if src.shape is not None else 0
            if rank != 2:
                continue
            user.attributes[flag] = ir.AttrInt64(flag, 1 - user.attributes.get_int(flag, 0))
            user.replace_input_with(idx, src)
        elif _is_product(user):
            if user.op_type == "MatMul":
                new = ir.Node(
                    MS_DOMAIN,
                    "FusedMatMul",
                    list(user.inputs),
                    attributes=[ir.AttrInt64(flag, 1)],
                    name=f"{user.name}/fused",
                    metadata_props=dict(user.metadata_props),
                )
                new.replace_input_with(idx, src)
                replace_node(graph, user, new, user)
            elif _trans_batch(user):
                continue
            else:
                user.attributes[flag] = ir.AttrInt64(flag, 1 - user.attributes.get_int(flag, 0))
                user.replace_input_with(idx, src)
        else:
            continue
        count += 1
    if count and not t_out.uses() and not t_out.is_graph_output():
        graph.remove(node, safe=True)
    return count


def fold_transposes(model: ir.Model, scope: Scope | None = None) -> int:
    """Cases 1-3 over the nodes ``scope`` accepts (default: all); returns the folds."""
    graph = model.graph
    scope = scope or (lambda _: True)
    count = 0
    for node in list(graph):
        if node.graph is None or not _is(node, "Transpose") or not scope(node):
            continue
        src = node.inputs[0]
        producer = src.producer() if src is not None else None
        if producer is not None and scope(producer):
            if _fold_gemm_output(graph, node) or _fold_product_output(graph, node):
                count += 1
                continue
        count += _fold_operands(graph, node, scope)
    if count and MS_DOMAIN not in model.opset_imports:
        model.opset_imports[MS_DOMAIN] = 1
    return count


def fold_transpose_into_gemm(model: ir.Model) -> int:
    """Case 1 over the whole graph; returns the number of Transposes folded."""
    graph = model.graph
    count = 0
    for node in list(graph):
        if node.graph is not None and _is(node, "Transpose") and _fold_gemm_output(graph, node):
            count += 1
    return count
