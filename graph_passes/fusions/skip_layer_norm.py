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
Kept: a skip broadcast over the batch (GPT-2's position embeddings), a LayerNorm over
more than the last axis or with another stash type, a sum in another dtype.
"""

from __future__ import annotations

import onnx_ir as ir
from onnxscript.rewriter import pattern
from onnxscript.rewriter.ort_fusions.skip_normalization import skip_layer_normalization_ruleset

from graph_passes.fusions._common import MS_DOMAIN, apply


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
    rules: pattern.RewriteRuleSet = skip_layer_normalization_ruleset
    count = apply(rules, model)
    if count:
        if MS_DOMAIN not in model.opset_imports:
            model.opset_imports[MS_DOMAIN] = 1
        for node in model.graph:
            if node.op_type == "SkipLayerNormalization" and node.domain == MS_DOMAIN:
                _tidy(node)
    return count
