"""Ops that move, pick or copy positions of the padded axis without mixing them: where the
sequence axes go, and which fixed positions a read takes (``ortrain/padding/__init__.py``)."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import onnx_ir as ir

from ortrain.padding.contents import ANY, ZERO, Const, join
from ortrain.padding.values import (
    Axis,
    Unknown,
    Val,
    arange_axis,
    axis_of,
    const_ints,
    int_attr,
    merged,
    moved,
    pick,
    reshaped,
    shape_of,
    subsets,
    where,
)


class StructureOps:
    """The walk's rules for ops that move positions (mixed into ``padding.walk.Walk``)."""

    _map: Callable[..., Val]
    _aligned: Callable[..., tuple[dict, list]]

    def op_Transpose(self, node: ir.Node, ins: list) -> list:
        x = ins[0]
        perm = int_attr(node, "perm") or list(reversed(range(len(x.shape))))
        mapping = {a: perm.index(a) for a in x.seq}
        return [moved(node.outputs[0], x, mapping)]

    def op_Reshape(self, node: ir.Node, ins: list) -> list:
        return [reshaped(node.outputs[0], ins[0])]

    op_Flatten = op_Reshape
    op_Squeeze = op_Reshape
    op_Unsqueeze = op_Reshape

    def op_Expand(self, node: ir.Node, ins: list) -> list:
        x = ins[0]
        shape = shape_of(node.outputs[0])
        if shape is None:
            raise Unknown
        off = len(shape) - len(x.shape)
        return [moved(node.outputs[0], x, {a: a + off for a in x.seq})]

    def op_Dropout(self, node: ir.Node, ins: list) -> list:
        x = ins[0]
        out = self._map(node, x, lambda c: ZERO if c == ZERO else ANY)
        mask = Val(out.shape, dict(x.seq), {k: ANY for k in x.blocks}, x.dirty)
        return [out, mask]

    def op_Split(self, node: ir.Node, ins: list) -> list:
        x = ins[0]
        axis = axis_of(node, len(x.shape))
        if axis in x.seq:
            raise Unknown
        return [moved(v, x, {a: a for a in x.seq}) for v in node.outputs]

    def op_Concat(self, node: ir.Node, ins: list) -> list:
        vals = [x for x in ins if x is not None]
        shape = shape_of(node.outputs[0])
        if shape is None:
            raise Unknown
        axis = axis_of(node, len(shape))
        if any(axis in x.seq for x in vals):
            raise Unknown
        # aligned as a broadcast over the other axes (sizes along ``axis`` differ)
        probes = [
            Val(tuple(1 if i == axis else d for i, d in enumerate(x.shape)), x.seq, x.blocks)
            for x in vals
        ]
        probe_shape = tuple(1 if i == axis else d for i, d in enumerate(shape))
        seq, lifted = self._aligned(probe_shape, probes)
        blocks = {p: join([x.block(p) for x, _ in lifted]) for p in subsets(seq)}
        dirty = next((x.dirty for x in vals if x.dirty), "")
        return [Val(shape, seq, blocks, dirty)]

    def op_Slice(self, node: ir.Node, ins: list) -> list:
        x = ins[0]
        starts, ends = const_ints(node.inputs[1]), const_ints(node.inputs[2])
        axes = const_ints(node.inputs[3]) if len(node.inputs) > 3 else None
        steps = const_ints(node.inputs[4]) if len(node.inputs) > 4 else None
        if starts is None or ends is None:
            raise Unknown
        axes = axes if axes is not None else list(range(len(starts)))
        steps = steps if steps is not None else [1] * len(starts)
        seq = dict(x.seq)
        for s, e, a, st in zip(starts, ends, axes, steps, strict=True):
            a %= len(x.shape)
            size = x.shape[a]
            s = min(max(s + size if s < 0 else s, 0), size)
            e = min(max(e + size if e < 0 else e, 0), size)
            if s == 0 and e == size and st == 1:
                continue
            if a in seq:
                if st != 1 or e != size or merged(x, a):
                    raise Unknown  # a prefix of the padded axis: where it ends moves
                seq[a] = seq[a].moved(-s)
        shape = shape_of(node.outputs[0])
        if shape is None:
            raise Unknown
        return [Val(shape, seq, dict(x.blocks), x.dirty)]

    def op_Pad(self, node: ir.Node, ins: list) -> list:
        x = ins[0]
        pads = const_ints(node.inputs[1])
        mode = node.attributes.get_string("mode", "constant")
        value = 0.0
        if len(node.inputs) > 2 and node.inputs[2] is not None:
            c = const_ints(node.inputs[2], floats=True)
            if c is None:
                raise Unknown
            value = float(c[0])
        if pads is None or mode != "constant":
            raise Unknown
        rank = len(x.shape)
        axes = const_ints(node.inputs[3]) if len(node.inputs) > 3 else None
        axes = [a % rank for a in axes] if axes is not None else list(range(rank))
        k = len(axes)
        seq = dict(x.seq)
        blocks = dict(x.blocks)
        for i, a in enumerate(axes):
            begin, end = pads[i], pads[i + k]
            if not begin and not end:
                continue
            if a in seq:
                # appended: the shorter run has the pad value there, the padded run its
                # padding: the same only where that padding holds the pad value
                if merged(x, a) or (end and x.block({a}) != Const(value)):
                    raise Unknown
                seq[a] = seq[a].moved(begin + end)
            else:
                blocks = {p: join([c, Const(value)]) for p, c in blocks.items()}
        shape = shape_of(node.outputs[0])
        if shape is None:
            raise Unknown
        return [Val(shape, seq, blocks, x.dirty)]

    def op_Gather(self, node: ir.Node, ins: list) -> list:
        data, idx = ins
        rank = len(data.shape)
        axis = node.attributes.get_int("axis", 0) % rank
        shape = shape_of(node.outputs[0])
        if shape is None:
            raise Unknown
        if idx.seq and not data.seq:  # an embedding: rows picked by the padded ids
            seq = {a + axis: ax for a, ax in idx.seq.items()}
            blocks = {p: ANY for p in subsets(seq)}
            if data.array is not None and idx.array is None:
                blocks = {
                    p: pick(data.array, axis, idx.block({a - axis for a in p}))
                    for p in subsets(seq)
                }
            return [Val(shape, seq, blocks, idx.dirty or data.dirty)]
        if idx.seq or merged(data, axis):
            raise Unknown
        seq: dict[int, Axis] = {}
        for a, ax in data.seq.items():
            if a < axis:
                seq[a] = ax
            elif a > axis:
                seq[a + len(idx.shape) - 1] = ax
        dirty = data.dirty or idx.dirty
        if axis in data.seq:
            dirty = dirty or self._read(node, data, axis, idx)
        blocks = {p: ANY for p in subsets(seq)}
        return [Val(shape, seq, blocks, dirty)]

    def _read(self, node: ir.Node, data: Val, axis: int, idx: Val) -> str:
        """Positions read at fixed indices of the padded axis: the first is real (every
        row has one token), the last is padding where eager reads the last real one."""
        if idx.array is None:
            raise Unknown
        size = data.shape[axis]
        picked = np.asarray(idx.array).reshape(-1) % size
        if (picked < 1 + data.seq[axis].delta).all():
            return ""
        if (picked == size - 1).any():
            return (
                f"{where(node)} reads position {size - 1} of the padded axis: padding, "
                "where the unpadded batch has its last real position there"
            )
        raise Unknown

    def op_GatherElements(self, node: ir.Node, ins: list) -> list:
        data, idx = ins
        axis = node.attributes.get_int("axis", 0) % len(data.shape)
        if not data.seq:  # a lookup per position (ids -> a buffer's rows)
            shape = shape_of(node.outputs[0])
            if shape is None:
                raise Unknown
            return [Val(shape, dict(idx.seq), {p: ANY for p in subsets(idx.seq)}, idx.dirty)]
        if axis in data.seq or axis in idx.seq or data.seq != idx.seq:
            raise Unknown
        return [moved(node.outputs[0], idx, {a: a for a in idx.seq}, dirty=data.dirty)]

    def op_GatherND(self, node: ir.Node, ins: list) -> list:
        data, idx = ins
        if node.attributes.get_int("batch_dims", 0) or idx.seq or idx.array is None:
            raise Unknown
        r = idx.shape[-1]
        lead = len(idx.shape) - 1
        seq: dict[int, Axis] = {}
        blocks_of: dict[int, int] = {}  # output axis -> data axis
        for a, ax in data.seq.items():
            if a >= r:
                seq[lead + a - r] = ax
                blocks_of[lead + a - r] = a
                continue
            comp = np.asarray(idx.array)[..., a] % data.shape[a]
            o = arange_axis(comp)
            if o is None or merged(data, a):
                raise Unknown
            seq[o] = ax
            blocks_of[o] = a
        shape = shape_of(node.outputs[0])
        if shape is None:
            raise Unknown
        blocks = {p: data.block(blocks_of[o] for o in p) for p in subsets(seq)}
        return [Val(shape, seq, blocks, data.dirty)]
