"""Activations and unary math: Clip, Softplus, Elu, LeakyRelu, HardSwish, Mish, trigonometry, ...

At a kink the derivative is the one torch's backward kernel takes (its comparison, strict
or not), so inputs that sit exactly on a bound train as in eager:

1. ``Clip`` passes the gradient where ``min <= x <= max`` (torch.clamp); tensor bounds get
   theirs where ``x < min`` (and ``min < max``) / ``x > max`` (or ``max < min``).
2. ``Clip`` exported from ``F.hardtanh`` / ``F.relu6`` (the exporter records the aten op in
   the node's ``pkg.torch.onnx.fx_node``) passes it only where ``min < x < max``.
3. LeakyRelu / PRelu take the negative slope at 0; Elu / Selu their negative branch at 0.
4. HardSigmoid is flat at its bounds (``alpha x + beta`` in {0, 1}); HardSwish is 0 at
   ``x <= -3`` and 1 at ``x >= 3``; Shrink and ThresholdedRelu are 0 at ``|x| == lambd`` /
   ``x == alpha``.
5. Max / Min of an exported torch.clamp(x, min_t, max_t) give x the whole gradient on a tie
   (``clamp_bound``), torch.maximum / minimum half (rules/elementwise.py). One node made of
   two torch calls with different rules (CSE merges torch.maximum(x, t) and
   torch.clamp(x, min=t)) follows the call the exporter recorded.
"""

from __future__ import annotations

import re

import numpy as np
import onnx_ir as ir

from ortrain.graph_passes.autodiff.context import GradContext
from ortrain.graph_passes.autodiff.registry import gradient

_FX_TARGET = re.compile(r"target=torch\.ops\.aten\.(\w+)\.")
_HIERARCHY_OP = re.compile(r"'aten\.(\w+)\.\w+'\]$")


def exported_from(node: ir.Node) -> str | None:
    """The aten op (``"hardtanh"``, ``"clamp"``, in-place ``_`` dropped) that the dynamo
    exporter translated into ``node``, read from the metadata it records; None if absent."""
    fx = node.metadata_props.get("pkg.torch.onnx.fx_node", "")
    match = _FX_TARGET.search(fx)
    if match is None:
        match = _HIERARCHY_OP.search(node.metadata_props.get("pkg.torch.onnx.class_hierarchy", ""))
    return match.group(1).rstrip("_") if match else None


# --- helpers ---------------------------------------------------------------------------------


def _c(ctx: GradContext, value: float) -> ir.Value:
    return ctx.scalar_like(value, ctx.I(0))


def _where(ctx: GradContext, cond: ir.Value, a: ir.Value, b: ir.Value) -> ir.Value:
    return ctx.op("Where", cond, a, b, dtype=ctx.I(0).dtype)


def _chain(ctx: GradContext, d: ir.Value) -> dict[int, ir.Value]:
    """dx = dy * f'(x)."""
    return {0: ctx.op("Mul", ctx.GO(0), d)}


def _mask(ctx: GradContext, cond: ir.Value) -> dict[int, ir.Value]:
    """dx = dy where ``cond``, else 0."""
    return {0: _where(ctx, cond, ctx.GO(0), _c(ctx, 0.0))}


def _and(ctx: GradContext, a: ir.Value | None, b: ir.Value | None) -> ir.Value | None:
    return a if b is None else b if a is None else ctx.op("And", a, b)


# --- Clip / hardtanh / relu6 ------------------------------------------------------------------

_OPEN_BOUNDS = frozenset({"hardtanh", "relu6"})  # their backward: 0 at the bounds


def _clip_x_mask(
    ctx: GradContext, lo: ir.Value | None, hi: ir.Value | None, legacy: bool
) -> ir.Value | None:
    """Where x's gradient passes; None: everywhere."""
    x = ctx.I(0)
    if exported_from(ctx.node) in _OPEN_BOUNDS:
        above = None if lo is None else ctx.op("Greater", x, lo)
        below = None if hi is None else ctx.op("Less", x, hi)
    elif legacy:  # GreaterOrEqual / LessOrEqual are opset 12
        above = None if lo is None else ctx.op("Not", ctx.op("Less", x, lo))
        below = None if hi is None else ctx.op("Not", ctx.op("Greater", x, hi))
    else:
        above = None if lo is None else ctx.op("GreaterOrEqual", x, lo)
        below = None if hi is None else ctx.op("LessOrEqual", x, hi)
    return _and(ctx, above, below)


