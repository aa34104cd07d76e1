"""Padding exactness proven on the exported training forward, not sampled.

Bucketing (``ortrain/bucketing.py``) appends padding on the right of a batch's sequence
axis. That is exact when no real position's value, the loss or a buffer update depends on
what the padded positions hold. ``prove`` follows the padded positions through the graph
(an abstract interpretation): every value knows which of its axes carry the padded
sequence (through reshapes, transposes, merged batch and sequence axes) and what its padded
*blocks* hold (a constant, a "masked" large negative score, or anything), and whether its
real block is the unpadded run's. Ops that mix positions read the blocks:

- a reduction over the padded axis is exact for a sum of zeros, a max of masked scores,
  never for a mean (its count includes the padding);
- a softmax over it needs masked scores there; a matmul contracting it needs zeros on one
  side (attention probabilities after a masked softmax);
- normalisation statistics over it (BatchNorm in training, LayerNorm over positions) and
  a read of a fixed position past the real ones (the last) mix padding in;
- a loss skips padded rows when their labels are its ``ignore_index``;
- a convolution along it reads padding unless the padding holds zeros (as its own zero
  padding) or the convolution is causal.

The verdict is "mixes" (with the node, op and module scope that mixes padding into what
the loss or a buffer update reads), "exact", or "unknown" (an op the analysis does not
model: the eager check decides alone). What "exact" assumes: values whose length comes
from the graph's static shape (a causal mask, a position table's rows) hold at each
position what the shorter run holds there; activations are finite and far smaller than a
masked score; every real query row attends to at least one real key (right padding: its
first token).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    import onnx_ir as ir

    from ortrain.core.roles import GraphIO

MASK_LIMIT = -1e4  # at or below: a masked score (exp underflows to 0 in float32)
IGNORE_INDEX = -100
_MAX_AXES = 4  # blocks are subsets of the sequence axes: 2**4 at most
_MAX_CONST = 1 << 22  # constants summarised by value up to this many elements


class _Neg:
    def __repr__(self) -> str:
        return "NEG"


class _Any:
    def __repr__(self) -> str:
        return "ANY"


NEG, ANY = _Neg(), _Any()


@dataclasses.dataclass(frozen=True)
class Const:
    value: float


Content = Const | _Neg | _Any
ZERO = Const(0.0)


def _negative(c: Content) -> bool:
    return c is NEG or (isinstance(c, Const) and c.value <= MASK_LIMIT)


@dataclasses.dataclass(frozen=True)
class Axis:
    """A sequence axis of a value: position = (index // stride) % length along it (merged
    with other dims where stride > 1 or the axis is longer); its real part is the unpadded
    run's length plus ``delta`` (shifted by a slice, grown by an appended constant), its
    padded ``length`` the graph's plus the same."""

    length: int
    stride: int = 1
    delta: int = 0

    def moved(self, by: int) -> Axis:
        return Axis(self.length + by, self.stride, self.delta + by)


@dataclasses.dataclass
class Val:
    shape: tuple[int, ...]
    seq: dict[int, Axis]
    # per subset of ``seq``'s axes that are padded (the rest real): what the block holds;
    # frozenset(): the real block's content (Const where uniform)
    blocks: dict[frozenset, Content]
    dirty: str = ""  # why the real block is not the unpadded run's ("": it is)
    array: np.ndarray | None = None  # the value, for constants without sequence axes

    def block(self, pads: Iterable[int]) -> Content:
        return self.blocks.get(frozenset(a for a in pads if a in self.seq), ANY)


class Unknown(Exception):
    """The analysis does not model this node's use of the padded axis."""


@dataclasses.dataclass(frozen=True)
class Proof:
    verdict: str  # "exact", "mixes", "unknown"
    detail: str = ""

    def as_tuple(self) -> tuple[str, str]:
        return (self.verdict, self.detail)


def scope(node: ir.Node) -> str:
    """The module scope and aten op the exporter recorded for ``node``."""
    props = node.metadata_props
    scopes = props.get("pkg.torch.onnx.name_scopes", "").strip("[]").replace("'", "").split(", ")
    module = ""
    for s in scopes[:-1] if len(scopes) > 1 else scopes:
        module = s or module
    for prefix in ("inner.module.", "inner.module", "inner"):
        if module.startswith(prefix):
            module = module[len(prefix) :].lstrip(".")
            break
    return module


