"""Fuse an RMSNorm chain (Llama, Qwen2, Mistral, T5...) into SimplifiedLayerNormalization,
before autodiff.

The chain, over the last axis ``D`` (onnxscript's RmsNormFusion rules, optional Casts to
and from a compute dtype)::

    r = Reciprocal(Sqrt(Add(ReduceMean(Pow(x, 2), [-1]), eps)))
    y = Mul(Mul(x, r), scale)          (either Mul order)

-> ``SimplifiedLayerNormalization(x, scale, axis=-1, epsilon=eps)`` (ONNX Runtime's op,
registered in the ONNX domain). The forward runs one kernel instead of 7; the gradient
rule (rules/contrib.py) reads the op's second output, 1/rms, saved by the forward.
Must run before ``pow_as_mul``, which takes the pattern's ``Pow`` apart. On llama-tiny
(``profile_graph.py --workload llama-tiny``, alternating with the chain left decomposed)
the gradient graph has fewer nodes and ran faster; the planned peak is unchanged (the
recompute policy redoes the fused op as it redid the chain's products).
Kept: an eps that is not a one-element float constant, non-float inputs, an intermediate
read elsewhere.
"""

from __future__ import annotations

import onnx_ir as ir
from onnxscript.rewriter.ort_fusions.rms_normalization import rms_normalization_ruleset

from ortrain.graph_passes.fusions._common import STANDARD, apply


def fuse_rms_norm(model: ir.Model) -> int:
    """Returns the number of chains fused."""
    count = apply(rms_normalization_ruleset, model)
    if count:
        for node in model.graph:
            if node.op_type == "SimplifiedLayerNormalization" and node.domain in STANDARD:
                x, y = node.inputs[0], node.outputs[0]
                if x is not None:
                    y.dtype = y.dtype or x.dtype
                    y.shape = y.shape or x.shape
    return count
