"""Pooling and spatial ops: MaxPool, AveragePool, global pools, ConvTranspose, Resize.

Shapes are static, so the window arithmetic is resolved when the rule runs:

1. MaxPool: the gradient goes to the element the forward picked, read from the node's
   ``Indices`` output (flat indices into x; ties go to the first maximum in window scan
   order, as in torch's max_pool); overlapping windows add up (ScatterElements "add").
2. AveragePool: dy divided by each window's divisor (a constant computed here, with or
   without the padding counted), spread back over the window by a ConvTranspose with a
   ones kernel per channel (strides, dilations, pads, ceil_mode's partial windows).
3. LpPool: the same window adjoint, of dy / y^(p-1), times sign(x) |x|^(p-1).
4. GlobalAveragePool: dy / (spatial size), broadcast. GlobalMaxPool: the gradient goes
   to the first maximum per channel (ArgMax), as torch's adaptive_max_pool picks it.
5. ConvTranspose: dx is the Conv of dy with the same weight; dw the correlation of dy
   with x (Conv's weight gradient with x and dy swapped); db sums dy.
6. Resize is linear in x and separable per axis: ``y = A_1 ... A_k x`` with one constant
   interpolation matrix per resized axis (nearest, linear, cubic, antialiased linear and
   cubic; every coordinate transformation but tf_crop_and_resize), so dx applies the
   transposes by MatMul. The matrices follow what onnxruntime's CPU kernel computes where
   it departs from the spec's formula (float32 coordinates; x copied when no axis changes
   size; nearest rounding of half-pixel coordinates, which it does not reproduce, raises).
"""

from __future__ import annotations

import math

import numpy as np
import onnx_ir as ir

from ortrain.graph_passes.autodiff.context import GradContext
from ortrain.graph_passes.autodiff.registry import gradient
from ortrain.graph_passes.autodiff.rules.conv import explicit_pads, weight_grad
from ortrain.graph_passes.infra.constant_value import constant_tensor


def _unsupported(ctx: GradContext, what: str) -> NotImplementedError:
    return NotImplementedError(f"{ctx.node.op_type} node {ctx.node.name!r}: {what}")


def _window(ctx: GradContext) -> tuple[list[int], list[int], list[int], list[int]]:
    """kernel_shape, strides, dilations and explicit begin/end pads of a pooling node."""
    xs, ys = ctx.shape(ctx.I(0)), ctx.shape(ctx.O(0))
    ks = list(ctx.attr("kernel_shape"))
    nd = len(ks)
    strides = list(ctx.attr("strides", None) or [1] * nd)
    dilations = list(ctx.attr("dilations", None) or [1] * nd)
    pads = explicit_pads(ctx, xs[2:], ks, ys[2:], strides, dilations)
    return ks, strides, dilations, pads


def _window_sum_transpose(
    ctx: GradContext,
    g: ir.Value,
    x_shape: tuple[int, ...],
    ks: list[int],
    strides: list[int],
    dilations: list[int],
    pads: list[int],
) -> ir.Value:
    """dx[i] = sum of g over the windows that read x[i] (the adjoint of a window sum):
    ConvTranspose of g with a ones kernel per channel. Its output is cropped to x: the
    begin pads off the front, and off the end whatever ceil_mode's partial windows
    reach past x; trailing inputs no window read get zeros (output_padding). Along an
    axis with one window, taps past x's end read nothing: the kernel stops at x's end
    (EfficientNet pools a 1 x 1 map with a 1280 x 1280 ceil-mode window, whose ones
    kernel per channel would be gigabytes)."""
    nd, c = len(ks), x_shape[1]
    gs = ctx.shape(g)[2:]
    ks = [
        min(k, x_shape[2 + i] + pads[i]) if gs[i] == 1 and dilations[i] == 1 else k
        for i, k in enumerate(ks)
    ]
    end, extra = [], []
    for i in range(nd):
        full = (gs[i] - 1) * strides[i] + (ks[i] - 1) * dilations[i] + 1
        crop = full - pads[i] - x_shape[2 + i]
        end.append(max(crop, 0))
        extra.append(max(-crop, 0))
    ones = ctx.const(np.ones((c, 1, *ks), np.float32), g.dtype)
    return ctx.op(
        "ConvTranspose",
        g,
        ones,
        kernel_shape=ks,
        strides=strides,
        dilations=dilations,
        pads=pads[:nd] + end,
        output_padding=extra,
        group=c,
        shape=x_shape,
    )


