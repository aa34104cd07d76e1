"""Large fp32 ``Gemm`` / ``MatMul`` / ``FusedMatMul`` products -> ``ortrain.blas.Gemm``.

``ortrain.blas.Gemm`` (``ortrain/runtime/blas_gemm.c``) is an ONNX Runtime custom op that
calls the BLAS torch already loaded (MKL on x86) instead of ONNX Runtime's MLAS: on Intel
CPUs MKL runs the products of a training step faster (``benchmarks/bench_gemm.py``), and
they are most of a transformer's gradient graph there. This is a kernel choice, made last
on the finished graph (after autodiff, the fusions and the memory passes), so nothing
upstream sees the custom op and no gradient rule is needed.

Only products of ``CpuCostModel.gemm_min_flops`` (2·M·N·K) or more move: below that MKL's
gain is small against a call on its own (OpenMP) threads, which keep spinning for a while
after each call and compete for the cores with ONNX Runtime's threads on the ops that
follow. The fused backward kernels (``ortrain.cpu``, far fewer ops after each product)
make that competition cheaper, which is why the threshold sits below a transformer
layer's products (``docs/benchmarks/history/`` has the runs that placed it).

Cases rewritten (every operand and the result float32, the right operand 2-D, static
shapes):
1. ``Gemm`` (ONNX): A, B 2-D; transA, transB, alpha, beta kept; C absent, a single
   value, a row of N ([N] or [1, N]) or the full [M, N].
2. ``MatMul`` (ONNX): A of rank >= 1 times B [K, N] (a Linear layer: the leading axes
   of A are the rows).
3. ``FusedMatMul`` (com.microsoft): as MatMul with transA (A 2-D only), transB and alpha;
   no transBatchA / transBatchB.
Kept as they are: smaller products, batched right operands (attention's products), other
dtypes, Gemm's column-broadcast C ([M, 1]), and operands of unknown shape or dtype.
"""

from __future__ import annotations

import onnx_ir as ir

from ortrain.core.names import BLAS_DOMAIN
from ortrain.graph_passes.infra.emitter import MS_DOMAIN
from ortrain.graph_passes.targets.cpu.cost_model import CpuCostModel, cost_or_default

__all__ = ["BLAS_DOMAIN", "become_blas_op", "lower_gemm_to_blas"]

_STD = ("", "ai.onnx")
_F32 = ir.DataType.FLOAT


def lower_gemm_to_blas(model: ir.Model, cost: CpuCostModel | None = None) -> int:
    """Returns the number of products rewritten (those of ``cost.gemm_min_flops`` or more;
    ``cost`` None: this machine's model)."""
    least = cost_or_default(cost).gemm_min_flops
    count = 0
    for node in model.graph:
        attrs = _blas_attributes(node)
        if attrs is None or _flops(node, attrs) < least:
            continue
        become_blas_op(node, "Gemm", attrs)
        count += 1
    if count:
        model.opset_imports[BLAS_DOMAIN] = 1
    return count


def become_blas_op(node: ir.Node, op_type: str, attrs: dict[str, int | float]) -> None:
    """Turn ``node`` into ``ortrain.blas.<op_type>`` with exactly ``attrs`` (ints as INT,
    floats as FLOAT)."""
    node.op_type, node.domain, node.version = op_type, BLAS_DOMAIN, None
    node.attributes.clear()
    for name, value in attrs.items():
        attr = ir.AttrInt64(name, value) if isinstance(value, int) else ir.AttrFloat32(name, value)
        node.attributes[name] = attr


def _flops(node: ir.Node, attrs: dict[str, int | float]) -> float:
    """2 M N K of an eligible product (A holds M * K elements whichever its layout)."""
    a, b = node.inputs[0], node.inputs[1]
    assert a is not None and b is not None and a.shape is not None and b.shape is not None
    n = b.shape[0] if attrs.get("transB") else b.shape[1]
    size = 1
    for d in a.shape:
        size *= int(d)  # type: ignore[arg-type]
    return 2.0 * size * int(n)  # type: ignore[arg-type]


def _rank(v: ir.Value | None) -> int | None:
    """The rank of a float32 value of static shape, else None."""
    if v is None or v.dtype != _F32 or v.shape is None:
        return None
    if not all(isinstance(d, int) for d in v.shape):
        return None
    return len(v.shape)


def _blas_attributes(node: ir.Node) -> dict[str, int | float] | None:
    """The ``ortrain.blas.Gemm`` attributes that compute ``node``, or None to keep it."""
    is_gemm = node.op_type == "Gemm" and node.domain in _STD
    is_matmul = node.op_type == "MatMul" and node.domain in _STD
    is_fused = node.op_type == "FusedMatMul" and node.domain == MS_DOMAIN
    if not (is_gemm or is_matmul or is_fused) or len(node.outputs) != 1:
        return None
    a, b = node.inputs[0], node.inputs[1]
    ra, rb = _rank(a), _rank(b)
    if ra is None or rb != 2 or node.outputs[0].dtype not in (_F32, None):
        return None
    get_int, get_float = node.attributes.get_int, node.attributes.get_float
    if is_matmul:
        return {} if ra >= 1 else None
    trans_a, trans_b = get_int("transA", 0), get_int("transB", 0)
    attrs: dict[str, int | float] = {"transA": trans_a, "transB": trans_b}
    attrs["alpha"] = get_float("alpha", 1.0)
    if is_fused:
        if get_int("transBatchA", 0) or get_int("transBatchB", 0) or (trans_a and ra != 2):
            return None
        return attrs if ra >= 1 else None
    if ra != 2:
        return None
    c = node.inputs[2] if len(node.inputs) > 2 else None
    if c is not None:
        if not _c_fits(c, a, b, trans_a, trans_b):
            return None
        attrs["beta"] = get_float("beta", 1.0)
    return attrs


def _c_fits(c: ir.Value, a: ir.Value, b: ir.Value, trans_a: int, trans_b: int) -> bool:
    """C is a single value, a row of N or the whole [M, N]."""
    if _rank(c) is None or a.shape is None or b.shape is None:
        return False
    m = a.shape[1 if trans_a else 0]
    n = b.shape[0 if trans_b else 1]
    dims = list(c.shape)  # type: ignore[union-attr]
    size = 1
    for d in dims:
        size *= d
    if size == 1:
        return True
    if dims in ([n], [1, n]):
        return True
    return dims == [m, n]
