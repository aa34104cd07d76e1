"""Index batch inputs range-checked as eager PyTorch checks them, before a batch is bound.

ONNX ``Gather`` (and ONNX Runtime's kernels, and ortrain's) accept indices in
``[-n, n)``: a token id of -5 reads row ``vocab - 5`` and trains it, where
``torch.embedding`` raises ``IndexError``. At build time (``index_ranges``) each integer
batch input is followed through ops that pass its values on unchanged to the index
operands it reaches:

1. the index of ``Gather`` / ``GatherElements`` / ``GatherND`` / ``ScatterElements`` /
   ``ScatterND``: valid ``[0, n)`` where the aten op behind the node raises on negatives
   (embedding, index_select, gather, scatter...), ``[-n, n)`` where eager wraps them too
   (advanced indexing ``x[idx]``, ``index_put``) or the origin is unknown;
2. the indices of ``OneHot`` with a constant depth: ``[0, depth)``;
3. the label of ``SoftmaxCrossEntropyLoss`` / ``NegativeLogLikelihoodLoss``: ``[0, C)``
   and the node's ``ignore_index``;
4. a float batch input taken as ``binary_cross_entropy``'s input or target
   (``ortrain/export_bce.py``): ``[0, 1]``, bounds included, as eager checks it (NaN
   fails). A float input's uses are closed ranges, an integer's half-open ones.

``Slice`` and ``Pad`` count as passing values on, so the whole input is checked even
where a slice drops a part eager never reads (GPT-2's shifted labels drop position 0).
``check_batch`` runs one min/max pass per checked input (a second, masked one only when
the input holds an allowed extra value such as ``ignore_index``) and raises ``BatchError``
naming the input, the bad value, its position and the valid range.

An index computed from batch values (``emb(ids - 1)``, a ``clamp``, a ``where``, position
ids from a cumsum of the mask) is checked as computed (``computed_indices``): the part of
the forward that computes it from the batch, and from nothing the model holds, is cut out
as a small graph of its own, run on each batch before the step, and its values checked
like an input's. An index that also depends on a parameter or a buffer is not checked.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

import torch

from ortrain.core.errors import BatchError
from ortrain.core.roles import GraphIO, Role

if TYPE_CHECKING:
    import onnx_ir as ir

# One use of a batch input as an index: (lo, hi, allowed extra values, where).
IndexUse = tuple[int, int, tuple[int, ...], str]

# ops whose output 0 holds (some of) input 0's values unchanged
_PASS_DATA = {
    "Reshape",
    "Squeeze",
    "Unsqueeze",
    "Flatten",
    "Identity",
    "Expand",
    "Slice",
    "Transpose",
    "Pad",
    "Tile",
}
_INT_TYPES = {2, 3, 4, 5, 6, 7, 12, 13}  # onnx TensorProto UINT8..INT64
_FLOAT_TYPES = {1, 10, 11, 16}  # FLOAT, FLOAT16, DOUBLE, BFLOAT16
# the ops through which binary_cross_entropy's translation takes x and its target, at
# input 0 (``ortrain/export_bce.py``; its weight enters at input 1 of a Mul)
_BCE_OPERANDS = ("Log", "Sub", "Mul")
# aten ops that wrap negative indices as Python does (the others raise on them)
_WRAPS = ("aten.index.", "aten.index_put", "aten._unsafe_index", "aten.select.")


def _aten(node: ir.Node) -> str:
    """The aten op the exporter made ``node`` from ('' when unknown)."""
    hierarchy = node.metadata_props.get("pkg.torch.onnx.class_hierarchy", "")
    parts = hierarchy.strip("[]").replace("'", "").split(", ")
    return parts[-1] if parts and parts[-1].startswith(("aten.", "prims.")) else ""


def _dim(value: ir.Value | None, axis: int) -> int | None:
    if value is None or value.shape is None:
        return None
    dims = list(value.shape.dims)
    if not -len(dims) <= axis < len(dims):
        return None
    d = dims[axis]
    return d if isinstance(d, int) else None


def _where(node: ir.Node, what: str) -> str:
    aten = _aten(node)
    return f"{what} of {node.op_type} node {node.name}" + (f" ({aten})" if aten else "")


def _axis_use(node: ir.Node, data: int, default_axis: int) -> IndexUse | None:
    axis = node.attributes.get_int("axis", default_axis)
    n = _dim(node.inputs[data], axis)
    if n is None:
        return None
    wraps = _aten(node).startswith(_WRAPS) or not _aten(node)
    return (-n if wraps else 0), n, (), _where(node, "index")


def _nd_use(node: ir.Node) -> IndexUse | None:
    """GatherND / ScatterND: only where every index column addresses dims of one size."""
    indices, data = node.inputs[1], node.inputs[0]
    k = _dim(indices, -1)
    if k is None or data is None or data.shape is None:
        return None
    batch = node.attributes.get_int("batch_dims", 0)
    sizes = {_dim(data, batch + i) for i in range(k)}
    if len(sizes) != 1 or None in sizes:
        return None
    (n,) = sizes
    assert n is not None
    wraps = _aten(node).startswith(_WRAPS) or not _aten(node)
    return (-n if wraps else 0), n, (), _where(node, "index")


def _label_use(node: ir.Node) -> IndexUse | None:
    c = _dim(node.inputs[0], 1)
    if c is None:
        return None
    ignore = node.attributes.get("ignore_index")
    extras = (ignore.as_int(),) if ignore is not None else ()
    return 0, c, extras, _where(node, "label")


def _one_hot_use(node: ir.Node) -> IndexUse | None:
    depth = node.inputs[1]
    if depth is None or depth.const_value is None:
        return None
    n = int(depth.const_value.numpy().reshape(-1)[0])
    return 0, n, (), _where(node, "indices")


def _float_use(node: ir.Node, idx: int) -> IndexUse | None:
    """The valid values of float input ``idx`` of ``node`` where eager bounds them."""
    from ortrain.export_bce import ATEN

    if idx == 0 and node.op_type in _BCE_OPERANDS and _aten(node) == ATEN:
        return 0, 1, (), _where(node, "input or target")
    return None


def _use(node: ir.Node, idx: int) -> IndexUse | None:
    """The valid values of input ``idx`` of ``node`` where it is an index operand."""
    op = node.op_type if node.domain in ("", "ai.onnx") else None
    if op == "Gather" and idx == 1:
        return _axis_use(node, 0, 0)
    if op in ("GatherElements", "ScatterElements") and idx == 1:
        return _axis_use(node, 0, 0)
    if op in ("GatherND", "ScatterND") and idx == 1:
        return _nd_use(node)
    if op in ("SoftmaxCrossEntropyLoss", "NegativeLogLikelihoodLoss") and idx == 1:
        return _label_use(node)
    if op == "OneHot" and idx == 0:
        return _one_hot_use(node)
    return None


def _passes_on(node: ir.Node, idx: int) -> list[ir.Value]:
    """The outputs of ``node`` that hold input ``idx``'s values unchanged."""
    if node.domain not in ("", "ai.onnx"):
        return []
    op = node.op_type
    if op in _PASS_DATA and idx == 0:
        return [node.outputs[0]]
    if op == "Concat":
        return [node.outputs[0]]
    if op == "Split" and idx == 0:
        return list(node.outputs)
    if op == "Cast" and idx == 0 and node.attributes.get_int("to", 0) in _INT_TYPES:
        return [node.outputs[0]]
    return []


