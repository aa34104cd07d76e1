"""Random draws switched to fixed values by the Dropout switch, so a check can compare them.

The first step is checked against eager (``ortrain/verify.py``) with dropout off on both
sides. Other random draws (a noise layer, a reparameterised sample, drop-path's mask,
MAE's shuffle) cannot be drawn alike: ONNX Runtime and torch have their own generators.
While the switch (``DROPOUT_SWITCH_INPUT``) is off, each draw this pass rewrites gives a
fixed value per element instead, which eager's draws give too under the check
(``verify.no_dropout``), so the rest of the graph (the formula around the draw, its
gradient) is compared:

    u[i]                   frac((i + 1) * (sqrt(5) - 1) / 2) in float64, i the element's
                           flat index: distinct values in (0, 1), so a sort of them has no
                           ties
    RandomUniform(Like)    low + (high - low) * u
    RandomNormal(Like)     mean + scale * (2u - 1)
    Bernoulli(p)           u < p

Each draw's output is replaced by ``Where(switch, draw, fixed)``: the training steps
(switch on) take the draw. A Multinomial has no such value: it is left alone, and a
graph with one is not compared (``uncentred_draws``).
"""

from __future__ import annotations

import math

import numpy as np
import onnx_ir as ir

from ortrain.core.names import DROPOUT_SWITCH_INPUT, RANDOM_OPS

GOLDEN = (math.sqrt(5.0) - 1.0) / 2.0
SWITCHED = frozenset(
    {"RandomUniform", "RandomUniformLike", "RandomNormal", "RandomNormalLike", "Bernoulli"}
)


class _Emit:
    """Nodes computing a draw's fixed value, inserted before the draw."""

    def __init__(self, graph: ir.Graph, at: ir.Node, base: str):
        self.graph, self.at, self.base, self.count = graph, at, base, 0

    def _name(self) -> str:
        self.count += 1
        return f"{self.base}_{self.count}"

    def const(self, value: float | int | np.ndarray, dtype: type = np.float64) -> ir.Value:
        name = self._name()
        t = ir.tensor(np.asarray(value, dtype=dtype), name=name)
        return self.op("Constant", [], value=t)

    def op(self, op_type: str, inputs: list[ir.Value], **attrs: object) -> ir.Value:
        node = ir.node(op_type, inputs, attrs or None, num_outputs=1)
        node.outputs[0].name = self._name()
        self.graph.insert_before(self.at, node)
        return node.outputs[0]


def _attr(node: ir.Node, name: str, default: float) -> float:
    a = node.attributes.get(name)
    return default if a is None else float(a.value)


def _u(e: _Emit, node: ir.Node) -> ir.Value:
    """``u`` (float64) in the shape of the draw's output."""
    if node.op_type in ("RandomUniform", "RandomNormal"):
        dims = [int(d) for d in node.attributes["shape"].value]
        shape = e.const(np.asarray(dims, dtype=np.int64), np.int64)
    else:  # the *Like draws and Bernoulli: shaped as their input
        shape = e.op("Shape", [node.inputs[0]])
    count = e.op("ReduceProd", [shape], keepdims=0)
    index = e.op("Range", [e.const(0, np.int64), count, e.const(1, np.int64)])
    x = e.op("Cast", [index], to=ir.DataType.DOUBLE.value)
    x = e.op("Mul", [e.op("Add", [x, e.const(1.0)]), e.const(GOLDEN)])
    frac = e.op("Sub", [x, e.op("Floor", [x])])
    return e.op("Reshape", [frac, shape])


def _fixed(graph: ir.Graph, node: ir.Node) -> ir.Value:
    """The draw's fixed value, in its output's type."""
    out = node.outputs[0]
    e = _Emit(graph, node, f"{node.name or out.name}_fixed")
    u = _u(e, node)
    if node.op_type == "Bernoulli":
        p = node.inputs[0]
        return e.op("CastLike", [e.op("Less", [e.op("CastLike", [u, p]), p]), out])
    if node.op_type.startswith("RandomUniform"):
        low, high = _attr(node, "low", 0.0), _attr(node, "high", 1.0)
        value = e.op("Add", [e.const(low), e.op("Mul", [e.const(high - low), u])])
    else:
        mean, scale = _attr(node, "mean", 0.0), _attr(node, "scale", 1.0)
        two_u = e.op("Sub", [e.op("Mul", [e.const(2.0), u]), e.const(1.0)])
        value = e.op("Add", [e.const(mean), e.op("Mul", [e.const(scale), two_u])])
    return e.op("CastLike", [value, out])


def _switch(graph: ir.Graph) -> ir.Value:
    for v in graph.inputs:
        if v.name == DROPOUT_SWITCH_INPUT:
            return v
    switch = ir.Value(
        name=DROPOUT_SWITCH_INPUT, shape=ir.Shape([]), type=ir.TensorType(ir.DataType.BOOL)
    )
    graph.inputs.append(switch)
    return switch


def switch_random_draws(model: ir.Model) -> int:
    """Returns the number of draws now switched (the switch input is added if no Dropout
    made it)."""
    graph = model.graph
    draws = [n for n in graph if n.op_type in SWITCHED and n.domain in ("", "ai.onnx")]
    if not draws:
        return 0
    switch = _switch(graph)
    for node in draws:
        out = node.outputs[0]
        users = list(out.uses())
        fixed = _fixed(graph, node)
        where = ir.node("Where", [switch, out, fixed], num_outputs=1)
        where.outputs[0].name = f"{out.name}_switched"
        graph.insert_after(node, where)
        for user, index in users:
            user.replace_input_with(index, where.outputs[0])
        if out.is_graph_output():
            outputs = graph.outputs
            outputs[outputs.index(out)] = where.outputs[0]
    return len(draws)


def _is_switch(v: ir.Value | None) -> bool:
    return v is not None and v.name == DROPOUT_SWITCH_INPUT


def uncentred_draws(model: ir.Model) -> list[str]:
    """Op types of the nodes that draw random numbers a check cannot fix (besides the
    switched Dropouts): a graph with any is not compared with eager."""
    found = []
    for node in ir.traversal.RecursiveGraphIterator(model.graph):
        if node.op_type not in RANDOM_OPS or node.op_type == "Dropout":
            continue
        uses = list(node.outputs[0].uses())
        switched = any(u.op_type == "Where" for u, _ in uses) and all(
            (u.op_type == "Where" and i == 1 and _is_switch(u.inputs[0]))
            or (u.op_type == "CastLike" and i == 1)  # its fixed value takes its type
            for u, i in uses
        )
        if not switched:
            found.append(node.op_type)
    return found
