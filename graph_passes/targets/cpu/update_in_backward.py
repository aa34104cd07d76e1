"""The Adam / AdamW update of each parameter inside the backward, as soon as its gradient
is complete, so no gradient outlives its update.

Without it every gradient is a graph output bound to a buffer of the trainer's, and the
update runs after the session: the gradients of the whole model are resident all the
time. Here each gradient is an ordinary value of the graph that an
``ortrain.cpu.AdamStep`` node (``ortrain/runtime/update_kernels.c``) reads right after it
is made, updating the parameter and its two moments in place, and the gradient's buffer
goes back to the arena: at most the gradients of the layer being differentiated are
alive (torch's ``register_post_accumulate_grad_hook`` "optimizer in backward" recipe).

Only for what needs no look at all the gradients first: one micro-step per update, no
clipping (the global norm), no loss scaling (the overflow check) and fp32 parameters;
the trainer picks it (``TrainerOptions.update_engine``) and keeps the update after the
session otherwise. A step whose loss is not finite changes nothing (the kernel reads the
loss), like the trainer's own check.

Ordering: the node reads the gradient and the loss, so it runs after the whole forward
and after the gradient's producers; a node that reads the parameter (or a view of it:
ONNX Runtime's Reshape and friends alias their input) but is neither an ancestor of the
gradient nor of the loss — the product with the weight that makes the layer's input
gradient — must run before the parameter changes (views and Transposes of the parameter
followed to their readers: ONNX Runtime aliases or folds them): its output is an extra
input of the update ("after" inputs the kernel does not read; the node's
``ORDERING_INPUTS_FROM`` tag says where they start, so later passes need not know the
kernel's input list). Each update's ``done`` output (1 when
applied) is a graph output no node reads: a leaf, which ``ort_order.py`` places so that
ONNX Runtime runs it right after the gradient it reads, as it did the gradient outputs.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import onnx_ir as ir

from ortrain.core.names import (
    CPU_DOMAIN,
    HYPER_NAMES,
    IN_BACKWARD_STATES,
    UpdateInBackwardError,
    hyper_name,
    state_key,
)

__all__ = [
    "LOSS_LEAF_PREFIX",
    "MAX_AFTER",
    "UpdateInBackwardError",
    "done_name",
    "update_in_backward",
]
from ortrain.graph_passes.infra.tags import GRAD_OF, ORDERING_INPUTS_FROM

F = ir.DataType.FLOAT
MAX_AFTER = 8  # kernel ABI, not tuning: ordering inputs AdamStep takes (update_kernels.c)
DONE_PREFIX = "update_done:"
LOSS_LEAF_PREFIX = "loss_leaf:"
# Followed to their readers: ONNX Runtime makes these outputs aliases of their input
# (Reshape and friends), or folds them into the products that read them (a Transpose into
# FusedMatMul / Gemm), whose nodes then read the parameter itself (ALBERT: one W^T that
# every layer's product reads; without this, the first layer's input-gradient product
# read an already updated W).
_VIEWS = frozenset({"Reshape", "Flatten", "Squeeze", "Unsqueeze", "Identity", "Transpose"})
_SHAPE_ONLY = frozenset({"Shape", "Size"})  # read the parameter's shape, not its data
_STANDARD = ("", "ai.onnx")


def done_name(param: str) -> str:
    return DONE_PREFIX + param


def _ancestors(starts: Iterable[ir.Node | None]) -> set[int]:
    seen: set[int] = set()
    stack = [n for n in starts if n is not None]
    while stack:
        node = stack.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        for v in node.inputs:
            if v is not None and v.producer() is not None:
                stack.append(v.producer())  # type: ignore[arg-type]
        for attr in node.attributes.values():  # values a subgraph reads from outside
            for sub in _subgraphs(attr):
                for inner in sub:
                    for v in inner.inputs:
                        producer = v.producer() if v is not None else None
                        if producer is not None and producer.graph is not sub:
                            stack.append(producer)
    return seen


def _subgraphs(attr: ir.Attr) -> list[ir.Graph]:
    if attr.type == ir.AttributeType.GRAPH:
        return [attr.as_graph()]
    if attr.type == ir.AttributeType.GRAPHS:
        return list(attr.as_graphs())
    return []


def _readers(param: ir.Value) -> list[ir.Node]:
    """Nodes that read ``param``'s data, directly or through views, Transposes and
    constant scalings of it."""
    readers: list[ir.Node] = []
    seen: set[int] = set()
    values = [param]
    while values:
        v = values.pop()
        for use in v.uses():
            node = use.node
            if id(node) in seen or (node.op_type in _SHAPE_ONLY and node.domain in _STANDARD):
                continue
            seen.add(id(node))
            if node.domain in _STANDARD and (node.op_type in _VIEWS or _scale_of(node, v)):
                values.extend(node.outputs)
            else:
                readers.append(node)
    return readers


def _scale_of(node: ir.Node, value: ir.Value) -> bool:
    """``value`` times / over a constant scalar: ONNX Runtime folds that into the product
    that reads it (MatMulScaleFusion), which then reads ``value`` itself."""
    if node.op_type not in ("Mul", "Div") or len(node.inputs) != 2:
        return False
    other = node.inputs[1] if node.inputs[0] is value else node.inputs[0]
    if other is None or other is value:
        return False
    const = other.const_value
    producer = other.producer()
    if const is None and producer is not None and producer.op_type == "Constant":
        return True
    return const is not None and const.size == 1


def _after_inputs(
    param: str, value: ir.Value, grad: ir.Value, loss_side: set[int]
) -> list[ir.Value]:
    grad_side = _ancestors([grad.producer()])
    after: list[ir.Value] = []
    for node in _readers(value):
        if id(node) in loss_side or id(node) in grad_side:
            continue  # the update reads its result already (through the loss or the gradient)
        out = next((o for o in node.outputs if o.name and o.dtype == F), None)
        if out is None:
            raise UpdateInBackwardError(
                f"parameter {param!r}: node {node.name!r} ({node.op_type}) reads it but has no "
                "float32 output to order its update after"
            )
        after.append(out)
    if len(after) > MAX_AFTER:
        raise UpdateInBackwardError(
            f"parameter {param!r} is read by {len(after)} nodes the update must wait for "
            f"(at most {MAX_AFTER})"
        )
    return after


def update_in_backward(
    model: ir.Model, grads: Mapping[str, str], groups: Mapping[str, int], loss: str
) -> dict[str, str]:
    """Update each parameter of ``grads`` (param -> gradient output) in the backward with
    the hyperparameters of its group in ``groups``. The gradients stop being graph outputs;
    new inputs: ``state_key(s, param)`` for the moments and ``hyper_name(g)`` per group.
    Returns {param: its ``done`` output}. Checks every parameter before changing anything."""
    graph = model.graph
    inputs = {v.name: v for v in graph.inputs}
    outputs = {v.name: v for v in graph.outputs}
    if loss not in outputs:
        raise UpdateInBackwardError(f"the loss {loss!r} is not a graph output")
    loss_value = outputs[loss]
    loss_side = _ancestors([loss_value.producer()])
    plans = []
    for param, grad_name in grads.items():
        value, grad = inputs.get(param), outputs.get(grad_name)
        if value is None or grad is None or grad.producer() is None:
            raise UpdateInBackwardError(
                f"parameter {param!r}: no graph input, or its gradient {grad_name!r} is not "
                "made by a node"
            )
        if value.dtype != F or grad.dtype != F:
            raise UpdateInBackwardError(
                f"parameter {param!r} is {value.dtype}, its gradient {grad.dtype}; the update in "
                "the backward takes float32"
            )
        if param not in groups:
            raise UpdateInBackwardError(f"parameter {param!r} is in no param group")
        plans.append((param, value, grad, _after_inputs(param, value, grad, loss_side)))

    hypers: dict[int, ir.Value] = {}
    for g in sorted({groups[p] for p, *_ in plans}):
        hypers[g] = ir.Value(
            name=hyper_name(g), shape=ir.Shape([len(HYPER_NAMES)]), type=ir.TensorType(F)
        )
        graph.inputs.append(hypers[g])
    position = {id(n): i for i, n in enumerate(graph)}
    done_outputs: dict[str, str] = {}
    for param, value, grad, after in plans:
        states = []
        for s in IN_BACKWARD_STATES:
            states.append(
                ir.Value(name=state_key(s, param), shape=value.shape, type=ir.TensorType(F))
            )
            graph.inputs.append(states[-1])
        done = ir.Value(name=done_name(param), shape=ir.Shape([]), type=ir.TensorType(F))
        data = [value, grad, *states, hypers[groups[param]], loss_value]  # what it reads
        node = ir.Node(
            CPU_DOMAIN,
            "AdamStep",
            [*data, *after],
            outputs=[done],
            name=f"update/{param}",
            metadata_props={GRAD_OF: f"update of {param}", ORDERING_INPUTS_FROM: str(len(data))},
        )
        producers = [v.producer() for v in (grad, loss_value, *after)]
        last = max((p for p in producers if p is not None), key=lambda n: position[id(n)])
        graph.insert_after(last, node)
        graph.outputs.remove(grad)
        graph.outputs.append(done)
        done_outputs[param] = done.name  # type: ignore[assignment]
    if plans:
        model.opset_imports[CPU_DOMAIN] = 1
        _loss_leaf(graph, loss_value)
    return done_outputs


def _loss_leaf(graph: ir.Graph, loss: ir.Value) -> None:
    """A leaf reading the loss, right after its producer. The updates read the loss, so it
    is no leaf of its own any more, and ONNX Runtime's order (reverse DFS from the leaves,
    ``ort_order.py``) would reach it through the first update's inputs — after that
    update's gradient, whose producer is later in the file: the loss's own reads of the
    probabilities (the labels' entries) would then wait until the head's backward had run,
    and keep them alive past the cross-entropy gradient, which could then not take their
    buffer (a second [tokens x vocab] buffer). As the
    first leaf in graph order, this one makes ONNX Runtime finish the forward first."""
    producer = loss.producer()
    assert producer is not None
    out = ir.Value(name=LOSS_LEAF_PREFIX + str(loss.name), shape=loss.shape, type=loss.type)
    node = ir.Node("", "Identity", [loss], outputs=[out], name=f"{loss.name}/leaf")
    graph.insert_after(producer, node)
    graph.outputs.append(out)
