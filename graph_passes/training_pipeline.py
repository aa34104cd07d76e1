"""The training build as one ordered list of passes, run by ``pipeline.run_pipeline``.

Every pass reads and writes one ``onnx_ir.Model``; what passes hand to later passes
(the value to differentiate, the gradient outputs, the accumulator aliases) lives in
one ``TrainingBuild`` record instead of flags spread through the trainer.

Order (forward passes first, then autodiff, then backward passes; * = optimizations,
left out with ``optimize=False``):

1.  seed_dropout       each Dropout gets its own seed (before anything could merge two)
    masked_attention_rows  fully masked attention rows give 0, as torch's SDPA (export fix)
    stable_log_sigmoid Log(Sigmoid(x)) as -Softplus(-x): finite where Sigmoid rounds to 0
    inline_control_flow  Loops with a constant trip count unrolled, constant Ifs inlined
    unroll_rnn         LSTM / GRU / RNN nodes as standard ops (autodiff differentiates those)
2.  clean_forward*     constant folding, dropout-safe CSE, dead code (forward_cleanup.py)
    pad_as_concat*     integer Pads (the labels') as Concat: CUDA has no integer Pad
3.  fuse_gelu*         decomposed GELU chains -> Gelu (fewer nodes to differentiate)
4.  fusions*           LayerNorm, FusedMatMul, Gemm, BiasGelu (``ortrain.graph_passes.fusions``)
    pow_as_mul*        Pow(x, 2 or 3) as products (after the fusions whose patterns read Pow)
    label_sparsity*    loss heads run on the labelled rows only (``label_rows`` given)
5.  mixed_precision    fp16/bf16 compute from half copies of the fp32 parameters
6.  loss_scaling       differentiate ``loss * loss_scale`` (a graph input)
7.  autodiff           minimal gradient graph, outputs ``grad:<param>`` (``cpu_kernels=True``:
                       GELU, LayerNorm and Softmax backwards as fused ``ortrain.cpu`` ops)
8.  fold_transpose_gemm* / lower_cross_entropy*   backward and loss kernels
9.  clean_backward*    folding, CSE, Transpose folding, merged gradient Sums
10. accumulate         ``grad = acc + micro-grad`` bound in place
11. recompute          cheap forward values the backward reads are made again there
                       (``RecomputePolicy``; NOTHING = off)
    recompute_attention  attention probabilities made again from Q, K and the mask
                       next to their backward (with the memory plan)
12. remove_unused      forward values nothing reads any more
13. blas_gemm          fp32 products on the BLAS custom op (``blas_gemm=True``: CPU
                       sessions whose ``cpu_gemm`` picks it; a kernel choice, made last)
    blas_batch_matmul  attention's batched products on MKL's sgemm_batch, head
                       transposes folded (``blas_batch=True``)
14. scatter_rows       embedding gradients' row scatter-adds on ortrain's CPU kernel
                       (``cpu_kernels=True``; a kernel choice too)
    scatter_in_place   a tied LM head's weight gradient written into the gradient
                       buffer, the scatter adding to it in place (``shared_outputs``)
15. cpu_softmax        masked fp32 Softmax (with the mask's Add) on ortrain's CPU
                       kernel (``cpu_kernels=True``; a kernel choice too)
    cpu_scatter_last   the cross-entropy gradient's ScatterElements, in place over
                       the probabilities (``cpu_kernels=True``; a kernel choice too)
    causal_products    causal attention's products skip the zeros of their triangular
                       operand (``cpu_kernels`` and ``blas_batch``)
16. gelu_value         recomputed GELUs as the GELU backward kernel's second output
                       (``cpu_kernels=True``)
17. cpu_layer_norm     fp32 LayerNorms (with the residual Add before them) and GELUs
    cpu_gelu           on ortrain's CPU kernels, which share the BLAS products' threads
    layer_norm_grad_sum  the residual gradient's Sums taken into LayerNormGrad
    cpu_split_concat   last-axis fp32 Splits / Concats (the QKV's) copied on those threads
    cpu_elementwise    large fp32 Mul / Add / Sub / Sum on those threads
                       (``cpu_kernels=True``; kernel choices too)
18. update_in_backward each parameter's Adam/AdamW update right after its gradient, in
                       the graph (``update_groups`` given; needs ``cpu_kernels``): no
                       gradient outlives its update. ``scatter_in_place`` then only adds
                       its early leaf (the gradients are no buffers of the trainer's)
    transposed_weight_grad  a vocabulary-sized weight gradient only its update reads
                       made as ``dW^T`` (MLAS's faster orientation), the update and the
                       tied table's scatter reading it so
19. transposed_activations  kernel outputs (LayerNorm, GELU, GELU backward, Mul) written
                       transposed where the products reading them run faster so (MLAS's
                       ``transA``, rows 4 KiB apart); ``cpu_kernels=True``
"""

