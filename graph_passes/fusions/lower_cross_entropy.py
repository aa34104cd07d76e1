"""Lower 2-D ``SoftmaxCrossEntropyLoss`` to kernels stock ONNX Runtime runs fast.

Stock (inference) ONNX Runtime has no SoftmaxCrossEntropyLoss kernel: it expands the
function body, which reshapes scores to [N, C, 1] and runs LogSoftmax over a strided
axis — much slower than LogSoftmax over the contiguous last axis. Runs after autodiff,
so the SCE gradient rule (which reads ``exp(log_prob)``) still sees one node.

Two forms:

1. softmax form, when the log-probabilities are read only by ``Exp`` nodes (the
   gradient rule's; or by nothing, as in evaluation), there are no class weights and the
   scores are fp32/fp64: ``prob = Softmax(scores)`` replaces those ``Exp`` outputs and
   the loss reads the labelled entries only, as log-softmax does:
   ``logsumexp(x_i) - x[i, t_i] = max_i + log(sum_j exp(x[i, j] - max_i)) - x[i, t_i]``.
   The sum is read off the probabilities: the row's largest one is ``exp(0) / sum``
   (at least 1/C, so it never underflows), hence ``log(sum) = -log(max_j prob[i, j])``
   and the loss is ``max_i - x[i, t_i] - log(max_j prob[i, j])``, exact at any logit
   gap (``-log(prob[i, t_i])`` would be -log(0) where the picked probability
   underflows). No [N, C] log-probabilities are made: ONNX Runtime runs Softmax in place
   over the scores (LogSoftmax too, but its ``Exp`` in the backward is not in place), so
   the backward starts with one [N, C] buffer fewer alive, and one Softmax ran faster
   than LogSoftmax + Exp. The gradient (``prob - onehot``) comes from the rule, not from
   these nodes.
2. LogSoftmax form otherwise: ``LogSoftmax``, then the labelled entries gathered (class
   weights, ignore_index and reduction kept); its ``log_prob`` output is the LogSoftmax
   output.

Both forms weight and reduce the picked entries with stock ops (Where, Mul, ReduceSum,
Div), not ``NegativeLogLikelihoodLoss``: ONNX Runtime's CUDA execution provider has no
kernel for it, so it ran on the CPU (a device-to-host copy per step) and kept the
session from being captured as a CUDA graph.

Scores of rank > 2 (class axis not last) are left alone.
"""

from __future__ import annotations

import onnx_ir as ir

from ortrain.graph_passes.infra.emitter import Emitter

_STD = ("", "ai.onnx")
# Metadata key on the nodes that implement a lowered loss: the op type they replace.
LOWERED_FROM = "ortrain.lowered_from"


def lower_softmax_cross_entropy(model: ir.Model) -> int:
    """Returns the number of nodes lowered."""
    graph = model.graph
    count = 0
    for node in list(graph):
        if node.op_type != "SoftmaxCrossEntropyLoss" or node.domain not in _STD:
            continue
        scores = node.inputs[0]
        if scores.shape is None or len(scores.shape) != 2:
            continue
        if _softmax_form_applies(graph, node):
            _lower_to_softmax(graph, node)
        else:
            _lower_to_log_softmax(graph, node)
        count += 1
    return count


def _softmax_form_applies(graph: ir.Graph, node: ir.Node) -> bool:
    if node.inputs[0].dtype not in (ir.DataType.FLOAT, ir.DataType.DOUBLE):
        return False  # a half-precision probability underflows at a logit gap of ~17
    if len(node.inputs) > 2 and node.inputs[2] is not None:
        return False  # class weights: NLL needs the whole row of log-probabilities
    if len(node.outputs) < 2:
        return True
    log_prob = node.outputs[1]
    if log_prob in graph.outputs:
        return False
    return all(
        user.op_type == "Exp" and user.domain in _STD and len(user.outputs) == 1
        for user, _ in log_prob.uses()
    )


def _lowered_metadata(node: ir.Node) -> dict[str, str]:
    # Later checks (mixed precision's op lists) treat these nodes as the loss they implement.
    return {**node.metadata_props, LOWERED_FROM: node.op_type}


def _replace(old: ir.Value, new: ir.Value) -> None:
    name, shape, typ = old.name, old.shape, old.type
    old.name = f"{name}__lowered"
    old.replace_all_uses_with(new, replace_graph_outputs=True)
    new.name, new.shape, new.type = name, shape, typ


