"""Layout ops: the gradient undoes the data movement (shapes are static)."""

from __future__ import annotations

import numpy as np

from ortrain.graph_passes.autodiff.context import GradContext
from ortrain.graph_passes.autodiff.registry import gradient
from ortrain.graph_passes.infra.tags import PADDING_IDX


def _reshape_back(ctx: GradContext):
    return {0: ctx.reshape(ctx.GO(0), ctx.shape(ctx.I(0)))}


for _op in ("Reshape", "Squeeze", "Unsqueeze"):
    gradient(_op, nondiff_inputs=(1,))(_reshape_back)
gradient("Flatten")(_reshape_back)


@gradient("Transpose")
def transpose(ctx: GradContext):
    perm = ctx.attr("perm")
    rank = ctx.rank(ctx.I(0))
    perm = list(perm) if perm is not None else list(reversed(range(rank)))
    inv = [0] * rank
    for i, p in enumerate(perm):
        inv[p] = i
    return {0: ctx.op("Transpose", ctx.GO(0), perm=inv, shape=ctx.shape(ctx.I(0)))}


@gradient("Expand", nondiff_inputs=(1,))
def expand(ctx: GradContext):
    return {0: ctx.unbroadcast(ctx.GO(0), ctx.I(0))}


@gradient("Split", nondiff_inputs=(1,))
def split(ctx: GradContext):
    axis = int(ctx.attr("axis", 0))
    parts = [ctx.GO_or_zeros(i) for i in range(len(ctx.node.outputs))]
    return {0: ctx.op("Concat", *parts, axis=axis, shape=ctx.shape(ctx.I(0)))}


@gradient("Concat")
def concat(ctx: GradContext):
    axis = int(ctx.attr("axis"))
    rank = ctx.rank(ctx.O(0))
    axis = axis % rank
    sizes = [ctx.shape(ctx.I(i))[axis] for i in range(len(ctx.node.inputs))]
    pieces = ctx.op_multi("Split", ctx.GO(0), ctx.ints(sizes), axis=axis, num_outputs=len(sizes))
    out = {}
    for i, piece in enumerate(pieces):
        piece.dtype = ctx.GO(0).dtype
        if ctx.needs(i):
            piece.shape = ctx.I(i).shape
            out[i] = piece
    return out


@gradient("Slice", nondiff_inputs=(1, 2, 3, 4))
def slice_(ctx: GradContext):
    x, g = ctx.I(0), ctx.GO(0)
    shape = ctx.shape(x)
    rank = len(shape)
    starts = ctx.const_ints(ctx.I(1))
    ends = ctx.const_ints(ctx.I(2))
    axes = ctx.const_ints(ctx.I(3)) if ctx.has_input(3) else list(range(len(starts or [])))
    steps = ctx.const_ints(ctx.I(4)) if ctx.has_input(4) else [1] * len(axes or [])
    if starts is None or ends is None or axes is None or steps is None:
        raise NotImplementedError("Slice with non-constant starts/ends/axes/steps")
    out_shape = list(ctx.shape(ctx.O(0)))
    cur = g
    for start, axis, step in zip(starts, axes, steps, strict=True):
        axis %= rank
        n = shape[axis]
        if step == 0:
            raise NotImplementedError("Slice with step 0")
        s = start + n if start < 0 else start
        flip = step < 0  # x[s::-k] is x[::-1][n-1-s::k]: that gradient, reversed back below
        if flip:
            s, step = n - 1 - min(max(s, 0), n - 1), -step
        s = min(max(s, 0), n)
        m = out_shape[axis]
        if step > 1 and m > 0:
            # Interleave zeros: [.., m, ..] -> [.., m, step, ..] -> [.., m*step, ..].
            unsq = ctx.op("Unsqueeze", cur, ctx.ints([axis + 1]))
            zshape = [*out_shape[: axis + 1], step - 1, *out_shape[axis + 1 :]]
            z = ctx.zeros(zshape, g.dtype)
            cur = ctx.op("Concat", unsq, z, axis=axis + 1)
            out_shape[axis] = m * step
            cur = ctx.op("Reshape", cur, ctx.ints(out_shape))
        width = out_shape[axis]
        after = n - s - width
        pads = [0] * (2 * rank)
        pads[axis] = s
        pads[rank + axis] = after
        if after < 0:  # the interleaved tail overshoots the input: trim it
            cur = ctx.op("Slice", cur, ctx.ints([0]), ctx.ints([n - s]), ctx.ints([axis]))
            pads[rank + axis] = 0
        if any(pads):
            cur = ctx.op("Pad", cur, ctx.ints(pads))
        out_shape[axis] = n
        if flip:
            ends = ctx.ints([-(2**62)])
            cur = ctx.op("Slice", cur, ctx.ints([-1]), ends, ctx.ints([axis]), ctx.ints([-1]))
    cur.shape = x.shape
    return {0: cur}


