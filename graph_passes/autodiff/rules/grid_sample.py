"""GridSample's gradient (``F.grid_sample``): linear, nearest and cubic, 2-D and 3-D (cubic:
2-D, as torch), every padding mode, with and without ``align_corners``; as torch's
``grid_sampler`` backward.

Shapes are static, so the rule works on flattened tensors: x as (N, C, S) over its S
spatial elements, the grid as (N, P, k) over its P sample points and k coordinates (x
first: the last spatial axis), dy as (N, C, P). Per coordinate axis:

1. the source index: the grid's [-1, 1] scaled to the axis (``(g + 1) / 2 * (size - 1)``
   with ``align_corners``, else ``((g + 1) * size - 1) / 2``), then the padding mode's
   border clip or reflection, each with the factor it contributes to d(index)/d(g)
   (0 on and past a border, the sign of a reflection), as torch computes them;
2. the taps: floor and floor + 1 with weights 1 - t and t (linear); the index rounded
   half to even with weight 1 (nearest); floor - 1 .. floor + 2 with the cubic
   convolution's weights of t (cubic: the padding mode moves each tap into the axis
   instead of the index); a tap outside the axis reads zero.

A sample's value is the sum over the taps' corners (every combination of one tap per
axis) of x at the corner times the product of the axes' weights. So dx scatters
dy x weight to each corner (one ScatterElements "add" over all corners), and the grid's
gradient along an axis is the sum over corners of (dy . x at the corner, summed over
channels) times that axis's weight derivative times the other axes' weights, times the
index's d(index)/d(g). Nearest sampling is piecewise constant in the grid: its gradient
is zero there.
"""

from __future__ import annotations

import itertools
import math

import onnx_ir as ir

from ortrain.graph_passes.autodiff.context import GradContext
from ortrain.graph_passes.autodiff.registry import gradient
from ortrain.graph_passes.autodiff.rules.reduce_more import graph_opset

LINEAR = ("linear", "bilinear")


class _Emit:
    """Ops on (N, P) float tensors of one dtype, shapes given."""

    def __init__(self, ctx: GradContext, dtype: ir.DataType, shape: tuple[int, ...]):
        self.ctx, self.dtype, self.shape = ctx, dtype, shape

    def c(self, value: float) -> ir.Value:
        return self.ctx.const(value, self.dtype)

    def op(self, op_type: str, *inputs: ir.Value, **attrs: object) -> ir.Value:
        return self.ctx.op(op_type, *inputs, dtype=self.dtype, shape=self.shape, **attrs)

    def mask(self, op_type: str, a: ir.Value, b: ir.Value) -> ir.Value:
        """A comparison as 0/1 in the float dtype."""
        flag = self.ctx.op(op_type, a, b, dtype=ir.DataType.BOOL, shape=self.shape)
        return self.ctx.op("Cast", flag, to=self.dtype.value, dtype=self.dtype, shape=self.shape)

    def both(self, a: ir.Value, b: ir.Value) -> ir.Value:
        return self.op("Mul", a, b)


def _clip(e: _Emit, ix: ir.Value, size: int) -> tuple[ir.Value, ir.Value]:
    """The index clipped into [0, size - 1] and its derivative: 1 strictly inside, 0 on
    or past a border (torch counts the borders out for the gradient)."""
    lo, hi = e.c(0.0), e.c(float(size - 1))
    inside = e.both(e.mask("Greater", ix, lo), e.mask("Less", ix, hi))
    return e.op("Min", e.op("Max", ix, lo), hi), inside