# --- MaxPool --------------------------------------------------------------------------------------


@gradient("MaxPool", opsets=(8, None), forward_outputs=2)
def max_pool(ctx: GradContext) -> dict[int, ir.Value]:
    if int(ctx.attr("storage_order", 0)) != 0:
        raise _unsupported(ctx, "storage_order=1 (column-major Indices) has no gradient rule")
    x, gy, idx = ctx.I(0), ctx.GO(0), ctx.O(1)
    # The builder types an output it exposes like the input; Indices are int64, y-shaped.
    idx.dtype, idx.shape = ir.DataType.INT64, ctx.O(0).shape
    xs = ctx.shape(x)
    size, ys_size = math.prod(xs), math.prod(ctx.shape(ctx.O(0)))
    flat = ctx.op(
        "ScatterElements",
        ctx.zeros([size], x.dtype),
        ctx.reshape(idx, [ys_size]),
        ctx.reshape(gy, [ys_size]),
        axis=0,
        reduction="add",
        shape=[size],
    )
    return {0: ctx.reshape(flat, xs)}


# --- AveragePool ----------------------------------------------------------------------------------


def _divisors(
    xs: list[int],
    ys: list[int],
    ks: list[int],
    strides: list[int],
    dilations: list[int],
    pads: list[int],
    count_pad: bool,
) -> np.ndarray:
    """Each output's divisor: the taps of its window inside x (or, counting padding,
    inside the padded x; ceil_mode's taps past the end padding never count)."""
    nd = len(ks)
    div = np.ones((), dtype=np.int64)
    for i in range(nd):
        lo = 0 if not count_pad else -pads[i]
        hi = xs[i] if not count_pad else xs[i] + pads[nd + i]
        taps = np.arange(ys[i])[:, None] * strides[i] - pads[i]
        taps = taps + np.arange(ks[i])[None, :] * dilations[i]
        counts = ((taps >= lo) & (taps < hi)).sum(axis=1)
        div = np.multiply.outer(div, counts)
    return div


@gradient("AveragePool")
def average_pool(ctx: GradContext) -> dict[int, ir.Value]:
    x, gy = ctx.I(0), ctx.GO(0)
    xs, ys = ctx.shape(x), ctx.shape(ctx.O(0))
    ks, strides, dilations, pads = _window(ctx)
    count_pad = bool(int(ctx.attr("count_include_pad", 0)))
    div = _divisors(list(xs[2:]), list(ys[2:]), ks, strides, dilations, pads, count_pad)
    if (div == 0).any():
        raise _unsupported(ctx, "a window reads no input element")
    div_c = ctx.const(div.reshape(1, 1, *div.shape).astype(x.dtype.numpy()), x.dtype)
    g = ctx.op("Div", gy, div_c, shape=ys)
    return {0: _window_sum_transpose(ctx, g, xs, ks, strides, dilations, pads)}


# --- LpPool ---------------------------------------------------------------------------------------


@gradient("LpPool", opsets=(11, None))
def lp_pool(ctx: GradContext) -> dict[int, ir.Value]:
    # y = (sum_window |x|^p)^(1/p): dx = sign(x) |x|^(p-1) * sum over the windows reading x
    # of dy / y^(p-1). A window of zeros (y = 0) passes no gradient.
    x, y, gy = ctx.I(0), ctx.O(0), ctx.GO(0)
    xs, ys = ctx.shape(x), ctx.shape(y)
    p = int(ctx.attr("p", 2))
    if p < 1:
        raise _unsupported(ctx, f"p={p}")
    ks, strides, dilations, pads = _window(ctx)
    g = gy
    if p > 1:
        zero = ctx.op("Equal", y, ctx.scalar_like(0.0, x))
        safe = ctx.op("Where", zero, ctx.scalar_like(1.0, x), y, shape=ys)
        g = ctx.op("Div", gy, ctx.op("Pow", safe, ctx.scalar_like(float(p - 1), x)), shape=ys)
        g = ctx.op("Where", zero, ctx.scalar_like(0.0, x), g, shape=ys)
    spread = _window_sum_transpose(ctx, g, xs, ks, strides, dilations, pads)
    local = ctx.op("Sign", x)  # times |x|^(p-1): d|x|^p / dx, over p
    if p > 1:
        mag = ctx.op("Abs", x)
        if p > 2:
            mag = ctx.op("Pow", mag, ctx.scalar_like(float(p - 1), x))
        local = ctx.op("Mul", local, mag)
    return {0: ctx.op("Mul", local, spread, shape=xs)}


