"""Fold Transposes feeding a MatMul into com.microsoft FusedMatMul's transA/transB, and
scalar scales of its result into alpha, before autodiff.

Cases (``op`` is MatMul or FusedMatMul; A Transpose output read by anything else is kept):
1. ``op(Transpose(a), b)`` where the perm swaps the last two axes (or is the default
   reversal of a 2-D tensor) → ``FusedMatMul(a, b, transA=1)``; the same for ``b`` with
   transB; an existing flag flips (torch ``nn.Linear``: ``MatMul(x, Transpose(W))``).
2. ``op(a, Transpose(k, perm))`` where perm = q followed by a swap of the last two axes
   and q keeps the last axis last (attention's K^T, perm [0, 2, 3, 1] = head permutation
   [0, 2, 1, 3] + swap) → ``FusedMatMul(a, Transpose(k, q), transB=1)``: the Transpose
   left moves whole rows instead of single elements, and its gradient is q's inverse
   instead of an element-wise transpose. The same for ``a``.
3. ``Mul(op(a, b), c)`` or ``Div(op(a, b), c)`` with ``c`` a one-element constant →
   ``FusedMatMul(a, b, alpha=alpha * c)`` (or ``/ c``); both operand orders of Mul.

Not folded: perms that move the last axis away (a head permutation [0, 2, 1, 3] feeding
a MatMul stays: FusedMatMul's transBatch attributes move axis 0, not a middle axis, and
ortrain's FusedMatMul gradient rule does not take them); FusedMatMul with transBatch set;
a Transpose of A when B is 1-D or of unknown rank (``W.T @ v``, spectral_norm's power
iteration): ONNX Runtime's CPU FusedMatMul ignores transA when B is 1-D
(tests/test_rules_coverage.py shows it).
"""

from __future__ import annotations

import onnx_ir as ir
from onnxscript.rewriter import pattern

from ortrain.graph_passes.fusions._common import MS_DOMAIN, apply, dims, scalar, typed

_FLAGS = ("transA", "transB")


def _attrs(node: ir.Node) -> dict[str, object]:
    return {k: a.value for k, a in node.attributes.items()}


class TransposeIntoMatMul(pattern.RewriteRuleClassBase):
    """Cases 1 and 2 for operand ``pos`` (0: A, 1: B) of a MatMul or FusedMatMul."""

    def __init__(self, pos: int, fused: bool):
        kind = "FusedMatMul" if fused else "MatMul"
        super().__init__(name=f"Transpose{'AB'[pos]}Into{kind}")
        self.pos, self.fused = pos, fused

    def pattern(self, op, x, y):
        if self.pos == 0:
            a, b = op.Transpose(x, _allow_other_attributes=True, _outputs=["t"]), y
        else:
            a, b = x, op.Transpose(y, _allow_other_attributes=True, _outputs=["t"])
        if self.fused:
            return op.FusedMatMul(a, b, _domain=MS_DOMAIN, _allow_other_attributes=True,
                                  _outputs=["mm"])  # fmt: skip
        return op.MatMul(a, b, _outputs=["mm"])

    def check(self, context, x, y, t, mm, **_) -> pattern.MatchResult:
        result = pattern.MatchResult()
        src = x if self.pos == 0 else y
        shape = dims(src)
        if shape is None or len(shape) < 2:
            return result.fail("the transposed operand needs a static rank >= 2", src)
        other = dims(y if self.pos == 0 else x)
        if self.pos == 0 and (other is None or len(other) < 2):
            return result.fail("B is 1-D: ONNX Runtime's FusedMatMul ignores transA then", y)
        rank = len(shape)
        attr = t.producer().attributes.get("perm")
        perm = list(attr.value) if attr is not None else list(reversed(range(rank)))
        q = [*perm[:-2], perm[-1], perm[-2]]  # perm = q, then swap the last two axes
        if q[-1] != rank - 1:
            return result.fail(f"perm {perm} moves the last axis: no flag absorbs it", t)
        node = mm.producer()
        if self.fused and (_attrs(node).get("transBatchA") or _attrs(node).get("transBatchB")):
            return result.fail("FusedMatMul with transBatch attributes", mm)
        self._q = None if q == list(range(rank)) else q
        self._q_shape = [shape[i] for i in q]
        return result

    def rewrite(self, op, x, y, t, mm, **_):
        attrs = _attrs(mm.producer()) if self.fused else {}
        flag = _FLAGS[self.pos]
        attrs[flag] = 1 - int(attrs.get(flag, 0))
        src = x if self.pos == 0 else y
        if self._q is not None:
            src = typed(op.Transpose(src, perm=self._q), src, self._q_shape)
        a, b = (src, y) if self.pos == 0 else (x, src)
        return typed(op.FusedMatMul(a, b, _domain=MS_DOMAIN, **attrs), mm, dims(mm))


class ScaleIntoMatMul(pattern.RewriteRuleClassBase):
    """Case 3: a scalar Mul/Div of the product becomes FusedMatMul's alpha."""

    def __init__(self, scale_op: str, fused: bool):
        kind = "FusedMatMul" if fused else "MatMul"
        super().__init__(name=f"{scale_op}Into{kind}")
        self.scale_op, self.fused = scale_op, fused

    def pattern(self, op, x, y, c):
        if self.fused:
            mm = op.FusedMatMul(x, y, _domain=MS_DOMAIN, _allow_other_attributes=True,
                                _outputs=["mm"])  # fmt: skip
        else:
            mm = op.MatMul(x, y, _outputs=["mm"])
        return getattr(op, self.scale_op)(mm, c, _outputs=["out"])

    def check(self, context, c, mm, out, **_) -> pattern.MatchResult:
        result = pattern.MatchResult()
        value = scalar(c)
        if value is None:
            return result.fail("the scale is not a one-element constant", c)
        if dims(c) is None or dims(out) != dims(mm):
            return result.fail("the scale broadcasts the product to another shape", c)
        if self.scale_op == "Div" and value == 0.0:
            return result.fail("division by zero", c)
        self._factor = value if self.scale_op == "Mul" else 1.0 / value
        return result

    def rewrite(self, op, x, y, mm, out, **_):
        attrs = _attrs(mm.producer()) if self.fused else {}
        attrs["alpha"] = float(attrs.get("alpha", 1.0)) * self._factor
        return typed(op.FusedMatMul(x, y, _domain=MS_DOMAIN, **attrs), out, dims(out))


RULES = pattern.RewriteRuleSet(
    [
        *(TransposeIntoMatMul.rule(pos, fused) for pos in (0, 1) for fused in (False, True)),
        *(ScaleIntoMatMul.rule(s, fused) for s in ("Mul", "Div") for fused in (False, True)),
    ],
    commute=True,
)


def fuse_matmul_transpose(model: ir.Model) -> int:
    """Returns the number of Transposes and scales folded into FusedMatMul attributes."""
    count = apply(RULES, model)
    if count and MS_DOMAIN not in model.opset_imports:
        model.opset_imports[MS_DOMAIN] = 1
    return count
