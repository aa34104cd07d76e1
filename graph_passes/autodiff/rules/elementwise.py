"""Element-wise ops (numpy broadcasting: gradients are summed back to input shapes)."""

from __future__ import annotations

import math

import numpy as np
import onnx_ir as ir

from ortrain.graph_passes.autodiff.context import GradContext
from ortrain.graph_passes.autodiff.registry import gradient
from ortrain.graph_passes.infra.constant_value import constant_tensor


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


@gradient("Mod")
def mod(ctx: GradContext):
    # Floating Mod is C's fmod (ONNX requires fmod=1 for floats; torch.fmod exports so):
    # a - trunc(a / b) * b, so d/da = 1 and d/db = -trunc(a / b), as torch's fmod backward.
    g = ctx.GO(0)
    out = {}
    if ctx.needs(0):
        out[0] = _un(ctx, g, 0)
    if ctx.needs(1):
        q = ctx.op("Div", ctx.I(0), ctx.I(1))
        trunc = ctx.op("Mul", ctx.op("Sign", q), ctx.op("Floor", ctx.op("Abs", q)))
        out[1] = _un(ctx, ctx.op("Neg", ctx.op("Mul", g, trunc)), 1)
    return out


@gradient("Neg")
def neg(ctx: GradContext):
    return {0: ctx.op("Neg", ctx.GO(0))}


@gradient("Identity")
def identity(ctx: GradContext):
    return {0: ctx.GO(0)}


@gradient("Pow")
def pow_(ctx: GradContext):
    # d(x^y)/dx = y x^(y-1) ; d(x^y)/dy = x^y ln x, each masked to 0 where torch's
    # pow_backward_self / pow_backward_exponent mask it: at x == 0 the products are
    # 0 * inf (y == 0) and 0 * -inf (y > 0), NaN, where torch's gradient is 0.
    x, y, g = ctx.I(0), ctx.I(1), ctx.GO(0)
    zero = ctx.scalar_like(0.0, x)
    out = {}
    if ctx.needs(0):
        yc = ctx.cast_like(y, x)
        ym1 = ctx.op("Sub", yc, ctx.scalar_like(1.0, x))
        d = ctx.op("Mul", g, ctx.op("Mul", yc, ctx.op("Pow", x, ym1)))
        if _may_be_zero(y):
            d = ctx.op("Where", ctx.op("Equal", yc, zero), zero, d, dtype=x.dtype)
        out[0] = _un(ctx, d, 0)
    if ctx.needs(1):
        d = ctx.op("Mul", g, ctx.op("Mul", ctx.O(0), ctx.op("Log", x)))
        y_x = ctx.cast_like(y, x)
        at_zero = ctx.op(
            "And",
            ctx.op("Equal", x, zero),
            ctx.op("GreaterOrEqual", y_x, zero),
        )
        d = ctx.op("Where", at_zero, ctx.scalar_like(0.0, d), d, dtype=d.dtype)
        out[1] = _un(ctx, d, 1)
    return out


def _may_be_zero(v: ir.Value) -> bool:
    """False only for a constant without zeros (``x ** 2``: no mask needed)."""
    t = constant_tensor(v)
    return t is None or bool((np.asarray(t.numpy()) == 0).any())


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
    x, y, g = ctx.I(0), ctx.O(0), ctx.GO(0)
    if ctx.kernel_for(g, y):  # one pass, from Y (ortrain/runtime/grad_kernels.c)
        return {0: ctx.kernel("ReluGrad", g, y, like=g)}
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
    return _select_extremum(ctx, "GreaterOrEqual", "Less")


@gradient("Min")
def min_(ctx: GradContext):
    return _select_extremum(ctx, "LessOrEqual", "Greater")


def _select_extremum(ctx: GradContext, keeps: str, loses: str):
    """torch.maximum / torch.minimum: the gradient goes to the inputs equal to the output,
    spread evenly over tied ones (half each for two, as torch.maximum; n inputs as amax).
    ``loses``: input 0 loses to input 1. The exported torch.clamp(x, min_t, max_t) (Max
    then Min) gives x the whole gradient on a tie instead (``keeps``), as clamp does."""
    from ortrain.graph_passes.autodiff.rules.activation import CLAMP_OPS, clamp_bound, exported_from

    n = len(ctx.node.inputs)
    if n == 1:
        return {0: ctx.GO(0)}
    if n == 2 and exported_from(ctx.node) in CLAMP_OPS:
        return clamp_bound(ctx, keeps, loses)
    if n == 2:
        return _extremum_of_two(ctx, loses)
    y, g = ctx.O(0), ctx.GO(0)
    wins = [ctx.cast_like(ctx.op("Equal", ctx.I(i), y), y) for i in range(n)]
    share = ctx.op("Div", g, ctx.op("Sum", *wins, dtype=y.dtype))
    return {i: _un(ctx, ctx.op("Mul", share, wins[i]), i) for i in range(n) if ctx.needs(i)}


def _extremum_of_two(ctx: GradContext, loses: str):
    # torch's own formula (inputs only, not the output): where(a == b, g / 2, g), zeroed
    # where the input loses; a NaN input gets g on both sides, as in torch.
    a, b, g = ctx.I(0), ctx.I(1), ctx.GO(0)
    zero = ctx.scalar_like(0.0, ctx.O(0))
    half = ctx.op("Mul", g, ctx.scalar_like(0.5, ctx.O(0)))
    share = ctx.op("Where", ctx.op("Equal", a, b), half, g, dtype=g.dtype)
    swapped = {"Less": "Greater", "Greater": "Less"}[loses]
    out = {}
    for i, cmp in ((0, loses), (1, swapped)):
        if ctx.needs(i):
            out[i] = _un(ctx, ctx.op("Where", ctx.op(cmp, a, b), zero, share, dtype=g.dtype), i)
    return out


def _zero(ctx: GradContext):
    x = ctx.I(0)
    return {0: ctx.zeros(ctx.shape(x), x.dtype)}


# Piecewise-constant float ops: torch differentiates through them with a zero gradient, so
# a parameter read only through one gets a gradient of zeros (not None: AdamW still decays
# it and moves its moments), and so does it here.
for _op in ("Sign", "Floor", "Ceil", "Round"):
    gradient(_op)(_zero)