# --- global pools ---------------------------------------------------------------------------------


@gradient("GlobalAveragePool")
def global_average_pool(ctx: GradContext) -> dict[int, ir.Value]:
    x = ctx.I(0)
    xs = ctx.shape(x)
    g = ctx.op("Div", ctx.GO(0), ctx.scalar_like(float(math.prod(xs[2:])), x))
    return {0: ctx.op("Expand", g, ctx.ints(xs), shape=xs)}


@gradient("GlobalMaxPool")
def global_max_pool(ctx: GradContext) -> dict[int, ir.Value]:
    # torch's adaptive_max_pool(x, 1) (what this op computes) sends the gradient to the
    # first maximum of each channel; ArgMax picks the first too (select_last_index=0).
    x = ctx.I(0)
    xs = ctx.shape(x)
    n, c, s = xs[0], xs[1], math.prod(xs[2:])
    x3 = ctx.reshape(x, (n, c, s))
    first = ctx.op("ArgMax", x3, axis=2, keepdims=1, select_last_index=0, dtype=ir.DataType.INT64)
    g3 = ctx.reshape(ctx.GO(0), (n, c, 1))
    dx = ctx.op(
        "ScatterElements", ctx.zeros((n, c, s), x.dtype), first, g3, axis=2, shape=(n, c, s)
    )
    return {0: ctx.reshape(dx, xs)}


# --- ConvTranspose --------------------------------------------------------------------------------


@gradient("ConvTranspose")
def conv_transpose(ctx: GradContext) -> dict[int, ir.Value]:
    x, w, gy = ctx.I(0), ctx.I(1), ctx.GO(0)
    xs, ws, ys = ctx.shape(x), ctx.shape(w), ctx.shape(ctx.O(0))
    ks = list(ws[2:])
    nd = len(ks)
    auto = ctx.attr("auto_pad", "NOTSET")
    auto = auto.decode() if isinstance(auto, bytes) else str(auto)
    if auto not in ("NOTSET", "") or ctx.attr("output_shape", None) is not None:
        raise _unsupported(ctx, f"auto_pad={auto} / output_shape (explicit pads only)")
    group = int(ctx.attr("group", 1))
    strides = list(ctx.attr("strides", None) or [1] * nd)
    dilations = list(ctx.attr("dilations", None) or [1] * nd)
    pads = list(ctx.attr("pads", None) or [0] * (2 * nd))
    out: dict[int, ir.Value] = {}
    if ctx.needs(0):
        # dx[i] = sum_k dy[i*s + k*d - pad] w[k]: a Conv of dy with the same weight
        out[0] = ctx.op(
            "Conv",
            gy,
            w,
            kernel_shape=ks,
            strides=strides,
            dilations=dilations,
            pads=pads,
            group=group,
            shape=xs,
        )
    if ctx.needs(1):
        # ConvTranspose is Conv's dx: its dw correlates dy (the conv's input) with x.
        out[1] = weight_grad(ctx, gy, x, ws, group, strides, dilations, pads)
    if ctx.has_input(2) and ctx.needs(2):
        axes = ctx.ints([0, *range(2, 2 + nd)])
        out[2] = ctx.op("ReduceSum", gy, axes, keepdims=0, shape=(ys[1],))
    return out


# --- Resize ---------------------------------------------------------------------------------------


def _text(ctx: GradContext, name: str, default: str) -> str:
    v = ctx.attr(name, default)
    return v.decode() if isinstance(v, bytes) else str(v)