def _uses_of(start: ir.Value, floating: bool = False) -> list[IndexUse]:
    find = _float_use if floating else _use
    uses: list[IndexUse] = []
    seen: set[tuple[int, int]] = set()
    todo = [start]
    while todo:
        value = todo.pop()
        for node, idx in value.uses():
            if (id(node), idx) in seen:
                continue
            seen.add((id(node), idx))
            use = find(node, idx)
            if use is not None:
                uses.append(use)
            todo.extend(_passes_on(node, idx))
    return sorted(set(uses), key=lambda u: (u[3], u[0], u[1]))


def index_ranges(model: ir.Model, io: Iterable[GraphIO]) -> dict[str, list[IndexUse]]:
    """Per integer batch input of ``model`` (an exported forward), its uses as an index;
    per float one, the ranges eager bounds its values to."""
    batch = {r.name for r in io if r.role is Role.BATCH}
    out: dict[str, list[IndexUse]] = {}
    for value in model.graph.inputs:
        dtype = value.dtype
        if value.name not in batch or dtype is None:
            continue
        if dtype.value not in _INT_TYPES and dtype.value not in _FLOAT_TYPES:
            continue
        uses = _uses_of(value, floating=dtype.value in _FLOAT_TYPES)
        if uses:
            out[value.name] = uses
    return out


