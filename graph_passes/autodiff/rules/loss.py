"""Loss ops. ``SoftmaxCrossEntropyLoss`` is what torch's cross_entropy exports to."""

from __future__ import annotations

from collections.abc import Sequence

import onnx_ir as ir

from ortrain.graph_passes.autodiff.context import GradContext
from ortrain.graph_passes.autodiff.registry import gradient


def _sample_coefficients(ctx: GradContext, labels_i: int, weights_i: int):
    """Per-sample coefficient of d loss / d (per-sample loss): w_i [/ sum w] [* dy]."""
    labels, g = ctx.I(labels_i), ctx.GO(0)
    dtype = g.dtype
    valid = None
    ignore = ctx.attr("ignore_index")
    if ignore is not None:
        eq = ctx.op("Equal", labels, ctx.const(int(ignore), labels.dtype))
        valid = ctx.op("Not", eq)
    if ctx.has_input(weights_i):
        safe = (
            labels if valid is None else ctx.op("Where", valid, labels, ctx.const(0, labels.dtype))
        )
        w = ctx.op("Gather", ctx.I(weights_i), safe, axis=0)
        if valid is not None:
            w = ctx.op("Mul", w, ctx.op("Cast", valid, to=dtype.value))
    elif valid is not None:
        w = ctx.op("Cast", valid, to=dtype.value)
    else:
        w = ctx.op("Expand", ctx.const(1.0, dtype), ctx.ints(ctx.shape(labels)))
    reduction = ctx.attr("reduction", "mean")
    if reduction == "mean":
        denom = ctx.op("ReduceSum", w, keepdims=0)
        w = ctx.op("Div", w, denom)
    elif reduction not in ("sum", "none"):
        raise NotImplementedError(f"reduction {reduction!r}")
    return ctx.op("Mul", w, g)  # g is a scalar for mean/sum, per-sample for none


def _add_at_labels(
    ctx: GradContext,
    base: ir.Value,
    labels: ir.Value,
    updates: ir.Value,
    shape: Sequence[int] | None = None,
) -> ir.Value:
    """``base`` with ``updates`` added at each sample's label along the class axis (1).

    One ScatterElements instead of building a [N, C] one-hot (Equal, Cast, Sub): the
    class dimension is the big one (the vocabulary). Ignored labels are clamped to 0;
    their rows are multiplied by a zero coefficient afterwards.
    """
    ignore = ctx.attr("ignore_index")
    if ignore is not None:
        bad = ctx.op("Equal", labels, ctx.const(int(ignore), labels.dtype))
        labels = ctx.op("Where", bad, ctx.const(0, labels.dtype), labels)
    idx = ctx.op("Unsqueeze", labels, ctx.ints([1]))
    return ctx.op("ScatterElements", base, idx, updates, axis=1, reduction="add", shape=shape)


@gradient("SoftmaxCrossEntropyLoss", nondiff_inputs=(1, 2), forward_outputs=2)
def softmax_cross_entropy(ctx: GradContext):
    # Output 0: d loss / d scores = (softmax(scores) - onehot(labels)) * coefficient per sample.
    # Output 1 (log_prob = scores - logsumexp(scores, 1)), when used: dlp - softmax * sum(dlp, 1).
    scores = ctx.I(0)
    shape = ctx.shape(scores)
    prob = ctx.op("Exp", ctx.O(1), shape=shape)
    parts = []
    if ctx.GO(0) is not None:
        # Shapes on the way: sink_row_scale.py moves the per-row coefficient off [N, C].
        idx_shape = [shape[0], 1, *shape[2:]]
        coef = ctx.op("Unsqueeze", _sample_coefficients(ctx, 1, 2), ctx.ints([1]), shape=idx_shape)
        minus_one = ctx.op("Expand", ctx.scalar_like(-1.0, scores), ctx.ints(idx_shape))
        diff = _add_at_labels(ctx, prob, ctx.I(1), minus_one, shape)
        parts.append(ctx.op("Mul", diff, coef, shape=shape))
    if ctx.GO(1) is not None:
        glp = ctx.GO(1)
        total = ctx.op("ReduceSum", glp, ctx.ints([1]), keepdims=1)
        parts.append(ctx.op("Sub", glp, ctx.op("Mul", prob, total), shape=shape))
    if len(parts) == 1:
        return {0: parts[0]}
    return {0: ctx.op("Add", *parts, shape=shape)}


@gradient("NegativeLogLikelihoodLoss", nondiff_inputs=(1, 2))
def nll_loss(ctx: GradContext):
    # loss_i = -x[i, t_i] * w_i  =>  d/dx = -onehot(t) * coefficient
    x = ctx.I(0)
    shape = ctx.shape(x)
    coef = ctx.op("Unsqueeze", _sample_coefficients(ctx, 1, 2), ctx.ints([1]))
    return {0: _add_at_labels(ctx, ctx.zeros(shape, x.dtype), ctx.I(1), ctx.op("Neg", coef))}
