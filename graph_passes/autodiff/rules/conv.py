"""Conv (1-D, 2-D, 3-D; strides, dilations, padding, groups): the patch embeddings of
vision transformers (ViT), the convolutional stems of speech models (Whisper, wav2vec2).

With y = conv(x, w) over the spatial axes:

- dx is the transposed convolution of dy with the same weight, strides, dilations, pads
  and groups; ``output_padding`` adds back the trailing input positions no window
  reached (stride > 1), so dx has x's shape.
- dw correlates x with dy, summed over the batch: a convolution in which channels and
  batch swap roles (batch = the input channels of one group, channels = the batch),
  with stride and dilation exchanged; trailing taps beyond the kernel (positions the
  forward never read) are sliced off.
- db sums dy over the batch and spatial axes.

Col2Im (torch's ``Fold``) adds image patches back into an image; its gradient gathers
them out again (``col2im``).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import onnx_ir as ir

from ortrain.graph_passes.autodiff.context import GradContext
from ortrain.graph_passes.autodiff.registry import gradient


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
    if ctx.needs(0):
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
    if ctx.needs(1):
        out[1] = _weight_grad(ctx, x, gy, xs, gys, o, cg, ks, group, strides, dilations, pads)
    if ctx.has_input(2) and ctx.needs(2):
        axes = ctx.ints([0, *range(2, 2 + nd)])
        out[2] = ctx.op("ReduceSum", gy, axes, keepdims=0, shape=(o,))
    return out


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
