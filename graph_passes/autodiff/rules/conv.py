"""Conv (1-D, 2-D, 3-D; strides, dilations, padding, groups): the patch embeddings of
vision transformers (ViT), the convolutional stems of speech models (Whisper, wav2vec2).

With y = conv(x, w) over the spatial axes:

- dx is the transposed convolution of dy with the same weight, strides, dilations, pads
  and groups; ``output_padding`` adds back the trailing input positions no window
  reached (stride > 1), so dx has x's shape. With stride 1 it is a plain convolution of
  dy with the weight flipped along its spatial axes and its channel axes exchanged per
  group, padded by each kernel's extent less the forward's pads: the same sums, run by
  the backends' forward convolution, which they tune most (``_input_grad_as_conv``).
- dw correlates x with dy, summed over the batch. Ungrouped, it is a matrix product of
  dy with x's patches per sample (``_weight_grad_patches``, im2col: one Gather of x laid
  out channels-last, a row per output position, a column per kernel tap and channel);
  the patches take taps x x's memory, so a batch whose patches exceed ``PATCH_BYTES``
  is taken in chunks. Grouped (and with more than ``PATCH_TAPS`` taps or ``PATCH_INDEX``
  (position, tap) pairs, whose index would outgrow the graph), a convolution in which
  channels and batch swap roles (batch = the input channels of one group, channels =
  the batch), with stride and dilation exchanged; trailing taps beyond the kernel
  (positions the forward never read) are sliced off. That convolution's kernel is as
  large as dy's spatial extent, which the backends run far below their rate.
- db sums dy over the batch and spatial axes.

Col2Im (torch's ``Fold``) adds image patches back into an image; its gradient gathers
them out again (``col2im``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import onnx_ir as ir

from ortrain.graph_passes.autodiff.context import GradContext
from ortrain.graph_passes.autodiff.registry import gradient

# the weight gradient as a product over patches (im2col): kernels of at most this many
# taps (3 x 3 x 3), and patches of at most this many bytes at a time
PATCH_TAPS = 27
PATCH_BYTES = 1 << 28
PATCH_INDEX = 1 << 21  # int64 entries of the gather index: 16 MiB in the graph


def _pads(ctx: GradContext, xs, ks, gys, strides, dilations) -> list[int]:
    """Explicit begin/end pads, resolving ``auto_pad`` from the static shapes."""
    nd = len(ks)
    auto = ctx.attr("auto_pad", "NOTSET")
    auto = auto.decode() if isinstance(auto, bytes) else str(auto)
    if auto in ("NOTSET", ""):
        return list(ctx.attr("pads", None) or [0] * (2 * nd))
    if auto == "VALID":
        return [0] * (2 * nd)
    begin, end = [], []
    for i in range(nd):
        total = max(0, (gys[i] - 1) * strides[i] + (ks[i] - 1) * dilations[i] + 1 - xs[i])
        small, large = total // 2, total - total // 2
        begin.append(small if auto == "SAME_UPPER" else large)
        end.append(large if auto == "SAME_UPPER" else small)
    return begin + end


@gradient("Conv")
def conv(ctx: GradContext):
    x, w, gy = ctx.I(0), ctx.I(1), ctx.GO(0)
    xs, ws, gys = ctx.shape(x), ctx.shape(w), ctx.shape(ctx.O(0))
    o, cg, ks = ws[0], ws[1], list(ws[2:])
    nd = len(ks)
    group = int(ctx.attr("group", 1))
    strides = list(ctx.attr("strides", None) or [1] * nd)
    dilations = list(ctx.attr("dilations", None) or [1] * nd)
    pads = _pads(ctx, xs[2:], ks, gys[2:], strides, dilations)
    out: dict[int, ir.Value] = {}
    if ctx.needs(0) and _flipped_pads(ks, strides, dilations, pads) is not None:
        out[0] = _input_grad_as_conv(ctx, gy, w, xs, ws, group, dilations, pads)
    elif ctx.needs(0):
        reached = [
            (gys[2 + i] - 1) * strides[i] + (ks[i] - 1) * dilations[i] + 1 - pads[i] - pads[nd + i]
            for i in range(nd)
        ]
        out[0] = ctx.op(
            "ConvTranspose",
            gy,
            w,
            strides=strides,
            dilations=dilations,
            pads=pads,
            group=group,
            output_padding=[xs[2 + i] - reached[i] for i in range(nd)],
            shape=xs,
        )
    patches = math.prod(ks) <= PATCH_TAPS and math.prod(ks) * math.prod(gys[2:]) <= PATCH_INDEX
    if ctx.needs(1) and group == 1 and patches:
        out[1] = _weight_grad_patches(ctx, x, gy, xs, gys, o, ks, strides, dilations, pads)
    elif ctx.needs(1):
        out[1] = _weight_grad(ctx, x, gy, xs, gys, o, cg, ks, group, strides, dilations, pads)
    if ctx.has_input(2) and ctx.needs(2):
        axes = ctx.ints([0, *range(2, 2 + nd)])
        out[2] = ctx.op("ReduceSum", gy, axes, keepdims=0, shape=(o,))
    return out


def _flipped_pads(ks, strides, dilations, pads) -> list[int] | None:
    """The pads of dx as a convolution of dy (stride 1 only; each side's pad at most the
    kernel's extent), else None."""
    nd = len(ks)
    if any(s != 1 for s in strides):
        return None
    extent = [(ks[i] - 1) * dilations[i] for i in range(nd)]
    flipped = [extent[i % nd] - pads[i] for i in range(2 * nd)]
    return flipped if min(flipped) >= 0 else None


def _input_grad_as_conv(ctx, gy, w, xs, ws, group, dilations, pads):
    """dx of a stride-1 convolution: dy convolved with the flipped weight whose channel
    axes are exchanged within each group ([O, Cg, k] -> [G * Cg, O / G, k])."""
    o, cg, ks = ws[0], ws[1], list(ws[2:])
    nd = len(ks)
    og = o // group
    spatial = list(range(3, 3 + nd))
    wt = ctx.reshape(w, (group, og, cg, *ks))
    wt = ctx.op("Transpose", wt, perm=[0, 2, 1, *spatial], shape=(group, cg, og, *ks))
    wt = ctx.reshape(wt, (group * cg, og, *ks))
    big = -(2**62)  # past the start: a reversed slice runs to the first element
    flipped = ctx.op(
        "Slice",
        wt,
        ctx.ints([-1] * nd),
        ctx.ints([big] * nd),
        ctx.ints(list(range(2, 2 + nd))),
        ctx.ints([-1] * nd),
        shape=(group * cg, og, *ks),
    )
    return ctx.op(
        "Conv",
        gy,
        flipped,
        dilations=dilations,
        pads=_flipped_pads(ks, [1] * nd, dilations, pads),
        group=group,
        shape=xs,
    )


def _patch_index(spatial, out_spatial, ks, strides, dilations, pads) -> np.ndarray:
    """Where each (output position, kernel tap) pair reads x, both row-major, as a flat
    spatial index; ``prod(spatial)`` (an appended zero) where it reads padding."""
    nd = len(ks)
    grid = np.stack(np.meshgrid(*[np.arange(v) for v in out_spatial], indexing="ij"), -1)
    taps = np.stack(np.meshgrid(*[np.arange(k) for k in ks], indexing="ij"), -1)
    at = grid.reshape(-1, 1, nd) * np.array(strides) + taps.reshape(1, -1, nd) * np.array(dilations)
    at -= np.array(pads[:nd])
    inside = ((at >= 0) & (at < np.array(spatial))).all(-1)
    flat = np.ravel_multi_index(tuple(np.clip(at, 0, np.array(spatial) - 1).T), spatial).T
    return np.where(inside, flat, math.prod(spatial)).reshape(-1)


def _weight_grad_patches(ctx, x, gy, xs, gys, o, ks, strides, dilations, pads):
    """dw of an ungrouped convolution: per sample, dy [O, P] (P output positions) times
    the patches of x [P, T * C] (im2col: a row per position, a column per tap and
    channel, gathered from x channels-last with a zero position appended for the
    padding), summed over the batch; in chunks of the batch whose patches fit
    ``PATCH_BYTES``."""
    n, c, nd = xs[0], xs[1], len(ks)
    spatial, out_spatial = list(xs[2:]), list(gys[2:])
    size, positions, t = math.prod(spatial), math.prod(out_spatial), math.prod(ks)
    index = _patch_index(spatial, out_spatial, ks, strides, dilations, pads)
    last = [0, *range(2, 2 + nd), 1]
    xl = ctx.op("Transpose", x, perm=last, shape=(n, *spatial, c))
    xl = ctx.reshape(xl, (n, size, c))
    xz = ctx.op("Pad", xl, ctx.ints([0, 0, 0, 0, 1, 0]), shape=(n, size + 1, c))
    at = ctx.const(index.tolist(), ir.DataType.INT64)
    dy = ctx.reshape(gy, (n, o, positions))
    chunk = max(1, min(n, PATCH_BYTES // (4 * t * c * positions)))
    parts = []
    for lo in range(0, n, chunk):
        m = min(chunk, n - lo)
        xc, dc = xz, dy
        if m < n:
            xc = ctx.op("Slice", xz, ctx.ints([lo]), ctx.ints([lo + m]), ctx.ints([0]),
                        shape=(m, size + 1, c))  # fmt: skip
            dc = ctx.op("Slice", dy, ctx.ints([lo]), ctx.ints([lo + m]), ctx.ints([0]),
                        shape=(m, o, positions))  # fmt: skip
        cols = ctx.op("Gather", xc, at, axis=1, shape=(m, positions * t, c))
        cols = ctx.reshape(cols, (m, positions, t * c))
        # per sample (a product whose right side stays in cache), summed over the batch
        prod = ctx.op("MatMul", dc, cols, shape=(m, o, t * c))
        parts.append(ctx.op("ReduceSum", prod, ctx.ints([0]), keepdims=0, shape=(o, t * c)))
    dw = parts[0] if len(parts) == 1 else ctx.op("Sum", *parts, shape=(o, t * c))
    dw = ctx.reshape(dw, (o, *ks, c))
    return ctx.op("Transpose", dw, perm=[0, nd + 1, *range(1, nd + 1)], shape=(o, c, *ks))


def _weight_grad(ctx, x, gy, xs, gys, o, cg, ks, group, strides, dilations, pads):
    n, nd = xs[0], len(ks)
    spatial, out_spatial = list(xs[2:]), list(gys[2:])
    sp = list(range(3, 3 + nd))
    # x [N, G*Cg, S] -> [Cg, G*N, S]: batch = a group's input channels, channels = (g, n).
    xg = ctx.reshape(x, (n, group, cg, *spatial))
    xg = ctx.op("Transpose", xg, perm=[2, 1, 0, *sp], shape=(cg, group, n, *spatial))
    xg = ctx.reshape(xg, (cg, group * n, *spatial))
    # dy [N, G*Og, S'] -> [G*Og, N, S']: one filter per output channel over the batch.
    og = o // group
    wg = ctx.reshape(gy, (n, group, og, *out_spatial))
    wg = ctx.op("Transpose", wg, perm=[1, 2, 0, *sp], shape=(group, og, n, *out_spatial))
    wg = ctx.reshape(wg, (o, n, *out_spatial))
    taps = [
        (spatial[i] + pads[i] + pads[nd + i] - ((out_spatial[i] - 1) * strides[i] + 1))
        // dilations[i]
        + 1
        for i in range(nd)
    ]
    corr = ctx.op(
        "Conv",
        xg,
        wg,
        strides=dilations,
        dilations=strides,
        pads=pads,
        group=group,
        shape=(cg, o, *taps),
    )
    if taps != ks:
        axes = list(range(2, 2 + nd))
        corr = ctx.op(
            "Slice",
            corr,
            ctx.ints([0] * nd),
            ctx.ints(ks),
            ctx.ints(axes),
            shape=(cg, o, *ks),
        )
    return ctx.op("Transpose", corr, perm=[1, 0, *range(2, 2 + nd)], shape=(o, cg, *ks))


# --- shared with ConvTranspose and the pooling rules (rules/pooling.py) -----------------------


def explicit_pads(
    ctx: GradContext,
    xs: Sequence[int],
    ks: Sequence[int],
    ys: Sequence[int],
    strides: Sequence[int],
    dilations: Sequence[int],
) -> list[int]:
    """Begin/end pads of a windowed op over spatial sizes ``xs`` -> ``ys`` (``auto_pad``
    resolved from the static shapes, as for Conv)."""
    return _pads(ctx, list(xs), list(ks), list(ys), list(strides), list(dilations))


def weight_grad(
    ctx: GradContext,
    x: ir.Value,
    gy: ir.Value,
    w_shape: Sequence[int],
    group: int,
    strides: Sequence[int],
    dilations: Sequence[int],
    pads: Sequence[int],
) -> ir.Value:
    """dw of ``y = Conv(x, w)`` with ``w_shape`` = [O, Cg, *kernel]: the correlation of x
    with dy over the batch. ConvTranspose's dw is this with x and dy swapped."""
    xs, gys = ctx.shape(x), ctx.shape(gy)
    o, cg, ks = w_shape[0], w_shape[1], list(w_shape[2:])
    return _weight_grad(
        ctx, x, gy, xs, gys, o, cg, ks, group, list(strides), list(dilations), list(pads)
    )


@gradient("Col2Im", nondiff_inputs=(1, 2))
def col2im(ctx: GradContext):
    # torch's Fold: y[n, c, p] = sum of x[n, c*K + k, l] over the (kernel tap k, block l)
    # pairs that land on image position p. Its adjoint gathers: dx[n, c*K + k, l] is dy at
    # the position of tap k in block l, or 0 where that position is padding. The positions
    # are static, so dx is one Gather of dy padded with zeros and flattened.
    x, g = ctx.I(0), ctx.GO(0)
    image = ctx.const_ints(ctx.I(1))
    block = ctx.const_ints(ctx.I(2))
    if image is None or block is None:
        raise NotImplementedError("Col2Im with a non-constant image or block shape")
    nd = len(block)
    dilations = list(ctx.attr("dilations", None) or [1] * nd)
    strides = list(ctx.attr("strides", None) or [1] * nd)
    pads = list(ctx.attr("pads", None) or [0] * (2 * nd))
    n, ck, blocks = ctx.shape(x)
    taps = int(np.prod(block))
    c = ck // taps
    padded = [image[d] + pads[d] + pads[nd + d] for d in range(nd)]
    counts = [(padded[d] - dilations[d] * (block[d] - 1) - 1) // strides[d] + 1 for d in range(nd)]
    if int(np.prod(counts)) != blocks:
        raise NotImplementedError(f"Col2Im: {blocks} blocks, the attributes make {counts}")
    # position of tap k (row-major over the kernel) in block l (row-major over the grid)
    tap = np.stack(np.meshgrid(*[np.arange(b) for b in block], indexing="ij"), -1).reshape(-1, nd)
    grid = np.stack(np.meshgrid(*[np.arange(m) for m in counts], indexing="ij"), -1)
    grid = grid.reshape(-1, nd)
    where = grid[None, :, :] * np.array(strides) + tap[:, None, :] * np.array(dilations)
    flat = np.ravel_multi_index(tuple(where[..., d] for d in range(nd)), padded)  # [K, L]
    gp = g
    if any(pads):
        zero = [0, 0]
        gp = ctx.op("Pad", g, ctx.ints([*zero, *pads[:nd], *zero, *pads[nd:]]),
                    shape=[n, c, *padded])  # fmt: skip
    gp = ctx.reshape(gp, (n, c, int(np.prod(padded))))
    index = ctx.const(flat.tolist(), ir.DataType.INT64)
    gathered = ctx.op("Gather", gp, index, axis=2, shape=[n, c, taps, blocks])
    return {0: ctx.reshape(gathered, (n, ck, blocks))}
