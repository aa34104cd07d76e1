"""Explicit roles of training-graph inputs and outputs (never inferred from names)."""

from __future__ import annotations

import dataclasses
import enum


class Role(str, enum.Enum):
    PARAMETER = "parameter"  # trainable: gets a gradient and an update
    FROZEN_PARAMETER = "frozen_parameter"  # requires_grad=False: read only
    BUFFER = "buffer"
    BATCH = "batch"
    LOSS = "loss"
    OUTPUT = "output"  # other model outputs (evaluation graphs)
    GRADIENT = "gradient"  # a parameter's gradient (``of`` it; two outputs may share one)
    ACCUMULATOR = "accumulator"  # the gradient sum an accumulating graph adds to, ``of``
    OPTIMIZER_STATE = "optimizer_state"
    HYPERPARAMETER = "hyperparameter"  # lr, betas, ... read from param_groups each step
    STEP = "step"
    GRAD_SCALE = "grad_scale"
    CLIP = "clip"  # global-norm clipping statistics
    LOSS_SCALE = "loss_scale"  # the backward's seed (dynamic loss scaling)
    GRADS_FINITE = "grads_finite"  # whether the update was applied (no Inf/NaN gradient)
    UPDATE_APPLIED = "update_applied"  # 1 when a parameter's update in the backward ran
    UPDATED_BUFFER = "updated_buffer"  # a buffer's new value (BatchNorm statistics), ``of`` it
    DROPOUT_SWITCH = "dropout_switch"  # bool scalar: every training Dropout draws (True) or not
    SEGMENT_INPUT = "segment_input"  # a compiled segment's tensor argument (ortrain/segments)
    SEGMENT_OUTPUT = "segment_output"  # a compiled segment's tensor result
    OUTPUT_GRADIENT = "output_gradient"  # the gradient torch hands a segment's backward, ``of``
    SAVED = "saved"  # a forward value a segment's backward reads (forward output, backward input)
    INPUT_GRADIENT = "input_gradient"  # a segment's gradient of one of its inputs, ``of`` it
    # an embedding's gradient left as rows (``segments/accumulate.py``), ``of`` its table:
    ROW_INDICES = "row_indices"  # which rows (int64 [N, 1])
    ROW_UPDATES = "row_updates"  # what is added to them ([N, *row shape])
    # a weight's gradient left as a product ``left^T @ right`` (``segments/factored.py``):
    FACTOR_LEFT = "factor_left"  # [T, M], ``of`` the [M, N] weight
    FACTOR_RIGHT = "factor_right"  # [T, N]


@dataclasses.dataclass(frozen=True)
class GraphIO:
    name: str
    role: Role
    of: str | None = None  # the parameter a gradient/state belongs to
