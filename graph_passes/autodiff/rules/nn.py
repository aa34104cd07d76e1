"""Neural-net ops: Softmax family, LayerNormalization, GELU, Dropout.

Stock onnxruntime has no training kernels (SoftmaxGrad, LayerNormalizationGrad,
GeluGrad, DropoutGrad), so each backward is spelled in standard ONNX ops; CPU builds
with ortrain's kernel library emit its fused fp32 kernels instead (``ctx.kernel_for``:
``ortrain/runtime/grad_kernels.c`` and ``dropout_kernels.c``, held to these spellings by
tests/test_grad_kernels.py and tests/test_dropout_kernel.py).
"""

from __future__ import annotations

import math

import onnx_ir as ir

from ortrain.core.names import CPU_DOMAIN
from ortrain.graph_passes.autodiff.context import GradContext
from ortrain.graph_passes.autodiff.registry import gradient


@gradient("Softmax", opsets=(13, None))
def softmax(ctx: GradContext):
    # dx = y * (dy - sum(dy * y, axis))
    y, g = ctx.O(0), ctx.GO(0)
    axis = int(ctx.attr("axis", -1))
    if axis % ctx.rank(y) == ctx.rank(y) - 1 and ctx.kernel_for(g, y):
        return {0: ctx.kernel("SoftmaxGrad", g, y, like=y)}
    s = ctx.op("ReduceSum", ctx.op("Mul", g, y), ctx.ints([axis]), keepdims=1)
    return {0: ctx.op("Mul", y, ctx.op("Sub", g, s))}


@gradient("LogSoftmax", opsets=(13, None))
def log_softmax(ctx: GradContext):
    # dx = dy - exp(y) * sum(dy, axis)
    y, g = ctx.O(0), ctx.GO(0)
    axis = int(ctx.attr("axis", -1))
    s = ctx.op("ReduceSum", g, ctx.ints([axis]), keepdims=1)
    return {0: ctx.op("Sub", g, ctx.op("Mul", ctx.op("Exp", y), s))}


@gradient("LayerNormalization", forward_outputs=3)
def layer_norm(ctx: GradContext):
    # Outputs: Y, Mean, InvStdDev (the builder exposes the statistics for this rule).
    axis = int(ctx.attr("axis", -1))
    bias = ctx.I(2) if ctx.has_input(2) else None
    grads = layer_norm_backward(
        ctx, ctx.I(0), ctx.I(1), bias, ctx.O(1), ctx.O(2), axis, ctx.GO(0), ctx.GO(1), ctx.GO(2),
        want={k for k, i in (("x", 0), ("scale", 1), ("bias", 2)) if ctx.needs(i)},
    )  # fmt: skip
    return {i: grads[k] for k, i in (("x", 0), ("scale", 1), ("bias", 2)) if k in grads}


def layer_norm_backward(
    ctx: GradContext,
    x: ir.Value,
    scale: ir.Value,
    bias: ir.Value | None,
    mean: ir.Value,
    rstd: ir.Value,
    axis: int,
    g: ir.Value | None,
    g_mean: ir.Value | None,
    g_rstd: ir.Value | None,
    want: set[str],
) -> dict[str, ir.Value]:
    """Gradients of y = xhat * scale + bias w.r.t. ``want`` (subset of x, scale, bias).

    xhat = (x - mean) * rstd over the axes from ``axis`` on; n = elements per group.
    dx = rstd * (dxhat - mean(dxhat) - xhat * mean(dxhat * xhat)), dxhat = dy * scale.
    Mean / InvStdDev outputs, when used: dmean/dx = 1/n, drstd/dx = -rstd^2 * xhat / n.
    Shared by LayerNormalization and com.microsoft SkipLayerNormalization.
    """
    shape = ctx.shape(x)
    rank = len(shape)
    axis %= rank
    if (
        g is not None
        and "x" in want
        and g_mean is None
        and g_rstd is None
        and axis == rank - 1
        and ctx.kernel_for(g, x, scale, mean, rstd)
    ):
        return _layer_norm_kernel(ctx, x, scale, bias, mean, rstd, g, want)
    norm_axes = ctx.ints(list(range(axis, rank)))
    if mean.dtype != x.dtype:  # stats are stashed in fp32 for half inputs
        mean, rstd = ctx.cast_like(mean, x), ctx.cast_like(rstd, x)
    xhat = ctx.op("Mul", ctx.op("Sub", x, mean), rstd)
    parts = []
    out = {}
    if g is not None and "x" in want:
        dxhat = ctx.op("Mul", g, scale)
        m1 = ctx.op("ReduceMean", dxhat, norm_axes, keepdims=1)
        m2 = ctx.op("ReduceMean", ctx.op("Mul", dxhat, xhat), norm_axes, keepdims=1)
        inner = ctx.op("Sub", ctx.op("Sub", dxhat, m1), ctx.op("Mul", xhat, m2))
        parts.append(ctx.op("Mul", inner, rstd, shape=shape))
    if "x" in want and (g_mean is not None or g_rstd is not None):
        n = 1
        for d in shape[axis:]:
            n *= d
        dstats = None
        if g_rstd is not None:
            grstd = ctx.cast_like(g_rstd, x)
            t = ctx.op("Mul", ctx.op("Mul", grstd, ctx.op("Mul", rstd, rstd)), xhat)
            dstats = ctx.op("Neg", t)
        if g_mean is not None:
            gmean = ctx.cast_like(g_mean, x)
            if dstats is None:
                dstats = ctx.op("Expand", gmean, ctx.ints(shape))
            else:
                dstats = ctx.op("Add", dstats, gmean)
        parts.append(ctx.op("Mul", dstats, ctx.scalar_like(1.0 / n, x), shape=shape))
    if parts:
        out["x"] = parts[0] if len(parts) == 1 else ctx.op("Add", *parts, shape=shape)
    if g is not None and "scale" in want:
        out["scale"] = ctx.sum_to(ctx.op("Mul", g, xhat), shape, ctx.shape(scale))
    if g is not None and bias is not None and "bias" in want:
        out["bias"] = ctx.sum_to(g, shape, ctx.shape(bias))
    return out