def _clip_x_grad(ctx: GradContext, lo: ir.Value | None, hi: ir.Value | None, legacy: bool):
    inside = _clip_x_mask(ctx, lo, hi, legacy)
    return ctx.GO(0) if inside is None else _mask(ctx, inside)[0]


@gradient("Clip", opsets=(6, 10))
def clip_attributes(ctx: GradContext):
    # min / max are attributes (absent: unbounded on that side)
    lo, hi = ctx.attr("min"), ctx.attr("max")
    lo_v = None if lo is None else _c(ctx, float(lo))
    hi_v = None if hi is None else _c(ctx, float(hi))
    return {0: _clip_x_grad(ctx, lo_v, hi_v, legacy=True)}


@gradient("Clip", opsets=(11, None))
def clip(ctx: GradContext):
    # min / max are optional scalar inputs; torch.clamp(x, min_t, max_t) gives min the
    # gradient where x < min < max, and max where x > max or max < min (the output is max).
    x, g = ctx.I(0), ctx.GO(0)
    lo = ctx.I(1) if ctx.has_input(1) else None
    hi = ctx.I(2) if ctx.has_input(2) else None
    zero = _c(ctx, 0.0)
    out = {}
    if ctx.needs(0):
        out[0] = _clip_x_grad(ctx, lo, hi, legacy=False)
    if ctx.needs(1) and lo is not None:
        below = ctx.op("Less", x, lo)
        if hi is not None:
            below = ctx.op("And", below, ctx.op("Less", lo, hi))
        out[1] = ctx.unbroadcast(_where(ctx, below, g, zero), lo)
    if ctx.needs(2) and hi is not None:
        above = ctx.op("Greater", x, hi)
        if lo is not None:
            above = ctx.op("Or", above, ctx.op("Less", hi, lo))
        out[2] = ctx.unbroadcast(_where(ctx, above, g, zero), hi)
    return out


CLAMP_OPS = frozenset({"clamp", "clamp_min", "clamp_max"})


def clamp_bound(ctx: GradContext, keeps: str, loses: str) -> dict[int, ir.Value]:
    """The Max (``keeps`` GreaterOrEqual, ``loses`` Less) or Min of an exported
    torch.clamp(x, min_t, max_t) = Min(Max(x, min_t), max_t): x (input 0) gets the gradient
    within the bound, ties included; the bound where x is beyond it."""
    x, bound, g = ctx.I(0), ctx.I(1), ctx.GO(0)
    zero = ctx.scalar_like(0.0, ctx.O(0))
    out = {}
    if ctx.needs(0):
        keep = ctx.op(keeps, x, bound)
        lower = _clamp_lower(ctx) if ctx.node.op_type == "Min" else None
        if lower is not None:
            # torch gives min the gradient where x < min only if min < max: where
            # x < min == max nothing flows, so neither does it into the Max here
            x0, lo = lower
            ok = ctx.op("Or", ctx.op("GreaterOrEqual", x0, lo), ctx.op("Less", lo, bound))
            keep = ctx.op("And", keep, ok)
        out[0] = ctx.unbroadcast(ctx.op("Where", keep, g, zero, dtype=g.dtype), x)
    if ctx.needs(1):
        beyond = ctx.op("Where", ctx.op(loses, x, bound), g, zero, dtype=g.dtype)
        out[1] = ctx.unbroadcast(beyond, bound)
    return out


def _clamp_lower(ctx: GradContext) -> tuple[ir.Value, ir.Value] | None:
    """(x, min) of the Max that this Min's torch.clamp call made (the same recorded FX
    call), else None."""
    fx = ctx.node.metadata_props.get("pkg.torch.onnx.fx_node")
    prev = ctx.I(0).producer()
    if fx is None or prev is None or prev.op_type != "Max" or len(prev.inputs) != 2:
        return None
    if prev.metadata_props.get("pkg.torch.onnx.fx_node") != fx or None in prev.inputs:
        return None
    return prev.inputs[0], prev.inputs[1]


# --- rectifier family -------------------------------------------------------------------------


@gradient("LeakyRelu")
def leaky_relu(ctx: GradContext):
    x, g = ctx.I(0), ctx.GO(0)
    alpha = float(ctx.attr("alpha", 0.01))
    pos = ctx.op("Greater", x, _c(ctx, 0.0))
    return {0: _where(ctx, pos, g, ctx.op("Mul", g, _c(ctx, alpha)))}


