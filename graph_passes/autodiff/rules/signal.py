"""Fourier transforms: DFT (``torch.fft``'s fft / ifft / rfft / irfft / fftn exports).

A DFT is linear, so its gradient is its adjoint, another DFT. With N the signal length
along the axis, complex values as the trailing pair of reals:

1. complex to complex (``onesided=0``): ``y = F x`` has adjoint ``F^H = N * IDFT``; the
   inverse ``y = F^H x / N`` has adjoint ``F / N``;
2. ``rfft`` (forward, ``onesided=1``, a real input): ``y`` is the first ``N // 2 + 1`` bins
   of ``F x``; the adjoint zero-pads the gradient back to N bins, applies ``N * IDFT`` and
   keeps the real part;
3. ``irfft`` (inverse, ``onesided=1``): ``y`` is the real signal of the Hermitian spectrum
   the half spectrum stands for; every bin but the first (and the middle one of an even
   N) stands for two, so the adjoint is the half spectrum of ``F g``, those bins doubled,
   over N (what torch computes).

A real input (a trailing axis of 1) takes the real part of its gradient. A ``dft_length``
that pads or truncates the signal is refused (no rule for the resizing yet).
"""

from __future__ import annotations

import onnx_ir as ir

from ortrain.graph_passes.autodiff.context import GradContext
from ortrain.graph_passes.autodiff.registry import gradient


def _dft(ctx: GradContext, g: ir.Value, axis: int, *, inverse: int, onesided: int, shape):
    """A DFT node over ``axis`` of the form the forward had (axis as input from opset 20)."""
    if ctx.has_input(2) or "axis" not in ctx.node.attributes:
        axis_input = ctx.const(axis, ir.DataType.INT64)
        return ctx.op("DFT", g, None, axis_input, inverse=inverse, onesided=onesided, shape=shape)
    return ctx.op("DFT", g, None, axis=axis, inverse=inverse, onesided=onesided, shape=shape)


def _dft_grad(ctx: GradContext, axis: int) -> dict:
    x, y, g = ctx.I(0), ctx.O(0), ctx.GO(0)
    assert g is not None
    xs, ys = ctx.shape(x), ctx.shape(y)
    rank = len(xs)
    a = axis if axis >= 0 else axis + rank
    inverse, onesided = int(ctx.attr("inverse", 0)), int(ctx.attr("onesided", 0))
    length = ctx.const_ints(ctx.I(1)) if ctx.has_input(1) else None
    n = ys[a] if onesided and inverse else xs[a]  # the signal's length
    if length is not None and length[0] != n:
        raise ValueError(f"a dft_length ({length[0]}) other than the signal's length ({n})")
    complex_shape = lambda m: (*xs[:a], m, *xs[a + 1 : -1], 2)  # noqa: E731
    if onesided and not inverse:  # rfft
        bins = ys[a]
        if bins < n:
            pads = [0] * (2 * rank)
            pads[rank + a] = n - bins
            g = ctx.op("Pad", g, ctx.ints(pads), shape=complex_shape(n))
        dx = _dft(ctx, g, a, inverse=1, onesided=0, shape=complex_shape(n))
        dx = ctx.op("Mul", dx, ctx.scalar_like(float(n), dx), shape=complex_shape(n))
    elif onesided:  # irfft
        bins = xs[a]
        half = _dft(ctx, g, a, inverse=0, onesided=1, shape=complex_shape(bins))
        doubled = [2.0 / n if 0 < k < n - k else 1.0 / n for k in range(bins)]
        weights = ctx.const(doubled, half.dtype or ir.DataType.FLOAT)
        view = [1] * rank
        view[a] = bins
        weights = ctx.reshape(weights, view)
        dx = ctx.op("Mul", half, weights, shape=complex_shape(bins))
    else:
        out = complex_shape(n)
        dx = _dft(ctx, g, a, inverse=1 - inverse, onesided=0, shape=out)
        dx = ctx.op("Mul", dx, ctx.scalar_like(1.0 / n if inverse else float(n), dx), shape=out)
    if xs[-1] == 1:  # a real signal: the real part
        starts, ends, axes = ctx.ints([0]), ctx.ints([1]), ctx.ints([rank - 1])
        dx = ctx.op("Slice", dx, starts, ends, axes, shape=xs)
    return {0: dx}


@gradient("DFT", nondiff_inputs=(1,), opsets=(17, 19))
def dft_17(ctx: GradContext):
    return _dft_grad(ctx, int(ctx.attr("axis", 1)))


@gradient("DFT", nondiff_inputs=(1, 2), opsets=(20, None))
def dft_20(ctx: GradContext):
    axis = ctx.const_ints(ctx.I(2)) if ctx.has_input(2) else None
    return _dft_grad(ctx, axis[0] if axis else -2)