def _source_coords(ctm: str, n_in: int, n_out: int, scale: float) -> np.ndarray:
    """Each output's coordinate in the input, in float32 like onnxruntime's kernels."""
    f = np.float32
    o = np.arange(n_out, dtype=f)
    s = f(scale)
    if ctm == "half_pixel":
        return (o + f(0.5)) / s - f(0.5)
    if ctm == "pytorch_half_pixel":
        return (o + f(0.5)) / s - f(0.5) if n_out > 1 else np.zeros(n_out, f)
    if ctm == "align_corners":
        return o * f(n_in - 1) / f(n_out - 1) if n_out > 1 else np.zeros(n_out, f)
    if ctm == "asymmetric":
        return o / s
    if ctm == "half_pixel_symmetric":  # float32 offset, the rest in float64, then float32
        adjustment = f(n_out) / (s * f(n_in))
        offset = f(n_in) / f(2) * (f(1) - adjustment)
        orig = np.float64(offset) + (o.astype(np.float64) + 0.5) / np.float64(s) - 0.5
        return orig.astype(f)
    raise NotImplementedError(f"coordinate_transformation_mode={ctm}")


def _nearest(x: np.ndarray, mode: str) -> np.ndarray:
    floor = np.floor(x)
    half = (x - floor) == 0.5
    if mode == "floor":
        return floor
    if mode == "ceil":
        return np.ceil(x)
    if mode == "round_prefer_floor":
        return np.where(half, floor, np.round(x))
    if mode == "round_prefer_ceil":
        return np.where(half, floor + 1, np.round(x))
    raise NotImplementedError(f"nearest_mode={mode}")


def _cubic_coeffs(t: np.ndarray, a: float) -> np.ndarray:
    """Keys' cubic weights of the taps at floor-1 .. floor+2 for the fraction ``t``."""
    d = np.stack([t + 1, t, 1 - t, 2 - t], axis=1).astype(np.float64)
    near = ((a + 2) * d - (a + 3)) * d * d + 1
    far = ((a * d - 5 * a) * d + 8 * a) * d - 4 * a
    return np.where(d <= 1, near, far)


def _resize_matrix(ctx: GradContext, n_in: int, n_out: int, scale: float) -> np.ndarray:
    """A [n_out, n_in]: one axis of the resize, y = A @ x (taps clamped to the edge)."""
    mode = _text(ctx, "mode", "nearest")
    ctm = _text(ctx, "coordinate_transformation_mode", "half_pixel")
    if int(ctx.attr("antialias", 0)) and mode != "nearest":
        return _antialias_matrix(ctx, mode, ctm, n_in, n_out, scale)
    nearest_mode = _text(ctx, "nearest_mode", "round_prefer_floor")
    if mode == "nearest" and (
        ctm == "half_pixel_symmetric"
        or (ctm.endswith("half_pixel") and nearest_mode.startswith("round"))
    ):
        # onnxruntime rounds these coordinates differently from their float32 formula
        # for some sizes (which source element it picks is not reproduced here)
        raise NotImplementedError(f"nearest_mode={nearest_mode} with {ctm}")
    x = _source_coords(ctm, n_in, n_out, scale).astype(np.float64)
    a = np.zeros((n_out, n_in))
    rows = np.arange(n_out)
    if mode == "nearest":
        idx = _nearest(x, nearest_mode).astype(np.int64)
        a[rows, np.clip(idx, 0, n_in - 1)] = 1.0
        return a
    if mode == "linear":
        x = np.clip(x, 0, n_in - 1)
        lo = np.floor(x).astype(np.int64)
        t = x - lo
        np.add.at(a, (rows, lo), 1 - t)
        np.add.at(a, (rows, np.minimum(lo + 1, n_in - 1)), t)
        return a
    if mode == "cubic":
        if int(ctx.attr("exclude_outside", 0)):
            raise NotImplementedError("exclude_outside=1 without antialias")
        lo = np.floor(x).astype(np.int64)
        weights = _cubic_coeffs(x - lo, float(ctx.attr("cubic_coeff_a", -0.75)))
        for j in range(4):
            np.add.at(a, (rows, np.clip(lo - 1 + j, 0, n_in - 1)), weights[:, j])
        return a
    raise NotImplementedError(f"mode={mode}")


