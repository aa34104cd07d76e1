"""The training build as one ordered list of passes, made by one function from the build
configuration and the target, run by ``infra.pipeline.run_pipeline``.

``build_pipeline(config, inputs, products)`` lists every pass the pipeline has, in order,
each with the gate that turns it on, and keeps those whose gate is on for ``config`` and
whose target is ``config.target``. Every pass reads and writes one ``onnx_ir.Model``;
what passes hand to later passes (the value to differentiate, the gradient outputs, the
accumulator aliases, the shared and update outputs) lives in one ``BuildProducts`` record
that they fill. ``eval_pipeline(config)`` is the same list's forward prefix (the passes
before autodiff) followed by the lowerings that apply to a forward graph: the passes
marked ``on_eval``. ``python -m ortrain.graph_passes.pass_table`` prints the whole list
(``docs/passes.md``).

Order (forward passes first, then autodiff, then backward passes; * = optimizations,
left out with ``optimize=False``):

1.  seed_dropout       each Dropout gets its own seed (before anything could merge two)
    dropout_switch     training Dropouts read one bool input (``dropout_switch``: a verified
                       first step runs without dropout, ``ortrain/verify.py``)
    masked_attention_rows  fully masked attention rows give 0, as torch's SDPA (export fix)
    stable_log_sigmoid Log(Sigmoid(x)) as -Softplus(-x): finite where Sigmoid rounds to 0
    exact_sigmoid_under_log  a Sigmoid a Log reads among others (``log p``, ``log(1 - p)``:
                       BCELoss) written out exactly in both tails
    inline_control_flow  Loops with a constant trip count unrolled, constant Ifs inlined
    unroll_rnn         LSTM / GRU / RNN nodes as standard ops (autodiff differentiates those)
2.  clean_forward*     constant folding, dropout-safe CSE, dead code (forward_cleanup.py)
    pad_as_concat*     integer Pads (the labels') as Concat: CUDA has no integer Pad
3.  fuse_gelu*         decomposed GELU chains -> Gelu (fewer nodes to differentiate)
4.  fusions*           LayerNorm, FusedMatMul, Gemm, BiasGelu (``ortrain.graph_passes.fusions``)
    pow_as_mul*        Pow(x, 2 or 3) as products (after the fusions whose patterns read Pow)
    batch_norm_training  a BatchNorm fed batch statistics computed beside it as one
                       training-mode BatchNormalization (``cpu_kernels=True``, fp32: its
                       backward is then one ``ortrain.cpu.BatchNormGrad``)
    label_sparsity*    loss heads run on the labelled rows only (``label_rows`` given)
5.  mixed_precision    fp16/bf16 compute from half copies of the fp32 parameters
6.  loss_scaling       differentiate ``loss * loss_scale`` (a graph input)
7.  autodiff           minimal gradient graph, outputs ``grad:<param>`` (``cpu_kernels=True``:
                       GELU, LayerNorm, BatchNorm and Softmax backwards as fused
                       ``ortrain.cpu`` ops)
    drop_stop_gradients  ``x.detach()`` / ``torch.no_grad()`` markers removed once
                       autodiff has stopped the gradient there (``ortrain/stop_gradient.py``)
8.  fold_transpose_gemm* / lower_cross_entropy*   backward and loss kernels
9.  clean_backward*    folding, CSE, Transpose folding, merged gradient Sums
10. accumulate         ``grad = acc + micro-grad`` bound in place
11. recompute          cheap forward values the backward reads are made again there
                       (``RecomputePolicy``; NOTHING = off)
    recompute_attention  attention probabilities made again from Q, K and the mask
                       next to their backward (with the memory plan)
12. remove_unused      forward values nothing reads any more
    half_in_float      bf16 nodes ONNX Runtime's CPU provider has no kernel for computed
                       in float32, cast back after (its kernel registry decides)
13. blas_gemm          fp32 products on the BLAS custom op (``blas_gemm=True``: CPU
                       sessions whose ``cpu_gemm`` picks it; a kernel choice, made last)
    blas_batch_matmul  attention's batched products on MKL's sgemm_batch, head
                       transposes folded (``blas_batch=True``)
14. scatter_rows       embedding gradients' row scatter-adds on ortrain's CPU kernel
                       (``cpu_kernels=True``; a kernel choice too)
    scatter_in_place   a tied LM head's weight gradient written into the gradient
                       buffer, the scatter adding to it in place (``shared_outputs``;
                       not in a segment's graph, whose gradients go back to torch)
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
    cpu_dropout        training Dropouts drawn by ortrain's CPU kernel: counter-based, on
                       those threads (``cpu_kernels=True``; a kernel choice too)
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
                       ``transA``, rows a multiple of the L1 way size apart);
                       ``cpu_kernels=True``
20. ort_order          (on the serialized copy for ONNX Runtime) leaves last, so ONNX
                       Runtime finishes each weight gradient early; the ``onnx_ir`` model
                       keeps its order
    kernel_threads     (serialized) ``ortrain.cpu`` kernels on the products' threads

Inline control flow and RNN unrolling exist for autodiff, and loss scaling and label
sparsity for training, so evaluation graphs leave them out.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import onnx_ir as ir
import onnx_ir.passes.common

from ortrain.core.build_config import BuildConfig, BuildInputs
from ortrain.core.names import (
    DROPOUT_SWITCH_INPUT,
    IN_BACKWARD_STATES,
    LOSS_SCALE_INPUT,
    hyper_name,
    state_key,
)
from ortrain.core.roles import GraphIO, Role
from ortrain.graph_passes.autodiff import GradientGraphResult, build_gradient_graph
from ortrain.graph_passes.cleanup.drop_stop_gradients import drop_stop_gradients
from ortrain.graph_passes.cleanup.fold_transpose_gemm import fold_transpose_into_gemm
from ortrain.graph_passes.cleanup.forward_cleanup import clean_forward
from ortrain.graph_passes.cleanup.pad_as_concat import pad_as_concat
from ortrain.graph_passes.cleanup.pow_as_mul import pow_as_mul
from ortrain.graph_passes.fusions import FUSIONS, training_fusions
from ortrain.graph_passes.fusions.exact_sigmoid import exact_sigmoid_under_log
from ortrain.graph_passes.fusions.gelu import fuse_gelu
from ortrain.graph_passes.fusions.log_sigmoid import stable_log_sigmoid
from ortrain.graph_passes.fusions.lower_cross_entropy import lower_softmax_cross_entropy
from ortrain.graph_passes.infra.pipeline import AnyPass, Pass, SerializedPass
from ortrain.graph_passes.memory.ort_order import order_for_ort
from ortrain.graph_passes.memory.recompute import RecomputePolicy, recompute_cheap_values
from ortrain.graph_passes.memory.recompute_attention import recompute_attention_probs
from ortrain.graph_passes.precision.loss_scaling import scale_loss
from ortrain.graph_passes.precision.mixed_precision import convert_to_mixed_precision
from ortrain.graph_passes.prepare.dropout_seed import seed_dropouts
from ortrain.graph_passes.prepare.dropout_switch import switch_dropouts
from ortrain.graph_passes.prepare.inline_control_flow import inline_control_flow
from ortrain.graph_passes.prepare.masked_attention_rows import fix_masked_attention_rows
from ortrain.graph_passes.prepare.random_switch import switch_random_draws
from ortrain.graph_passes.prepare.unroll_rnn import unroll_rnns
from ortrain.graph_passes.targets.cpu.batch_norm_training import train_batch_norms
from ortrain.graph_passes.targets.cpu.blas_batch_matmul import lower_batch_matmul
from ortrain.graph_passes.targets.cpu.blas_gemm import lower_gemm_to_blas
from ortrain.graph_passes.targets.cpu.causal_products import mark_causal_products
from ortrain.graph_passes.targets.cpu.dropout import lower_dropout
from ortrain.graph_passes.targets.cpu.elementwise import lower_elementwise
from ortrain.graph_passes.targets.cpu.gelu import lower_gelu
from ortrain.graph_passes.targets.cpu.gelu_value import take_gelu_values
from ortrain.graph_passes.targets.cpu.half_in_float import compute_half_in_float
from ortrain.graph_passes.targets.cpu.kernel_threads import place_kernel_threads
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

__all__ = [
    "BuildConfig",
    "BuildInputs",
    "BuildProducts",
    "build_pipeline",
    "eval_pipeline",
    "pipeline_entries",
    "serialized_passes",
    "target_pipeline",
]


@dataclasses.dataclass
class BuildProducts:
    """What a training build's passes produce for later passes and for the trainer."""

    diff_loss: str = ""  # the value autodiff starts from ("": the inputs' loss)
    gradient: GradientGraphResult | None = None
    accumulators: dict[str, str] = dataclasses.field(default_factory=dict)
    # output -> the gradient output whose buffer it shares (scatter_in_place.py)
    shared_outputs: dict[str, str] = dataclasses.field(default_factory=dict)
    # param -> its update's ``done`` output (update_in_backward.py)
    update_outputs: dict[str, str] = dataclasses.field(default_factory=dict)
    # the roles of the inputs and outputs the passes created, written where they made them
    # (the training graph's manifest is the export's roles plus these)
    io: list[GraphIO] = dataclasses.field(default_factory=list)

    def grad_outputs(self) -> dict[str, str]:
        if self.gradient is None:
            raise RuntimeError("a pass after autodiff ran before autodiff")
        return self.gradient.grad_outputs


