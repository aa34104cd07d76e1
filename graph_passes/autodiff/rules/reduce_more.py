"""Reductions beyond Sum/Mean: Max/Min (ties split as torch), L1/L2, LogSumExp, Prod, CumSum.

Each rule views the output and its gradient with the reduced axes kept (size 1), so they
broadcast against the input. The reductions took ``axes`` as an attribute up to opset 17
and as input 1 from opset 18 (``reduce._axes`` reads either); each rule is registered for
both ranges, input 1 being an index input in the second.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import onnx_ir as ir

from ortrain.graph_passes.autodiff.context import GradContext
from ortrain.graph_passes.autodiff.registry import gradient
from ortrain.graph_passes.autodiff.rules.reduce import _axes

# The exporter's record of the aten op a node came from. ``torch.max(x, dim)`` and
# ``torch.min(x, dim)`` export to ReduceMax/ReduceMin like ``amax``/``amin``, but torch sends
# their gradient to the one index they return (the first extremum), not spread over ties.
FX_NODE = "pkg.torch.onnx.fx_node"
_INDEXED = {"ReduceMax": "aten.max.dim", "ReduceMin": "aten.min.dim"}


def graph_opset(ctx: GradContext) -> int:
    """The default-domain opset of the graph the gradient nodes are emitted into."""
    imports = ctx.em.graph.opset_imports
    return int(imports.get("", imports.get("ai.onnx", 1)))


def reduce_kept(ctx: GradContext, op: str, v: ir.Value, axes: Sequence[int]) -> ir.Value:
    """``op`` over ``axes`` with keepdims=1, axes passed the way the graph's opset wants."""
    shape = [1 if i in axes else d for i, d in enumerate(ctx.shape(v))]
    input_from = 13 if op == "ReduceSum" else 18
    if graph_opset(ctx) >= input_from:
        return ctx.op(op, v, ctx.ints(axes), keepdims=1, shape=shape)
    return ctx.op(op, v, axes=list(axes), keepdims=1, shape=shape)


def _kept(ctx: GradContext, v: ir.Value, axes: Sequence[int]) -> ir.Value:
    """An output-shaped value viewed with the reduced axes kept (as keepdims=1 gives)."""
    shape = ctx.shape(ctx.I(0))
    return ctx.reshape(v, [1 if i in axes else d for i, d in enumerate(shape)])


_NOOP_IS_IDENTITY = frozenset({"ReduceMax", "ReduceMin", "ReduceProd", "ReduceLogSumExp"})


def _reduction(op: str) -> Callable:
    """Register ``fn`` for ``op`` with axes as attribute (<= 17) and as input 1 (>= 18)."""

    def deco(fn: Callable) -> Callable:
        def rule(ctx: GradContext) -> dict[int, ir.Value]:
            # noop_with_empty_axes and no axes: the op maps each element on its own (L1 to
            # |x|, SumSquare to x*x, which their rules handle); Max/Min/Prod/LogSumExp to x.
            if not _axes(ctx) and op in _NOOP_IS_IDENTITY:
                return {0: ctx.GO(0)}
            return fn(ctx)

        gradient(op, opsets=(1, 17))(rule)
        gradient(op, nondiff_inputs=(1,), opsets=(18, None))(rule)
        return fn

    return deco


def _extremum(ctx: GradContext) -> dict[int, ir.Value]:
    x = ctx.I(0)
    axes = _axes(ctx)
    shape = ctx.shape(x)
    g = _kept(ctx, ctx.GO(0), axes)
    if _INDEXED[ctx.node.op_type] in ctx.node.metadata_props.get(FX_NODE, ""):
        return {0: _to_first_extremum(ctx, g, axes)}
    # amax/amin: the gradient is spread evenly over the elements equal to the result.
    hit = ctx.op("Equal", x, _kept(ctx, ctx.O(0), axes), shape=shape)
    hit = ctx.op("Cast", hit, to=x.dtype.value, dtype=x.dtype, shape=shape)
    count = reduce_kept(ctx, "ReduceSum", hit, axes)
    share = ctx.op("Div", g, count, shape=ctx.shape(count))
    return {0: ctx.op("Mul", hit, share, shape=shape)}


def _to_first_extremum(ctx: GradContext, g: ir.Value, axes: list[int]) -> ir.Value:
    """torch.max/min(x, dim): all of the gradient to the first index of the extremum."""
    if len(axes) != 1:
        raise NotImplementedError(f"{ctx.node.op_type} from torch.max/min(dim) over axes {axes}")
    x = ctx.I(0)
    arg = "ArgMax" if ctx.node.op_type == "ReduceMax" else "ArgMin"
    # select_last_index defaults to 0: the first extremum, as torch's CPU kernel returns.
    idx = ctx.op(arg, x, axis=axes[0], keepdims=1, dtype=ir.DataType.INT64, shape=ctx.shape(g))
    zeros = ctx.zeros(ctx.shape(x), x.dtype)
    return ctx.op("ScatterElements", zeros, idx, g, axis=axes[0], shape=ctx.shape(x))


