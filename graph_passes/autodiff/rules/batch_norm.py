"""BatchNormalization: training mode (batch statistics) and inference mode.

Inputs X [N, C, D1...], scale [C], B [C], input_mean [C], input_var [C]; the channel
axis is 1 and the statistics run over every other axis.

1. Inference mode (``training_mode=0``, or opsets 9-13 with one output):
   y = scale * (x - mean) * rstd + B, rstd = 1 / sqrt(var + eps). Every input is
   differentiable: the exporter spells BatchNorm without running statistics
   (``track_running_stats=False``) as this node with mean and var reduced from X.
2. Training mode (``training_mode=1``, opset 14 on): the node normalizes with the batch
   mean and biased variance, and outputs 1/2 are the updated running statistics. Y does
   not depend on input_mean/input_var (their gradient is zero); a gradient flowing into
   the running statistics is refused (they feed buffer updates, not the loss). An
   inference-mode node marked ``BATCH_STATISTICS`` (fed its own batch's statistics
   through StopGradient: ``targets/cpu/batch_norm_training.py``) takes this gradient too.

On a CPU build with ortrain's kernels (``GradContext.cpu_kernels``) case 2 is one fused
``ortrain.cpu.BatchNormGrad`` (``ortrain/runtime/grad_kernels.c``) instead of a dozen
full-size element-wise ops and reductions; the standard spelling stays its reference.

Opsets 9-13 express training mode by 5 outputs (with saved statistics): refused.
ortrain's export never emits training mode (ortrain/buffer_updates.py): ONNX Runtime's
kernel writes the running statistics into its mean/var inputs.
"""

from __future__ import annotations

import onnx_ir as ir

from ortrain.core.names import BATCH_STATISTICS, CPU_DOMAIN
from ortrain.graph_passes.autodiff.context import GradContext
from ortrain.graph_passes.autodiff.registry import gradient


@gradient("BatchNormalization", opsets=(9, 13))
def batch_norm_9(ctx: GradContext) -> dict[int, ir.Value]:
    if len(ctx.node.outputs) > 1:
        raise NotImplementedError(
            "training mode before opset 14 (5 outputs with saved statistics) is not supported"
        )
    return _inference(ctx)


@gradient("BatchNormalization", opsets=(14, None))
def batch_norm_14(ctx: GradContext) -> dict[int, ir.Value]:
    if int(ctx.attr("training_mode", 0)) or ctx.node.metadata_props.get(BATCH_STATISTICS):
        return _training(ctx)
    return _inference(ctx)


def _layout(ctx: GradContext) -> tuple[tuple[int, ...], list[int], list[int]]:
    """(X's shape, the reduced axes, the [1, C, 1...] shape of per-channel values)."""
    shape = ctx.shape(ctx.I(0))
    if len(shape) < 2:
        raise NotImplementedError(f"input of rank {len(shape)} (needs [N, C, ...])")
    axes = [0, *range(2, len(shape))]
    channel = [1, shape[1]] + [1] * (len(shape) - 2)
    return shape, axes, channel


def _rstd(ctx: GradContext, var: ir.Value, channel: list[int]) -> ir.Value:
    """1 / sqrt(var + eps) as [1, C, 1...]."""
    eps = ctx.scalar_like(float(ctx.attr("epsilon", 1e-5)), var)
    std = ctx.op("Sqrt", ctx.op("Add", ctx.reshape(var, channel), eps))
    return ctx.op("Reciprocal", std, shape=channel)


def _channel_sum(ctx: GradContext, v: ir.Value, axes: list[int], c: int) -> ir.Value:
    return ctx.op("ReduceSum", v, ctx.ints(axes), keepdims=0, shape=(c,))