Gate = Callable[[BuildConfig, BuildInputs], bool]


@dataclasses.dataclass(frozen=True)
class Entry:
    """One pass of the full pipeline and the predicate behind its ``gate`` string."""

    pass_: AnyPass
    on: Gate


def _always(c: BuildConfig, i: BuildInputs) -> bool:
    return True


def _optimize(c: BuildConfig, i: BuildInputs) -> bool:
    return c.optimize


def _cpu_kernels(c: BuildConfig, i: BuildInputs) -> bool:
    return c.cpu_kernels


def serialized_passes() -> list[SerializedPass]:
    """The passes on the serialized copy handed to ONNX Runtime (every graph, the update
    graphs included: ``infra.serialize.serialize_for_ort``)."""
    return [
        SerializedPass(
            "ort_order", order_for_ort, stage="memory", test="tests/test_ort_order.py",
            on_eval=True,
        ),
        SerializedPass(
            "kernel_threads", place_kernel_threads, stage="target", target="cpu",
            test="tests/test_kernel_threads.py", on_eval=True,
        ),
    ]  # fmt: skip


def pipeline_entries(
    config: BuildConfig, inputs: BuildInputs, products: BuildProducts
) -> list[Entry]:
    """Every pass of the pipeline in order, gates not applied (the pass table's source)."""
    c = config
    chosen = training_fusions(c.fusions)  # raises on an unknown fusion name
    names = {p.name for p in (*chosen.before_autodiff, *chosen.after_autodiff)}

    def fusion(name: str) -> Entry:
        return Entry(FUSIONS[name].as_pass(), lambda c, i: c.optimize and name in names)

    before = [fusion(f.name) for f in FUSIONS.values() if f.before_autodiff]
    after = [fusion(f.name) for f in FUSIONS.values() if not f.before_autodiff]

    def diff_loss() -> str:
        return products.diff_loss or inputs.loss

    def scale(m: ir.Model) -> bool:
        products.diff_loss = scale_loss(m, inputs.loss)
        products.io.append(GraphIO(LOSS_SCALE_INPUT, Role.LOSS_SCALE))
        return True

    def switch(m: ir.Model) -> int:
        count = switch_dropouts(m)
        if count:
            products.io.append(GraphIO(DROPOUT_SWITCH_INPUT, Role.DROPOUT_SWITCH))
        return count

    def switch_draws(m: ir.Model) -> int:
        count = switch_random_draws(m)
        if count and not any(io.name == DROPOUT_SWITCH_INPUT for io in products.io):
            products.io.append(GraphIO(DROPOUT_SWITCH_INPUT, Role.DROPOUT_SWITCH))
        return count

    def autodiff(m: ir.Model) -> bool:
        products.gradient = build_gradient_graph(
            m, diff_loss(), list(inputs.wrt), cpu_kernels=c.cpu_kernels, seeds=inputs.seeds
        )
        if not inputs.seeds:
            products.io.append(GraphIO(inputs.loss, Role.LOSS))
            grads = products.gradient.grad_outputs.items()
            products.io += [GraphIO(out, Role.GRADIENT, of=p) for p, out in grads]
        return bool(products.gradient.grad_outputs)

    def accumulate(m: ir.Model) -> bool:
        products.accumulators = accumulate_gradients(m, products.grad_outputs())
        param_of = {out: p for p, out in products.grad_outputs().items()}
        products.io += [
            GraphIO(acc, Role.ACCUMULATOR, of=param_of[out])
            for acc, out in products.accumulators.items()
        ]
        return bool(products.accumulators)

    def in_place(m: ir.Model) -> int:
        grads = products.grad_outputs().values()
        if c.update_groups:
            return base_ready_leaves(m, grads)
        products.shared_outputs = scatter_into_gradients(m, grads)
        param_of = {out: p for p, out in products.grad_outputs().items()}
        products.io += [  # a second output of the same gradient: bound to the same buffer
            GraphIO(out, Role.GRADIENT, of=param_of[grad])
            for out, grad in products.shared_outputs.items()
        ]
        return len(products.shared_outputs)

    def update(m: ir.Model) -> bool:
        products.update_outputs = update_in_backward(
            m, products.grad_outputs(), dict(c.update_groups), inputs.loss
        )
        done = products.update_outputs
        gradients = set(products.grad_outputs().values())
        # the gradients are no outputs any more: each update's inputs and ``done`` instead
        products.io = [r for r in products.io if r.name not in gradients]
        group_of = dict(c.update_groups)
        products.io += [
            GraphIO(state_key(s, p), Role.OPTIMIZER_STATE, of=p)
            for p in done
            for s in IN_BACKWARD_STATES
        ]
        products.io += [
            GraphIO(hyper_name(g), Role.HYPERPARAMETER) for g in sorted({group_of[p] for p in done})
        ]
        products.io += [GraphIO(out, Role.UPDATE_APPLIED, of=p) for p, out in done.items()]
        return bool(done)

    policy = RecomputePolicy[c.recompute]
    rows = dict(inputs.label_rows)
    opt = "optimize_graph"
    kernels = "cpu_kernels"
    batch = "cpu_gemm (with MKL's sgemm_batch)"
    test_passes = "tests/test_passes.py"
    fwd_kernels = "tests/test_forward_kernels.py"
    return [
        Entry(
            Pass("seed_dropout", lambda m: seed_dropouts(m, c.seed), stage="prepare",
                 test=test_passes, on_eval=True, impl=seed_dropouts),
            _always,
        ),
        Entry(
            Pass("dropout_switch", switch, stage="prepare", gate="verify",
                 test="tests/test_verify.py", impl=switch_dropouts),
            lambda c, i: c.dropout_switch,
        ),
        Entry(
            Pass("random_switch", switch_draws, stage="prepare", gate="verify",
                 test="tests/test_random_switch.py", impl=switch_random_draws),
            lambda c, i: c.dropout_switch,
        ),
        Entry(
            Pass("masked_attention_rows", fix_masked_attention_rows, stage="prepare",
                 test=test_passes, on_eval=True),
            _always,
        ),
        Entry(
            Pass("stable_log_sigmoid", stable_log_sigmoid, stage="fusions",
                 test="tests/test_rules_activation.py", on_eval=True),
            _always,
        ),
        Entry(
            Pass("exact_sigmoid_under_log", exact_sigmoid_under_log, stage="fusions",
                 test="tests/test_export_losses.py", on_eval=True),
            _always,
        ),
        Entry(
            Pass("inline_control_flow", inline_control_flow, stage="prepare",
                 test="tests/test_control_flow.py"),
            _always,
        ),
        Entry(Pass("unroll_rnn", unroll_rnns, stage="prepare", test="tests/test_rnn.py"), _always),
        Entry(
            Pass("clean_forward", clean_forward, stage="cleanup", gate=opt, test=test_passes,
                 on_eval=True),
            _optimize,
        ),
        Entry(
            Pass("pad_as_concat", pad_as_concat, stage="cleanup", gate=opt, test=test_passes,
                 on_eval=True),
            _optimize,
        ),
        Entry(
            Pass("fuse_gelu", fuse_gelu, stage="fusions", gate=opt, test=test_passes,
                 on_eval=True),
            _optimize,
        ),
        *before,
        Entry(
            Pass("pow_as_mul", pow_as_mul, stage="cleanup", gate=opt, test=test_passes,
                 on_eval=True),
            _optimize,
        ),
        Entry(
            Pass("batch_norm_training", train_batch_norms, stage="prepare", target="cpu",
                 gate="cpu_kernels, fp32", test="tests/test_grad_kernels.py"),
            lambda c, i: c.cpu_kernels and c.mixed_precision is None,
        ),
        Entry(
            Pass("label_sparsity", lambda m: shrink_label_rows(m, rows), stage="training",
                 gate="optimize_graph, labelled rows", test="tests/test_label_sparsity.py",
                 impl=shrink_label_rows),
            lambda c, i: c.optimize and bool(i.label_rows),
        ),
        Entry(
            Pass("mixed_precision",
                 lambda m: convert_to_mixed_precision(m, c.mixed_precision or "fp16"),
                 stage="precision", gate="mixed_precision", test="tests/test_mixed_precision.py",
                 on_eval=True, impl=convert_to_mixed_precision),
            lambda c, i: c.mixed_precision is not None,
        ),
        Entry(
            Pass("loss_scaling", scale, stage="precision", gate="loss_scale (fp16)",
                 test="tests/test_mixed_precision.py", impl=scale_loss),
            lambda c, i: c.loss_scaling,
        ),
        Entry(
            Pass("autodiff", autodiff, stage="autodiff", test="tests/test_gradient_rules.py",
                 impl=build_gradient_graph),
            _always,
        ),
        Entry(
            Pass("drop_stop_gradients", drop_stop_gradients, stage="cleanup",
                 test="tests/test_stop_gradient.py", on_eval=True),
            _always,
        ),
        Entry(
            Pass("fold_transpose_gemm", fold_transpose_into_gemm, stage="cleanup", gate=opt,
                 test=test_passes),
            _optimize,
        ),
        Entry(
            Pass("lower_cross_entropy", lower_softmax_cross_entropy, stage="fusions", gate=opt,
                 test=test_passes, on_eval=True),
            _optimize,
        ),
        *after,
        Entry(
            Pass("accumulate", accumulate, stage="training", gate="grad_accumulation_steps > 1",
                 test="tests/test_parity.py", impl=accumulate_gradients),
            lambda c, i: c.accumulate,
        ),
        Entry(
            Pass("recompute", lambda m: recompute_cheap_values(m, policy), stage="memory",
                 gate="memory_plan", test="tests/test_memory_plan.py",
                 impl=recompute_cheap_values),
            lambda c, i: policy is not RecomputePolicy.NOTHING,
        ),
        Entry(
            Pass("recompute_attention", recompute_attention_probs, stage="memory",
                 gate="memory_plan", test="tests/test_recompute_attention.py"),
            lambda c, i: policy is not RecomputePolicy.NOTHING,
        ),
        Entry(
            Pass("remove_unused", ir.passes.common.RemoveUnusedNodesPass(), stage="cleanup",
                 test="tests/test_memory_plan.py"),
            _always,
        ),
        Entry(
            Pass("half_in_float", compute_half_in_float, stage="target", target="cpu",
                 gate="not bf16", test="tests/test_half_in_float.py", on_eval=True),
            lambda c, i: c.mixed_precision != "bf16",
        ),
        Entry(
            Pass("blas_gemm", lower_gemm_to_blas, stage="target", target="cpu",
                 gate="cpu_gemm", test="tests/test_blas_gemm.py", on_eval=True),
            lambda c, i: c.blas_gemm,
        ),
        Entry(
            Pass("blas_batch_matmul", lower_batch_matmul, stage="target", target="cpu",
                 gate=batch, test="tests/test_blas_batch_matmul.py", on_eval=True),
            lambda c, i: c.blas_batch,
        ),
        Entry(
            Pass("scatter_rows", lower_scatter_add_rows, stage="target", target="cpu",
                 gate=kernels, test="tests/test_grad_kernels.py"),
            _cpu_kernels,
        ),
        Entry(
            Pass("scatter_in_place", in_place, stage="target", target="cpu",
                 gate=f"{kernels}, whole-model graphs",
                 test="tests/test_scatter_in_place.py", impl=scatter_into_gradients),
            lambda c, i: c.cpu_kernels and not i.seeds,
        ),
        Entry(
            Pass("cpu_softmax", lower_softmax, stage="target", target="cpu", gate=kernels,
                 test="tests/test_cpu_softmax.py", on_eval=True),
            _cpu_kernels,
        ),
        Entry(
            Pass("cpu_scatter_last", lower_scatter_last, stage="target", target="cpu",
                 gate=kernels, test="tests/test_scatter_last.py"),
            _cpu_kernels,
        ),
        Entry(
            Pass("causal_products", mark_causal_products, stage="target", target="cpu",
                 gate=f"{kernels}, {batch}", test="tests/test_causal_products.py", on_eval=True),
            lambda c, i: c.cpu_kernels and c.blas_batch,
        ),
        Entry(
            Pass("gelu_value", take_gelu_values, stage="target", target="cpu", gate=kernels,
                 test="tests/test_gelu_value.py"),
            _cpu_kernels,
        ),
        Entry(
            Pass("cpu_layer_norm", lower_layer_norm, stage="target", target="cpu", gate=kernels,
                 test=fwd_kernels, on_eval=True),
            _cpu_kernels,
        ),
        Entry(
            Pass("cpu_gelu", lower_gelu, stage="target", target="cpu", gate=kernels,
                 test=fwd_kernels, on_eval=True),
            _cpu_kernels,
        ),
        Entry(
            Pass("cpu_dropout", lower_dropout, stage="target", target="cpu", gate=kernels,
                 test="tests/test_dropout_kernel.py"),
            _cpu_kernels,
        ),
        Entry(
            Pass("layer_norm_grad_sum", fold_layer_norm_grad_sums, stage="target",
                 target="cpu", gate=kernels, test=fwd_kernels),
            _cpu_kernels,
        ),
        Entry(
            Pass("cpu_split_concat", lower_split_concat, stage="target", target="cpu",
                 gate=kernels, test="tests/test_layout_kernels.py", on_eval=True),
            _cpu_kernels,
        ),
        Entry(
            Pass("cpu_elementwise", lower_elementwise, stage="target", target="cpu",
                 gate=kernels, test="tests/test_elementwise_kernels.py", on_eval=True),
            _cpu_kernels,
        ),
        Entry(
            Pass("update_in_backward", update, stage="target", target="cpu",
                 gate="update_engine=backward", test="tests/test_update_in_backward.py",
                 impl=update_in_backward),
            lambda c, i: bool(c.update_groups),
        ),
        Entry(
            Pass("transposed_weight_grad", transpose_weight_gradients, stage="target",
                 target="cpu", gate="update_engine=backward",
                 test="tests/test_transposed_weight_grad.py"),
            lambda c, i: bool(c.update_groups),
        ),
        Entry(
            Pass("transposed_activations", write_activations_transposed, stage="target",
                 target="cpu", gate=kernels, test="tests/test_transposed_activations.py"),
            _cpu_kernels,
        ),
        *(Entry(p, _always) for p in serialized_passes()),
    ]  # fmt: skip


