"""Liveness and buffer planning for a training graph (tinygrad ``schedule/memory.py`` style).

1. ``Lifetime(name, nbytes, start, end)``: a buffer is live from the step that writes it
   through the last step that reads it, both inclusive.
2. ``plan_offsets(lifetimes)`` is a pure function from lifetimes to offsets in one arena:
   the largest buffers are placed first, each in the smallest gap (best fit) between the
   buffers already placed that are live at the same time, else above them all. Buffers
   live at the same time never share a byte. ``reuse=False`` is the off switch: every
   buffer gets its own bytes (peak = naive).
3. ``lifetimes(model)`` reads lifetimes off an ``onnx_ir`` graph in its node order: one per
   value a node produces. Graph inputs (parameters, buffers, the batch) and constants
   are not activations and are left out; graph outputs live to the last step; a value
   read inside a subgraph counts as read by the node owning it; sizes are static shape x
   dtype size (values without a static shape count 0 bytes and are listed).
4. ``memory_report(model)``: the planned peak, and what the backward keeps alive: forward
   values read by backward nodes, i.e. nodes tagged ``ortrain.grad_of`` by the autodiff
   builder (never guessed from value names).

ONNX Runtime plans its own buffers, in its own node order, and lets Reshape and friends
alias their input; the figures here count every value of the graph as its own buffer in
the graph's order: what the passes before ONNX Runtime control, in bytes of the real
dtypes and shapes (an fp16 activation counts 2 bytes an element). ONNX Runtime's
default order (a reverse DFS from the graph's leaves, higher node indices first) would run
the whole input-gradient chain before any weight-gradient Gemm; ``ort_order.py`` orders
the file it loads so that each weight gradient runs where the graph's order puts it.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Mapping

import numpy as np
import onnx
import onnx_ir as ir

from ortrain.graph_passes.infra.tags import RECOMPUTE_OF, is_backward


@dataclasses.dataclass(frozen=True)
class Lifetime:
    name: str
    nbytes: int
    start: int  # step (node index) that writes the buffer
    end: int  # last step that reads it (inclusive)

    def overlaps(self, other: Lifetime) -> bool:
        return self.start <= other.end and other.start <= self.end


@dataclasses.dataclass(frozen=True)
class MemoryPlan:
    offsets: Mapping[str, int]  # value name -> byte offset in the arena
    peak_bytes: int  # arena size: highest offset + size
    naive_bytes: int  # every buffer its own bytes (the sum)

    @property
    def saved_bytes(self) -> int:
        return self.naive_bytes - self.peak_bytes


def _align(n: int, alignment: int) -> int:
    return -(-n // alignment) * alignment


def plan_offsets(
    lifetimes: Iterable[Lifetime], *, alignment: int = 1, reuse: bool = True
) -> MemoryPlan:
    """Greedy best-fit by size; buffers whose lifetimes overlap never overlap in memory."""
    lts = list(lifetimes)
    if len({lt.name for lt in lts}) != len(lts):
        raise ValueError("lifetimes must have unique names")
    for lt in lts:
        if lt.nbytes < 0 or lt.end < lt.start:
            raise ValueError(f"bad lifetime {lt}")
    naive = sum(lt.nbytes for lt in lts)
    offsets: dict[str, int] = {}
    # the buffers placed so far, as columns (a whole training graph has thousands: the
    # overlap test runs over all of them for each buffer, vectorized)
    n_placed = 0
    starts, ends, los, his = (np.empty(len(lts), dtype=np.int64) for _ in range(4))
    cursor_all = 0
    # Largest first (ties: earliest, then by name) so the result does not depend on input order.
    for lt in sorted(lts, key=lambda x: (-x.nbytes, x.start, x.name)):
        size = _align(lt.nbytes, alignment)
        if size == 0:
            offsets[lt.name] = 0
            continue
        if not reuse:
            offsets[lt.name] = cursor_all
            cursor_all += size
            continue
        live = (starts[:n_placed] <= lt.end) & (ends[:n_placed] >= lt.start)
        busy_lo, busy_hi = los[:n_placed][live], his[:n_placed][live]
        order = np.lexsort((busy_hi, busy_lo))  # by offset, then end
        best: int | None = None
        best_gap = math.inf
        top = 0
        for lo, hi in zip(busy_lo[order].tolist(), busy_hi[order].tolist(), strict=True):
            gap = lo - top
            if size <= gap < best_gap:
                best, best_gap = top, gap
            top = max(top, hi)
        offset = top if best is None else best
        starts[n_placed], ends[n_placed] = lt.start, lt.end
        los[n_placed], his[n_placed] = offset, offset + size
        n_placed += 1
        offsets[lt.name] = offset
    peak = max((offsets[lt.name] + lt.nbytes for lt in lts if lt.nbytes), default=0)
    return MemoryPlan(offsets, peak, naive)


def live_peak_bytes(lifetimes: Iterable[Lifetime]) -> int:
    """The most bytes live at one step: a lower bound for any plan's peak."""
    delta: dict[int, int] = {}
    for lt in lifetimes:
        delta[lt.start] = delta.get(lt.start, 0) + lt.nbytes
        delta[lt.end + 1] = delta.get(lt.end + 1, 0) - lt.nbytes
    live = peak = 0
    for step in sorted(delta):
        live += delta[step]
        peak = max(peak, live)
    return peak


