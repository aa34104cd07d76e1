"""Reductions: the gradient is broadcast back over the reduced axes."""

from __future__ import annotations

from ortrain.graph_passes.autodiff.context import GradContext
from ortrain.graph_passes.autodiff.registry import gradient


def _axes(ctx: GradContext) -> list[int]:
    rank = ctx.rank(ctx.I(0))
    axes = ctx.attr("axes")
    if axes is None and ctx.has_input(1):
        axes = ctx.const_ints(ctx.I(1))
        if axes is None:
            raise NotImplementedError("reduction with non-constant axes")
    if not axes:
        if ctx.attr("noop_with_empty_axes", 0):
            return []
        return list(range(rank))
    return sorted(int(a) % rank for a in axes)


def _broadcast_back(ctx: GradContext, scale: float | None):
    x, g = ctx.I(0), ctx.GO(0)
    shape = ctx.shape(x)
    axes = _axes(ctx)
    kept = [1 if i in axes else d for i, d in enumerate(shape)]
    g = ctx.reshape(g, kept)
    if scale is not None:
        g = ctx.op("Mul", g, ctx.scalar_like(scale, x))
    return {0: ctx.op("Expand", g, ctx.ints(shape), shape=shape)}


@gradient("ReduceSum", nondiff_inputs=(1,))
def reduce_sum(ctx: GradContext):
    return _broadcast_back(ctx, None)


@gradient("ReduceMean", nondiff_inputs=(1,))
def reduce_mean(ctx: GradContext):
    shape = ctx.shape(ctx.I(0))
    count = 1
    for a in _axes(ctx):
        count *= shape[a]
    return _broadcast_back(ctx, 1.0 / count)