def _reflect(e: _Emit, ix: ir.Value, twice_low: int, twice_high: int) -> tuple[ir.Value, ir.Value]:
    """The index reflected into [twice_low / 2, twice_high / 2] and its derivative (+1 or
    -1 by the number of reflections)."""
    if twice_low == twice_high:
        zero = e.op("Mul", ix, e.c(0.0))
        return zero, zero
    low, span = twice_low / 2, (twice_high - twice_low) / 2
    shifted = e.op("Sub", ix, e.c(low))
    sign = e.op("Sub", e.c(1.0), e.op("Mul", e.c(2.0), e.mask("Less", shifted, e.c(0.0))))
    dist = e.op("Abs", shifted)
    flips = e.op("Floor", e.op("Div", dist, e.c(span)))
    extra = e.op("Sub", dist, e.op("Mul", flips, e.c(span)))
    odd = e.op("Sub", flips, e.op("Mul", e.c(2.0), e.op("Floor", e.op("Div", flips, e.c(2.0)))))
    # even flips: low + extra (slope +sign); odd: low + span - extra (slope -sign)
    reflected = e.op(
        "Add",
        e.c(low),
        e.op("Add", extra, e.op("Mul", odd, e.op("Sub", e.c(span), e.op("Mul", e.c(2.0), extra)))),
    )
    slope = e.op("Mul", sign, e.op("Sub", e.c(1.0), e.op("Mul", e.c(2.0), odd)))
    return reflected, slope


def _source_index(
    e: _Emit, g: ir.Value, size: int, align: bool, padding: str
) -> tuple[ir.Value, ir.Value]:
    """A grid coordinate as an index along an axis of ``size``, and d(index)/d(g)."""
    # in torch's order of operations: a tap's weight is the index's fraction, which a
    # rounding apart would move
    shifted = e.op("Add", g, e.c(1.0))
    if align:
        scale = (size - 1) / 2
        ix = e.op("Mul", e.op("Div", shifted, e.c(2.0)), e.c(float(size - 1)))
    else:
        scale = size / 2
        ix = e.op("Div", e.op("Sub", e.op("Mul", shifted, e.c(float(size))), e.c(1.0)), e.c(2.0))
    slope: ir.Value | float = scale
    if padding == "border":
        ix, inside = _clip(e, ix, size)
        slope = e.op("Mul", inside, e.c(scale))
    elif padding == "reflection":
        low, high = (0, 2 * (size - 1)) if align else (-1, 2 * size - 1)
        ix, flip = _reflect(e, ix, low, high)
        ix, inside = _clip(e, ix, size)
        slope = e.op("Mul", e.both(flip, inside), e.c(scale))
    elif padding != "zeros":
        raise NotImplementedError(f"GridSample with padding_mode={padding!r}")
    return ix, slope if isinstance(slope, ir.Value) else e.c(slope)


Tap = tuple[ir.Value, ir.Value, "ir.Value | None", "ir.Value | float"]
CUBIC_A = -0.75  # the cubic convolution's coefficient, as torch's bicubic sampling


def _taps(e: _Emit, ix: ir.Value, size: int, mode: str, padding: str, align: bool) -> list[Tap]:
    """(index clamped into the axis, 1 where the tap is inside it, weight (None: 1),
    d weight / d index) per tap. Cubic taps are each moved into the axis by the padding
    mode (``ix`` itself is not: torch pads its four taps, not the index)."""
    if mode in LINEAR:
        low = e.op("Floor", ix)
        t = e.op("Sub", ix, low)
        raw = [(low, e.op("Sub", e.c(1.0), t), -1.0), (e.op("Add", low, e.c(1.0)), t, 1.0)]
    elif mode == "nearest":
        raw = [(e.op("Round", ix), None, 0.0)]
    else:
        raw = _cubic_taps(e, ix, size, padding, align)
    out: list[Tap] = []
    for idx, weight, slope in raw:
        valid = e.both(
            e.mask("GreaterOrEqual", idx, e.c(0.0)),
            e.mask("LessOrEqual", idx, e.c(float(size - 1))),
        )
        clamped = e.op("Min", e.op("Max", idx, e.c(0.0)), e.c(float(size - 1)))
        out.append((clamped, valid, weight, slope))
    return out


