"""The training build as one ordered list of passes, run by ``pipeline.run_pipeline``.

Every pass reads and writes one ``onnx_ir.Model``; what passes hand to later passes
(the value to differentiate, the gradient outputs, the accumulator aliases) lives in
one ``TrainingBuild`` record instead of flags spread through the trainer.

Order (forward passes first, then autodiff, then backward passes):

1. seed_dropout       each Dropout gets its own seed (before anything could merge two)
2. fuse_gelu          decomposed GELU chains -> Gelu (fewer nodes to differentiate)
3. mixed_precision    fp16/bf16 compute from half copies of the fp32 parameters
4. loss_scaling       differentiate ``loss * loss_scale`` (a graph input)
5. autodiff           minimal gradient graph, outputs ``grad:<param>``
6. fold_transpose_gemm / lower_cross_entropy   backward and loss kernels
7. accumulate         ``grad = acc + micro-grad`` bound in place
8. remove_unused      forward values nothing reads any more
"""

from __future__ import annotations

import dataclasses

import onnx_ir as ir

from graph_passes.accumulate import accumulate_gradients
from graph_passes.autodiff import GradientGraphResult, build_gradient_graph
from graph_passes.dropout_seed import seed_dropouts
from graph_passes.fold_transpose_gemm import fold_transpose_into_gemm
from graph_passes.fusions.gelu import fuse_gelu
from graph_passes.loss_scaling import scale_loss
from graph_passes.lower_cross_entropy import lower_softmax_cross_entropy
from graph_passes.mixed_precision import convert_to_mixed_precision
from graph_passes.pipeline import Pass


@dataclasses.dataclass
class TrainingBuild:
    """Inputs of one training build and what its passes produce for later ones."""

    loss: str  # the model's (unscaled) loss output
    wrt: list[str]  # trainable graph inputs
    seed: int = 0
    accumulate: bool = False
    mixed_precision: str | None = None  # "fp16" | "bf16" | None
    loss_scaling: bool = False
    # Produced by the passes:
    diff_loss: str = ""  # the value autodiff starts from
    gradient: GradientGraphResult | None = None
    accumulators: dict[str, str] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        self.diff_loss = self.diff_loss or self.loss


def training_passes(build: TrainingBuild) -> list[Pass]:
    passes = [
        Pass("seed_dropout", lambda m: seed_dropouts(m, build.seed)),
        Pass("fuse_gelu", fuse_gelu),
    ]
    if build.mixed_precision is not None:
        precision = build.mixed_precision
        passes.append(Pass("mixed_precision", lambda m: convert_to_mixed_precision(m, precision)))
    if build.loss_scaling:

        def _scale(m: ir.Model) -> None:
            build.diff_loss = scale_loss(m, build.loss)

        passes.append(Pass("loss_scaling", _scale))

    def _autodiff(m: ir.Model) -> None:
        build.gradient = build_gradient_graph(m, build.diff_loss, build.wrt)

    passes += [
        Pass("autodiff", _autodiff),
        Pass("fold_transpose_gemm", fold_transpose_into_gemm),
        Pass("lower_cross_entropy", lower_softmax_cross_entropy),
    ]
    if build.accumulate:

        def _accumulate(m: ir.Model) -> None:
            assert build.gradient is not None
            build.accumulators = accumulate_gradients(m, build.gradient.grad_outputs)

        passes.append(Pass("accumulate", _accumulate))
    passes.append(Pass("remove_unused", ir.passes.common.RemoveUnusedNodesPass()))
    return passes


def eval_passes(mixed_precision: str | None) -> list[Pass]:
    """Evaluation graphs: the same precision as training, no gradients."""
    passes = [Pass("fuse_gelu", fuse_gelu)]
    if mixed_precision is not None:
        passes.append(
            Pass("mixed_precision", lambda m: convert_to_mixed_precision(m, mixed_precision))
        )
    passes.append(Pass("lower_cross_entropy", lower_softmax_cross_entropy))
    return passes
