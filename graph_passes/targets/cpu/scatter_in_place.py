"""Tied embeddings: the LM head's weight gradient written straight into the gradient buffer.

With tied input/output embeddings (GPT-2, BERT-MLM) the table's gradient is the LM head's
weight gradient ``dW = Gemm(dLogits, X)`` plus the embedding's rows, scattered in by
``ortrain.cpu.ScatterAddRows(dW, rows, updates)`` at the very end of the backward. Under
ONNX Runtime's execution order (``ort_order.py``) a node that only that last scatter reads
runs just before it, so ``dW`` is computed last and the [tokens x vocab] logit gradient
it reads stays alive through the whole backward, and ``dW`` itself ([vocab x hidden]) is
a temporary of the arena.

``scatter_into_gradients`` makes ``dW`` a graph output (``base:<grad>``) that the runtime
binds to the same buffer as the gradient output, and the scatter adds its rows there in
place (its kernel skips the copy when ``out`` is ``base``). An empty ``Slice`` of ``dW``,
another graph output (``base_ready:<grad>``, tagged ``EARLY_LEAF``), is a leaf that ONNX
Runtime reaches right after the head's other gradients, so ``dW`` runs there and the logit
gradient dies early.
The graph keeps its ONNX meaning: bound apart, the outputs hold ``dW`` and ``dW`` + rows;
the scatter still reads ``dW`` through an edge, so any execution order is correct and
only the memory depends on ONNX Runtime's.

Rewritten: a ``ScatterAddRows`` whose output is a gradient output and whose base is made by
a node that nothing else reads (not a graph input, output or constant; same shape and
type). Gradient accumulation leaves nothing to rewrite (the gradient output is then an
``Add`` of the accumulator).
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
import onnx_ir as ir

from ortrain.core.names import CPU_DOMAIN
from ortrain.graph_passes.infra.tags import EARLY_LEAF

BASE_PREFIX = "base:"
READY_PREFIX = "base_ready:"


def scatter_into_gradients(model: ir.Model, grad_outputs: Iterable[str]) -> dict[str, str]:
    """Returns {new output name: the gradient output whose buffer it shares}."""
    graph = model.graph
    shared: dict[str, str] = {}
    for node, base, producer in _sites(graph, grad_outputs):
        out = node.outputs[0]
        assert out.name is not None
        base.name = BASE_PREFIX + out.name
        graph.outputs.append(base)
        graph.outputs.append(_empty_slice(graph, producer, base, READY_PREFIX + out.name))
        shared[base.name] = out.name
    return shared


def base_ready_leaves(model: ir.Model, grad_outputs: Iterable[str]) -> int:
    """For gradients that are no buffer of the trainer's (``update_in_backward.py``): the
    scatter takes ``dW``'s buffer in place (its kernel offers that) and the update reads
    the sum, so ``dW`` is a temporary of the arena from where it is made to the end of
    the backward. The leaf that makes it early is added only where ``dW`` is smaller than
    what making it late keeps alive until then (the logit gradient and the head's input):
    a small vocabulary over many tokens, not a large one over few tokens nor a
    label-sparse head. Returns the number of leaves added."""
    graph = model.graph
    count = 0
    for node, base, producer in _sites(graph, grad_outputs):
        read = [v for v in producer.inputs if v is not None and v.producer() is not None]
        if _nbytes(base) >= sum(_nbytes(v) for v in read):
            continue
        name = READY_PREFIX + str(node.outputs[0].name)
        graph.outputs.append(_empty_slice(graph, producer, base, name))
        count += 1
    return count


def _nbytes(value: ir.Value) -> int:
    """Static size in bytes; 0 where the shape is not static."""
    dims = value.shape.dims if value.shape is not None else ()
    if value.shape is None or value.dtype is None or not all(isinstance(d, int) for d in dims):
        return 0
    return int(np.prod(dims, dtype=np.int64)) * value.dtype.itemsize


def _sites(graph: ir.Graph, grad_outputs: Iterable[str]) -> list[tuple[ir.Node, ir.Value, ir.Node]]:
    """(scatter, its base dW, dW's producer) for each rewritable gradient output."""
    wanted = set(grad_outputs)
    outputs = {v.name: v for v in graph.outputs}
    sites = []
    for node in list(graph):
        if node.op_type != "ScatterAddRows" or node.domain != CPU_DOMAIN:
            continue
        out = node.outputs[0]
        if out.name not in wanted or outputs.get(out.name) is not out:
            continue
        base = node.inputs[0]
        producer = base.producer() if base is not None else None
        if base is None or producer is None or not _only_reader(base, node):
            continue
        if base.name in outputs or base.shape != out.shape or base.dtype != out.dtype:
            continue
        if base.shape is None or len(base.shape) < 1:
            continue
        sites.append((node, base, producer))
    return sites


def _only_reader(value: ir.Value, node: ir.Node) -> bool:
    uses = value.uses()
    return len(uses) == 1 and uses[0].node is node and uses[0].idx == 0


def _empty_slice(graph: ir.Graph, after: ir.Node, value: ir.Value, name: str) -> ir.Value:
    """``value[0:0]`` as a node right after ``after``: no work, a leaf reading ``value``."""
    consts = []
    for suffix, v in (("zero", 0), ("axis", 0)):
        c_name = f"{name}/{suffix}"
        arr = np.array([v], dtype=np.int64)
        c = ir.Value(
            name=c_name,
            shape=ir.Shape([1]),
            type=ir.TensorType(ir.DataType.INT64),
            const_value=ir.tensor(arr, name=c_name),
        )
        graph.register_initializer(c)
        consts.append(c)
    zero, axis = consts
    dims = list(value.shape)  # type: ignore[arg-type]
    dims[0] = 0
    out = ir.Value(name=name, shape=ir.Shape(dims), type=ir.TensorType(value.dtype))  # type: ignore[arg-type]
    node = ir.Node(
        "",
        "Slice",
        [value, zero, zero, axis],
        outputs=[out],
        name=f"{name}/Slice",
        # a backward node, as its producer; tagged so later passes know it reads no data
        metadata_props={**after.metadata_props, EARLY_LEAF: "1"},
    )
    graph.insert_after(after, node)
    return out
