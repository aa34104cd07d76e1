"""Ops that mix positions along the padded axis: reductions, softmax, products,
normalisation statistics, convolutions and losses; each exact only where the padded
block holds what leaves the result unchanged (``ortrain/padding/__init__.py``)."""

from __future__ import annotations

from collections.abc import Callable

import onnx_ir as ir

from ortrain.padding.contents import ANY, NEG, ZERO, Const, Content, negative, same
from ortrain.padding.values import (
    Axis,
    Unknown,
    Val,
    axis_of,
    const_ints,
    int_attr,
    lift,
    merged,
    shape_of,
    subsets,
    where,
)


class MixingOps:
    """The walk's rules for ops that mix positions (mixed into ``padding.walk.Walk``)."""

    _map: Callable[..., Val]
    _elementwise: Callable[..., Val]

    def _reduce(self, node: ir.Node, ins: list, ok: Callable[[Content], bool], what: str) -> list:
        x = ins[0]
        rank = len(x.shape)
        axes = const_ints(node.inputs[1]) if len(node.inputs) > 1 else None
        if axes is None:
            axes = int_attr(node, "axes")
        if axes is None and len(node.inputs) > 1 and node.inputs[1] is not None:
            raise Unknown
        if not axes:
            if node.attributes.get_int("noop_with_empty_axes", 0):
                return [self._map(node, x, same)]
            axes = list(range(rank))
        axes = sorted(a % rank for a in axes)
        keep = node.attributes.get_int("keepdims", 1)
        dirty = x.dirty
        for a in axes:
            if a in x.seq and not dirty and not ok(x.block({a})):
                dirty = f"{where(node)} {what}"
        seq = {}
        for a, ax in x.seq.items():
            if a in axes:
                continue
            seq[a if keep else a - sum(b < a for b in axes)] = ax
        shape = shape_of(node.outputs[0])
        if shape is None:
            raise Unknown
        return [Val(shape, seq, {p: ANY for p in subsets(seq)}, dirty)]

    def op_ReduceSum(self, node: ir.Node, ins: list) -> list:
        return self._reduce(
            node, ins, lambda c: c == ZERO, "sums over the padded axis, where padding is not 0"
        )

    def op_ReduceMax(self, node: ir.Node, ins: list) -> list:
        return self._reduce(
            node, ins, negative, "takes a maximum over the padded axis, where it is not masked"
        )

    op_ReduceLogSumExp = op_ReduceMax

    def op_ReduceMean(self, node: ir.Node, ins: list) -> list:
        return self._reduce(
            node, ins, lambda c: False, "averages over the padded axis: its count includes padding"
        )

    def op_ReduceMin(self, node: ir.Node, ins: list) -> list:
        return self._reduce(node, ins, lambda c: False, "reduces over the padded axis, padding in")

    op_ReduceProd = op_ReduceMin
    op_ReduceL1 = op_ReduceSum
    op_ReduceL2 = op_ReduceSum
    op_ReduceSumSquare = op_ReduceSum

    def op_ArgMax(self, node: ir.Node, ins: list) -> list:
        x = ins[0]
        axis = axis_of(node, len(x.shape))
        if axis in x.seq:
            raise Unknown  # an index along the padded axis: what reads it decides
        return self._reduce_attr(node, x, axis)

    op_ArgMin = op_ArgMax

    def _reduce_attr(self, node: ir.Node, x: Val, axis: int) -> list:
        keep = node.attributes.get_int("keepdims", 1)
        seq = {(a if keep or a < axis else a - 1): ax for a, ax in x.seq.items() if a != axis}
        shape = shape_of(node.outputs[0])
        if shape is None:
            raise Unknown
        return [Val(shape, seq, {p: ANY for p in subsets(seq)}, x.dirty)]

    def op_Softmax(self, node: ir.Node, ins: list) -> list:
        x = ins[0]
        axis = axis_of(node, len(x.shape), default=-1)
        if merged(x, axis):
            raise Unknown
        dirty = x.dirty
        blocks = {p: ANY for p in subsets(x.seq)}
        if axis in x.seq:
            if not negative(x.block({axis})):
                dirty = dirty or f"{where(node)} normalises over the padded axis without a mask"
            masked = ZERO if node.op_type == "Softmax" else NEG
            blocks[frozenset({axis})] = masked
        return [Val(x.shape, dict(x.seq), blocks, dirty)]

    op_LogSoftmax = op_Softmax

    def op_CumSum(self, node: ir.Node, ins: list) -> list:
        x = ins[0]
        axis = const_ints(node.inputs[1])
        if axis is None:
            raise Unknown
        a = axis[0] % len(x.shape)
        if merged(x, a):
            raise Unknown
        dirty = x.dirty
        if a in x.seq and node.attributes.get_int("reverse", 0) and x.block({a}) != ZERO:
            dirty = dirty or f"{where(node)} sums from the padded end"
        return [Val(x.shape, dict(x.seq), {p: ANY for p in subsets(x.seq)}, dirty)]

    def _matmul(self, node: ir.Node, a: Val, b: Val, ka: int, kb: int, ma: int, nb: int) -> Val:
        """a's axis ``ka`` contracted with b's ``kb``; a's ``ma`` and b's ``nb`` kept."""
        shape = shape_of(node.outputs[0])
        if shape is None:
            raise Unknown
        rank = len(shape)
        if ka not in a.seq and kb in b.seq:
            a = lift(a, {ka: b.seq[kb]}) if a.shape[ka] == b.seq[kb].length else a
        if kb not in b.seq and ka in a.seq:
            b = lift(b, {kb: a.seq[ka]}) if b.shape[kb] == a.seq[ka].length else b
        dirty = a.dirty or b.dirty
        if ka in a.seq or kb in b.seq:
            if a.seq.get(ka) != b.seq.get(kb) or merged(a, ka) or merged(b, kb):
                raise Unknown
            if not dirty and ZERO not in (a.block({ka}), b.block({kb})):
                dirty = f"{where(node)} sums over the padded axis with neither side masked there"
        seq: dict[int, Axis] = {}
        for x, k, keep, out_axis in ((a, ka, ma, rank - 2), (b, kb, nb, rank - 1)):
            off = rank - len(x.shape)
            for i, ax in x.seq.items():
                if i == k:
                    continue
                o = out_axis if i == keep else i + off
                if (i != keep and o >= rank - 2) or seq.setdefault(o, ax) != ax:
                    raise Unknown
        return Val(shape, seq, {p: ANY for p in subsets(seq)}, dirty)

    def op_MatMul(self, node: ir.Node, ins: list) -> list:
        a, b = ins
        if len(a.shape) < 2 or len(b.shape) < 2:
            raise Unknown
        ra, rb = len(a.shape), len(b.shape)
        return [self._matmul(node, a, b, ra - 1, rb - 2, ra - 2, rb - 1)]

    def op_Gemm(self, node: ir.Node, ins: list) -> list:
        a, b = ins[0], ins[1]
        ta, tb = node.attributes.get_int("transA", 0), node.attributes.get_int("transB", 0)
        ka, ma = (0, 1) if ta else (1, 0)
        kb, nb = (1, 0) if tb else (0, 1)
        out = self._matmul(node, a, b, ka, kb, ma, nb)
        if len(ins) > 2 and ins[2] is not None:
            out = self._elementwise(node, [out, ins[2]], lambda x, y: ANY)
            out.blocks = {p: ANY for p in out.blocks}
        return [out]

    def op_LayerNormalization(self, node: ir.Node, ins: list) -> list:
        x = ins[0]
        axis = axis_of(node, len(x.shape), default=-1)
        dirty = next((v.dirty for v in ins if v is not None and v.dirty), "")
        if any(a >= axis for a in x.seq):
            dirty = dirty or f"{where(node)} normalises over the padded axis"
        out = Val(x.shape, dict(x.seq), {p: ANY for p in subsets(x.seq)}, dirty)
        stats = []
        for v in node.outputs[1:]:
            shape = shape_of(v)
            seq = {a: ax for a, ax in x.seq.items() if a < axis}
            stats.append(Val(shape, seq, {p: ANY for p in subsets(seq)}, dirty) if shape else None)
        return [out, *stats]

    op_RMSNormalization = op_LayerNormalization

    def op_BatchNormalization(self, node: ir.Node, ins: list) -> list:
        x = ins[0]
        dirty = next((v.dirty for v in ins if v is not None and v.dirty), "")
        if node.attributes.get_int("training_mode", 0) and any(a != 1 for a in x.seq):
            dirty = dirty or f"{where(node)} takes batch statistics over the padded axis"
        out = Val(x.shape, dict(x.seq), {p: ANY for p in subsets(x.seq)}, dirty)
        rest = []
        for v in node.outputs[1:]:
            shape = shape_of(v)
            rest.append(Val(shape, {}, {frozenset(): ANY}, dirty) if shape is not None else None)
        return [out, *rest]

    def op_InstanceNormalization(self, node: ir.Node, ins: list) -> list:
        x = ins[0]
        dirty = next((v.dirty for v in ins if v is not None and v.dirty), "")
        if any(a >= 2 for a in x.seq):
            dirty = dirty or f"{where(node)} normalises over the padded axis"
        return [Val(x.shape, dict(x.seq), {p: ANY for p in subsets(x.seq)}, dirty)]

    def op_GroupNormalization(self, node: ir.Node, ins: list) -> list:
        x = ins[0]
        dirty = next((v.dirty for v in ins if v is not None and v.dirty), "")
        if any(a >= 1 for a in x.seq):
            dirty = dirty or f"{where(node)} normalises over the padded axis"
        return [Val(x.shape, dict(x.seq), {p: ANY for p in subsets(x.seq)}, dirty)]

    def op_Conv(self, node: ir.Node, ins: list) -> list:
        x, w = ins[0], ins[1]
        if w.seq or any(a < 2 for a in x.seq) or node.attributes.get_int("group", 1) < 1:
            raise Unknown
        spatial = len(x.shape) - 2
        pads = int_attr(node, "pads") or [0] * (2 * spatial)
        strides = int_attr(node, "strides") or [1] * spatial
        dil = int_attr(node, "dilations") or [1] * spatial
        auto = node.attributes.get_string("auto_pad", "NOTSET")
        if auto not in ("NOTSET", "VALID"):
            raise Unknown
        dirty = next((v.dirty for v in ins if v is not None and v.dirty), "")
        seq = {}
        for a, ax in x.seq.items():
            i = a - 2
            if strides[i] != 1:
                raise Unknown
            if merged(x, a):
                raise Unknown
            k = w.shape[a]
            begin, end = pads[i], pads[i + spatial]
            if end and x.block({a}) != ZERO:
                dirty = dirty or f"{where(node)} convolves across the padded end"
            seq[a] = ax.moved(begin + end - dil[i] * (k - 1))
        out = Val(shape_of(node.outputs[0]) or x.shape, seq, {p: ANY for p in subsets(seq)}, dirty)
        if len(ins) > 2 and ins[2] is not None and ins[2].dirty:
            out.dirty = out.dirty or ins[2].dirty
        return [out]

    def op_SoftmaxCrossEntropyLoss(self, node: ir.Node, ins: list) -> list:
        scores, labels = ins[0], ins[1]
        ignore = node.attributes.get_int("ignore_index", None)
        dirty = next((v.dirty for v in ins if v is not None and v.dirty), "")
        if 1 in scores.seq:
            raise Unknown  # the class axis
        # scores' axis 0 is labels' 0, scores' i + 1 labels' i
        expect = {(a if a == 0 else a - 1): ax for a, ax in scores.seq.items()}
        if expect != labels.seq:
            raise Unknown
        for a in labels.seq:
            if ignore is None or labels.block({a}) != Const(float(ignore)):
                dirty = dirty or (
                    f"{where(node)} counts padded positions: their labels are not its ignore_index"
                )
        reduction = node.attributes.get_string("reduction", "mean")
        outs = []
        for i, v in enumerate(node.outputs):
            shape = shape_of(v)
            if shape is None:
                outs.append(None)
                continue
            seq = labels.seq if i == 0 and reduction == "none" else (scores.seq if i else {})
            blocks = {p: (ZERO if i == 0 else ANY) for p in subsets(seq)}
            outs.append(Val(shape, dict(seq), blocks, dirty))
        return outs

    op_NegativeLogLikelihoodLoss = op_SoftmaxCrossEntropyLoss

    def op_Shape(self, node: ir.Node, ins: list) -> list:
        raise Unknown  # a length read from the padded shape

    op_Size = op_Shape
