"""The walk over the padded graph: each node's rule (``structure.py``, ``mixing.py``,
element-wise ops by ``contents.py``'s tables), values the rules do not model left unknown
(``ortrain/padding/__init__.py``)."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import numpy as np
import onnx_ir as ir

from ortrain.padding.contents import ELEMENTWISE, UNARY, Content, cast_content, uniform
from ortrain.padding.mixing import MixingOps
from ortrain.padding.structure import StructureOps
from ortrain.padding.values import (
    MAX_AXES,
    MAX_CONST,
    Axis,
    Proof,
    Unknown,
    Val,
    fold,
    lift,
    shape_of,
    subsets,
    where,
)


class Walk(StructureOps, MixingOps):
    """Each value of the graph by id: its ``Val``, or None where not modelled."""

    def __init__(self, model: ir.Model):
        self.model = model
        self.vals: dict[int, Val | None] = {}  # by id(ir.Value); None: unknown
        self.unknown = ""  # the first node the analysis did not model

    # ------------------------------------------------------------ helpers
    def get(self, v: ir.Value | None) -> Val | None:
        if v is None:
            return None
        key = id(v)
        if key in self.vals:
            return self.vals[key]
        shape = shape_of(v)
        if shape is None:
            return None
        array = None
        const = v.const_value
        if const is not None and math.prod(shape) <= MAX_CONST:
            try:
                array = np.asarray(const.numpy())
            except Exception:  # an external or unreadable tensor: by shape only
                array = None
        blocks: dict[frozenset, Content] = {frozenset(): uniform(array)}
        val = Val(shape, {}, blocks, array=array)
        self.vals[key] = val
        return val

    def run(self, outputs: Sequence[ir.Value]) -> Proof:
        for node in self.model.graph:
            try:
                outs = self.node(node)
            except Unknown:
                outs = None
                if not self.unknown:
                    self.unknown = where(node)
            outs = outs if outs is not None else [None] * len(node.outputs)
            for v, val in zip(node.outputs, outs, strict=False):
                self.vals[id(v)] = val
        for v in outputs:
            val = self.get(v)
            if val is not None and val.dirty:
                return Proof("mixes", val.dirty)
        for v in outputs:
            if self.get(v) is None:
                return Proof("unknown", f"not modelled: {self.unknown or v.name}")
        return Proof("exact")

    def node(self, node: ir.Node) -> list[Val | None] | None:
        op = node.op_type
        if node.domain not in ("", "ai.onnx"):
            raise Unknown
        ins = [self.get(v) for v in node.inputs]
        if any(x is None for x, v in zip(ins, node.inputs, strict=True) if v is not None):
            raise Unknown
        if not any(x.seq for x in ins if x is not None):
            return self._plain(node, ins)
        rule = getattr(self, f"op_{op}", None)
        if rule is not None:
            return rule(node, ins)
        if op in ELEMENTWISE:
            return [self._elementwise(node, ins, ELEMENTWISE[op])]
        if op in UNARY or op == "Cast" or op == "CastLike":
            return [self._map(node, ins[0], UNARY.get(op, cast_content(node)))]
        raise Unknown

    def _plain(self, node: ir.Node, ins: list[Val | None]) -> list[Val | None]:
        """A node no sequence axis reaches: clean where its inputs are; constants folded
        where cheap (masks built from constants)."""
        dirty = next((x.dirty for x in ins if x is not None and x.dirty), "")
        arrays = fold(node, ins)
        out = []
        for i, v in enumerate(node.outputs):
            shape = shape_of(v)
            if shape is None:
                out.append(None)
                continue
            array = arrays[i] if arrays is not None and i < len(arrays) else None
            out.append(Val(shape, {}, {frozenset(): uniform(array)}, dirty, array))
        return out

    def _aligned(self, out_shape: tuple[int, ...], ins: Sequence[Val]) -> tuple[dict, list]:
        """The output's sequence axes of a broadcasting op, and each input lifted to them
        (an input without a sequence axis where the output has one, at full length: its
        value along it is taken as the shorter run's, e.g. a position table's rows)."""
        rank = len(out_shape)
        seq: dict[int, Axis] = {}
        for x in ins:
            for a, ax in x.seq.items():
                o = a + rank - len(x.shape)
                if seq.setdefault(o, ax) != ax:
                    raise Unknown
        if len(seq) > MAX_AXES:
            raise Unknown
        lifted = []
        for x in ins:
            off = rank - len(x.shape)
            new = {}
            for o, ax in seq.items():
                a = o - off
                if a < 0 or a in x.seq or x.shape[a] == 1:
                    continue
                if x.shape[a] != ax.length or ax.stride != 1:
                    raise Unknown
                new[a] = ax
            lifted.append((lift(x, new) if new else x, off))
        return seq, lifted

    def _elementwise(self, node: ir.Node, ins: list[Val | None], fn: Callable[..., Content]) -> Val:
        vals = [x for x in ins if x is not None]
        shape = shape_of(node.outputs[0])
        if shape is None:
            raise Unknown
        seq, lifted = self._aligned(shape, vals)
        blocks = {}
        for pads in subsets(seq):
            cs = [x.block({o - off for o in pads}) for x, off in lifted]
            blocks[pads] = fn(*cs)
        dirty = next((x.dirty for x in vals if x.dirty), "")
        return Val(shape, seq, blocks, dirty)

    def _map(self, node: ir.Node, x: Val | None, fn: Callable[[Content], Content]) -> Val:
        if x is None:
            raise Unknown
        shape = shape_of(node.outputs[0]) or x.shape
        return Val(shape, dict(x.seq), {k: fn(c) for k, c in x.blocks.items()}, x.dirty)