_reduction("ReduceMax")(_extremum)
_reduction("ReduceMin")(_extremum)


@_reduction("ReduceL1")
def reduce_l1(ctx: GradContext):
    # d|x|/dx = sign(x), 0 at x = 0 as torch.abs.
    x, axes = ctx.I(0), _axes(ctx)
    sign = ctx.op("Sign", x, shape=ctx.shape(x))
    return {0: ctx.op("Mul", sign, _kept(ctx, ctx.GO(0), axes), shape=ctx.shape(x))}


@_reduction("ReduceL2")
def reduce_l2(ctx: GradContext):
    # d||x||/dx = x / ||x||, and 0 where the norm is 0 (torch.linalg.vector_norm's choice).
    x, axes = ctx.I(0), _axes(ctx)
    y, g = _kept(ctx, ctx.O(0), axes), _kept(ctx, ctx.GO(0), axes)
    kept = ctx.shape(y)
    zero = ctx.scalar_like(0.0, x)
    at_zero = ctx.op("Equal", y, zero, shape=kept)
    safe = ctx.op("Where", at_zero, ctx.scalar_like(1.0, x), y, shape=kept)
    scale = ctx.op("Where", at_zero, zero, ctx.op("Div", g, safe, shape=kept), shape=kept)
    return {0: ctx.op("Mul", x, scale, shape=ctx.shape(x))}


@_reduction("ReduceSumSquare")
def reduce_sum_square(ctx: GradContext):
    x, axes = ctx.I(0), _axes(ctx)
    g2 = ctx.op("Mul", _kept(ctx, ctx.GO(0), axes), ctx.scalar_like(2.0, x))
    return {0: ctx.op("Mul", x, g2, shape=ctx.shape(x))}


@_reduction("ReduceLogSumExp")
def reduce_log_sum_exp(ctx: GradContext):
    # d lse/dx = softmax(x) over the reduced axes = exp(x - lse).
    x, axes = ctx.I(0), _axes(ctx)
    shape = ctx.shape(x)
    p = ctx.op("Exp", ctx.op("Sub", x, _kept(ctx, ctx.O(0), axes), shape=shape), shape=shape)
    return {0: ctx.op("Mul", p, _kept(ctx, ctx.GO(0), axes), shape=shape)}


@_reduction("ReduceProd")
def reduce_prod(ctx: GradContext):
    """d prod/dx_i = product of the other elements, exactly as torch also with zeros:
    no zero in the set: y / x_i; one zero: the product of the nonzeros at the zero, 0
    elsewhere; two or more zeros: 0 everywhere."""
    x, axes = ctx.I(0), _axes(ctx)
    shape = ctx.shape(x)
    y, g = _kept(ctx, ctx.O(0), axes), _kept(ctx, ctx.GO(0), axes)
    kept = ctx.shape(y)
    zero, one = ctx.scalar_like(0.0, x), ctx.scalar_like(1.0, x)
    is_zero = ctx.op("Equal", x, zero, shape=shape)
    nonzero = ctx.op("Where", is_zero, one, x, shape=shape)
    zf = ctx.op("Cast", is_zero, to=x.dtype.value, dtype=x.dtype, shape=shape)
    zeros_in_set = reduce_kept(ctx, "ReduceSum", zf, axes)
    prod_nonzero = reduce_kept(ctx, "ReduceProd", nonzero, axes)
    no_zero = ctx.op("Equal", zeros_in_set, zero, shape=kept)
    one_zero = ctx.op("Equal", zeros_in_set, one, shape=kept)
    others = ctx.op("Div", y, nonzero, shape=shape)
    at_lone_zero = ctx.op("And", is_zero, one_zero, shape=shape)
    with_zero = ctx.op("Where", at_lone_zero, prod_nonzero, zero, shape=shape)
    d = ctx.op("Where", no_zero, others, with_zero, shape=shape)
    return {0: ctx.op("Mul", d, g, shape=shape)}


@gradient("CumSum", nondiff_inputs=(1,))
def cumsum(ctx: GradContext):
    # y_i = sum_{j <= i} x_j (j < i exclusive): dx_j = sum_{i >= j} g_i, the cumsum the other
    # way round with the same exclusivity.
    reverse = int(ctx.attr("reverse", 0))
    exclusive = int(ctx.attr("exclusive", 0))
    out = ctx.op(
        "CumSum",
        ctx.GO(0),
        ctx.I(1),
        exclusive=exclusive,
        reverse=1 - reverse,
        shape=ctx.shape(ctx.I(0)),
    )
    return {0: out}
