"""A value of the padded graph: its sequence axes, what its padded blocks hold, whether its
real block is the unpadded run's; and the helpers that move them through reshapes,
transposes, broadcasts and constants (``ortrain/padding/__init__.py``)."""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
from collections.abc import Iterable, Mapping

import numpy as np
import onnx_ir as ir

from ortrain.padding.contents import ANY, Const, Content, uniform

MAX_AXES = 4  # blocks are subsets of the sequence axes: 2**4 at most
MAX_CONST = 1 << 22  # constants summarised by value up to this many elements


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


def shape_of(v: ir.Value) -> tuple[int, ...] | None:
    if v.shape is None or not all(isinstance(d, int) for d in v.shape.dims):
        return None
    return tuple(int(d) for d in v.shape.dims)


def subsets(seq: Mapping[int, Axis]) -> list[frozenset]:
    axes = sorted(seq)
    return [frozenset(c) for r in range(len(axes) + 1) for c in itertools.combinations(axes, r)]


def lift(x: Val, new: Mapping[int, Axis]) -> Val:
    """``x`` with the axes ``new`` taken as sequence axes it was not known to have (its
    values along them taken as the shorter run's: a causal mask, a position table's rows)."""
    seq = {**x.seq, **new}
    blocks = {}
    for pads in subsets(seq):
        old = pads - set(new)
        if old == pads:
            blocks[pads] = x.blocks.get(pads, ANY)
        elif x.array is not None and not x.seq:
            blocks[pads] = region(x.array, pads, frozenset(new) - pads)
        else:  # padded along a new axis: the data there if nothing old is padded
            blocks[pads] = x.blocks.get(old, ANY) if old else ANY
    return Val(x.shape, seq, blocks, x.dirty, None)


def region(array: np.ndarray, pads: frozenset, real: frozenset) -> Content:
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
    return uniform(values) if values.size else ANY


def pick(table: np.ndarray, axis: int, c: Content) -> Content:
    if not isinstance(c, Const):
        return ANY
    try:
        return uniform(np.take(table, int(c.value), axis=axis))
    except IndexError:
        return ANY


def moved(v: ir.Value, x: Val, mapping: Mapping[int, int], dirty: str = "") -> Val:
    shape = shape_of(v)
    if shape is None:
        raise Unknown
    seq = {mapping[a]: ax for a, ax in x.seq.items()}
    blocks = {frozenset(mapping[a] for a in p): c for p, c in x.blocks.items()}
    return Val(shape, seq, blocks, x.dirty or dirty)


def reshaped(v: ir.Value, x: Val) -> Val:
    """Sequence axes through a reshape: each keeps its stride in the flat layout."""
    shape = shape_of(v)
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


def merged(x: Val, axis: int) -> bool:
    """Whether ``axis`` holds a sequence axis merged with other dims (slicing or mixing
    along it cuts across positions)."""
    ax = x.seq.get(axis)
    return ax is not None and (ax.stride != 1 or x.shape[axis] != ax.length)


def axis_of(node: ir.Node, rank: int, default: int = 0) -> int:
    return node.attributes.get_int("axis", default) % rank


def int_attr(node: ir.Node, name: str) -> list[int] | None:
    attr = node.attributes.get(name)
    return None if attr is None else [int(i) for i in attr.value]


def const_ints(v: ir.Value | None, floats: bool = False) -> list | None:
    if v is None or v.const_value is None:
        return None
    arr = np.asarray(v.const_value.numpy()).reshape(-1)
    return [float(i) for i in arr] if floats else [int(i) for i in arr]


def arange_axis(comp: np.ndarray) -> int | None:
    """The axis along which ``comp`` counts 0, 1, 2... (constant along the others)."""
    for o, n in enumerate(comp.shape):
        if n < 2:
            continue
        ramp = np.arange(n).reshape([n if i == o else 1 for i in range(comp.ndim)])
        if np.array_equal(comp, np.broadcast_to(ramp, comp.shape)):
            return o
    return None


def fold(node: ir.Node, ins: list[Val | None]) -> list[np.ndarray | None] | None:
    """Constants through the ops a mask is built with (where every input is known)."""
    if not ins or any(x is None or x.array is None for x in ins):
        return None
    shape = shape_of(node.outputs[0]) if node.outputs else None
    if shape is None or math.prod(shape) > MAX_CONST:
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
            perm = int_attr(node, "perm")
            return [np.transpose(arrays[0], perm)]
        if op == "Trilu":  # a causal mask the exporter left unfolded (too large to fold)
            k = int(arrays[1].reshape(-1)[0]) if len(arrays) > 1 else 0
            upper = node.attributes.get_int("upper", 1)
            return [np.triu(arrays[0], k) if upper else np.tril(arrays[0], k)]
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