from __future__ import annotations

import dataclasses

import onnx_ir as ir
import onnx_ir.passes.common

from ortrain.graph_passes.autodiff import GradientGraphResult, build_gradient_graph
from ortrain.graph_passes.cleanup.fold_transpose_gemm import fold_transpose_into_gemm
from ortrain.graph_passes.cleanup.forward_cleanup import clean_forward
from ortrain.graph_passes.cleanup.pad_as_concat import pad_as_concat
from ortrain.graph_passes.cleanup.pow_as_mul import pow_as_mul
from ortrain.graph_passes.fusions import training_fusions
from ortrain.graph_passes.fusions.gelu import fuse_gelu
from ortrain.graph_passes.fusions.log_sigmoid import stable_log_sigmoid
from ortrain.graph_passes.fusions.lower_cross_entropy import lower_softmax_cross_entropy
from ortrain.graph_passes.infra.pipeline import Pass
from ortrain.graph_passes.memory.recompute import RecomputePolicy, recompute_cheap_values
from ortrain.graph_passes.memory.recompute_attention import recompute_attention_probs
from ortrain.graph_passes.precision.loss_scaling import scale_loss
from ortrain.graph_passes.precision.mixed_precision import convert_to_mixed_precision
from ortrain.graph_passes.prepare.dropout_seed import seed_dropouts
from ortrain.graph_passes.prepare.inline_control_flow import inline_control_flow
from ortrain.graph_passes.prepare.masked_attention_rows import fix_masked_attention_rows
from ortrain.graph_passes.prepare.unroll_rnn import unroll_rnns
from ortrain.graph_passes.targets.cpu.blas_batch_matmul import lower_batch_matmul
from ortrain.graph_passes.targets.cpu.blas_gemm import lower_gemm_to_blas
from ortrain.graph_passes.targets.cpu.causal_products import mark_causal_products
from ortrain.graph_passes.targets.cpu.elementwise import lower_elementwise
from ortrain.graph_passes.targets.cpu.gelu import lower_gelu
from ortrain.graph_passes.targets.cpu.gelu_value import take_gelu_values
from ortrain.graph_passes.targets.cpu.layer_norm import lower_layer_norm
from ortrain.graph_passes.targets.cpu.layer_norm_grad_sum import fold_layer_norm_grad_sums
from ortrain.graph_passes.targets.cpu.scatter_in_place import (
    base_ready_leaves,
    scatter_into_gradients,
)
from ortrain.graph_passes.targets.cpu.scatter_last import lower_scatter_last
from ortrain.graph_passes.targets.cpu.scatter_rows import lower_scatter_add_rows
from ortrain.graph_passes.targets.cpu.softmax import lower_softmax
from ortrain.graph_passes.targets.cpu.split_concat import lower_split_concat
from ortrain.graph_passes.targets.cpu.transposed_activations import write_activations_transposed
from ortrain.graph_passes.targets.cpu.transposed_weight_grad import transpose_weight_gradients
from ortrain.graph_passes.targets.cpu.update_in_backward import update_in_backward
from ortrain.graph_passes.training.accumulate import accumulate_gradients
from ortrain.graph_passes.training.label_sparsity import shrink_label_rows