def _first_bad(t: torch.Tensor, lo: int, hi: int, extras: tuple[int, ...]) -> tuple[int, int]:
    """(flat position, value) of the first element outside [lo, hi) and not an extra."""
    flat = t.reshape(-1)
    bad = (flat < lo) | (flat >= hi)
    for e in extras:
        bad &= flat != e
    pos = int(torch.nonzero(bad)[0, 0]) if bool(bad.any()) else -1
    return pos, int(flat[pos]) if pos >= 0 else 0


def _position(shape: torch.Size, flat: int) -> str:
    idx = []
    for d in reversed(shape):
        idx.append(flat % d)
        flat //= d
    return "[" + ", ".join(str(i) for i in reversed(idx)) + "]"


def _valid(uses: list[IndexUse]) -> str:
    lo, hi = max(u[0] for u in uses), min(u[1] for u in uses)
    extras = sorted({e for u in uses for e in u[2] if not lo <= e < hi})
    text = f"[{lo}, {hi})"
    return text + (f" or {', '.join(map(str, extras))}" if extras else "")


def _check_floats(name: str, t: torch.Tensor, uses: list[IndexUse]) -> None:
    """Closed ranges (NaN outside every one)."""
    lo, hi = torch.aminmax(t.detach())
    low, high = float(lo), float(hi)
    for u_lo, u_hi, _, where in uses:
        if u_lo <= low and high <= u_hi:
            continue
        flat = t.detach().reshape(-1)
        pos = int(torch.nonzero(~((flat >= u_lo) & (flat <= u_hi)))[0, 0])
        raise BatchError(
            f"batch input '{name}' holds {float(flat[pos])} at {name}{_position(t.shape, pos)}, "
            f"outside [{u_lo}, {u_hi}] (it is the {where}; eager PyTorch raises "
            "RuntimeError on it); the batch was not run and nothing was applied"
        )


def check_batch(checks: Mapping[str, list[IndexUse]], batch: Mapping[str, Any]) -> None:
    """Raise ``BatchError`` where an index input of ``batch`` holds a value its uses reject."""
    for name, uses in checks.items():
        t = batch.get(name)
        if not isinstance(t, torch.Tensor) or t.numel() == 0:
            continue
        if t.is_floating_point():
            _check_floats(name, t, uses)
            continue
        lo, hi = torch.aminmax(t)
        low, high = int(lo), int(hi)
        if all(u[0] <= low and high < u[1] for u in uses):
            continue  # the common case: one pass over the tensor
        for u_lo, u_hi, extras, where in uses:
            if u_lo <= low and high < u_hi:
                continue
            pos, value = _first_bad(t, u_lo, u_hi, extras)
            if pos < 0:
                continue
            raise BatchError(
                f"batch input '{name}' holds {value} at {name}{_position(t.shape, pos)}, outside "
                f"the valid range {_valid(uses)} (it is the {where}; eager PyTorch raises "
                "IndexError on it); the batch was not run and nothing was applied"
            )


def _reached(start: ir.Value) -> set[ir.Value]:
    """The values holding ``start``'s values unchanged (``_passes_on``), ``start`` too."""
    seen = {start}
    todo = [start]
    while todo:
        for node, idx in todo.pop().uses():
            for out in _passes_on(node, idx):
                if out not in seen:
                    seen.add(out)
                    todo.append(out)
    return seen


_STATIC = {"Shape", "Size"}  # of a graph built for one batch shape: constants


