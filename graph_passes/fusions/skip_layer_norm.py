"""Fuse a residual Add feeding a LayerNormalization into com.microsoft
SkipLayerNormalization, before autodiff.

Cases (onnxscript's SkipLayerNormFusion rules; input and skip [B, S, D], gamma, beta and
bias [D], LayerNormalization over the last axis with stash_type 1):
1. ``LayerNormalization(Add(x, skip), gamma, beta)`` → ``SkipLayerNormalization(x, skip,
   gamma, beta)``; either Add operand may be the skip.
2. ``Add(Add(x, skip), bias)`` or ``Add(Add(x, bias), skip)`` before it → the bias
   becomes SkipLayerNormalization's fifth input.
3. The residual sum read by others (GPT-2's pre-LN blocks add it to the next branch)
   is SkipLayerNormalization's output 3 (input_skip_bias_sum); its statistics (outputs
   1 and 2) are declared unnamed, and autodiff names them when the gradient rule reads
   them (rules/contrib.py), so no extra forward value is kept when nothing trains.
Kept: a skip broadcast over the batch (GPT-2's position embeddings), input and skip whose
shapes are not provably equal (unnamed symbolic dims), a LayerNorm over more than the
last axis or with another stash type, a sum in another dtype.
"""

from __future__ import annotations

import onnx_ir as ir
from onnxscript.rewriter import pattern
from onnxscript.rewriter.ort_fusions.skip_normalization import (
    SkipLayerNormFusion,
    SkipRmsNormFusion,
)

from ortrain.graph_passes.fusions._common import MS_DOMAIN, apply


def provably_same_shape(a: ir.Value, b: ir.Value) -> bool:
    """Both shapes known and equal dim by dim: equal integers, or symbolic dims with the
    same name. Two unnamed symbolic dims prove nothing: a skip broadcast over the batch
    ([1, S, D] at run time) would make SkipLayerNormalization's output [1, S, D]."""
    if a.shape is None or b.shape is None or len(a.shape) != len(b.shape):
        return False
    for x, y in zip(a.shape.dims, b.shape.dims, strict=True):
        if isinstance(x, int) or isinstance(y, int):
            if x != y:
                return False
        elif x.value is None or x.value != y.value:
            return False
    return True


class _SameShape:
    """Adds to onnxscript's skip-norm check that input and skip have one shape."""

    def check(self, op, input, skip, **kw) -> pattern.MatchResult:
        result = super().check(op, input, skip, **kw)  # type: ignore[misc]
        if result and not provably_same_shape(input, skip):
            return pattern.MatchResult().fail(
                f"input {input.shape} and skip {skip.shape} are not provably one shape "
                "(a broadcast skip would change the output's shape)",
                skip,
            )
        return result


class SameShapeSkipLayerNorm(_SameShape, SkipLayerNormFusion):
    pass


class SameShapeSkipRmsNorm(_SameShape, SkipRmsNormFusion):
    pass


def _rules(cls: type) -> pattern.RewriteRuleSet:
    stem = cls.__name__
    return pattern.RewriteRuleSet(
        [
            cls.rule(f"{stem}PreBias", has_bias=True, bias_pre_add=True),
            cls.rule(f"{stem}Bias", has_bias=True, bias_pre_add=False),
            cls.rule(stem, has_bias=False),
        ]
    )


SKIP_LAYER_NORM_RULES = _rules(SameShapeSkipLayerNorm)
SKIP_RMS_NORM_RULES = _rules(SameShapeSkipRmsNorm)


def _tidy(node: ir.Node) -> None:
    """Types on the outputs the rewrite created; unused statistics left unnamed."""
    x = node.inputs[0]
    for k, v in enumerate(node.outputs):
        if k in (1, 2) and not v.uses() and not v.is_graph_output():
            v.name = ""
            continue
        if k in (0, 3) and x is not None:
            v.dtype = v.dtype or x.dtype
            v.shape = v.shape or x.shape


def fuse_skip_layer_norm(model: ir.Model) -> int:
    """Returns the number of Add + LayerNormalization pairs fused."""
    count = apply(SKIP_LAYER_NORM_RULES, model)
    if count:
        if MS_DOMAIN not in model.opset_imports:
            model.opset_imports[MS_DOMAIN] = 1
        for node in model.graph:
            if node.op_type == "SkipLayerNormalization" and node.domain == MS_DOMAIN:
                _tidy(node)
    return count
