"""Element-wise ops (numpy broadcasting: gradients are summed back to input shapes)."""

from __future__ import annotations

import math

from graph_passes.autodiff.context import GradContext
from graph_passes.autodiff.registry import gradient


def _un(ctx: GradContext, g, i: int):
    return ctx.unbroadcast(g, ctx.I(i))


@gradient("Add")
def add(ctx: GradContext):
    g = ctx.GO(0)
    return {i: _un(ctx, g, i) for i in (0, 1) if ctx.needs(i)}


@gradient("Sum")
def sum_(ctx: GradContext):
    g = ctx.GO(0)
    return {i: _un(ctx, g, i) for i in range(len(ctx.node.inputs)) if ctx.needs(i)}


@gradient("Sub")
def sub(ctx: GradContext):
    g = ctx.GO(0)
    out = {}
    if ctx.needs(0):
        out[0] = _un(ctx, g, 0)
    if ctx.needs(1):
        out[1] = _un(ctx, ctx.op("Neg", g), 1)
    return out


@gradient("Mul")
def mul(ctx: GradContext):
    g = ctx.GO(0)
    out = {}
    if ctx.needs(0):
        out[0] = _un(ctx, ctx.op("Mul", g, ctx.I(1)), 0)
    if ctx.needs(1):
        out[1] = _un(ctx, ctx.op("Mul", g, ctx.I(0)), 1)
    return out


@gradient("Div")
def div(ctx: GradContext):
    # d(a/b)/da = 1/b ; d(a/b)/db = -(a/b)/b
    g = ctx.GO(0)
    out = {}
    if ctx.needs(0):
        out[0] = _un(ctx, ctx.op("Div", g, ctx.I(1)), 0)
    if ctx.needs(1):
        t = ctx.op("Div", ctx.op("Mul", g, ctx.O(0)), ctx.I(1))
        out[1] = _un(ctx, ctx.op("Neg", t), 1)
    return out


@gradient("Neg")
def neg(ctx: GradContext):
    return {0: ctx.op("Neg", ctx.GO(0))}


@gradient("Identity")
def identity(ctx: GradContext):
    return {0: ctx.GO(0)}


@gradient("Pow")
def pow_(ctx: GradContext):
    # d(x^y)/dx = y x^(y-1) ; d(x^y)/dy = x^y ln x
    x, y, g = ctx.I(0), ctx.I(1), ctx.GO(0)
    out = {}
    if ctx.needs(0):
        yc = ctx.cast_like(y, x)
        ym1 = ctx.op("Sub", yc, ctx.scalar_like(1.0, x))
        d = ctx.op("Mul", yc, ctx.op("Pow", x, ym1))
        out[0] = _un(ctx, ctx.op("Mul", g, d), 0)
    if ctx.needs(1):
        d = ctx.op("Mul", ctx.O(0), ctx.op("Log", x))
        out[1] = _un(ctx, ctx.op("Mul", g, d), 1)
    return out


@gradient("Sqrt")
def sqrt(ctx: GradContext):
    half = ctx.scalar_like(0.5, ctx.I(0))
    return {0: ctx.op("Div", ctx.op("Mul", ctx.GO(0), half), ctx.O(0))}


@gradient("Reciprocal")
def reciprocal(ctx: GradContext):
    y = ctx.O(0)
    return {0: ctx.op("Neg", ctx.op("Mul", ctx.GO(0), ctx.op("Mul", y, y)))}


@gradient("Exp")
def exp(ctx: GradContext):
    return {0: ctx.op("Mul", ctx.GO(0), ctx.O(0))}


@gradient("Log")
def log(ctx: GradContext):
    return {0: ctx.op("Div", ctx.GO(0), ctx.I(0))}


@gradient("Tanh")
def tanh(ctx: GradContext):
    y = ctx.O(0)
    one = ctx.scalar_like(1.0, y)
    return {0: ctx.op("Mul", ctx.GO(0), ctx.op("Sub", one, ctx.op("Mul", y, y)))}


@gradient("Sigmoid")
def sigmoid(ctx: GradContext):
    y = ctx.O(0)
    one = ctx.scalar_like(1.0, y)
    return {0: ctx.op("Mul", ctx.GO(0), ctx.op("Mul", y, ctx.op("Sub", one, y)))}


@gradient("Erf")
def erf(ctx: GradContext):
    # d erf(x)/dx = 2/sqrt(pi) exp(-x^2)
    x = ctx.I(0)
    e = ctx.op("Exp", ctx.op("Neg", ctx.op("Mul", x, x)))
    d = ctx.op("Mul", e, ctx.scalar_like(2.0 / math.sqrt(math.pi), x))
    return {0: ctx.op("Mul", ctx.GO(0), d)}


@gradient("Relu")
def relu(ctx: GradContext):
    x = ctx.I(0)
    pos = ctx.op("Greater", x, ctx.scalar_like(0.0, x), dtype=None)
    return {0: ctx.op("Where", pos, ctx.GO(0), ctx.scalar_like(0.0, x), dtype=x.dtype)}


@gradient("Abs")
def abs_(ctx: GradContext):
    return {0: ctx.op("Mul", ctx.GO(0), ctx.op("Sign", ctx.I(0)))}


@gradient("Cast")
def cast(ctx: GradContext):
    # Only reached when both sides are floating point (ints carry no gradient).
    return {0: ctx.cast_like(ctx.GO(0), ctx.I(0))}


@gradient("CastLike", nondiff_inputs=(1,))
def cast_like(ctx: GradContext):
    return {0: ctx.cast_like(ctx.GO(0), ctx.I(0))}


@gradient("Where", nondiff_inputs=(0,))
def where(ctx: GradContext):
    cond, g = ctx.I(0), ctx.GO(0)
    zero = ctx.scalar_like(0.0, ctx.O(0))
    out = {}
    if ctx.needs(1):
        out[1] = _un(ctx, ctx.op("Where", cond, g, zero, dtype=g.dtype), 1)
    if ctx.needs(2):
        out[2] = _un(ctx, ctx.op("Where", cond, zero, g, dtype=g.dtype), 2)
    return out


@gradient("Max")
def max_(ctx: GradContext):
    return _select_extremum(ctx, "GreaterOrEqual")


@gradient("Min")
def min_(ctx: GradContext):
    return _select_extremum(ctx, "LessOrEqual")


def _select_extremum(ctx: GradContext, cmp: str):
    # Two-input form: the gradient goes to the winning input (ties to input 0, like torch.maximum
    # splits; documented difference: ties are rare with continuous inputs).
    if len(ctx.node.inputs) != 2:
        raise NotImplementedError(f"{ctx.node.op_type} with {len(ctx.node.inputs)} inputs")
    a, b, g = ctx.I(0), ctx.I(1), ctx.GO(0)
    zero = ctx.scalar_like(0.0, ctx.O(0))
    first = ctx.op(cmp, a, b, dtype=None)
    out = {}
    if ctx.needs(0):
        out[0] = _un(ctx, ctx.op("Where", first, g, zero, dtype=g.dtype), 0)
    if ctx.needs(1):
        out[1] = _un(ctx, ctx.op("Where", first, zero, g, dtype=g.dtype), 1)
    return out