@dataclasses.dataclass
class TrainingBuild:
    """Inputs of one training build and what its passes produce for later ones."""

    loss: str  # the model's (unscaled) loss output
    wrt: list[str]  # trainable graph inputs
    seed: int = 0
    accumulate: bool = False
    mixed_precision: str | None = None  # "fp16" | "bf16" | None
    loss_scaling: bool = False
    recompute: RecomputePolicy = RecomputePolicy.NOTHING
    optimize: bool = True  # the optimization passes (* above); False: only what training needs
    fusions: tuple[str, ...] | None = None  # names from ``fusions.FUSIONS``; None: the default set
    # loss node -> rows to keep (label_sparsity.py); empty: every row
    label_rows: dict[str, int] = dataclasses.field(default_factory=dict)
    blas_gemm: bool = False  # fp32 products -> ortrain.blas.Gemm (blas_gemm.py)
    blas_batch: bool = False  # batched products -> ortrain.blas.BatchMatMul
    cpu_kernels: bool = False  # rules may emit fused ortrain.cpu backward kernels (CPU)
    # param -> its param group: Adam/AdamW updates in the backward (update_in_backward.py)
    update_groups: dict[str, int] = dataclasses.field(default_factory=dict)
    # Produced by the passes:
    diff_loss: str = ""  # the value autodiff starts from
    gradient: GradientGraphResult | None = None
    accumulators: dict[str, str] = dataclasses.field(default_factory=dict)
    # output -> the gradient output whose buffer it shares (scatter_in_place.py)
    shared_outputs: dict[str, str] = dataclasses.field(default_factory=dict)
    # param -> its update's ``done`` output (update_in_backward.py)
    update_outputs: dict[str, str] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        self.diff_loss = self.diff_loss or self.loss
        if self.update_groups and not self.cpu_kernels:
            raise ValueError("the update in the backward runs on ortrain's CPU kernels")
        if self.update_groups and (self.accumulate or self.loss_scaling):
            raise ValueError(
                "the update in the backward takes one micro-step per update and no loss scaling"
            )