def _layer_norm_kernel(
    ctx: GradContext,
    x: ir.Value,
    scale: ir.Value,
    bias: ir.Value | None,
    mean: ir.Value,
    rstd: ir.Value,
    g: ir.Value,
    want: set[str],
) -> dict[str, ir.Value]:
    """layer_norm_backward over the last axis as one ``ortrain.cpu.LayerNormGrad``."""
    shape, cols = ctx.shape(x), ctx.shape(x)[-1]
    dx, dscale, dbias = ctx.op_multi(
        "LayerNormGrad", g, x, scale, mean, rstd, domain=CPU_DOMAIN, num_outputs=3
    )
    for v, s in ((dx, shape), (dscale, (cols,)), (dbias, (cols,))):
        v.dtype, v.shape = x.dtype, ir.Shape(list(s))
    out = {"x": dx}
    if "scale" in want:
        out["scale"] = ctx.reshape(dscale, ctx.shape(scale))
    if bias is not None and "bias" in want:
        out["bias"] = ctx.reshape(dbias, ctx.shape(bias))
    return out


def gelu_grad(ctx: GradContext, dy: ir.Value, x: ir.Value, y: ir.Value, tanh: bool) -> ir.Value:
    """dL/dx of y = gelu(x) (tanh approximation or erf form) given dy = dL/dy."""
    if ctx.kernel_for(dy, x):
        return ctx.kernel("FastGeluGrad" if tanh else "GeluGrad", dy, x, like=x)
    d = gelu_tanh_derivative(ctx, x, y) if tanh else gelu_erf_derivative(ctx, x)
    return ctx.op("Mul", dy, d)


def gelu_erf_derivative(ctx: GradContext, x: ir.Value) -> ir.Value:
    # d/dx [x * Phi(x)] = Phi(x) + x * phi(x)
    half = ctx.scalar_like(0.5, x)
    one = ctx.scalar_like(1.0, x)
    cdf = ctx.op(
        "Mul",
        half,
        ctx.op(
            "Add", one, ctx.op("Erf", ctx.op("Mul", x, ctx.scalar_like(1.0 / math.sqrt(2.0), x)))
        ),
    )
    pdf = ctx.op(
        "Mul",
        ctx.op("Exp", ctx.op("Mul", ctx.op("Mul", x, x), ctx.scalar_like(-0.5, x))),
        ctx.scalar_like(1.0 / math.sqrt(2.0 * math.pi), x),
    )
    return ctx.op("Add", cdf, ctx.op("Mul", x, pdf))


def gelu_tanh_derivative(ctx: GradContext, x: ir.Value, y: ir.Value) -> ir.Value:
    # y = x * s with s = 0.5 (1 + tanh(u)) = sigmoid(2u), u = c (x + a x^3), c = sqrt(2/pi):
    # dy/dx = s + x s (1 - s) 2c (1 + 3a x^2) = s + y (1 - s) k (1 + 3a x^2), k = 2c.
    # 12 element-wise ops (the tanh form takes 17), reusing the forward output y.
    k, a = 2.0 * math.sqrt(2.0 / math.pi), 0.044715
    x2 = ctx.op("Mul", x, x)
    z = ctx.op(
        "Mul", x, ctx.op("Add", ctx.op("Mul", x2, ctx.scalar_like(a * k, x)), ctx.scalar_like(k, x))
    )
    s = ctx.op("Sigmoid", z)
    dz = ctx.op("Add", ctx.op("Mul", x2, ctx.scalar_like(3 * a * k, x)), ctx.scalar_like(k, x))
    one_minus_s = ctx.op("Sub", ctx.scalar_like(1.0, x), s)
    return ctx.op("Add", s, ctx.op("Mul", ctx.op("Mul", y, one_minus_s), dz))


@gradient("Gelu", opsets=(20, None))
def gelu(ctx: GradContext):
    tanh = ctx.attr("approximate", "none") == "tanh"
    return {0: gelu_grad(ctx, ctx.GO(0), ctx.I(0), ctx.O(0), tanh)}


@gradient("Dropout", nondiff_inputs=(1, 2), opsets=(12, None), forward_outputs=2)
def dropout(ctx: GradContext):
    # dx = dy * mask / (1 - ratio) in training mode, dy otherwise.
    g = ctx.GO(0)
    if not ctx.has_input(2):  # no training_mode input: inference, identity
        return {0: g}
    ratio_f32 = not ctx.has_input(1) or ctx.I(1).dtype == ir.DataType.FLOAT
    if ctx.kernel_for(g) and ratio_f32 and ctx.O(1).dtype == ir.DataType.BOOL:
        ratio = ctx.I(1) if ctx.has_input(1) else ctx.scalar_like(0.5, g)
        return {0: ctx.kernel("DropoutGrad", g, ctx.O(1), ratio, ctx.I(2), like=g)}
    mask = ctx.cast_like(ctx.O(1), g)
    if ctx.has_input(1):
        ratio = ctx.cast_like(ctx.I(1), g)
    else:
        ratio = ctx.scalar_like(0.5, g)
    one = ctx.scalar_like(1.0, g)
    scale = ctx.op("Div", one, ctx.op("Sub", one, ratio))
    scale = ctx.op("Where", ctx.I(2), scale, one)
    return {0: ctx.op("Mul", ctx.op("Mul", g, mask), scale)}