def where(node: ir.Node) -> str:
    s = scope(node)
    return f"{node.op_type} node '{node.name}'" + (f" in {s}" if s else "")


# ---------------------------------------------------------------------------- contents
def _join(cs: Sequence[Content]) -> Content:
    first = cs[0]
    return first if all(c == first for c in cs) else ANY


def _consts(cs: Sequence[Content]) -> list[float] | None:
    return [c.value for c in cs] if all(isinstance(c, Const) for c in cs) else None


def _num(fn: Callable[..., float], cs: Sequence[Content]) -> Content | None:
    vals = _consts(cs)
    if vals is None:
        return None
    with np.errstate(all="ignore"):
        return Const(float(fn(*vals)))


def _add(a: Content, b: Content) -> Content:
    c = _num(lambda x, y: x + y, (a, b))
    if c is not None:
        return c
    return NEG if _negative(a) or _negative(b) else ANY


def _sub(a: Content, b: Content) -> Content:
    c = _num(lambda x, y: x - y, (a, b))
    if c is not None:
        return c
    return NEG if _negative(a) and not _negative(b) else ANY


def _mul(a: Content, b: Content) -> Content:
    c = _num(lambda x, y: x * y, (a, b))
    if c is not None:
        return c
    for x, y in ((a, b), (b, a)):
        if x == ZERO and y is not NEG:
            return ZERO
        if _negative(x) and isinstance(y, Const) and y.value > 0:
            return NEG
    return ANY


def _div(a: Content, b: Content) -> Content:
    c = _num(lambda x, y: x / y, (a, b))
    if c is not None:
        return c
    return NEG if _negative(a) and isinstance(b, Const) and 0 < b.value <= 1e3 else ANY


def _where(c: Content, x: Content, y: Content) -> Content:
    if isinstance(c, Const):
        return x if c.value else y
    return x if x == y else ANY


def _and(*cs: Content) -> Content:
    if any(c == ZERO for c in cs):
        return ZERO
    return Const(1.0) if all(isinstance(c, Const) and c.value for c in cs) else ANY


def _or(*cs: Content) -> Content:
    if any(isinstance(c, Const) and c.value for c in cs):
        return Const(1.0)
    return ZERO if all(c == ZERO for c in cs) else ANY


def _compare(fn: Callable[[float, float], bool]) -> Callable[..., Content]:
    return lambda a, b: _num(lambda x, y: float(fn(x, y)), (a, b)) or ANY


def _numeric(fn: Callable[..., float]) -> Callable[..., Content]:
    return lambda *cs: _num(fn, cs) or ANY


_ELEMENTWISE: dict[str, Callable[..., Content]] = {
    "Add": _add,
    "Sub": _sub,
    "Mul": _mul,
    "Div": _div,
    "Where": _where,
    "And": _and,
    "Or": _or,
    "Pow": _numeric(lambda x, y: x**y),
    "Max": _numeric(max),
    "Min": _numeric(min),
    "Equal": _compare(lambda x, y: x == y),
    "Less": _compare(lambda x, y: x < y),
    "LessOrEqual": _compare(lambda x, y: x <= y),
    "Greater": _compare(lambda x, y: x > y),
    "GreaterOrEqual": _compare(lambda x, y: x >= y),
    "BitwiseAnd": _and,
    "BitwiseOr": _or,
    "PRelu": _numeric(lambda x, a: x if x >= 0 else a * x),
}


def _unary(fn: Callable[[float], float] | None, neg: Content = ANY) -> Callable[..., Content]:
    def apply(c: Content) -> Content:
        if isinstance(c, Const) and fn is not None:
            return _num(fn, (c,)) or ANY
        return neg if _negative(c) else ANY

    return apply


def _same(c: Content) -> Content:
    return c