def _batch_sources(value: ir.Value, batch: set[str]) -> set[str] | None:
    """The batch inputs whose values ``value`` is computed from; None where it also reads
    another graph input (a parameter, a buffer) or a subgraph."""
    sources: set[str] = set()
    seen: set[ir.Value] = set()
    todo = [value]
    while todo:
        v = todo.pop()
        if v in seen or v.is_initializer() or v.const_value is not None:
            continue
        seen.add(v)
        node = v.producer()
        if node is None:
            if v.name not in batch:
                return None
            sources.add(v.name)  # type: ignore[arg-type]
            continue
        if any(a.type.name in ("GRAPH", "GRAPHS") for a in node.attributes.values()):
            return None
        if node.op_type in _STATIC and node.domain in ("", "ai.onnx"):
            continue
        todo.extend(i for i in node.inputs if i is not None)
    return sources


@dataclasses.dataclass
class ComputedIndices:
    """Indices computed from the batch: the graph that computes them, and their uses."""

    data: bytes  # an ONNX model: batch inputs -> the computed index operands
    inputs: tuple[str, ...]
    # (graph output, its use, the batch inputs it is computed from)
    outputs: tuple[tuple[str, IndexUse, tuple[str, ...]], ...]
    _session: Any = dataclasses.field(default=None, repr=False, compare=False)

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_session": None}

    def check(self, batch: Mapping[str, Any]) -> None:
        """Raise ``BatchError`` where an index computed from ``batch`` is out of range."""
        import onnxruntime as ort

        if self._session is None:
            so = ort.SessionOptions()
            so.intra_op_num_threads = 1
            so.log_severity_level = 3
            self._session = ort.InferenceSession(self.data, so, providers=["CPUExecutionProvider"])
        feeds = {n: batch[n].detach().cpu().numpy() for n in self.inputs}
        values = self._session.run([o[0] for o in self.outputs], feeds)
        for (_, (lo, hi, extras, where), sources), value in zip(self.outputs, values, strict=True):
            t = torch.from_numpy(value)
            if t.numel() == 0:
                continue
            pos, bad = _first_bad(t, lo, hi, extras)
            if pos >= 0:
                raise BatchError(
                    f"the {where} is computed from batch input(s) {', '.join(sources)} and "
                    f"holds {bad} at {_position(t.shape, pos)}, outside the valid range "
                    f"[{lo}, {hi}) (eager PyTorch raises IndexError on it); the batch was not "
                    "run and nothing was applied"
                )


def computed_indices(model: ir.Model, io: Iterable[GraphIO]) -> ComputedIndices | None:
    """The index operands of ``model`` (an exported forward) computed from batch values
    alone, not reached unchanged from an input (``index_ranges`` checks those), as a
    graph to run on each batch; None when there are none."""
    import onnx_ir as ir

    from ortrain.graph_passes.cleanup.drop_stop_gradients import drop_stop_gradients

    batch = {r.name for r in io if r.role is Role.BATCH}
    direct: set[ir.Value] = set()
    for v in model.graph.inputs:
        if v.name in batch:
            direct |= _reached(v)
    found: dict[ir.Value, list[tuple[IndexUse, tuple[str, ...]]]] = {}
    for node in model.graph:
        for i, value in enumerate(node.inputs):
            if value is None or value in direct or value.const_value is not None:
                continue
            use = _use(node, i)
            sources = _batch_sources(value, batch) if use is not None else None
            if use is not None and sources:
                found.setdefault(value, []).append((use, tuple(sorted(sources))))
    if not found:
        return None
    inputs = [v for v in model.graph.inputs if v.name in batch]
    try:
        graph = ir.convenience.extract(model.graph, inputs, list(found))
    except ValueError:  # a Shape of a weight on the way: not bounded by the batch
        return None
    used = [v for v in graph.inputs if v.uses()]
    graph.inputs.clear()
    graph.inputs.extend(used)
    part = ir.Model(graph, ir_version=model.ir_version)
    part.opset_imports.update(model.opset_imports)
    drop_stop_gradients(part)
    names = [v.name for v in found]
    outputs = tuple(
        (name, use, sources)
        for name, uses in zip(names, found.values(), strict=True)
        for use, sources in uses
    )
    data = ir.serde.serialize_model(part).SerializeToString()
    return ComputedIndices(data, tuple(v.name for v in graph.inputs), outputs)  # type: ignore[misc]
