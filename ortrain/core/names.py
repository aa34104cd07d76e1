"""What the training process needs from the passes, without the graph libraries.

``ORTTrainer`` builds its graphs in a forked child (``ortrain/build.py``) and never
imports onnx, onnx_ir or onnxscript itself; the names and records it shares with the
passes live here and the pass modules re-export them.
"""

from __future__ import annotations

import dataclasses

LOSS_SCALE_INPUT = "loss_scale"  # graph input the backward is seeded with (loss_scaling.py)
# bool scalar graph input every training Dropout reads as its training_mode (dropout_switch.py)
DROPOUT_SWITCH_INPUT = "dropout_on"
# ORTHFTrainer's labels for a loss Trainer computes (label smoothing, compute_loss_func):
# a batch key the forward does not take, so the loss function alone gets it; padded as labels
LOSS_LABELS = "loss_labels"
BLAS_DOMAIN = "ortrain.blas"  # the BLAS GEMM custom op's domain (blas_gemm.py)
CPU_DOMAIN = "ortrain.cpu"  # fused CPU backward kernels (ortrain/runtime/grad_kernels.c)
# ``x.detach()`` and values made under ``torch.no_grad()`` (ortrain/stop_gradient.py): an
# identity autodiff does not differentiate through, dropped after autodiff
GRAD_DOMAIN = "ortrain.grad"
STOP_GRADIENT = "StopGradient"
# metadata of an inference-mode BatchNormalization fed its batch's statistics: its gradient
# is training mode's (graph_passes/targets/cpu/batch_norm_training.py)
BATCH_STATISTICS = "ortrain.batch_statistics"
# ops that draw random numbers when run: never folded into a constant (a mask drawn once
# at build time), merged, or moved
RANDOM_OPS = frozenset(
    {"Dropout", "BiasDropout", "BitmaskDropout", "BitmaskBiasDropout", "RandomNormal",
     "RandomNormalLike", "RandomUniform", "RandomUniformLike", "Bernoulli", "Multinomial"}
)  # fmt: skip
DROPOUT_OPS = frozenset({"Dropout", "BiasDropout", "BitmaskDropout", "BitmaskBiasDropout"})


class GradientError(RuntimeError):
    """An op on a gradient path cannot be differentiated."""


class UpdateInBackwardError(ValueError):
    """A parameter's update cannot run in the backward (update_in_backward.py)."""


def state_key(state: str, param: str) -> str:
    """Name of one optimizer state tensor of one parameter in the update graph."""
    return f"{state}:{param}"


# The update in the backward (update_in_backward.py): its Adam moments, and per param
# group one input of HYPER_NAMES values.
IN_BACKWARD_STATES = ("exp_avg", "exp_avg_sq")
HYPER_NAMES = ("lr", "beta1", "beta2", "eps", "weight_decay", "step", "decoupled")


def hyper_name(group: int) -> str:
    """The graph input holding param group ``group``'s ``HYPER_NAMES`` values."""
    return f"hyper:group{group}"


@dataclasses.dataclass(frozen=True)
class LabelSite:
    """A loss whose ignored rows can be dropped: ``input`` holds its labels."""

    node: str  # the SoftmaxCrossEntropyLoss node
    input: str  # the graph input its labels are reshaped from
    ignore_index: int
    rows: int  # N


def label_rows_bucket(labelled: int, rows: int) -> int:
    """The row count to build for ``labelled`` labelled rows out of ``rows``.

    Rounded up to a 16th of ``rows``, so that batches with slightly different label
    counts share one graph (at most 16 graphs per batch shape).
    """
    step = max(1, -(-rows // 16))
    return min(rows, max(step, -(-labelled // step) * step))