_UNARY: dict[str, Callable[[Content], Content]] = {
    "Identity": _same,
    "Neg": _unary(lambda x: -x),
    "Exp": _unary(math.exp, ZERO),
    "Relu": _unary(lambda x: max(x, 0.0), ZERO),
    "Sigmoid": _unary(lambda x: 1 / (1 + math.exp(-x)), ZERO),
    "Tanh": _unary(math.tanh),
    "Erf": _unary(math.erf),
    "Abs": _unary(abs),
    "Sqrt": _unary(math.sqrt),
    "Reciprocal": _unary(lambda x: 1 / x),
    "Log": _unary(math.log),
    "Not": _unary(lambda x: float(not x)),
    "Floor": _unary(math.floor),
    "Ceil": _unary(math.ceil),
    "Round": _unary(round),
    "Sin": _unary(math.sin),
    "Cos": _unary(math.cos),
    "Sign": _unary(lambda x: float(np.sign(x))),
    "Softplus": _unary(lambda x: math.log1p(math.exp(x)), ZERO),
    "Gelu": _unary(None, ZERO),
    "Elu": _unary(None),
    "Selu": _unary(None),
    "LeakyRelu": _unary(None),
    "HardSigmoid": _unary(None),
    "HardSwish": _unary(None),
    "Mish": _unary(None),
    "Softsign": _unary(None),
    "IsNaN": _unary(lambda x: float(math.isnan(x))),
    "IsInf": _unary(lambda x: float(math.isinf(x))),
    "Clip": _unary(None),
}


