"""Fuse a bias Add feeding a GELU into one com.microsoft kernel, before autodiff.

Cases (``b`` has the shape [N] of the last axis of ``x``; both operand orders of the Add):
1. ``Gelu(Add(x, b))`` (erf form: ONNX Gelu without ``approximate`` or with "none", or
   com.microsoft Gelu) → ``BiasGelu(x, b)`` (onnxscript's BiasGeluFusion pattern with a
   stricter bias check: BiasGelu's kernel needs the bias to span the last axis).
2. ``Gelu(Add(x, b), approximate="tanh")`` → ``FastGelu(x, b)``.
Kept: an Add whose sum something else reads (the GELU's input is then needed anyway),
a bias that is not 1-D over the last axis.

Run it after matmul_add: a bias that a Gemm can absorb is cheaper there (the GELU's
gradient then reads the Gemm output instead of recomputing x + b).
"""

from __future__ import annotations

import onnx_ir as ir
from onnxscript.rewriter import pattern
from onnxscript.rewriter.ort_fusions.bias_gelu import BiasGeluFusion

from ortrain.graph_passes.fusions._common import MS_DOMAIN, apply, dims, typed


def _check_bias(result: pattern.MatchResult, x: ir.Value, bias: ir.Value):
    sx, sb = dims(x), dims(bias)
    if sx is None or sb is None:
        return result.fail("operands need static shapes", x)
    if sb != sx[-1:]:
        return result.fail(f"bias shape {sb} is not the last axis of {sx}", bias)
    return result


class ErfBiasGelu(BiasGeluFusion):
    """Case 1: onnxscript's pattern; the bias must span the input's last axis."""

    def check(self, op, gelu, input, bias, **kw) -> pattern.MatchResult:
        result = super().check(op, gelu=gelu, input=input, bias=bias, **kw)
        if not result:
            return result
        return _check_bias(result, input, bias)

    def rewrite(self, op, input, bias, gelu, **_):
        return typed(op.BiasGelu(input, bias, _domain=MS_DOMAIN), gelu, dims(gelu))


class TanhBiasGelu(pattern.RewriteRuleClassBase):
    """Case 2."""

    def pattern(self, op, x, bias):
        return op.Gelu(op.Add(x, bias), approximate="tanh", _outputs=["gelu"])

    def check(self, context, x, bias, **_) -> pattern.MatchResult:
        return _check_bias(pattern.MatchResult(), x, bias)

    def rewrite(self, op, x, bias, gelu, **_):
        return typed(op.FastGelu(x, bias, _domain=MS_DOMAIN), gelu, dims(gelu))


RULES = pattern.RewriteRuleSet(
    [
        *ErfBiasGelu.rule("BiasGeluOnnx", contrib_op=False).commute(),
        *ErfBiasGelu.rule("BiasGeluContrib", contrib_op=True).commute(),
        *TanhBiasGelu.rule().commute(),
    ]
)


def fuse_bias_gelu(model: ir.Model) -> int:
    """Returns the number of bias + GELU pairs fused."""
    count = apply(RULES, model)
    if count and MS_DOMAIN not in model.opset_imports:
        model.opset_imports[MS_DOMAIN] = 1
    return count