def _inference(ctx: GradContext) -> dict[int, ir.Value]:
    # dx = g * scale * rstd; dscale = sum(g * xhat); dB = sum(g);
    # dmean = -sum(g) * scale * rstd; dvar = -1/2 * sum(g * (x - mean)) * scale * rstd^3.
    shape, axes, channel = _layout(ctx)
    c = shape[1]
    x, scale, g = ctx.I(0), ctx.I(1), ctx.GO(0)
    if g is None:
        return {}
    rstd = _rstd(ctx, ctx.I(4), channel)
    scale_c = ctx.reshape(scale, channel)
    out: dict[int, ir.Value] = {}
    if ctx.needs(0):
        out[0] = ctx.op("Mul", g, ctx.op("Mul", scale_c, rstd), shape=shape)
    if ctx.needs(2):
        out[2] = _channel_sum(ctx, g, axes, c)
    centered = None
    if ctx.needs(1) or ctx.needs(4):
        centered = ctx.op("Sub", x, ctx.reshape(ctx.I(3), channel), shape=shape)
    if ctx.needs(1):
        xhat = ctx.op("Mul", centered, rstd, shape=shape)
        out[1] = _channel_sum(ctx, ctx.op("Mul", g, xhat), axes, c)
    if ctx.needs(3):
        dmean = ctx.op("Mul", ctx.op("Neg", _channel_sum(ctx, g, axes, c)), scale)
        out[3] = ctx.op("Mul", dmean, ctx.reshape(rstd, (c,)), shape=(c,))
    if ctx.needs(4):
        half = ctx.scalar_like(-0.5, x)
        rstd2 = ctx.op("Mul", rstd, rstd, shape=channel)
        rstd3 = ctx.reshape(ctx.op("Mul", rstd2, rstd, shape=channel), (c,))
        s = _channel_sum(ctx, ctx.op("Mul", g, centered), axes, c)
        out[4] = ctx.op("Mul", ctx.op("Mul", ctx.op("Mul", s, scale), rstd3), half, shape=(c,))
    return out


def _training(ctx: GradContext) -> dict[int, ir.Value]:
    # xhat = (x - mean_b) * rstd_b over the batch statistics (biased variance);
    # dx = scale * rstd_b * (g - mean(g) - xhat * mean(g * xhat)).
    for k in (1, 2):
        if ctx.GO(k) is not None:
            raise NotImplementedError(
                f"a gradient flows into output {k} (the running "
                f"{'mean' if k == 1 else 'variance'}): differentiating the running "
                "statistics is not supported"
            )
    shape, axes, channel = _layout(ctx)
    c = shape[1]
    x, scale, g = ctx.I(0), ctx.I(1), ctx.GO(0)
    out: dict[int, ir.Value] = {}
    for k in (3, 4):  # Y does not read the running statistics
        if ctx.needs(k):
            out[k] = ctx.zeros((c,), ctx.I(k).dtype)
    if g is None:
        return out
    if ctx.kernel_for(x, scale, g):
        return {**out, **_training_kernel(ctx, x, scale, g, shape)}
    red = ctx.ints(axes)
    mean = ctx.op("ReduceMean", x, red, keepdims=1, shape=channel)
    centered = ctx.op("Sub", x, mean, shape=shape)
    var = ctx.op("ReduceMean", ctx.op("Mul", centered, centered), red, keepdims=1, shape=channel)
    rstd = _rstd(ctx, var, channel)
    xhat = ctx.op("Mul", centered, rstd, shape=shape)
    if ctx.needs(2):
        out[2] = _channel_sum(ctx, g, axes, c)
    if ctx.needs(1):
        out[1] = _channel_sum(ctx, ctx.op("Mul", g, xhat), axes, c)
    if ctx.needs(0):
        m1 = ctx.op("ReduceMean", g, red, keepdims=1, shape=channel)
        m2 = ctx.op("ReduceMean", ctx.op("Mul", g, xhat), red, keepdims=1, shape=channel)
        inner = ctx.op("Sub", ctx.op("Sub", g, m1), ctx.op("Mul", xhat, m2))
        coef = ctx.op("Mul", ctx.reshape(scale, channel), rstd, shape=channel)
        out[0] = ctx.op("Mul", inner, coef, shape=shape)
    return out


def _training_kernel(
    ctx: GradContext, x: ir.Value, scale: ir.Value, g: ir.Value, shape: tuple[int, ...]
) -> dict[int, ir.Value]:
    """Case 2 as one ``ortrain.cpu.BatchNormGrad`` (the statistics recomputed inside)."""
    c = shape[1]
    eps = float(ctx.attr("epsilon", 1e-5))
    dx, dscale, dbias = ctx.op_multi(
        "BatchNormGrad", g, x, scale, domain=CPU_DOMAIN, num_outputs=3, epsilon=eps
    )
    for v, s in ((dx, shape), (dscale, (c,)), (dbias, (c,))):
        v.dtype, v.shape = x.dtype, ir.Shape(list(s))
    wanted = {0: dx, 1: dscale, 2: dbias}
    return {i: v for i, v in wanted.items() if ctx.needs(i)}