def _cubic_taps(e: _Emit, ix: ir.Value, size: int, padding: str, align: bool) -> list[tuple]:
    """The four taps floor(ix) - 1 .. floor(ix) + 2, each padded, with the cubic
    convolution's weights of t = ix - floor(ix) and their derivatives in t."""
    a = CUBIC_A
    low = e.op("Floor", ix)
    t = e.op("Sub", ix, low)

    def poly(x: ir.Value, coeffs: tuple[float, ...]) -> ir.Value:  # Horner, highest first
        acc = e.op("Mul", x, e.c(coeffs[0]))
        for k in coeffs[1:-1]:
            acc = e.op("Mul", e.op("Add", acc, e.c(k)), x)
        return e.op("Add", acc, e.c(coeffs[-1]))

    # torch's own expressions (weights as its upsampling's, derivatives as its
    # grid_sampler backward's, negated there), so both round alike
    near = (a + 2, -(a + 3), 0.0, 1.0)  # |x| <= 1
    far = (a, -5 * a, 8 * a, -4 * a)  # 1 < |x| < 2
    one_minus = e.op("Sub", e.c(1.0), t)
    m_t, m_t1 = e.op("Neg", t), e.op("Sub", e.c(-1.0), t)
    weights = [
        (poly(e.op("Add", t, e.c(1.0)), far), e.op("Neg", poly(m_t1, (-3 * a, -10 * a, -8 * a)))),
        (poly(t, near), e.op("Neg", poly(m_t, (-3 * (a + 2), -2 * (a + 3), 0.0)))),
        (poly(one_minus, near), e.op("Neg", poly(one_minus, (3 * (a + 2), -2 * (a + 3), 0.0)))),
        (
            poly(e.op("Add", one_minus, e.c(1.0)), far),
            e.op("Neg", poly(e.op("Sub", e.c(2.0), t), (3 * a, -10 * a, 8 * a))),
        ),
    ]
    out = []
    for offset, (w, dw) in zip((-1.0, 0.0, 1.0, 2.0), weights, strict=True):
        idx = e.op("Add", low, e.c(offset))
        if padding == "reflection":
            low2, high2 = (0, 2 * (size - 1)) if align else (-1, 2 * size - 1)
            idx = _reflect(e, idx, low2, high2)[0]
        if padding in ("border", "reflection"):
            idx = e.op("Min", e.op("Max", idx, e.c(0.0)), e.c(float(size - 1)))
        out.append((idx, w, dw))
    return out


def _cast(ctx: GradContext, v: ir.Value, dtype: ir.DataType) -> ir.Value:
    if v.dtype == dtype:
        return v
    return ctx.op("Cast", v, to=dtype.value, dtype=dtype, shape=ctx.shape(v))