@gradient("PRelu")
def prelu(ctx: GradContext):
    # y = x (x > 0) else slope * x; slope broadcasts to x. At 0: slope for x, 0 for slope.
    x, slope, g = ctx.I(0), ctx.I(1), ctx.GO(0)
    pos = ctx.op("Greater", x, _c(ctx, 0.0))
    out = {}
    if ctx.needs(0):
        out[0] = _where(ctx, pos, g, ctx.op("Mul", g, slope))
    if ctx.needs(1):
        gs = _where(ctx, pos, _c(ctx, 0.0), ctx.op("Mul", g, x))
        out[1] = ctx.unbroadcast(gs, slope)
    return out


@gradient("ThresholdedRelu")
def thresholded_relu(ctx: GradContext):
    x = ctx.I(0)
    return _mask(ctx, ctx.op("Greater", x, _c(ctx, float(ctx.attr("alpha", 1.0)))))


def _exp_branch(ctx: GradContext, scale: float, coef: float, pos_slope: float):
    """Elu family: dy/dx = coef * exp(x * scale) for x <= 0, pos_slope above."""
    x = ctx.I(0)
    arg = x if scale == 1.0 else ctx.op("Mul", x, _c(ctx, scale))
    neg = ctx.op("Exp", arg)
    if coef != 1.0:
        neg = ctx.op("Mul", neg, _c(ctx, coef))
    d = _where(ctx, ctx.op("Greater", x, _c(ctx, 0.0)), _c(ctx, pos_slope), neg)
    return _chain(ctx, d)


@gradient("Elu")
def elu(ctx: GradContext):
    alpha = float(ctx.attr("alpha", 1.0))
    return _exp_branch(ctx, 1.0, alpha, 1.0)


@gradient("Selu")
def selu(ctx: GradContext):
    alpha = float(ctx.attr("alpha", 1.67326319217681884765625))
    gamma = float(ctx.attr("gamma", 1.05070102214813232421875))
    return _exp_branch(ctx, 1.0, alpha * gamma, gamma)


@gradient("Celu")
def celu(ctx: GradContext):
    alpha = float(ctx.attr("alpha", 1.0))
    return _exp_branch(ctx, 1.0 / alpha, 1.0, 1.0)


# --- smooth and hard sigmoid-like -------------------------------------------------------------


@gradient("Softplus")
def softplus(ctx: GradContext):
    return _chain(ctx, ctx.op("Sigmoid", ctx.I(0)))


@gradient("Softsign")
def softsign(ctx: GradContext):
    # d/dx x / (1 + |x|) = 1 / (1 + |x|)^2
    x = ctx.I(0)
    den = ctx.op("Add", ctx.op("Abs", x), _c(ctx, 1.0))
    return {0: ctx.op("Div", ctx.GO(0), ctx.op("Mul", den, den))}


@gradient("Mish")
def mish(ctx: GradContext):
    # y = x tanh(sp(x)), sp = softplus: dy/dx = t + x sigmoid(x) (1 - t^2), t = tanh(sp(x))
    x = ctx.I(0)
    t = ctx.op("Tanh", ctx.op("Softplus", x))
    sech2 = ctx.op("Sub", _c(ctx, 1.0), ctx.op("Mul", t, t))
    d = ctx.op("Add", t, ctx.op("Mul", ctx.op("Mul", x, ctx.op("Sigmoid", x)), sech2))
    return _chain(ctx, d)


@gradient("HardSigmoid")
def hard_sigmoid(ctx: GradContext):
    # y = clip(alpha x + beta, 0, 1): slope alpha strictly between the bounds (torch's
    # hardsigmoid: -3 < x < 3). The bounds are taken in x, as torch compares x.
    x = ctx.I(0)
    alpha = float(ctx.attr("alpha", 0.2))
    beta = float(ctx.attr("beta", 0.5))
    if alpha == 0.0:
        return {0: ctx.op("Mul", ctx.GO(0), _c(ctx, 0.0))}
    a32, b32 = (float(np.float32(v)) for v in (alpha, beta))  # the kernel's float attributes
    lo, hi = sorted(((0.0 - b32) / a32, (1.0 - b32) / a32))
    inside = ctx.op("And", ctx.op("Greater", x, _c(ctx, lo)), ctx.op("Less", x, _c(ctx, hi)))
    return {0: _where(ctx, inside, ctx.op("Mul", ctx.GO(0), _c(ctx, alpha)), _c(ctx, 0.0))}


