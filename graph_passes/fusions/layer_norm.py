"""Fuse a decomposed layer norm (a hand-written LayerNorm module, as exported) into ONNX
LayerNormalization, before autodiff.

The chain, over the last axis ``D`` of ``x`` (ReduceMean with axes as an input, opset 18+)::

    mean = ReduceMean(x, [-1], keepdims=1)        d = Sub(x, mean)
    var  = ReduceMean(Pow(d, 2) | Mul(d, d), [-1], keepdims=1)
    std  = Sqrt(Add(var, eps))                    n = Div(d, std) | Mul(d, Reciprocal(std))
    y    = Mul(n, scale) [+ bias]

Cases: 1. with a bias Add → ``LayerNormalization(x, scale, bias, axis=-1, epsilon=eps)``;
2. without → ``LayerNormalization(x, scale)``. Every Add/Mul in either operand order;
axes given as [-1] or [rank - 1]. The forward then runs one kernel instead of 9, and the
backward is the LayerNormalization rule (statistics saved by the forward, ~11 element-wise
ops) instead of the gradients of 9 ops.
Kept: eps that is not a one-element constant, scale or bias not of shape [D], other axes,
an intermediate (mean, variance, ...) read elsewhere, non-float inputs.
"""

from __future__ import annotations

import onnx_ir as ir
from onnxscript.rewriter import pattern

from graph_passes.fusions._common import apply, dims, ints, scalar, typed

_FLOATS = {ir.DataType.FLOAT, ir.DataType.DOUBLE, ir.DataType.FLOAT16, ir.DataType.BFLOAT16}


class DecomposedLayerNorm(pattern.RewriteRuleClassBase):
    def __init__(self, with_bias: bool):
        super().__init__(name=f"DecomposedLayerNorm{'Bias' if with_bias else ''}")
        self.with_bias = with_bias

    def pattern(self, op, x, axes_mean, axes_var, eps, scale, bias):
        mean = op.ReduceMean(x, axes_mean, _allow_other_attributes=True, _outputs=["mean"])
        d = op.Sub(x, mean)
        squared = pattern.OrValue([op.Pow(d, 2), op.Mul(d, d)])
        var = op.ReduceMean(squared, axes_var, _allow_other_attributes=True, _outputs=["var"])
        std = op.Sqrt(op.Add(var, eps))
        normalized = pattern.OrValue([op.Div(d, std), op.Mul(d, op.Reciprocal(std))])
        if not self.with_bias:
            return op.Mul(normalized, scale, _outputs=["out"])
        return op.Add(op.Mul(normalized, scale), bias, _outputs=["out"])

    def check(self, context, x, axes_mean, axes_var, eps, scale, mean, var, out, bias=None,
              **_) -> pattern.MatchResult:  # fmt: skip
        result = pattern.MatchResult()
        sx = dims(x)
        if sx is None or x.dtype not in _FLOATS:
            return result.fail("x needs a static shape and a float type", x)
        rank = len(sx)
        for axes, node in ((axes_mean, mean), (axes_var, var)):
            values = ints(axes)
            if values is None or [a % rank for a in values] != [rank - 1]:
                return result.fail(f"reduction axes {values}: only the last axis", axes)
            keep = node.producer().attributes.get("keepdims")
            if keep is not None and keep.value != 1:
                return result.fail("ReduceMean without keepdims", node)
        value = scalar(eps)
        if value is None:
            return result.fail("epsilon is not a one-element constant", eps)
        for name, v in (("scale", scale), ("bias", bias)):
            if v is not None and dims(v) != sx[-1:]:
                return result.fail(f"{name} shape {dims(v)} is not [{sx[-1]}]", v)
        if dims(out) != sx:
            return result.fail("scale or bias broadcasts the result", out)
        self._epsilon = value
        return result

    def rewrite(self, op, x, scale, out, bias=None, **_):
        inputs = [x, scale] + ([bias] if self.with_bias else [])
        y = op.LayerNormalization(*inputs, axis=-1, epsilon=self._epsilon, stash_type=1)
        return typed(y, x, dims(x))


# Two sets, applied in this order: the rewriter visits nodes in graph order, so a single
# set would fuse a chain without its bias at the scale Mul before reaching the bias Add.
WITH_BIAS = pattern.RewriteRuleSet([DecomposedLayerNorm.rule(True)], commute=True)
WITHOUT_BIAS = pattern.RewriteRuleSet([DecomposedLayerNorm.rule(False)], commute=True)


def fuse_layer_norm(model: ir.Model) -> int:
    """Returns the number of decomposed layer norms fused (needs opset >= 18)."""
    if model.opset_imports.get("", 0) < 18:
        return 0
    return apply(WITH_BIAS, model) + apply(WITHOUT_BIAS, model)
