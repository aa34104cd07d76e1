"""Large fp32 ``Mul`` / ``Add`` / ``Sub`` / ``Sum`` -> ``ortrain.cpu`` element-wise kernels.

ONNX Runtime runs element-wise arithmetic on its intra-op threads, which share the cores
with the BLAS products' OpenMP workers while those spin after each product; a Llama
block's backward holds many such ops (rotary embeddings, RMSNorm, the SiLU gate).
ortrain's kernels (``ortrain/runtime/elementwise_kernels.c``) run on the products' own
team.

A kernel choice like ``softmax.py``: made last, on CPU builds with ortrain's kernel
library. Rewritten: float32 ``Mul`` / ``Add`` / ``Sub`` whose operands have static shapes
that broadcast (numpy rules, rank <= ``MAX_RANK``) and ``Sum`` of 2 to ``MAX_SUM`` float32
operands of one static shape, with outputs of at least
``CpuCostModel.elementwise_min_elements`` elements (below that ONNX Runtime's inline loop
costs less than a hand-off to threads). ``MAX_SUM`` / ``MAX_RANK`` are what the kernels
accept (their ABI), not tuning.
"""

from __future__ import annotations

import onnx_ir as ir

from ortrain.core.names import CPU_DOMAIN
from ortrain.graph_passes.targets.cpu.cost_model import CpuCostModel, cost_or_default

_STD = ("", "ai.onnx")
_F32 = ir.DataType.FLOAT
MAX_SUM = 8  # kernel ABI: operands a Sum kernel takes (elementwise_kernels.c)
MAX_RANK = 8  # kernel ABI: broadcast rank the kernels index (elementwise_kernels.c)


def lower_elementwise(model: ir.Model, cost: CpuCostModel | None = None) -> int:
    """Returns the number of nodes rewritten (``cost`` None: this machine's model)."""
    least = cost_or_default(cost).elementwise_min_elements
    count = 0
    for node in model.graph:
        if node.domain not in _STD or not _eligible(node, least):
            continue
        node.domain, node.version = CPU_DOMAIN, None
        count += 1
    if count:
        model.opset_imports[CPU_DOMAIN] = 1
    return count


def _static(v: ir.Value | None) -> tuple[int, ...] | None:
    if v is None or v.dtype != _F32 or v.shape is None or not v.shape.is_static():
        return None
    return tuple(int(d) for d in v.shape)


def _eligible(node: ir.Node, least: int) -> bool:
    if node.op_type not in ("Mul", "Add", "Sub", "Sum") or len(node.outputs) != 1:
        return False
    out = _static(node.outputs[0])
    shapes = [_static(v) for v in node.inputs]
    if out is None or any(s is None for s in shapes) or len(out) > MAX_RANK:
        return False
    size = 1
    for d in out:
        size *= d
    if size < least:
        return False
    if node.op_type == "Sum":
        return 2 <= len(shapes) <= MAX_SUM and all(s == out for s in shapes)
    if len(shapes) != 2:
        return False
    a, b = shapes
    assert a is not None and b is not None
    return _broadcast(a, b) == out


def _broadcast(a: tuple[int, ...], b: tuple[int, ...]) -> tuple[int, ...] | None:
    rank = max(len(a), len(b))
    a, b = (1,) * (rank - len(a)) + a, (1,) * (rank - len(b)) + b
    out = []
    for x, y in zip(a, b, strict=True):
        if x != y and 1 not in (x, y):
            return None
        out.append(0 if 0 in (x, y) else max(x, y))
    return tuple(out)
