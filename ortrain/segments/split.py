"""Split a segment's forward + backward graph into a forward graph and a backward graph.

The training pipeline builds one graph per segment call: the forward, then the backward
seeded by one gradient input per forward output (``build_gradient_graph``'s ``seeds``).
Torch runs a segment's forward and backward at different times, so that graph becomes two:

1. the forward graph holds the nodes the forward outputs need (none of which reads a
   seed); its outputs are the forward outputs, then the values it makes that the
   backward reads ("saved": the minimal set the backward cannot make from the inputs);
2. the backward graph holds every other node (the gradients, and the forward values that
   only the backward reads, such as recomputed copies: made there, not saved); its
   inputs are the saved values, the seeds and the graph inputs it reads;
3. a value both graphs need keeps its name in both, so the manifest pairs them by name.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import onnx
import onnx_ir as ir
import onnx_ir.passes.common

from ortrain.graph_passes.autodiff.builder import captured_values


@dataclasses.dataclass
class Split:
    forward: ir.Model
    backward: ir.Model
    saved: list[str]  # forward-made values the backward reads, in the forward's order
    forward_inputs: list[str]  # the original graph inputs each side reads
    backward_inputs: list[str]


def _copy(model: ir.Model) -> ir.Model:
    return ir.serde.deserialize_model(ir.serde.serialize_model(model))


def _reads(graph: ir.Graph) -> dict[int, list[ir.Value]]:
    """id(node) -> the values it reads: its inputs and what its subgraphs capture."""
    captured = captured_values(graph)
    return {id(n): [v for v in n.inputs if v is not None] + captured.get(id(n), []) for n in graph}


def forward_nodes(graph: ir.Graph, outputs: Sequence[str]) -> set[str]:
    """Names of the nodes the values ``outputs`` are made from."""
    reads = _reads(graph)
    by_value = {id(o): n for n in graph for o in n.outputs}
    wanted = [v for v in graph.outputs if v.name in set(outputs)]
    keep: set[int] = set()
    stack = [by_value[id(v)] for v in wanted if id(v) in by_value]
    while stack:
        n = stack.pop()
        if id(n) in keep:
            continue
        keep.add(id(n))
        stack.extend(by_value[id(v)] for v in reads[id(n)] if id(v) in by_value)
    return {n.name for n in graph if id(n) in keep}


def _name_nodes(graph: ir.Graph) -> None:
    used: set[str] = set()
    for i, n in enumerate(graph):
        if not n.name or n.name in used:
            n.name = f"{n.op_type}_split{i}"
        used.add(n.name)


def _prune_inputs(model: ir.Model, keep_order: Sequence[str] = ()) -> list[str]:
    """Drop graph inputs nothing reads; returns the names of those left."""
    graph = model.graph
    read: set[int] = set()
    for vals in _reads(graph).values():
        read.update(id(v) for v in vals)
    outs = {id(v) for v in graph.outputs}
    for v in list(graph.inputs):
        if id(v) not in read and id(v) not in outs:
            graph.inputs.remove(v)
    return [v.name for v in graph.inputs]


def split_forward_backward(
    model: ir.Model, forward_outputs: Sequence[str], backward_outputs: Sequence[str]
) -> Split:
    """Cases 1-3 of the module docstring; ``model`` is left unchanged."""
    model = _copy(model)
    _name_nodes(model.graph)
    fwd_names = forward_nodes(model.graph, forward_outputs)
    graph = model.graph
    reads = _reads(graph)
    made_by_fwd = {id(o): o for n in graph if n.name in fwd_names for o in n.outputs}
    saved: dict[int, ir.Value] = {}
    for n in graph:
        if n.name in fwd_names:
            continue
        for v in reads[id(n)]:
            if id(v) in made_by_fwd:
                saved.setdefault(id(v), v)
    for v in graph.outputs:  # a backward output made in the forward (rare): saved too
        if v.name in set(backward_outputs) and id(v) in made_by_fwd:
            saved.setdefault(id(v), v)
    order = {id(o): i for i, n in enumerate(graph) for o in n.outputs}
    saved_vals = sorted(saved.values(), key=lambda v: order[id(v)])
    missing = [v.name for v in saved_vals if v.dtype is None]
    if missing:
        raise ValueError(f"saved values without a type: {missing[:5]}")
    saved_names = [v.name for v in saved_vals]
    outputs = list(dict.fromkeys([*forward_outputs, *saved_names]))  # an output may be saved
    forward = _side(model, fwd_names, outputs, keep_nodes=True)
    backward = _side(model, fwd_names, list(backward_outputs), keep_nodes=False, saved=saved_names)
    fwd_inputs = _prune_inputs(forward)
    bwd_inputs = _prune_inputs(backward)
    original = {v.name for v in model.graph.inputs}
    return Split(
        forward,
        backward,
        saved_names,
        [n for n in fwd_inputs if n in original],
        [n for n in bwd_inputs if n in original],
    )


def _side(
    model: ir.Model,
    fwd_names: set[str],
    outputs: list[str],
    *,
    keep_nodes: bool,
    saved: Sequence[str] = (),
) -> ir.Model:
    """A copy of ``model`` with the forward nodes only (``keep_nodes``) or every other node,
    ``outputs`` as its outputs and, for the backward, the saved values as inputs."""
    side = _copy(model)
    graph = side.graph
    # an initializer can be an output (a constant the module returns, ``zeros_like``)
    values: dict[str, ir.Value] = dict(graph.initializers)
    values.update((v.name, v) for v in graph.inputs)
    for n in graph:
        for o in n.outputs:
            values[o.name] = o
    for name in saved:  # the backward reads them as inputs
        v = values[name]
        new = ir.Value(name=name, shape=v.shape, type=v.type)
        v.name = f"{name}__made"
        v.replace_all_uses_with(new, replace_graph_outputs=True)
        graph.inputs.append(new)
        values[name] = new
    graph.outputs.clear()
    graph.outputs.extend(values[n] for n in outputs)
    drop = [n for n in graph if (n.name in fwd_names) != keep_nodes]
    for n in reversed(drop):
        graph.remove(n, safe=False)
    if keep_nodes:
        onnx_ir.passes.common.RemoveUnusedNodesPass()(side)
    else:
        _check_closed(graph)
        onnx_ir.passes.common.RemoveUnusedNodesPass()(side)
    return side


def _check_closed(graph: ir.Graph) -> None:
    """Every value the backward reads is an input, an initializer or made in it."""
    made = {id(v) for v in graph.inputs} | {id(v) for v in graph.initializers.values()}
    made |= {id(o) for n in graph for o in n.outputs}
    for n, vals in zip(graph, _reads(graph).values()):
        for v in vals:
            if id(v) not in made and v.const_value is None:
                raise ValueError(f"backward node {n.name} reads {v.name}, made nowhere")


def as_proto(model: ir.Model) -> onnx.ModelProto:
    return ir.serde.serialize_model(model)