# ----------------------------------------------------------------------- graph liveness
def value_nbytes(value: ir.Value) -> int | None:
    """Static shape x dtype size, or None when either is unknown."""
    shape, dtype = value.shape, value.dtype
    if shape is None or dtype is None or not all(isinstance(d, int) for d in shape.dims):
        return None
    return -(-math.prod(shape.dims) * dtype.bitwidth // 8)


def _nbytes(value: ir.Value, sizes: Mapping[str, int]) -> int:
    n = value_nbytes(value)
    return n if n is not None else sizes.get(value.name, 0)


def _top_level_index(graph: ir.Graph) -> dict[int, int]:
    """id(node) -> step of the top-level node that runs it (itself or its subgraph owner)."""
    index: dict[int, int] = {}
    for i, node in enumerate(graph):
        index[id(node)] = i
        for attr in node.attributes.values():
            subgraphs = (
                [attr.value]
                if attr.type == ir.AttributeType.GRAPH
                else list(attr.value)
                if attr.type == ir.AttributeType.GRAPHS
                else []
            )
            for sub in subgraphs:
                for inner in ir.traversal.RecursiveGraphIterator(sub):
                    index[id(inner)] = i
    return index


def _is_activation(value: ir.Value, node: ir.Node) -> bool:
    # Constant nodes become initializers in ONNX Runtime; omitted optional outputs have no name.
    return bool(value.name) and node.op_type != "Constant" and value.const_value is None


def lifetimes(model: ir.Model | ir.Graph, sizes: Mapping[str, int] | None = None) -> list[Lifetime]:
    """Liveness of every value the graph's nodes produce, in the graph's node order.

    ``sizes``: bytes of values whose shape the graph does not record (see ``inferred_sizes``).
    """
    return _liveness(model.graph if isinstance(model, ir.Model) else model, sizes or {})[0]


def _liveness(graph: ir.Graph, sizes: Mapping[str, int]) -> tuple[list[Lifetime], list[str]]:
    step = _top_level_index(graph)
    last = len(graph) - 1
    out: list[Lifetime] = []
    unknown: list[str] = []
    for i, node in enumerate(graph):
        for v in node.outputs:
            if not _is_activation(v, node):
                continue
            nbytes = value_nbytes(v)
            if nbytes is None:
                nbytes = sizes.get(v.name)
            if nbytes is None:
                unknown.append(v.name)
                nbytes = 0
            end = last if v.is_graph_output() else i
            for use in v.uses():
                end = max(end, step.get(id(use.node), i))
            out.append(Lifetime(v.name, nbytes, i, end))
    return out, unknown


def inferred_sizes(model: ir.Model) -> dict[str, int]:
    """Bytes of the values without a recorded static shape, by ONNX shape inference on a
    serialized copy (the builders do not record the shape of every backward value; the
    model itself is not changed)."""
    missing = {
        v.name
        for node in model.graph
        for v in node.outputs
        if _is_activation(v, node) and value_nbytes(v) is None
    }
    if not missing:
        return {}
    proto = onnx.shape_inference.infer_shapes(
        ir.serde.serialize_model(model), check_type=False, strict_mode=False, data_prop=True
    )
    found = ir.serde.deserialize_graph(proto.graph)
    sizes: dict[str, int] = {}
    for v in [*found.outputs, *(v for n in found for v in n.outputs)]:
        if v.name in missing and (n := value_nbytes(v)) is not None:
            sizes[v.name] = n
    return sizes


def planned_peak_bytes(model: ir.Model, *, alignment: int = 64) -> int:
    """The plan's arena size for ``model``'s graph in node order (``memory_report``'s
    ``planned_peak_bytes`` without the rest of the report)."""
    lts, _ = _liveness(model.graph, inferred_sizes(model))
    return plan_offsets(lts, alignment=alignment).peak_bytes


# ----------------------------------------------------------------------- report
@dataclasses.dataclass(frozen=True)
class KeptValue:
    """A forward value the backward reads, so it stays alive from forward to backward."""

    name: str
    nbytes: int
    op_type: str  # of the node producing it
    node: str
    dtype: str = ""


@dataclasses.dataclass(frozen=True)
class MemoryReport:
    planned_peak_bytes: int  # plan_offsets over all node outputs (activations + gradients)
    # the same without the graph's outputs, which are written into the caller's buffers
    # (gradients, updated state) where the trainer binds them: the session's arena
    arena_peak_bytes: int
    live_peak_bytes: int  # most bytes live at one step (the plan's lower bound)
    naive_bytes: int  # every value its own buffer
    num_values: int
    kept_count: int  # forward values read by backward nodes
    kept_bytes: int
    largest_kept: tuple[KeptValue, ...]  # the largest kept values, largest first
    kept_bytes_by_dtype: tuple[tuple[str, int], ...]  # e.g. (("FLOAT16", n), ("FLOAT", m))
    recomputed_nodes: int  # nodes the recompute pass added to the backward
    unknown_size: tuple[str, ...]  # values without a static shape (counted 0 bytes)

    def format(self) -> str:
        mib = 2**20
        lines = [
            f"activations: planned peak {self.planned_peak_bytes / mib:.1f} MiB "
            f"(live peak {self.live_peak_bytes / mib:.1f} MiB, no reuse "
            f"{self.naive_bytes / mib:.1f} MiB, {self.num_values} values)",
            f"kept for backward: {self.kept_count} values, {self.kept_bytes / mib:.1f} MiB; "
            f"nodes recomputed in backward: {self.recomputed_nodes}",
            "kept by dtype: "
            + ", ".join(f"{d} {n / mib:.1f} MiB" for d, n in self.kept_bytes_by_dtype),
        ]
        if self.largest_kept:
            lines.append(f"  {'MiB':>8}  {'op':<20} value")
            lines += [
                f"  {k.nbytes / mib:8.2f}  {k.op_type:<20} {k.name}" for k in self.largest_kept
            ]
        if self.unknown_size:
            lines.append(f"values without a static shape (0 bytes): {len(self.unknown_size)}")
        return "\n".join(lines)


def kept_for_backward(graph: ir.Graph) -> list[ir.Value]:
    """Forward node outputs that some backward node reads, in graph order."""
    kept = []
    for node in graph:
        if is_backward(node):
            continue
        for v in node.outputs:
            if _is_activation(v, node) and any(is_backward(u.node) for u in v.uses()):
                kept.append(v)
    return kept


def memory_report(model: ir.Model, *, top: int = 10, alignment: int = 64) -> MemoryReport:
    """Liveness + plan of ``model``'s graph in node order and what the backward keeps.

    ``alignment`` is the allocator's (ONNX Runtime's CPU allocator aligns to 64 bytes).
    """
    graph = model.graph
    sizes = inferred_sizes(model)
    lts, unknown = _liveness(graph, sizes)
    plan = plan_offsets(lts, alignment=alignment)
    kept = []
    for v in kept_for_backward(graph):
        node = v.producer()
        assert node is not None
        dtype = v.dtype.name if v.dtype is not None else "?"
        kept.append(KeptValue(v.name, _nbytes(v, sizes), node.op_type, node.name or "", dtype))
    largest = sorted(kept, key=lambda k: (-k.nbytes, k.name))[:top]
    by_dtype: dict[str, int] = {}
    for k in kept:
        by_dtype[k.dtype] = by_dtype.get(k.dtype, 0) + k.nbytes
    recomputed = sum(1 for n in graph if RECOMPUTE_OF in n.metadata_props)
    outputs = {v.name for v in graph.outputs}
    arena = plan_offsets([lt for lt in lts if lt.name not in outputs], alignment=alignment)
    return MemoryReport(
        planned_peak_bytes=plan.peak_bytes,
        arena_peak_bytes=arena.peak_bytes,
        live_peak_bytes=live_peak_bytes(lts),
        naive_bytes=plan.naive_bytes,
        num_values=len(lts),
        kept_count=len(kept),
        kept_bytes=sum(k.nbytes for k in kept),
        largest_kept=tuple(largest),
        kept_bytes_by_dtype=tuple(sorted(by_dtype.items(), key=lambda kv: -kv[1])),
        recomputed_nodes=recomputed,
        unknown_size=tuple(unknown),
    )
