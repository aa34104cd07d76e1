"""Normalizations beyond LayerNorm: InstanceNormalization, GroupNormalization.

Both normalize x [N, C, *spatial] over groups of channels and the spatial axes: viewed as
x4 [N, G, C/G, S], each (n, g) slice is normalized over its last two axes, which is
LayerNormalization's backward over axes 2.. (``nn.layer_norm_backward``) with the affine
parameters broadcast as [G, C/G, 1] (per channel) or [G, 1, 1] (GroupNormalization-18's
per-group scale and bias). The statistics are recomputed from x (the ops have no
statistics outputs): mean, and 1 / sqrt(population variance + epsilon).

The dynamo exporter writes ``nn.GroupNorm`` as Reshape -> InstanceNormalization (ones /
zeros affine over the groups) -> Reshape -> Mul -> Add, and ``nn.InstanceNorm1d/2d/3d``
as one InstanceNormalization: both train through the rule here.
"""

from __future__ import annotations

import math

import onnx_ir as ir

from ortrain.graph_passes.autodiff.context import GradContext
from ortrain.graph_passes.autodiff.registry import gradient
from ortrain.graph_passes.autodiff.rules.nn import layer_norm_backward


def _grouped_norm(
    ctx: GradContext, groups: int, per_channel: bool, stash: bool
) -> dict[int, ir.Value]:
    """Gradients of y = xhat * scale + bias with xhat normalized per (n, group).

    ``stash``: compute in float32 for half-precision x (GroupNormalization-21's
    ``stash_type=1``, which keeps its statistics in float32)."""
    x, xs = ctx.I(0), ctx.shape(ctx.I(0))
    n, c, s = xs[0], xs[1], math.prod(xs[2:])
    if c % groups:
        raise NotImplementedError(
            f"{ctx.node.op_type} node {ctx.node.name!r}: {c} channels in {groups} groups"
        )
    cg = c // groups
    work = ir.DataType.FLOAT if stash and x.dtype in _HALF else x.dtype

    def view(v: ir.Value, shape: tuple[int, ...]) -> ir.Value:
        v = ctx.reshape(v, shape)
        if v.dtype == work:
            return v
        return ctx.op("Cast", v, to=work.value, dtype=work, shape=shape)

    x4 = view(x, (n, groups, cg, s))
    axes = ctx.ints([2, 3])
    mean = ctx.op("ReduceMean", x4, axes, keepdims=1, shape=(n, groups, 1, 1))
    xc = ctx.op("Sub", x4, mean)
    var = ctx.op("ReduceMean", ctx.op("Mul", xc, xc), axes, keepdims=1, shape=(n, groups, 1, 1))
    eps = ctx.const(float(ctx.attr("epsilon", 1e-5)), work)
    rstd = ctx.op("Reciprocal", ctx.op("Sqrt", ctx.op("Add", var, eps)))
    affine = (groups, cg, 1) if per_channel else (groups, 1, 1)
    scale = view(ctx.I(1), affine)
    bias = view(ctx.I(2), affine)
    g4 = view(ctx.GO(0), (n, groups, cg, s))
    want = {k for k, i in (("x", 0), ("scale", 1), ("bias", 2)) if ctx.needs(i)}
    grads = layer_norm_backward(ctx, x4, scale, bias, mean, rstd, 2, g4, None, None, want)
    out: dict[int, ir.Value] = {}
    for key, i in (("x", 0), ("scale", 1), ("bias", 2)):
        if key in grads:
            like = ctx.I(i)
            out[i] = ctx.cast_like(ctx.reshape(grads[key], ctx.shape(like)), like)
    return out


_HALF = (ir.DataType.FLOAT16, ir.DataType.BFLOAT16)


@gradient("InstanceNormalization", opsets=(6, None))
def instance_norm(ctx: GradContext) -> dict[int, ir.Value]:
    return _grouped_norm(ctx, ctx.shape(ctx.I(0))[1], per_channel=True, stash=False)


@gradient("GroupNormalization", opsets=(18, 20))
def group_norm_18(ctx: GradContext) -> dict[int, ir.Value]:
    # scale and bias hold one value per group
    return _grouped_norm(ctx, int(ctx.attr("num_groups")), per_channel=False, stash=False)


@gradient("GroupNormalization", opsets=(21, None))
def group_norm_21(ctx: GradContext) -> dict[int, ir.Value]:
    # scale and bias hold one value per channel; statistics in stash_type (float32)
    stash = int(ctx.attr("stash_type", 1)) == 1
    return _grouped_norm(ctx, int(ctx.attr("num_groups")), per_channel=True, stash=stash)