@gradient("Pad", nondiff_inputs=(1, 2, 3))
def pad(ctx: GradContext):
    # Constant mode: y = x with p[i] zeros/values added (p < 0: entries removed) at each
    # end, so dx = Pad(dy, -p): added entries are cut off, removed ones get zero gradient.
    # reflect / edge / wrap: each added entry is a copy of an input entry, whose gradient
    # it adds to (_copied_pad).
    mode = ctx.attr("mode", "constant")
    pads = ctx.const_ints(ctx.I(1))
    if pads is None:
        raise NotImplementedError("Pad with non-constant pads")
    if mode != "constant":
        return {0: _copied_pad(ctx, str(mode), pads)}
    extra = (None, ctx.I(3)) if ctx.has_input(3) else ()  # same axes, constant 0
    neg = ctx.ints([-p for p in pads])
    return {0: ctx.op("Pad", ctx.GO(0), neg, *extra, shape=ctx.shape(ctx.I(0)))}


def _copied_pad(ctx: GradContext, mode: str, pads: list[int]):
    """The gradient of a reflect / edge / wrap Pad, one padded axis at a time (these
    pads are successive one-axis pads, so their gradients are too). Along an axis of n
    entries padded by b before and a after, dy's middle n entries are x's own; the added
    ones go back to the entries they copy:

    1. reflect: y[b - 1 - i] = x[1 + i] (i < b), y[b + n + j] = x[n - 2 - j] (j < a): the
       added runs, reversed, add onto x[1 : 1 + b] and x[n - 1 - a : n - 1];
    2. edge: every added entry copies x[0] (before) or x[n - 1] (after): their sums add
       onto those;
    3. wrap: y[i] = x[n - b + i], y[b + n + j] = x[j]: the runs add onto x[n - b :] and
       x[: a] unreversed.
    """
    x = ctx.I(0)
    shape = list(ctx.shape(x))
    rank = len(shape)
    axes = ctx.const_ints(ctx.I(3)) if ctx.has_input(3) else list(range(rank))
    if axes is None:
        raise NotImplementedError("Pad with non-constant axes")
    if mode not in ("reflect", "edge", "wrap"):
        raise NotImplementedError(f"Pad mode {mode!r}")
    k = len(axes)
    cur = ctx.GO(0)
    cur_shape = list(ctx.shape(ctx.O(0)))
    for i, axis in enumerate(axes):
        axis %= rank
        before, after, n = pads[i], pads[k + i], shape[axis]
        if before == after == 0:
            continue
        limit = n - 1 if mode == "reflect" else n
        if before < 0 or after < 0 or max(before, after) > limit:
            raise NotImplementedError(f"Pad mode {mode!r} with pads {pads} of an axis of {n}")
        cur = _unpad_axis(ctx, mode, cur, cur_shape, axis, before, after, n)
        cur_shape[axis] = n
    return cur


def _unpad_axis(ctx: GradContext, mode: str, g, g_shape, axis: int, b: int, a: int, n: int):
    """``g`` (b + n + a entries along ``axis``) folded back onto n entries."""

    def part(start: int, stop: int, reverse: bool = False):
        shape = list(g_shape)
        shape[axis] = stop - start
        piece = ctx.op("Slice", g, ctx.ints([start]), ctx.ints([stop]), ctx.ints([axis]),
                       shape=shape)  # fmt: skip
        if reverse:
            ends = ctx.ints([-(2**62)])
            piece = ctx.op("Slice", piece, ctx.ints([-1]), ends, ctx.ints([axis]), ctx.ints([-1]),
                           shape=shape)  # fmt: skip
        return piece, shape

    def placed(piece, shape, offset: int):
        """``piece`` at ``offset`` in zeros of n entries along the axis."""
        pads = [0] * (2 * len(shape))
        pads[axis], pads[len(shape) + axis] = offset, n - offset - shape[axis]
        full = list(shape)
        full[axis] = n
        return ctx.op("Pad", piece, ctx.ints(pads), shape=full) if any(pads) else piece

    out_shape = list(g_shape)
    out_shape[axis] = n
    total, _ = part(b, b + n)
    terms = []
    if b:
        piece, shape = part(0, b, reverse=mode == "reflect")
        if mode == "edge":
            shape[axis] = 1
            piece = ctx.op("ReduceSum", piece, ctx.ints([axis]), keepdims=1, shape=shape)
        terms.append(placed(piece, shape, {"reflect": 1, "edge": 0, "wrap": n - b}[mode]))
    if a:
        piece, shape = part(b + n, b + n + a, reverse=mode == "reflect")
        if mode == "edge":
            shape[axis] = 1
            piece = ctx.op("ReduceSum", piece, ctx.ints([axis]), keepdims=1, shape=shape)
        terms.append(placed(piece, shape, {"reflect": n - 1 - a, "edge": n - 1, "wrap": 0}[mode]))
    for term in terms:
        total = ctx.op("Add", total, term, shape=out_shape)
    return total