def _applies(entry: Entry, config: BuildConfig, inputs: BuildInputs) -> bool:
    target = entry.pass_.target
    return (target in ("any", config.target)) and entry.on(config, inputs)


def build_pipeline(
    config: BuildConfig, inputs: BuildInputs, products: BuildProducts
) -> list[AnyPass]:
    """The training pipeline for ``config`` (its options and target): the passes whose
    gate is on, in order; they fill ``products``."""
    entries = pipeline_entries(config, inputs, products)
    return [e.pass_ for e in entries if _applies(e, config, inputs)]


def target_pipeline(
    config: BuildConfig, inputs: BuildInputs, products: BuildProducts
) -> list[Pass]:
    """The target stage alone, in the pipeline's order and with its gates, for a gradient
    graph built elsewhere without it (``ortrain/offline.py``'s artifacts keep standard ops
    and are lowered where a session is made); ``products.gradient`` names the gradient
    outputs. The serialized passes are left to ``serialize_for_ort``."""
    passes = build_pipeline(config, inputs, products)
    return [p for p in passes if isinstance(p, Pass) and p.stage == "target"]


def eval_pipeline(config: BuildConfig) -> list[AnyPass]:
    """Evaluation graphs: the training pipeline's forward prefix (the passes before
    autodiff) and the lowerings that apply to a forward graph, no gradients."""
    inputs = BuildInputs(loss="")
    return [p for p in build_pipeline(config, inputs, BuildProducts()) if p.on_eval]