def _antialias_matrix(
    ctx: GradContext, mode: str, ctm: str, n_in: int, n_out: int, scale: float
) -> np.ndarray:
    """Antialiased linear / cubic (torch's and PIL's filters, as onnxruntime runs them): when
    shrinking, the filter is stretched by 1 / scale; the taps outside x are dropped and
    each row's weights renormalized (``exclude_outside=1``)."""
    if ctm not in ("half_pixel", "pytorch_half_pixel") or not int(ctx.attr("exclude_outside", 0)):
        raise NotImplementedError(f"antialias with {ctm}, exclude_outside=0")
    if n_in == n_out:  # onnxruntime leaves an axis that keeps its size alone
        return np.eye(n_in)
    a_coeff = float(ctx.attr("cubic_coeff_a", -0.75))

    def filt(t: np.ndarray) -> np.ndarray:
        t = np.abs(t)
        if mode == "linear":
            return np.clip(1 - t, 0, None)
        near = ((a_coeff + 2) * t - (a_coeff + 3)) * t * t + 1
        far = (((t - 5) * t + 8) * t - 4) * a_coeff
        return np.where(t < 1, near, np.where(t < 2, far, 0.0))

    support = (1.0 if mode == "linear" else 2.0) * max(1.0 / scale, 1.0)
    stretch = min(scale, 1.0)
    a = np.zeros((n_out, n_in))
    for o in range(n_out):
        center = (o + 0.5) / scale
        lo = max(int(center - support + 0.5), 0)
        hi = min(int(center + support + 0.5), n_in)
        w = filt((np.arange(lo, hi) - center + 0.5) * stretch)
        a[o, lo:hi] = w / w.sum()
    return a


def _resize_scales(ctx: GradContext, xs: tuple[int, ...], ys: tuple[int, ...]) -> list[float]:
    """The scale per axis the coordinates use: the ``scales`` input, else out / in."""
    rank = len(xs)
    scales = [float(np.float32(o) / np.float32(i)) for i, o in zip(xs, ys, strict=True)]
    if not ctx.has_input(2):
        return scales
    t = constant_tensor(ctx.I(2))
    if t is None:
        raise _unsupported(ctx, "scales is not a constant")
    given = [float(v) for v in np.asarray(t.numpy()).reshape(-1)]
    if not given:  # empty: sizes decide
        return scales
    axes = list(ctx.attr("axes", None) or range(rank))
    for ax, s in zip(axes, given, strict=True):
        scales[ax % rank] = s
    return scales


@gradient("Resize", opsets=(11, None), nondiff_inputs=(1, 2, 3))
def resize(ctx: GradContext) -> dict[int, ir.Value]:
    x, g = ctx.I(0), ctx.GO(0)
    xs, ys = ctx.shape(x), ctx.shape(ctx.O(0))
    if _text(ctx, "keep_aspect_ratio_policy", "stretch") != "stretch":
        raise _unsupported(ctx, "keep_aspect_ratio_policy other than stretch")
    if xs == ys:  # onnxruntime copies x when no axis changes size, whatever the scales
        return {0: g}
    scales = _resize_scales(ctx, xs, ys)
    rank = len(xs)
    shape = list(ys)
    try:
        mats = [_resize_matrix(ctx, xs[ax], ys[ax], scales[ax]) for ax in range(rank)]
    except NotImplementedError as exc:
        raise _unsupported(ctx, str(exc)) from None
    for ax in reversed(range(rank)):
        a = mats[ax]
        if a.shape[0] == a.shape[1] and np.array_equal(a, np.eye(a.shape[0])):
            continue
        g = _apply_along(ctx, g, a.astype(x.dtype.numpy()), ax, shape)
        shape[ax] = xs[ax]
    return {0: g}


def _apply_along(
    ctx: GradContext, g: ir.Value, a: np.ndarray, axis: int, shape: list[int]
) -> ir.Value:
    """Contract axis ``axis`` of g (length n_out) with A [n_out, n_in]: g' = A^T g."""
    rank = len(shape)
    new = list(shape)
    new[axis] = a.shape[1]
    if axis == rank - 2:  # [.., n_out, W] -> A^T [n_in, n_out] @ g
        return ctx.op("MatMul", ctx.const(a.T.copy(), g.dtype), g, shape=new)
    perm = list(range(rank))
    perm[axis], perm[-1] = perm[-1], perm[axis]
    if axis != rank - 1:
        g = ctx.op("Transpose", g, perm=perm, shape=[shape[p] for p in perm])
    moved = [new[p] for p in perm]
    g = ctx.op("MatMul", g, ctx.const(a, g.dtype), shape=moved)
    if axis != rank - 1:
        g = ctx.op("Transpose", g, perm=perm, shape=new)
    return g