def _scatter_add_rows(ctx: GradContext, table_shape, indices, updates, skip_row: int = -1):
    """zeros(table_shape) with ``updates`` added at rows ``indices``.

    ScatterElements(add) with the row index broadcast over each row, not ScatterND(add):
    ONNX Runtime's CPU ScatterND loses updates to repeated indices when it runs on more
    than one thread (onnxruntime#18048), and embedding rows repeat all the time.
    ``skip_row >= 0``: that row gets no updates (an embedding's ``padding_idx``).
    """
    rows = int(np.prod(ctx.shape(indices), dtype=np.int64))
    rest = list(table_shape[1:])
    flat_updates = ctx.reshape(updates, [rows, *rest])
    column = ctx.reshape(indices, [rows] + [1] * len(rest))
    if skip_row >= 0:
        pad = ctx.op("Equal", column, ctx.const(skip_row, column.dtype))
        zero = ctx.scalar_like(0.0, flat_updates)
        flat_updates = ctx.op("Where", pad, zero, flat_updates, shape=[rows, *rest])
    expanded = ctx.op("Expand", column, ctx.ints([rows, *rest]), shape=[rows, *rest])
    zeros = ctx.zeros(table_shape, updates.dtype)
    return ctx.op(
        "ScatterElements", zeros, expanded, flat_updates, axis=0, reduction="add", shape=table_shape
    )


@gradient("Gather", nondiff_inputs=(1,))
def gather(ctx: GradContext):
    x, idx, g = ctx.I(0), ctx.I(1), ctx.GO(0)
    shape = ctx.shape(x)
    rank = len(shape)
    axis = int(ctx.attr("axis", 0)) % rank
    q = ctx.rank(idx)
    consts = ctx.const_ints(idx)
    if q == 0 and consts is not None:
        # x.select(axis, k): put the slice back with zeros around it.
        k = consts[0] % shape[axis]
        unsq = ctx.op("Unsqueeze", g, ctx.ints([axis]))
        pads = [0] * (2 * rank)
        pads[axis], pads[rank + axis] = k, shape[axis] - k - 1
        out = ctx.op("Pad", unsq, ctx.ints(pads), shape=shape)
        return {0: out}
    if q == 0:
        idx = ctx.op("Unsqueeze", idx, ctx.ints([0]), shape=[1])
        g_shape = list(ctx.shape(g))
        g = ctx.op("Unsqueeze", g, ctx.ints([axis]), shape=[*g_shape[:axis], 1, *g_shape[axis:]])
        q = 1
    if axis == 0:
        # Negative indices count from the end; torch's padding_idx is never negative.
        skip = int(ctx.node.metadata_props.get(PADDING_IDX, -1))
        return {0: _scatter_add_rows(ctx, shape, idx, g, skip_row=skip)}
    # Move the gathered axis to the front, scatter rows, move it back.
    g_rank = rank - 1 + q
    idx_dims = list(range(axis, axis + q))
    perm_g = idx_dims + [d for d in range(g_rank) if d not in idx_dims]
    g_dims = ctx.shape(g)
    g_t = ctx.op("Transpose", g, perm=perm_g, shape=[g_dims[d] for d in perm_g])
    t_shape = [shape[axis], *shape[:axis], *shape[axis + 1 :]]
    scattered = _scatter_add_rows(ctx, t_shape, idx, g_t)
    perm_back = [*range(1, axis + 1), 0, *range(axis + 1, rank)]
    return {0: ctx.op("Transpose", scattered, perm=perm_back, shape=shape)}


@gradient("GatherND", nondiff_inputs=(1,))
def gather_nd(ctx: GradContext):
    if int(ctx.attr("batch_dims", 0)) != 0:
        raise NotImplementedError("GatherND with batch_dims != 0")
    shape = ctx.shape(ctx.I(0))
    depth = ctx.shape(ctx.I(1))[-1]
    lead = [int(d) for d in shape[:depth]]
    # Row-major linear index into the first ``depth`` axes (negatives wrapped by Mod),
    # then the same row scatter as Gather's over the table viewed as [prod(lead), rest].
    strides = [int(np.prod(lead[j + 1 :], dtype=np.int64)) for j in range(depth)]
    idx_shape = ctx.shape(ctx.I(1))
    wrapped = ctx.op("Mod", ctx.I(1), ctx.ints(lead), fmod=0, shape=idx_shape)
    scaled = ctx.op("Mul", wrapped, ctx.ints(strides), shape=idx_shape)
    linear = ctx.op("ReduceSum", scaled, ctx.ints([-1]), keepdims=0, shape=idx_shape[:-1])
    table = [int(np.prod(lead, dtype=np.int64)), *shape[depth:]]
    rows = _scatter_add_rows(ctx, table, linear, ctx.GO(0))
    return {0: ctx.reshape(rows, shape)}


@gradient("Tile", nondiff_inputs=(1,))
def tile(ctx: GradContext):
    reps = ctx.const_ints(ctx.I(1))
    if reps is None:
        raise NotImplementedError("Tile with non-constant repeats")
    # y[r0*d0 + i0, ...] = x[i0, ...]: view dy as [r0, d0, r1, d1, ...], sum the r axes.
    shape = ctx.shape(ctx.I(0))
    inter = []
    for r, d in zip(reps, shape, strict=True):
        inter += [r, d]
    g = ctx.reshape(ctx.GO(0), inter)
    axes = ctx.ints(list(range(0, 2 * len(shape), 2)))
    return {0: ctx.op("ReduceSum", g, axes, keepdims=0, shape=shape)}
