"""Fuse a decomposed layer norm (a hand-written LayerNorm module, as exported) into ONNX
LayerNormalization, before autodiff.

The chain, over the last axis ``D`` of ``x`` (ReduceMean's axes an input from opset 18 on,
an attribute before)::

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
an intermediate (mean, variance, ...) read elsewhere, non-float inputs, a last axis of
unknown size (other axes may be symbolic: ``ortrain optimize`` on dynamic axes; an x of
unknown rank needs the axes written as -1).
Before opset 17 the fused node is ONNX Runtime's LayerNormalization, which it registers
in the ONNX domain for every opset (the standard op arrived in 17).
"""

from __future__ import annotations

import onnx_ir as ir
from onnxscript.rewriter import pattern

from ortrain.graph_passes.fusions._common import apply, dims, ints, scalar

_FLOATS = {ir.DataType.FLOAT, ir.DataType.DOUBLE, ir.DataType.FLOAT16, ir.DataType.BFLOAT16}


class DecomposedLayerNorm(pattern.RewriteRuleClassBase):
    def __init__(self, with_bias: bool, axes_input: bool = True):
        bias = "Bias" if with_bias else ""
        attr = "" if axes_input else "AxesAttribute"
        super().__init__(name=f"DecomposedLayerNorm{bias}{attr}")
        self.with_bias = with_bias
        self.axes_input = axes_input

    def _reduce_mean(self, op, v, axes, name: str):
        if self.axes_input:
            return op.ReduceMean(v, axes, _allow_other_attributes=True, _outputs=[name])
        return op.ReduceMean(v, _allow_other_attributes=True, _outputs=[name])

    def pattern(self, op, x, axes_mean, axes_var, eps, scale, bias):
        mean = self._reduce_mean(op, x, axes_mean, "mean")
        d = op.Sub(x, mean)
        squared = pattern.OrValue([op.Pow(d, 2), op.Mul(d, d)])
        var = self._reduce_mean(op, squared, axes_var, "var")
        std = op.Sqrt(op.Add(var, eps))
        normalized = pattern.OrValue([op.Div(d, std), op.Mul(d, op.Reciprocal(std))])
        if not self.with_bias:
            return op.Mul(normalized, scale, _outputs=["out"])
        return op.Add(op.Mul(normalized, scale), bias, _outputs=["out"])

    def check(self, context, x, eps, scale, mean, var, out, axes_mean=None, axes_var=None,
              bias=None, **_) -> pattern.MatchResult:  # fmt: skip
        result = pattern.MatchResult()
        if x.dtype not in _FLOATS:
            return result.fail("x is not a float tensor", x)
        # Without x's shape (an exporter that left it out) the axes must say "last" as -1,
        # and the width comes from the scale.
        rank = None if x.shape is None else len(x.shape)
        width = None if x.shape is None else x.shape[-1]
        if width is None:
            width = (dims(scale) or (None,))[0]
        if not isinstance(width, int):
            return result.fail("the normalized axis has no static size", x)
        for axes, node in ((axes_mean, mean), (axes_var, var)):
            values = ints(axes) if self.axes_input else _axes_attribute(node.producer())
            last = [-1] if rank is None else [rank - 1]
            if values is None or [a % rank if rank else a for a in values] != last:
                return result.fail(f"reduction axes {values}: only the last axis", axes or node)
            keep = node.producer().attributes.get("keepdims")
            if keep is not None and keep.value != 1:
                return result.fail("ReduceMean without keepdims", node)
        value = scalar(eps)
        if value is None:
            return result.fail("epsilon is not a one-element constant", eps)
        for name, v in (("scale", scale), ("bias", bias)):
            if v is not None and dims(v) != (width,):
                return result.fail(f"{name} shape {dims(v)} is not [{width}]", v)
        self._epsilon = value
        return result

    def rewrite(self, op, x, scale, out, bias=None, **_):
        inputs = [x, scale] + ([bias] if self.with_bias else [])
        y = op.LayerNormalization(*inputs, axis=-1, epsilon=self._epsilon, stash_type=1)
        y.dtype, y.shape = x.dtype, x.shape
        return y


def _axes_attribute(node: ir.Node) -> list[int] | None:
    axes = node.attributes.get("axes")
    return None if axes is None else [int(a) for a in axes.value]


# Two sets per axes form, applied in this order: the rewriter visits nodes in graph order,
# so a single set would fuse a chain without its bias at the scale Mul before reaching
# the bias Add.
def _sets(axes_input: bool) -> tuple[pattern.RewriteRuleSet, pattern.RewriteRuleSet]:
    return tuple(
        pattern.RewriteRuleSet([DecomposedLayerNorm.rule(bias, axes_input)], commute=True)
        for bias in (True, False)
    )


WITH_BIAS, WITHOUT_BIAS = _sets(axes_input=True)
ATTRIBUTE_SETS = _sets(axes_input=False)


def rule_sets(model: ir.Model) -> tuple[pattern.RewriteRuleSet, ...]:
    """The sets for the model's ReduceMean form; none before opset 13."""
    opset = model.opset_imports.get("", 0)
    if opset >= 18:
        return (WITH_BIAS, WITHOUT_BIAS)
    return ATTRIBUTE_SETS if opset >= 13 else ()


def fuse_layer_norm(model: ir.Model) -> int:
    """Returns the number of decomposed layer norms fused."""
    return sum(apply(rules, model) for rules in rule_sets(model))