@gradient("HardSwish")
def hard_swish(ctx: GradContext):
    # y = x relu6(x + 3) / 6; torch: 0 for x <= -3, x / 3 + 1/2 for -3 < x < 3, 1 from 3 on
    x = ctx.I(0)
    ramp = ctx.op("Add", ctx.op("Div", x, _c(ctx, 3.0)), _c(ctx, 0.5))
    d = _where(ctx, ctx.op("Less", x, _c(ctx, 3.0)), ramp, _c(ctx, 1.0))
    d = _where(ctx, ctx.op("Greater", x, _c(ctx, -3.0)), d, _c(ctx, 0.0))
    return _chain(ctx, d)


@gradient("Shrink")
def shrink(ctx: GradContext):
    # y = x -+ bias outside [-lambd, lambd], 0 inside (softshrink / hardshrink): slope 1 outside
    x = ctx.I(0)
    lambd = float(ctx.attr("lambd", 0.5))
    outside = ctx.op("Or", ctx.op("Greater", x, _c(ctx, lambd)), ctx.op("Less", x, _c(ctx, -lambd)))
    return _mask(ctx, outside)


# --- variadic mean ----------------------------------------------------------------------------


@gradient("Mean")
def mean(ctx: GradContext):
    n = len(ctx.node.inputs)
    share = ctx.op("Mul", ctx.GO(0), ctx.scalar_like(1.0 / n, ctx.O(0)))
    return {i: ctx.unbroadcast(share, ctx.I(i)) for i in range(n) if ctx.needs(i)}


# --- trigonometric and hyperbolic -------------------------------------------------------------


def _sqrt_of(ctx: GradContext, one_sign: float, sq_sign: float) -> ir.Value:
    """sqrt(one_sign + sq_sign * x^2)."""
    x = ctx.I(0)
    sq = ctx.op("Mul", x, x)
    if sq_sign < 0:
        return ctx.op("Sqrt", ctx.op("Sub", _c(ctx, one_sign), sq))
    return ctx.op("Sqrt", ctx.op("Add", sq, _c(ctx, one_sign)))


@gradient("Sin")
def sin(ctx: GradContext):
    return _chain(ctx, ctx.op("Cos", ctx.I(0)))


@gradient("Cos")
def cos(ctx: GradContext):
    return {0: ctx.op("Neg", ctx.op("Mul", ctx.GO(0), ctx.op("Sin", ctx.I(0))))}


@gradient("Tan")
def tan(ctx: GradContext):
    # 1 + tan(x)^2 from the output, as torch does
    y = ctx.O(0)
    return _chain(ctx, ctx.op("Add", ctx.op("Mul", y, y), _c(ctx, 1.0)))


@gradient("Atan")
def atan(ctx: GradContext):
    x = ctx.I(0)
    return {0: ctx.op("Div", ctx.GO(0), ctx.op("Add", ctx.op("Mul", x, x), _c(ctx, 1.0)))}


@gradient("Asin")
def asin(ctx: GradContext):
    return {0: ctx.op("Div", ctx.GO(0), _sqrt_of(ctx, 1.0, -1.0))}


@gradient("Acos")
def acos(ctx: GradContext):
    return {0: ctx.op("Neg", ctx.op("Div", ctx.GO(0), _sqrt_of(ctx, 1.0, -1.0)))}


@gradient("Sinh")
def sinh(ctx: GradContext):
    return _chain(ctx, ctx.op("Cosh", ctx.I(0)))


@gradient("Cosh")
def cosh(ctx: GradContext):
    return _chain(ctx, ctx.op("Sinh", ctx.I(0)))


@gradient("Asinh")
def asinh(ctx: GradContext):
    return {0: ctx.op("Div", ctx.GO(0), _sqrt_of(ctx, 1.0, 1.0))}


@gradient("Acosh")
def acosh(ctx: GradContext):
    return {0: ctx.op("Div", ctx.GO(0), _sqrt_of(ctx, -1.0, 1.0))}


@gradient("Atanh")
def atanh(ctx: GradContext):
    x = ctx.I(0)
    return {0: ctx.op("Div", ctx.GO(0), ctx.op("Sub", _c(ctx, 1.0), ctx.op("Mul", x, x)))}
