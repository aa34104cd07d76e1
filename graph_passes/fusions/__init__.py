"""Fusions: onnxscript rewriter rules (pattern / check / rewrite), one family per module.

``FUSIONS`` lists every training-graph fusion in pipeline order with where it runs
(before autodiff: the fused op's gradient rule builds its backward; after autodiff: over
the gradient nodes) and whether it is proposed for the default training pipeline
(``training_fusions()``): only passes measured not to slow the gradient graph down
(``benchmarks/bench_fusions.py``, gpt2-tiny / bert-tiny, 2 threads, quiet machine).

Order before autodiff (after seed_dropout and fuse_gelu, before mixed_precision):
1. fuse_layer_norm        decomposed LayerNorm chains → LayerNormalization (no-op on the
                          HF exports; a hand-written-LayerNorm model's gradient graph ran
                          faster)
   fuse_rms_norm          RMSNorm chains (Llama, Qwen2, T5...) → SimplifiedLayerNormalization
                          (no-op on GPT-2/BERT; llama-tiny's gradient graph ran faster,
                          rms_norm.py)
2. fuse_matmul_transpose  Transpose / scalar scale → FusedMatMul transA/transB/alpha
3. fuse_matmul_add        MatMul(+FusedMatMul) + bias Add → Gemm (after 2: reads transB)
4. fuse_bias_gelu         bias Add + Gelu → BiasGelu / FastGelu (after 3: a Gemm takes
                          the bias first, which leaves the GELU's gradient cheaper; alone
                          on BERT it measured within noise)
5. fuse_skip_layer_norm   residual Add + LayerNormalization → SkipLayerNormalization.
                          Not proposed: onnxruntime's CPU SkipLayerNormalization kernel
                          ran slower than Add + LayerNormalization, and the gradient graph
                          got slower with it.
Order after autodiff (after lower_cross_entropy, before accumulate / remove_unused):
6. clean_backward         constant folding, dropout-safe CSE, Transpose folding and Sum
                          merging over the gradient nodes (within noise on both models)
7. sink_row_scale         a per-row scale (the cross-entropy gradient's coefficient) moves
                          off the [tokens x vocab] operand of the LM head's gradient Gemms
                          onto their narrow side (gpt2-tiny's gradient graph ran faster,
                          interleaved A/B)
The proposed set (1-4, 6) ran the gradient graph faster than without it on both
workloads, by more than the A/A noise of the measurement.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import onnx_ir as ir

from ortrain.graph_passes.cleanup.backward_cleanup import clean_backward
from ortrain.graph_passes.fusions.bias_gelu import fuse_bias_gelu
from ortrain.graph_passes.fusions.layer_norm import fuse_layer_norm
from ortrain.graph_passes.fusions.matmul_add import fuse_matmul_add
from ortrain.graph_passes.fusions.matmul_transpose import fuse_matmul_transpose
from ortrain.graph_passes.fusions.rms_norm import fuse_rms_norm
from ortrain.graph_passes.fusions.sink_row_scale import sink_row_scales
from ortrain.graph_passes.fusions.skip_layer_norm import fuse_skip_layer_norm
from ortrain.graph_passes.infra.pipeline import Pass, Stage


@dataclasses.dataclass(frozen=True)
class Fusion:
    name: str
    run: Callable[[ir.Model], int]
    before_autodiff: bool
    default: bool  # proposed for the training pipeline (measured not to slow it down)
    stage: Stage = "fusions"  # the pass table's stage: the folder of ``run``'s module

    def as_pass(self) -> Pass:
        gate = "optimize_graph" if self.default else f"optimize_graph, fusions={self.name}"
        return Pass(
            self.name,
            self.run,
            stage=self.stage,
            test="tests/test_fusions.py",
            gate=gate,
            on_eval=self.before_autodiff,  # the forward fusions run on evaluation graphs too
        )


FUSIONS: dict[str, Fusion] = {
    f.name: f
    for f in (
        Fusion("fuse_layer_norm", fuse_layer_norm, True, True),
        Fusion("fuse_rms_norm", fuse_rms_norm, True, True),
        Fusion("fuse_matmul_transpose", fuse_matmul_transpose, True, True),
        Fusion("fuse_matmul_add", fuse_matmul_add, True, True),
        Fusion("fuse_bias_gelu", fuse_bias_gelu, True, True),
        Fusion("fuse_skip_layer_norm", fuse_skip_layer_norm, True, False),
        Fusion("clean_backward", clean_backward, False, True, stage="cleanup"),
        Fusion("sink_row_scale", sink_row_scales, False, True),
    )
}


@dataclasses.dataclass(frozen=True)
class TrainingFusions:
    before_autodiff: list[Pass]  # run after fuse_gelu
    after_autodiff: list[Pass]  # run after lower_cross_entropy


def training_fusions(names: Sequence[str] | None = None) -> TrainingFusions:
    """The proposed fusion passes (or ``names``), in pipeline order."""
    chosen = [f for f in FUSIONS.values() if (f.default if names is None else f.name in names)]
    unknown = set(names or ()) - set(FUSIONS)
    if unknown:
        raise ValueError(f"unknown fusions {sorted(unknown)}; known: {list(FUSIONS)}")
    return TrainingFusions(
        [f.as_pass() for f in chosen if f.before_autodiff],
        [f.as_pass() for f in chosen if not f.before_autodiff],
    )