def _lower_to_softmax(graph: ir.Graph, node: ir.Node) -> None:
    scores, labels = node.inputs[0], node.inputs[1]
    assert scores.dtype is not None and labels.dtype is not None
    e = Emitter(graph, node.name, metadata=_lowered_metadata(node))
    prob = e.op("Softmax", scores, axis=1, shape=list(scores.shape.dims))
    index, ignored = _gather_index(e, node, labels)
    at = e.op("Unsqueeze", index, e.ints([1]))
    # log prob[i, t] = (x[i, t] - max_i) - log(sum_j exp(x[i, j] - max_i)), the largest
    # probability being 1 / that sum: exact where prob[i, t] underflows, no exp again.
    gap = e.op(
        "Sub",
        e.op("GatherElements", scores, at, axis=1),
        e.op("ReduceMax", scores, e.ints([1]), keepdims=1),
    )
    top_prob = e.op("ReduceMax", prob, e.ints([1]), keepdims=1)
    log_picked = e.op("Add", gap, e.op("Log", top_prob))
    loss = _weighted_nll(e, node, log_picked, ignored, None, _rows(labels))
    exps = [user for user, _ in node.outputs[1].uses()] if len(node.outputs) > 1 else []
    # An Exp output that is a graph output keeps its own name (through an Identity).
    named = {id(u): e.op("Identity", prob) for u in exps if u.outputs[0] in graph.outputs}
    e.flush_before(node)
    _replace(node.outputs[0], loss)
    for user in exps:
        if id(user) in named:
            _replace(user.outputs[0], named[id(user)])
        else:
            user.outputs[0].replace_all_uses_with(prob)
        graph.remove(user, safe=True)
    graph.remove(node, safe=True)


def _lower_to_log_softmax(graph: ir.Graph, node: ir.Node) -> None:
    scores, labels = node.inputs[0], node.inputs[1]
    weights = node.inputs[2] if len(node.inputs) > 2 else None
    e = Emitter(graph, node.name, metadata=_lowered_metadata(node))
    log_prob = e.op("LogSoftmax", scores, axis=1, name_hint="log_softmax")
    log_prob.dtype, log_prob.shape = scores.dtype, scores.shape
    index, ignored = _gather_index(e, node, labels)
    log_picked = e.op("GatherElements", log_prob, e.op("Unsqueeze", index, e.ints([1])), axis=1)
    weight = e.op("Gather", weights, index, axis=0) if weights is not None else None
    loss = _weighted_nll(e, node, log_picked, ignored, weight, _rows(labels))
    e.flush_before(node)
    _replace(node.outputs[0], loss)
    if len(node.outputs) > 1:
        _replace(node.outputs[1], log_prob)
    else:
        log_prob.name = f"{node.name}/log_prob"
    graph.remove(node, safe=True)


def _rows(labels: ir.Value) -> list | None:
    return list(labels.shape.dims) if labels.shape is not None else None


def _gather_index(e: Emitter, node: ir.Node, labels: ir.Value) -> tuple[ir.Value, ir.Value | None]:
    """The class index each row gathers (ignored rows gather class 0) and the ignored-row
    mask (None without ignore_index)."""
    ignore = node.attributes.get("ignore_index")
    if ignore is None:
        return labels, None
    assert labels.dtype is not None
    rows = _rows(labels)
    ignored = e.op("Equal", labels, e.const(int(ignore.value), labels.dtype), shape=rows)
    index = e.op("Where", ignored, e.const(0, labels.dtype), labels, shape=rows)
    return index, ignored


def _weighted_nll(
    e: Emitter,
    node: ir.Node,
    log_picked: ir.Value,
    ignored: ir.Value | None,
    weight: ir.Value | None,
    rows: list | None,
) -> ir.Value:
    """NegativeLogLikelihoodLoss over the picked log-probabilities ``[N, 1]``: ignored rows
    count 0 (and weigh 0 in the mean), ``weight`` is each row's class weight."""
    dtype = node.inputs[0].dtype
    assert dtype is not None
    reduction = node.attributes.get("reduction")
    reduction = reduction.value if reduction is not None else "mean"
    loss = e.op("Neg", e.op("Squeeze", log_picked, e.ints([1]), shape=rows), shape=rows)
    zero = e.const(0, dtype)
    if ignored is not None:  # Where, not a product: a -inf log-probability stays out
        loss = e.op("Where", ignored, zero, loss, shape=rows)
        if weight is not None:
            weight = e.op("Where", ignored, zero, weight, shape=rows)
        elif reduction == "mean":
            weight = e.op("Cast", e.op("Not", ignored, shape=rows), to=int(dtype), shape=rows)
            total = e.op("ReduceSum", loss, keepdims=0, shape=[])
            return e.op("Div", total, e.op("ReduceSum", weight, keepdims=0, shape=[]), shape=[])
    if weight is not None:
        loss = e.op("Mul", loss, weight, shape=rows)
    if reduction == "none":
        return loss
    if reduction == "sum":
        return e.op("ReduceSum", loss, keepdims=0, shape=[])
    if weight is None:
        return e.op("ReduceMean", loss, keepdims=0, shape=[])
    total = e.op("ReduceSum", loss, keepdims=0, shape=[])
    return e.op("Div", total, e.op("ReduceSum", weight, keepdims=0, shape=[]), shape=[])