def training_passes(build: TrainingBuild) -> list[Pass]:
    passes = [
        Pass("seed_dropout", lambda m: seed_dropouts(m, build.seed)),
        Pass("masked_attention_rows", fix_masked_attention_rows),
        Pass("stable_log_sigmoid", stable_log_sigmoid),
        Pass("inline_control_flow", inline_control_flow),
        Pass("unroll_rnn", unroll_rnns),
    ]
    if build.optimize:
        passes += [Pass("clean_forward", clean_forward), Pass("pad_as_concat", pad_as_concat)]
        passes += [Pass("fuse_gelu", fuse_gelu), *training_fusions(build.fusions).before_autodiff]
        passes.append(Pass("pow_as_mul", pow_as_mul))
        if build.label_rows:
            rows = build.label_rows
            passes.append(Pass("label_sparsity", lambda m: shrink_label_rows(m, rows)))
    if build.mixed_precision is not None:
        precision = build.mixed_precision
        passes.append(Pass("mixed_precision", lambda m: convert_to_mixed_precision(m, precision)))
    if build.loss_scaling:

        def _scale(m: ir.Model) -> None:
            build.diff_loss = scale_loss(m, build.loss)

        passes.append(Pass("loss_scaling", _scale))

    def _autodiff(m: ir.Model) -> None:
        build.gradient = build_gradient_graph(
            m, build.diff_loss, build.wrt, cpu_kernels=build.cpu_kernels
        )

    passes.append(Pass("autodiff", _autodiff))
    if build.optimize:
        passes += [
            Pass("fold_transpose_gemm", fold_transpose_into_gemm),
            Pass("lower_cross_entropy", lower_softmax_cross_entropy),
            *training_fusions(build.fusions).after_autodiff,
        ]
    if build.accumulate:

        def _accumulate(m: ir.Model) -> None:
            assert build.gradient is not None
            build.accumulators = accumulate_gradients(m, build.gradient.grad_outputs)

        passes.append(Pass("accumulate", _accumulate))
    if build.recompute is not RecomputePolicy.NOTHING:
        policy = build.recompute
        passes.append(Pass("recompute", lambda m: recompute_cheap_values(m, policy)))
        passes.append(Pass("recompute_attention", recompute_attention_probs))
    passes.append(Pass("remove_unused", ir.passes.common.RemoveUnusedNodesPass()))
    if build.blas_gemm:
        passes.append(Pass("blas_gemm", lower_gemm_to_blas))
    if build.blas_batch:
        passes.append(Pass("blas_batch_matmul", lower_batch_matmul))
    if build.cpu_kernels:
        passes.append(Pass("scatter_rows", lower_scatter_add_rows))

        def _in_place(m: ir.Model) -> None:
            assert build.gradient is not None
            grads = build.gradient.grad_outputs.values()
            if build.update_groups:
                base_ready_leaves(m, grads)
            else:
                build.shared_outputs = scatter_into_gradients(m, grads)

        passes.append(Pass("scatter_in_place", _in_place))
        passes.append(Pass("cpu_softmax", lower_softmax))
        passes.append(Pass("cpu_scatter_last", lower_scatter_last))
        if build.blas_batch:
            passes.append(Pass("causal_products", mark_causal_products))
        passes.append(Pass("gelu_value", take_gelu_values))
        passes.append(Pass("cpu_layer_norm", lower_layer_norm))
        passes.append(Pass("cpu_gelu", lower_gelu))
        passes.append(Pass("layer_norm_grad_sum", fold_layer_norm_grad_sums))
        passes.append(Pass("cpu_split_concat", lower_split_concat))
        passes.append(Pass("cpu_elementwise", lower_elementwise))
    if build.update_groups:

        def _update(m: ir.Model) -> None:
            assert build.gradient is not None
            build.update_outputs = update_in_backward(
                m, build.gradient.grad_outputs, build.update_groups, build.loss
            )

        passes.append(Pass("update_in_backward", _update))
        passes.append(Pass("transposed_weight_grad", transpose_weight_gradients))
    if build.cpu_kernels:
        passes.append(Pass("transposed_activations", write_activations_transposed))
    return passes


def eval_passes(
    mixed_precision: str | None,
    optimize: bool = True,
    blas_gemm: bool = False,
    cpu_kernels: bool = False,
    blas_batch: bool = False,
) -> list[Pass]:
    """Evaluation graphs: the same precision and forward passes as training, no gradients."""
    passes = [
        Pass("seed_dropout", lambda m: seed_dropouts(m, 0)),
        Pass("masked_attention_rows", fix_masked_attention_rows),
        Pass("stable_log_sigmoid", stable_log_sigmoid),
    ]
    if optimize:
        passes += [Pass("clean_forward", clean_forward), Pass("pad_as_concat", pad_as_concat)]
        passes += [Pass("fuse_gelu", fuse_gelu), *training_fusions().before_autodiff]
        passes.append(Pass("pow_as_mul", pow_as_mul))
    if mixed_precision is not None:
        passes.append(
            Pass("mixed_precision", lambda m: convert_to_mixed_precision(m, mixed_precision))
        )
    if optimize:
        passes.append(Pass("lower_cross_entropy", lower_softmax_cross_entropy))
    if blas_gemm:
        passes.append(Pass("blas_gemm", lower_gemm_to_blas))
    if blas_batch:
        passes.append(Pass("blas_batch_matmul", lower_batch_matmul))
    if cpu_kernels:
        passes.append(Pass("cpu_softmax", lower_softmax))
        if blas_batch:
            passes.append(Pass("causal_products", mark_causal_products))
        passes.append(Pass("cpu_layer_norm", lower_layer_norm))
        passes.append(Pass("cpu_gelu", lower_gelu))
        passes.append(Pass("cpu_split_concat", lower_split_concat))
        passes.append(Pass("cpu_elementwise", lower_elementwise))
    return passes
