"""com.microsoft contrib ops that the fusions put on gradient paths.

Stock onnxruntime ships these forward kernels but none of their training kernels
(BiasGeluGrad, FastGeluGrad, SkipLayerNormalizationGrad), so each backward is spelled in
standard ONNX ops with the math of the standard op it fuses (rules/nn.py), or as
ortrain's fused CPU kernels where the build has them. FusedMatMul
lives with MatMul and Gemm in rules/matmul.py.
"""

from __future__ import annotations

import onnx_ir as ir

from ortrain.graph_passes.autodiff.context import GradContext
from ortrain.graph_passes.autodiff.registry import gradient
from ortrain.graph_passes.autodiff.rules.nn import gelu_grad, layer_norm_backward
from ortrain.graph_passes.infra.emitter import MS_DOMAIN


def _biased(ctx: GradContext) -> ir.Value:
    """x + bias (recomputed: the fused op does not output it), or x without a bias."""
    if not ctx.has_input(1):
        return ctx.I(0)
    return ctx.op("Add", ctx.I(0), ctx.I(1), shape=ctx.shape(ctx.O(0)))


def _input_and_bias(ctx: GradContext, d: ir.Value) -> dict[int, ir.Value]:
    """d = dL/d(x + bias): x gets it as is, the bias its sum over the broadcast axes."""
    return {i: ctx.unbroadcast(d, ctx.I(i)) for i in (0, 1) if ctx.has_input(i) and ctx.needs(i)}


@gradient("Gelu", domain=MS_DOMAIN)
def gelu(ctx: GradContext):
    # y = x * Phi(x) (erf form): dx = dy * (Phi(x) + x * phi(x))
    return {0: gelu_grad(ctx, ctx.GO(0), ctx.I(0), ctx.O(0), tanh=False)}


@gradient("BiasGelu", domain=MS_DOMAIN)
def bias_gelu(ctx: GradContext):
    # y = gelu(x + b) (erf form), b over the last axis: d(x + b) = dy * gelu'(x + b)
    d = gelu_grad(ctx, ctx.GO(0), _biased(ctx), ctx.O(0), tanh=False)
    return _input_and_bias(ctx, d)


@gradient("FastGelu", domain=MS_DOMAIN)
def fast_gelu(ctx: GradContext):
    # y = gelu_tanh(x [+ b]) = 0.5 t (1 + tanh(sqrt(2/pi) (t + 0.044715 t^3))), t = x [+ b]
    d = gelu_grad(ctx, ctx.GO(0), _biased(ctx), ctx.O(0), tanh=True)
    return _input_and_bias(ctx, d)


@gradient("QuickGelu", domain=MS_DOMAIN)
def quick_gelu(ctx: GradContext):
    # y = x * s, s = sigmoid(alpha x): dy/dx = s + alpha x s (1 - s) = s + alpha y (1 - s)
    x, y = ctx.I(0), ctx.O(0)
    alpha = float(ctx.attr("alpha", 1.702))
    s = ctx.op("Sigmoid", ctx.op("Mul", x, ctx.scalar_like(alpha, x)))
    one_minus_s = ctx.op("Sub", ctx.scalar_like(1.0, x), s)
    ay = ctx.op("Mul", y, ctx.scalar_like(alpha, x))
    d = ctx.op("Add", s, ctx.op("Mul", ay, one_minus_s))
    return {0: ctx.op("Mul", ctx.GO(0), d)}


@gradient("SkipLayerNormalization", domain=MS_DOMAIN, forward_outputs=4)
def skip_layer_norm(ctx: GradContext):
    # Inputs: input, skip, gamma, beta?, bias?; outputs: y, mean, inv_std_var, s where
    # s = input + skip (+ bias) and y = LayerNorm(s) over the last axis. ds = the
    # LayerNorm gradient + whatever flows into s directly (a residual stream reading it);
    # input, skip and bias each get ds summed to their shapes.
    s = ctx.O(3)
    beta = ctx.I(3) if ctx.has_input(3) else None
    want = {"x"} if any(ctx.needs(i) for i in (0, 1, 4)) else set()
    want |= {k for k, i in (("scale", 2), ("bias", 3)) if ctx.needs(i)}
    grads = layer_norm_backward(
        ctx, s, ctx.I(2), beta, ctx.O(1), ctx.O(2), -1, ctx.GO(0), ctx.GO(1), ctx.GO(2), want
    )
    out = {i: grads[k] for k, i in (("scale", 2), ("bias", 3)) if k in grads}
    ds = grads.get("x")
    if ctx.GO(3) is not None and "x" in want:
        ds = ctx.GO(3) if ds is None else ctx.op("Add", ds, ctx.GO(3), shape=ctx.shape(s))
    if ds is not None:
        shape = ctx.shape(s)
        for i in (0, 1, 4):
            if ctx.has_input(i) and ctx.needs(i):
                out[i] = ctx.sum_to(ds, shape, ctx.shape(ctx.I(i)))
    return out


@gradient("SimplifiedLayerNormalization", forward_outputs=2)
def simplified_layer_norm(ctx: GradContext):
    # ONNX Runtime's RMSNorm (ONNX domain): y = x * r * scale, r = 1/sqrt(mean(x^2) + eps)
    # over the axes from ``axis`` on; output 1 is r. With xhat = x * r, dxhat = dy * scale:
    # dx = r * (dxhat - xhat * mean(dxhat * xhat)), dscale = sum(dy * xhat).
    if ctx.GO(1) is not None:
        raise NotImplementedError("SimplifiedLayerNormalization with its 1/rms output read")
    x, scale, g = ctx.I(0), ctx.I(1), ctx.GO(0)
    shape = ctx.shape(x)
    axis = int(ctx.attr("axis", -1)) % len(shape)
    r = ctx.O(1)
    if r.dtype != x.dtype:  # stashed in fp32 for half inputs
        r = ctx.cast_like(r, x)
    xhat = ctx.op("Mul", x, r, shape=shape)
    out = {}
    if ctx.needs(0):
        dxhat = ctx.op("Mul", g, scale, shape=shape)
        axes = ctx.ints(list(range(axis, len(shape))))
        m = ctx.op("ReduceMean", ctx.op("Mul", dxhat, xhat, shape=shape), axes, keepdims=1)
        inner = ctx.op("Sub", dxhat, ctx.op("Mul", xhat, m, shape=shape), shape=shape)
        out[0] = ctx.op("Mul", inner, r, shape=shape)
    if ctx.needs(1):
        out[1] = ctx.sum_to(ctx.op("Mul", g, xhat, shape=shape), shape, ctx.shape(scale))
    return out