# ---------------------------------------------------------------------------- the walk
class _Walk:
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
        shape = _shape(v)
        if shape is None:
            return None
        array = None
        const = v.const_value
        if const is not None and math.prod(shape) <= _MAX_CONST:
            try:
                array = np.asarray(const.numpy())
            except Exception:  # an external or unreadable tensor: by shape only
                array = None
        blocks: dict[frozenset, Content] = {frozenset(): _uniform(array)}
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
        if op in _ELEMENTWISE:
            return [self._elementwise(node, ins, _ELEMENTWISE[op])]
        if op in _UNARY or op == "Cast" or op == "CastLike":
            return [self._map(node, ins[0], _UNARY.get(op, _cast(node)))]
        raise Unknown

    def _plain(self, node: ir.Node, ins: list[Val | None]) -> list[Val | None]:
        """A node no sequence axis reaches: clean where its inputs are; constants folded
        where cheap (masks built from constants)."""
        dirty = next((x.dirty for x in ins if x is not None and x.dirty), "")
        arrays = _fold(node, ins)
        out = []
        for i, v in enumerate(node.outputs):
            shape = _shape(v)
            if shape is None:
                out.append(None)
                continue
            array = arrays[i] if arrays is not None and i < len(arrays) else None
            out.append(Val(shape, {}, {frozenset(): _uniform(array)}, dirty, array))
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
        if len(seq) > _MAX_AXES:
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
            lifted.append((_lift(x, new) if new else x, off))
        return seq, lifted

    def _elementwise(self, node: ir.Node, ins: list[Val | None], fn: Callable[..., Content]) -> Val:
        vals = [x for x in ins if x is not None]
        shape = _shape(node.outputs[0])
        if shape is None:
            raise Unknown
        seq, lifted = self._aligned(shape, vals)
        blocks = {}
        for pads in _subsets(seq):
            cs = [x.block({o - off for o in pads}) for x, off in lifted]
            blocks[pads] = fn(*cs)
        dirty = next((x.dirty for x in vals if x.dirty), "")
        return Val(shape, seq, blocks, dirty)

    def _map(self, node: ir.Node, x: Val | None, fn: Callable[[Content], Content]) -> Val:
        if x is None:
            raise Unknown
        shape = _shape(node.outputs[0]) or x.shape
        return Val(shape, dict(x.seq), {k: fn(c) for k, c in x.blocks.items()}, x.dirty)

    # ------------------------------------------------------------ structure
    def op_Transpose(self, node: ir.Node, ins: list) -> list:
        x = ins[0]
        perm = _ints(node, "perm") or list(reversed(range(len(x.shape))))
        mapping = {a: perm.index(a) for a in x.seq}
        return [_moved(node.outputs[0], x, mapping)]

    def op_Reshape(self, node: ir.Node, ins: list) -> list:
        return [_reshaped(node.outputs[0], ins[0])]

    op_Flatten = op_Reshape
    op_Squeeze = op_Reshape
    op_Unsqueeze = op_Reshape

    def op_Expand(self, node: ir.Node, ins: list) -> list:
        x = ins[0]
        shape = _shape(node.outputs[0])
        if shape is None:
            raise Unknown
        off = len(shape) - len(x.shape)
        return [_moved(node.outputs[0], x, {a: a + off for a in x.seq})]

    def op_Dropout(self, node: ir.Node, ins: list) -> list:
        x = ins[0]
        out = self._map(node, x, lambda c: ZERO if c == ZERO else ANY)
        mask = Val(out.shape, dict(x.seq), {k: ANY for k in x.blocks}, x.dirty)
        return [out, mask]

    def op_Split(self, node: ir.Node, ins: list) -> list:
        x = ins[0]
        axis = _axis(node, len(x.shape))
        if axis in x.seq:
            raise Unknown
        return [_moved(v, x, {a: a for a in x.seq}) for v in node.outputs]

    def op_Concat(self, node: ir.Node, ins: list) -> list:
        vals = [x for x in ins if x is not None]
        shape = _shape(node.outputs[0])
        if shape is None:
            raise Unknown
        axis = _axis(node, len(shape))
        if any(axis in x.seq for x in vals):
            raise Unknown
        # aligned as a broadcast over the other axes (sizes along ``axis`` differ)
        probes = [
            Val(tuple(1 if i == axis else d for i, d in enumerate(x.shape)), x.seq, x.blocks)
            for x in vals
        ]
        probe_shape = tuple(1 if i == axis else d for i, d in enumerate(shape))
        seq, lifted = self._aligned(probe_shape, probes)
        blocks = {p: _join([x.block(p) for x, _ in lifted]) for p in _subsets(seq)}
        dirty = next((x.dirty for x in vals if x.dirty), "")
        return [Val(shape, seq, blocks, dirty)]

    def op_Slice(self, node: ir.Node, ins: list) -> list:
        x = ins[0]
        starts, ends = _const_ints(node.inputs[1]), _const_ints(node.inputs[2])
        axes = _const_ints(node.inputs[3]) if len(node.inputs) > 3 else None
        steps = _const_ints(node.inputs[4]) if len(node.inputs) > 4 else None
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
                if st != 1 or e != size or _merged(x, a):
                    raise Unknown  # a prefix of the padded axis: where it ends moves
                seq[a] = seq[a].moved(-s)
        shape = _shape(node.outputs[0])
        if shape is None:
            raise Unknown
        return [Val(shape, seq, dict(x.blocks), x.dirty)]

    def op_Pad(self, node: ir.Node, ins: list) -> list:
        x = ins[0]
        pads = _const_ints(node.inputs[1])
        mode = node.attributes.get_string("mode", "constant")
        value = 0.0
        if len(node.inputs) > 2 and node.inputs[2] is not None:
            c = _const_ints(node.inputs[2], floats=True)
            if c is None:
                raise Unknown
            value = float(c[0])
        if pads is None or mode != "constant":
            raise Unknown
        rank = len(x.shape)
        axes = _const_ints(node.inputs[3]) if len(node.inputs) > 3 else None
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
                if _merged(x, a) or (end and x.block({a}) != Const(value)):
                    raise Unknown
                seq[a] = seq[a].moved(begin + end)
            else:
                blocks = {p: _join([c, Const(value)]) for p, c in blocks.items()}
        shape = _shape(node.outputs[0])
        if shape is None:
            raise Unknown
        return [Val(shape, seq, blocks, x.dirty)]

    def op_Gather(self, node: ir.Node, ins: list) -> list:
        data, idx = ins
        rank = len(data.shape)
        axis = node.attributes.get_int("axis", 0) % rank
        shape = _shape(node.outputs[0])
        if shape is None:
            raise Unknown
        if idx.seq and not data.seq:  # an embedding: rows picked by the padded ids
            seq = {a + axis: ax for a, ax in idx.seq.items()}
            blocks = {p: ANY for p in _subsets(seq)}
            if data.array is not None and idx.array is None:
                blocks = {
                    p: _pick(data.array, axis, idx.block({a - axis for a in p}))
                    for p in _subsets(seq)
                }
            return [Val(shape, seq, blocks, idx.dirty or data.dirty)]
        if idx.seq or _merged(data, axis):
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
        blocks = {p: ANY for p in _subsets(seq)}
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
            shape = _shape(node.outputs[0])
            if shape is None:
                raise Unknown
            return [Val(shape, dict(idx.seq), {p: ANY for p in _subsets(idx.seq)}, idx.dirty)]
        if axis in data.seq or axis in idx.seq or data.seq != idx.seq:
            raise Unknown
        return [_moved(node.outputs[0], idx, {a: a for a in idx.seq}, dirty=data.dirty)]

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
            o = _arange_axis(comp)
            if o is None or _merged(data, a):
                raise Unknown
            seq[o] = ax
            blocks_of[o] = a
        shape = _shape(node.outputs[0])
        if shape is None:
            raise Unknown
        blocks = {p: data.block(blocks_of[o] for o in p) for p in _subsets(seq)}
        return [Val(shape, seq, blocks, data.dirty)]

    # ------------------------------------------------------------ mixing
    def _reduce(self, node: ir.Node, ins: list, ok: Callable[[Content], bool], what: str) -> list:
        x = ins[0]
        rank = len(x.shape)
        axes = _const_ints(node.inputs[1]) if len(node.inputs) > 1 else None
        if axes is None:
            axes = _ints(node, "axes")
        if axes is None and len(node.inputs) > 1 and node.inputs[1] is not None:
            raise Unknown
        if not axes:
            if node.attributes.get_int("noop_with_empty_axes", 0):
                return [self._map(node, x, _same)]
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
        shape = _shape(node.outputs[0])
        if shape is None:
            raise Unknown
        return [Val(shape, seq, {p: ANY for p in _subsets(seq)}, dirty)]

    def op_ReduceSum(self, node: ir.Node, ins: list) -> list:
        return self._reduce(
            node, ins, lambda c: c == ZERO, "sums over the padded axis, where padding is not 0"
        )

    def op_ReduceMax(self, node: ir.Node, ins: list) -> list:
        return self._reduce(
            node, ins, _negative, "takes a maximum over the padded axis, where it is not masked"
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
        axis = _axis(node, len(x.shape))
        if axis in x.seq:
            raise Unknown  # an index along the padded axis: what reads it decides
        return self._reduce_attr(node, x, axis)

    op_ArgMin = op_ArgMax

    def _reduce_attr(self, node: ir.Node, x: Val, axis: int) -> list:
        keep = node.attributes.get_int("keepdims", 1)
        seq = {(a if keep or a < axis else a - 1): ax for a, ax in x.seq.items() if a != axis}
        shape = _shape(node.outputs[0])
        if shape is None:
            raise Unknown
        return [Val(shape, seq, {p: ANY for p in _subsets(seq)}, x.dirty)]

    def op_Softmax(self, node: ir.Node, ins: list) -> list:
        x = ins[0]
        axis = _axis(node, len(x.shape), default=-1)
        if _merged(x, axis):
            raise Unknown
        dirty = x.dirty
        blocks = {p: ANY for p in _subsets(x.seq)}
        if axis in x.seq:
            if not _negative(x.block({axis})):
                dirty = dirty or f"{where(node)} normalises over the padded axis without a mask"
            masked = ZERO if node.op_type == "Softmax" else NEG
            blocks[frozenset({axis})] = masked
        return [Val(x.shape, dict(x.seq), blocks, dirty)]

    op_LogSoftmax = op_Softmax

    def op_CumSum(self, node: ir.Node, ins: list) -> list:
        x = ins[0]
        axis = _const_ints(node.inputs[1])
        if axis is None:
            raise Unknown
        a = axis[0] % len(x.shape)
        if _merged(x, a):
            raise Unknown
        dirty = x.dirty
        if a in x.seq and node.attributes.get_int("reverse", 0) and x.block({a}) != ZERO:
            dirty = dirty or f"{where(node)} sums from the padded end"
        return [Val(x.shape, dict(x.seq), {p: ANY for p in _subsets(x.seq)}, dirty)]

    def _matmul(self, node: ir.Node, a: Val, b: Val, ka: int, kb: int, ma: int, nb: int) -> Val:
        """a's axis ``ka`` contracted with b's ``kb``; a's ``ma`` and b's ``nb`` kept."""
        shape = _shape(node.outputs[0])
        if shape is None:
            raise Unknown
        rank = len(shape)
        if ka not in a.seq and kb in b.seq:
            a = _lift(a, {ka: b.seq[kb]}) if a.shape[ka] == b.seq[kb].length else a
        if kb not in b.seq and ka in a.seq:
            b = _lift(b, {kb: a.seq[ka]}) if b.shape[kb] == a.seq[ka].length else b
        dirty = a.dirty or b.dirty
        if ka in a.seq or kb in b.seq:
            if a.seq.get(ka) != b.seq.get(kb) or _merged(a, ka) or _merged(b, kb):
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
        return Val(shape, seq, {p: ANY for p in _subsets(seq)}, dirty)

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
        axis = _axis(node, len(x.shape), default=-1)
        dirty = next((v.dirty for v in ins if v is not None and v.dirty), "")
        if any(a >= axis for a in x.seq):
            dirty = dirty or f"{where(node)} normalises over the padded axis"
        out = Val(x.shape, dict(x.seq), {p: ANY for p in _subsets(x.seq)}, dirty)
        stats = []
        for v in node.outputs[1:]:
            shape = _shape(v)
            seq = {a: ax for a, ax in x.seq.items() if a < axis}
            stats.append(Val(shape, seq, {p: ANY for p in _subsets(seq)}, dirty) if shape else None)
        return [out, *stats]

    op_RMSNormalization = op_LayerNormalization

    def op_BatchNormalization(self, node: ir.Node, ins: list) -> list:
        x = ins[0]
        dirty = next((v.dirty for v in ins if v is not None and v.dirty), "")
        if node.attributes.get_int("training_mode", 0) and any(a != 1 for a in x.seq):
            dirty = dirty or f"{where(node)} takes batch statistics over the padded axis"
        out = Val(x.shape, dict(x.seq), {p: ANY for p in _subsets(x.seq)}, dirty)
        rest = []
        for v in node.outputs[1:]:
            shape = _shape(v)
            rest.append(Val(shape, {}, {frozenset(): ANY}, dirty) if shape is not None else None)
        return [out, *rest]

    def op_InstanceNormalization(self, node: ir.Node, ins: list) -> list:
        x = ins[0]
        dirty = next((v.dirty for v in ins if v is not None and v.dirty), "")
        if any(a >= 2 for a in x.seq):
            dirty = dirty or f"{where(node)} normalises over the padded axis"
        return [Val(x.shape, dict(x.seq), {p: ANY for p in _subsets(x.seq)}, dirty)]

    def op_GroupNormalization(self, node: ir.Node, ins: list) -> list:
        x = ins[0]
        dirty = next((v.dirty for v in ins if v is not None and v.dirty), "")
        if any(a >= 1 for a in x.seq):
            dirty = dirty or f"{where(node)} normalises over the padded axis"
        return [Val(x.shape, dict(x.seq), {p: ANY for p in _subsets(x.seq)}, dirty)]

    def op_Conv(self, node: ir.Node, ins: list) -> list:
        x, w = ins[0], ins[1]
        if w.seq or any(a < 2 for a in x.seq) or node.attributes.get_int("group", 1) < 1:
            raise Unknown
        spatial = len(x.shape) - 2
        pads = _ints(node, "pads") or [0] * (2 * spatial)
        strides = _ints(node, "strides") or [1] * spatial
        dil = _ints(node, "dilations") or [1] * spatial
        auto = node.attributes.get_string("auto_pad", "NOTSET")
        if auto not in ("NOTSET", "VALID"):
            raise Unknown
        dirty = next((v.dirty for v in ins if v is not None and v.dirty), "")
        seq = {}
        for a, ax in x.seq.items():
            i = a - 2
            if strides[i] != 1:
                raise Unknown
            if _merged(x, a):
                raise Unknown
            k = w.shape[a]
            begin, end = pads[i], pads[i + spatial]
            if end and x.block({a}) != ZERO:
                dirty = dirty or f"{where(node)} convolves across the padded end"
            seq[a] = ax.moved(begin + end - dil[i] * (k - 1))
        out = Val(_shape(node.outputs[0]) or x.shape, seq, {p: ANY for p in _subsets(seq)}, dirty)
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
            shape = _shape(v)
            if shape is None:
                outs.append(None)
                continue
            seq = labels.seq if i == 0 and reduction == "none" else (scores.seq if i else {})
            blocks = {p: (ZERO if i == 0 else ANY) for p in _subsets(seq)}
            outs.append(Val(shape, dict(seq), blocks, dirty))
        return outs

    op_NegativeLogLikelihoodLoss = op_SoftmaxCrossEntropyLoss

    def op_Shape(self, node: ir.Node, ins: list) -> list:
        raise Unknown  # a length read from the padded shape

    op_Size = op_Shape


# ---------------------------------------------------------------------------- helpers
def _shape(v: ir.Value) -> tuple[int, ...] | None:
    if v.shape is None or not all(isinstance(d, int) for d in v.shape.dims):
        return None
    return tuple(int(d) for d in v.shape.dims)


def _uniform(array: np.ndarray | None) -> Content:
    if array is None or array.size == 0 or array.dtype.kind not in "biuf":
        return ANY
    flat = array.reshape(-1)
    first = float(flat[0])
    if bool((flat == flat[0]).all()):
        return Const(first)
    if array.dtype.kind == "f" and bool((flat <= MASK_LIMIT).all()):
        return NEG
    return ANY


def _subsets(seq: Mapping[int, Axis]) -> list[frozenset]:
    axes = sorted(seq)
    return [frozenset(c) for r in range(len(axes) + 1) for c in itertools.combinations(axes, r)]


def _lift(x: Val, new: Mapping[int, Axis]) -> Val:
    """``x`` with the axes ``new`` taken as sequence axes it was not known to have (its
    values along them taken as the shorter run's: a causal mask, a position table's rows)."""
    seq = {**x.seq, **new}
    blocks = {}
    for pads in _subsets(seq):
        old = pads - set(new)
        if old == pads:
            blocks[pads] = x.blocks.get(pads, ANY)
        elif x.array is not None and not x.seq:
            blocks[pads] = _region(x.array, pads, frozenset(new) - pads)
        else:  # padded along a new axis: the data there if nothing old is padded
            blocks[pads] = x.blocks.get(old, ANY) if old else ANY
    return Val(x.shape, seq, blocks, x.dirty, None)


def _region(array: np.ndarray, pads: frozenset, real: frozenset) -> Content:
    """What a constant holds where its axes ``pads`` are padding and ``real`` are real,
    for every real length: each index on a padded axis above each on a real one."""
    if array.dtype.kind not in "biuf":
        return ANY
    idx = np.indices(array.shape, sparse=True)
    low = functools.reduce(np.minimum, [idx[a] for a in pads])
    sel = low >= 1
    for a in real:
        sel = sel & (idx[a] < low)
    values = array[np.broadcast_to(sel, array.shape)]
    return _uniform(values) if values.size else ANY


def _pick(table: np.ndarray, axis: int, c: Content) -> Content:
    if not isinstance(c, Const):
        return ANY
    try:
        return _uniform(np.take(table, int(c.value), axis=axis))
    except IndexError:
        return ANY


def _moved(v: ir.Value, x: Val, mapping: Mapping[int, int], dirty: str = "") -> Val:
    shape = _shape(v)
    if shape is None:
        raise Unknown
    seq = {mapping[a]: ax for a, ax in x.seq.items()}
    blocks = {frozenset(mapping[a] for a in p): c for p, c in x.blocks.items()}
    return Val(shape, seq, blocks, x.dirty or dirty)


def _reshaped(v: ir.Value, x: Val) -> Val:
    """Sequence axes through a reshape: each keeps its stride in the flat layout."""
    shape = _shape(v)
    if shape is None:
        raise Unknown
    mapping = {}
    seq = {}
    for a, ax in x.seq.items():
        length = ax.length
        flat = ax.stride * math.prod(x.shape[a + 1 :])
        for o in range(len(shape)):
            inner = math.prod(shape[o + 1 :])
            if flat % inner == 0 and math.prod(shape[o:]) % (flat * length) == 0:
                if inner <= flat and flat * length <= math.prod(shape[o:]):
                    mapping[a] = o
                    seq[o] = Axis(ax.length, flat // inner, ax.delta)
                    break
        else:
            raise Unknown
    if len(set(mapping.values())) != len(mapping):
        raise Unknown
    blocks = {frozenset(mapping[a] for a in p): c for p, c in x.blocks.items()}
    return Val(shape, seq, blocks, x.dirty)


def _merged(x: Val, axis: int) -> bool:
    """Whether ``axis`` holds a sequence axis merged with other dims (slicing or mixing
    along it cuts across positions)."""
    ax = x.seq.get(axis)
    return ax is not None and (ax.stride != 1 or x.shape[axis] != ax.length)


def _axis(node: ir.Node, rank: int, default: int = 0) -> int:
    return node.attributes.get_int("axis", default) % rank


def _ints(node: ir.Node, name: str) -> list[int] | None:
    attr = node.attributes.get(name)
    return None if attr is None else [int(i) for i in attr.value]


def _const_ints(v: ir.Value | None, floats: bool = False) -> list | None:
    if v is None or v.const_value is None:
        return None
    arr = np.asarray(v.const_value.numpy()).reshape(-1)
    return [float(i) for i in arr] if floats else [int(i) for i in arr]


def _arange_axis(comp: np.ndarray) -> int | None:
    """The axis along which ``comp`` counts 0, 1, 2... (constant along the others)."""
    for o, n in enumerate(comp.shape):
        if n < 2:
            continue
        ramp = np.arange(n).reshape([n if i == o else 1 for i in range(comp.ndim)])
        if np.array_equal(comp, np.broadcast_to(ramp, comp.shape)):
            return o
    return None


def _cast(node: ir.Node) -> Callable[[Content], Content]:
    to = node.attributes.get_int("to", 1)
    if to == 9:  # BOOL
        return lambda c: Const(float(bool(c.value))) if isinstance(c, Const) else ANY
    if to in (1, 10, 11, 16):  # floats keep a masked score masked
        return _same
    return lambda c: Const(float(int(c.value))) if isinstance(c, Const) else ANY


def _fold(node: ir.Node, ins: list[Val | None]) -> list[np.ndarray | None] | None:
    """Constants through the ops a mask is built with (where every input is known)."""
    if not ins or any(x is None or x.array is None for x in ins):
        return None
    shape = _shape(node.outputs[0]) if node.outputs else None
    if shape is None or math.prod(shape) > _MAX_CONST:
        return None
    arrays = [x.array for x in ins if x is not None]
    op = node.op_type
    with np.errstate(all="ignore"):
        if op in ("Identity", "Reshape", "Unsqueeze", "Squeeze", "Flatten"):
            return [arrays[0].reshape(shape)]
        if op == "Expand":
            return [np.broadcast_to(arrays[0], shape)]
        if op == "Cast":
            to = node.attributes.get_int("to", 1)
            return [arrays[0].astype(bool) if to == 9 else arrays[0]]
        if op == "Transpose":
            perm = _ints(node, "perm")
            return [np.transpose(arrays[0], perm)]
        fn = {
            "Add": np.add,
            "Sub": np.subtract,
            "Mul": np.multiply,
            "And": np.logical_and,
            "Or": np.logical_or,
            "Not": np.logical_not,
            "Where": np.where,
            "Equal": np.equal,
            "Less": np.less,
            "LessOrEqual": np.less_equal,
            "Greater": np.greater,
            "GreaterOrEqual": np.greater_equal,
        }.get(op)
        if fn is None:
            return None
        return [np.broadcast_to(fn(*arrays), shape)]


# ---------------------------------------------------------------------------- entry
def prove(
    model: ir.Model,
    io: Sequence[GraphIO],
    outputs: Sequence[str],
    padded: Mapping[str, float | None],
    length: int,
) -> Proof:
    """Whether appending padding on the right of axis 1 of the batch inputs ``padded``
    (name -> what the padding holds: a number, or None for anything, e.g. token ids)
    changes what the graph's ``outputs`` (the loss, buffer updates) are, for any real
    length up to ``length``."""
    from ortrain.core.roles import Role

    walk = _Walk(model)
    batch = {r.name for r in io if r.role is Role.BATCH}
    graph = model.graph
    for v in graph.inputs:
        if v.name not in padded or v.name not in batch:
            continue
        shape = _shape(v)
        if shape is None or len(shape) < 2 or shape[1] != length:
            return Proof("unknown", f"batch input '{v.name}' has no static [batch, length]")
        value = padded[v.name]
        pad = ANY if value is None else Const(float(value))
        ax = Axis(length)
        walk.vals[id(v)] = Val(shape, {1: ax}, {frozenset(): ANY, frozenset({1}): pad})
    by_name = {v.name: v for v in graph.outputs}
    wanted = [by_name[n] for n in outputs if n in by_name]
    try:
        return walk.run(wanted)
    except Exception as exc:  # a form the rules did not foresee: the eager check decides
        return Proof("unknown", f"the analysis failed: {type(exc).__name__}: {exc}")
