"""Fuse a MatMul and the bias Add after it into one Gemm, before autodiff.

Cases (``op`` is MatMul or a FusedMatMul without transA/transBatch; ``w`` is 2-D):
1. ``Add(op(x, w), c)`` with ``x`` 2-D and ``c`` unidirectionally broadcastable to the
   [M, N] product → ``Gemm(x, w, c)`` (FusedMatMul's transB and alpha carried over);
   both operand orders of the Add.
2. ``x`` of rank > 2 (torch ``nn.Linear`` on [batch, seq, K]) with ``c`` of shape [N]
   or [1, N] → ``Reshape(x, [rows, K])``, Gemm, ``Reshape`` back to the product's shape.
   The bias add runs inside the GEMM kernel (beta * C), and the gradient is the Gemm
   rule: one Gemm per operand over all rows and the bias gradient as ones @ dY.
Kept: a product read by anything but the Add, a batched ``w``, a bias that varies along
the rows of an N-D product, transA on an N-D ``x``.
"""

from __future__ import annotations

import math

import numpy as np
import onnx_ir as ir
from onnxscript.rewriter import pattern

from ortrain.graph_passes.fusions._common import MS_DOMAIN, apply, dims, typed


class MatMulAddToGemm(pattern.RewriteRuleClassBase):
    def __init__(self, fused: bool):
        super().__init__(name=f"{'FusedMatMul' if fused else 'MatMul'}AddToGemm")
        self.fused = fused

    def pattern(self, op, x, w, c):
        if self.fused:
            mm = op.FusedMatMul(x, w, _domain=MS_DOMAIN, _allow_other_attributes=True,
                                _outputs=["mm"])  # fmt: skip
        else:
            mm = op.MatMul(x, w, _outputs=["mm"])
        return op.Add(mm, c, _outputs=["out"])

    def check(self, context, x, w, c, mm, out, **_) -> pattern.MatchResult:
        result = pattern.MatchResult()
        sx, sw, sc, so = dims(x), dims(w), dims(c), dims(out)
        if sx is None or sw is None or sc is None or so is None:
            return result.fail("operands need static shapes", x)
        if len(sw) != 2 or len(sx) < 2:
            return result.fail(f"not x[..., K] @ W[K, N] (shapes {sx} x {sw})", w)
        attrs = {k: a.value for k, a in mm.producer().attributes.items()}
        if attrs.get("transBatchA") or attrs.get("transBatchB"):
            return result.fail("FusedMatMul with transBatch attributes", mm)
        if dims(mm) != so:
            return result.fail("the Add broadcasts the product to a larger shape", c)
        ta = int(attrs.get("transA", 0))
        n = so[-1]
        if len(sx) == 2:
            ok = len(sc) <= 2 and all(d in (1, s) for d, s in zip(reversed(sc), reversed(so)))
            if not ok:
                return result.fail(f"bias shape {sc} does not broadcast to {so}", c)
        elif ta:
            return result.fail("transA on an N-D operand", mm)
        elif sc not in ((n,), (1, n)) and not (len(sc) == len(so) and math.prod(sc) == n):
            return result.fail(f"bias shape {sc} varies along the rows of {so}", c)
        self._attrs = {
            "transA": ta,
            "transB": int(attrs.get("transB", 0)),
            "alpha": float(attrs.get("alpha", 1.0)),
        }
        return result

    def rewrite(self, op, x, w, c, mm, out, **_):
        sx, so, sc = dims(x), dims(out), dims(c)
        if len(sx) == 2:
            return typed(op.Gemm(x, w, c, **self._attrs), out, so)
        rows, k, n = math.prod(sx[:-1]), sx[-1], so[-1]

        def shape(name: str, values: list[int]) -> ir.Value:  # unique: named after ``out``
            return op.initializer(ir.tensor(np.array(values, np.int64), name=f"{out.name}/{name}"))

        x2 = typed(op.Reshape(x, shape("rows", [rows, k])), x, (rows, k))
        if len(sc) != 1:
            c = typed(op.Reshape(c, shape("bias", [n])), c, (n,))
        y2 = typed(op.Gemm(x2, w, c, **self._attrs), out, (rows, n))
        return typed(op.Reshape(y2, shape("shape", list(so))), out, so)


RULES = pattern.RewriteRuleSet(
    [MatMulAddToGemm.rule(False), MatMulAddToGemm.rule(True)], commute=True
)


def fuse_matmul_add(model: ir.Model) -> int:
    """Returns the number of MatMul + Add pairs turned into a Gemm."""
    return apply(RULES, model)