@gradient("GridSample")
def grid_sample(ctx: GradContext):
    mode = str(ctx.attr("mode", "linear"))
    padding = str(ctx.attr("padding_mode", "zeros"))
    align = bool(ctx.attr("align_corners", 0))
    if mode not in (*LINEAR, "nearest", "cubic", "bicubic"):
        raise NotImplementedError(f"GridSample with mode={mode!r}")
    if padding not in ("zeros", "border", "reflection"):
        raise NotImplementedError(f"GridSample with padding_mode={padding!r}")
    if graph_opset(ctx) < 16:
        raise NotImplementedError("GridSample's gradient needs ScatterElements 'add' (opset 16)")
    x, grid, dy = ctx.I(0), ctx.I(1), ctx.GO(0)
    xs, gs = ctx.shape(x), ctx.shape(grid)
    n, c, spatial = xs[0], xs[1], xs[2:]
    k = len(spatial)
    points = math.prod(gs[1:-1])
    s = math.prod(spatial)
    out_dtype = dtype = dy.dtype
    if mode in ("cubic", "bicubic") and dtype == ir.DataType.FLOAT:
        # sixteen taps of cubic weights and their derivatives: in float32 their rounding
        # exceeds eager's own several times over; in double it stays below it
        dtype = ir.DataType.DOUBLE

    def as_dtype(v: ir.Value, shape: tuple[int, ...]) -> ir.Value:
        flat = ctx.reshape(v, shape)
        if flat.dtype == dtype:
            return flat
        return ctx.op("Cast", flat, to=dtype.value, dtype=dtype, shape=shape)

    e = _Emit(ctx, dtype, (n, points))
    flat_grid = as_dtype(grid, (n, points, k))
    flat_x = as_dtype(x, (n, c, s))
    flat_dy = as_dtype(dy, (n, c, points))

    axes = []  # per grid coordinate (the last spatial axis first)
    for j in range(k):
        size = spatial[k - 1 - j]
        stride = math.prod(spatial[k - j :])
        g = ctx.op("Gather", flat_grid, ctx.ints([j]), axis=2, dtype=dtype, shape=(n, points, 1))
        # cubic sampling pads its taps, not the index
        pad_index = "zeros" if mode in ("cubic", "bicubic") else padding
        ix, slope = _source_index(e, ctx.reshape(g, (n, points)), size, align, pad_index)
        axes.append((_taps(e, ix, size, mode, padding, align), slope, stride))

    indices, updates, per_axis = [], [], [[] for _ in range(k)]
    shape3 = (n, c, points)
    for corner in itertools.product(*(range(len(taps)) for taps, _, _ in axes)):
        taps = [axes[j][0][t] for j, t in enumerate(corner)]
        flat = None
        valid = weight = None
        for j, (idx, ok, w, _) in enumerate(taps):
            term = e.op("Mul", idx, e.c(float(axes[j][2])))
            flat = term if flat is None else e.op("Add", flat, term)
            valid = ok if valid is None else e.both(valid, ok)
            if w is not None:
                weight = w if weight is None else e.both(weight, w)
        flat_i = ctx.op(
            "Cast", flat, to=ir.DataType.INT64.value, dtype=ir.DataType.INT64, shape=(n, points)
        )
        index = ctx.op(
            "Expand",
            ctx.reshape(flat_i, (n, 1, points)),
            ctx.ints(shape3),
            dtype=ir.DataType.INT64,
            shape=shape3,
        )
        scaled = valid if weight is None else e.both(weight, valid)
        if ctx.needs(0):
            indices.append(index)
            w3 = ctx.reshape(scaled, (n, 1, points))
            updates.append(ctx.op("Mul", flat_dy, w3, dtype=dtype, shape=shape3))
        if ctx.needs(1) and mode != "nearest":
            at = ctx.op("GatherElements", flat_x, index, axis=2, dtype=dtype, shape=shape3)
            prod = ctx.op("Mul", flat_dy, at, dtype=dtype, shape=shape3)
            dot = ctx.op(
                "ReduceSum", prod, ctx.ints([1]), keepdims=0, dtype=dtype, shape=(n, points)
            )
            dot = e.both(dot, valid)
            for j in range(k):
                others = None
                for i, (_, _, w, _) in enumerate(taps):
                    if i != j and w is not None:
                        others = w if others is None else e.both(others, w)
                d = taps[j][3]
                term = e.op("Mul", dot, d if isinstance(d, ir.Value) else e.c(d))
                per_axis[j].append(term if others is None else e.both(term, others))

    grads: dict[int, ir.Value] = {}
    if ctx.needs(0):
        all_idx = ctx.op(
            "Concat", *indices, axis=2, dtype=ir.DataType.INT64, shape=(n, c, points * len(indices))
        )
        all_upd = ctx.op(
            "Concat", *updates, axis=2, dtype=dtype, shape=(n, c, points * len(updates))
        )
        dx = ctx.op(
            "ScatterElements", ctx.zeros((n, c, s), dtype), all_idx, all_upd,
            axis=2, reduction="add", dtype=dtype, shape=(n, c, s),
        )  # fmt: skip
        grads[0] = ctx.reshape(_cast(ctx, dx, out_dtype), xs)
    if ctx.needs(1):
        if mode != "nearest":
            cols = []
            for j in range(k):
                total = per_axis[j][0]
                for t in per_axis[j][1:]:
                    total = e.op("Add", total, t)
                total = e.both(total, axes[j][1])
                cols.append(ctx.reshape(total, (n, points, 1)))
            dgrid = ctx.op("Concat", *cols, axis=2, dtype=dtype, shape=(n, points, k))
        else:  # nearest: piecewise constant in the grid
            dgrid = ctx.zeros((n, points, k), dtype)
        grads[1] = ctx.reshape(_cast(ctx, dgrid, out_dtype), gs)
    return grads
