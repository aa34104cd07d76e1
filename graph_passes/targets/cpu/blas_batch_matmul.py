"""Batched fp32 products (attention's) -> ``ortrain.blas.BatchMatMul``, head transposes folded.

Attention multiplies per head: ``Q @ K^T`` and ``P @ V`` in the forward, four more such
products in the backward, each operand a batch [B, H, S, D] that a ``Transpose(0, 2, 1,
3)`` split out of [B, S, H, D] and each result merged back by another. Under ONNX Runtime
the products run on MLAS, slower than MKL on Intel, and each Transpose is a copy.
``ortrain.blas.BatchMatMul`` (``ortrain/runtime/blas_batch.c``) hands all of a product's
matrices to MKL's ``sgemm_batch`` in one call, reading a head of [B, S, H, D] in place (a
row-major [S, D] matrix with leading dimension H*D): the Transposes on its operands and
result fold into the op (``swapA`` / ``swapB`` / ``swapY``), so no copy is made.

A kernel choice like ``blas_gemm.py``, made right after it (it leaves batched products
alone), on builds whose BLAS has ``sgemm_batch`` (MKL; one sgemm per matrix would be
slower than MLAS). Rewritten: ``MatMul`` and ``FusedMatMul`` (transA, transB, alpha; no
transBatch) of two float32 operands of equal static rank 3 or 4 with equal batch axes and
at least ``CpuCostModel.batch_matmul_min_flops``. Folded (rank 4): a ``Transpose(perm=[0,
2, 1, 3])`` making an operand (it goes once nothing else reads it), and one that is the
product's only reader.
"""

from __future__ import annotations

import onnx_ir as ir

from ortrain.core.names import BLAS_DOMAIN
from ortrain.graph_passes.infra.emitter import MS_DOMAIN
from ortrain.graph_passes.targets.cpu.blas_gemm import become_blas_op
from ortrain.graph_passes.targets.cpu.cost_model import CpuCostModel, cost_or_default

_STD = ("", "ai.onnx")
_F32 = ir.DataType.FLOAT
_SWAP = (0, 2, 1, 3)


def lower_batch_matmul(model: ir.Model, cost: CpuCostModel | None = None) -> int:
    """Returns the number of products rewritten (those of ``cost.batch_matmul_min_flops``
    or more; ``cost`` None: this machine's model)."""
    least = cost_or_default(cost).batch_matmul_min_flops
    graph = model.graph
    outputs = set(graph.outputs)
    count = 0
    for node in list(graph):
        attrs = _attributes(node)
        if attrs is None or _flops(node, attrs) < least:
            continue
        a, b = node.inputs
        assert a is not None and b is not None
        rank = len(a.shape)  # type: ignore[arg-type]
        for i, key in ((0, "swapA"), (1, "swapB")):
            source = _swapped_source(node.inputs[i]) if rank == 4 else None
            if source is not None:
                transpose = node.inputs[i].producer()  # type: ignore[union-attr]
                node.replace_input_with(i, source)
                attrs[key] = 1
                gone = transpose is not None and not transpose.outputs[0].uses()
                if gone and transpose.outputs[0] not in outputs:  # type: ignore[union-attr]
                    graph.remove(transpose, safe=True)
        merge = _merging_transpose(node.outputs[0], outputs) if rank == 4 else None
        if merge is not None:  # the product writes the merged layout itself
            merged, product = merge.outputs[0], node.outputs[0]
            name, shape = merged.name, merged.shape
            merged.replace_all_uses_with(product)
            if merged in outputs:
                graph.outputs[graph.outputs.index(merged)] = product
            graph.remove(merge, safe=True)
            product.name, product.shape = name, shape
            attrs["swapY"] = 1
        become_blas_op(node, "BatchMatMul", attrs)
        count += 1
    if count:
        model.opset_imports[BLAS_DOMAIN] = 1
    return count


def _attributes(node: ir.Node) -> dict[str, int | float] | None:
    """transA / transB / alpha of an eligible batched product, else None."""
    if node.op_type == "MatMul" and node.domain in _STD:
        attrs: dict[str, int | float] = {}
    elif node.op_type == "FusedMatMul" and node.domain == MS_DOMAIN:
        if node.attributes.get_int("transBatchA", 0) or node.attributes.get_int("transBatchB", 0):
            return None
        attrs = {
            "transA": node.attributes.get_int("transA", 0),
            "transB": node.attributes.get_int("transB", 0),
            "alpha": node.attributes.get_float("alpha", 1.0),
        }
    else:
        return None
    if len(node.inputs) != 2 or any(v is None or v.dtype != _F32 for v in node.inputs):
        return None
    if node.outputs[0].dtype != _F32:
        return None
    a, b = (_static(v) for v in node.inputs)  # type: ignore[arg-type]
    if a is None or b is None or len(a) != len(b) or len(a) not in (3, 4) or a[:-2] != b[:-2]:
        return None
    return attrs


def _flops(node: ir.Node, attrs: dict[str, int | float]) -> float:
    a, b = (_static(v) for v in node.inputs)  # type: ignore[arg-type]
    assert a is not None and b is not None
    batch = 1
    for d in a[:-2]:
        batch *= d
    m, k = (a[-1], a[-2]) if attrs.get("transA") else (a[-2], a[-1])
    n = b[-2] if attrs.get("transB") else b[-1]
    return 2.0 * batch * m * n * k


def _swapped_source(v: ir.Value | None) -> ir.Value | None:
    """X when ``v = Transpose(X, perm=[0, 2, 1, 3])``, else None."""
    t = v.producer() if v is not None else None
    if t is None or t.op_type != "Transpose" or t.domain not in _STD:
        return None
    perm = t.attributes.get("perm")
    if perm is None or tuple(perm.value) != _SWAP or t.inputs[0] is None:
        return None
    return t.inputs[0] if t.inputs[0].dtype == _F32 else None


def _merging_transpose(v: ir.Value, outputs: set[ir.Value]) -> ir.Node | None:
    """The Transpose(perm=[0, 2, 1, 3]) that is ``v``'s only reader, else None."""
    uses = v.uses()
    if len(uses) != 1 or v in outputs:
        return None
    t = uses[0].node
    perm = t.attributes.get("perm")
    if t.op_type != "Transpose" or t.domain not in _STD or perm is None:
        return None
    return t if tuple(perm.value) == _SWAP else None


def _static(v: ir.Value) -> tuple[int, ...] | None:
    if v.shape is None or not v.shape.is_static():
        return None
    return tuple(int(d) for d in v.shape)
