"""Recompute attention probabilities in the backward instead of keeping them.

Each attention layer's probabilities ``P = Softmax(mask(Q K^T))`` ([batch, heads, seq,
seq]) are read by its backward (the value product's gradient and SoftmaxGrad), so every
layer's P stays alive from its forward to its backward: at the start of the backward all
of them are (one [batch, heads, seq, seq] tensor per layer). The backward reads Q and K
anyway (for their own gradients), so P can be made again next to its first backward
reader from the product, the mask and the Softmax: one batched product and one Softmax
per layer (a small share of GPT-2 small's step), and only the layer being differentiated
holds its P.

Rewritten: a forward fp32 ``Softmax`` whose output a backward node reads, over an
optional mask ``Add`` / ``Where`` and an optional ``Mul`` / ``Div`` by a constant, over a
``MatMul`` / ``FusedMatMul`` of two values the backward reads anyway (or graph inputs /
constants), the intermediate values read by no backward node; the mask and scale operands
are graph inputs, constants, kept values or at most half P's size (a mask [batch, 1,
seq, seq], one value all layers share, is then kept alive into the backward). The copies
run the same ops on the same inputs, so P is bit-identical; they are backward nodes
tagged ``ortrain.recompute_of`` (ONNX Runtime's CSE must stay off for them, as for
``recompute.py``'s), and later passes lower them like the originals.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from ortrain.graph_passes.infra.tags import is_backward
from ortrain.graph_passes.memory.recompute import copy_before, names_in

_STD = ("", "ai.onnx")
_MS = "com.microsoft"
_MASKS = frozenset({"Add", "Where"})
_SCALES = frozenset({"Mul", "Div"})


def _nbytes(v: ir.Value) -> int | None:
    if v.shape is None or v.dtype is None or not all(isinstance(d, int) for d in v.shape.dims):
        return None
    return int(np.prod(v.shape.dims, dtype=np.int64)) * v.dtype.itemsize


def _kept(v: ir.Value) -> bool:
    return any(is_backward(u.node) for u in v.uses())


def _alive_anyway(v: ir.Value) -> bool:
    producer = v.producer()
    return producer is None or v.const_value is not None or producer.op_type == "Constant"


def _main_input(node: ir.Node) -> int | None:
    """Index of the input the chain runs through (the one of the node's output shape)."""
    candidates = [
        i for i, x in enumerate(node.inputs)
        if x is not None and x.producer() is not None and x.shape == node.outputs[0].shape
    ]  # fmt: skip
    return candidates[0] if len(candidates) == 1 else None


def _chain(softmax: ir.Node) -> list[ir.Node] | None:
    """[product, (scale), (mask), softmax] when the probabilities can be made again."""
    p = softmax.outputs[0]
    limit = _nbytes(p)
    if limit is None or p.dtype != ir.DataType.FLOAT:
        return None
    chain = [softmax]
    node = softmax.inputs[0].producer() if softmax.inputs[0] is not None else None
    while node is not None and not is_backward(node) and node.domain in _STD:
        if node.op_type not in _MASKS | _SCALES or len(chain) > 3:
            break
        chain.append(node)
        main = _main_input(node)
        if main is None:
            return None
        nxt = node.inputs[main]
        node = nxt.producer() if nxt is not None else None
    if node is None or is_backward(node):
        return None
    if not (
        (node.op_type == "MatMul" and node.domain in _STD)
        or (node.op_type == "FusedMatMul" and node.domain == _MS)
    ):
        return None
    chain.append(node)
    chain.reverse()
    for n in chain[:-1]:  # intermediates: only the chain reads them
        if any(is_backward(u.node) for u in n.outputs[0].uses()) or len(n.outputs) != 1:
            return None
    for x in chain[0].inputs:  # Q and K: the backward reads them anyway
        if x is None or not (_kept(x) or _alive_anyway(x)):
            return None
    chained = {id(n.outputs[0]) for n in chain}
    for n in chain[1:]:
        for x in n.inputs:
            if x is None or id(x) in chained or _kept(x) or _alive_anyway(x):
                continue
            size = _nbytes(x)
            if size is None or size * 2 > limit:
                return None
    return chain


def recompute_attention_probs(model: ir.Model) -> int:
    """Returns the number of probability tensors now made again in the backward."""
    graph = model.graph
    position = {id(n): i for i, n in enumerate(graph)}
    taken = names_in(graph)
    count = 0
    for softmax in list(graph):
        if softmax.op_type != "Softmax" or softmax.domain not in _STD or is_backward(softmax):
            continue
        readers = [u for u in softmax.outputs[0].uses() if is_backward(u.node)]
        if not readers:
            continue
        chain = _chain(softmax)
        if chain is None:
            continue
        first = min(readers, key=lambda u: position[id(u.node)]).node
        clones: dict[int, ir.Value] = {}
        for node in chain:
            inputs = [None if x is None else clones.get(id(x), x) for x in node.inputs]
            copy_before(graph, node, inputs, first, clones, taken)
        copy = clones[id(softmax.outputs[0])]
        for use in readers:
            use.node.replace_input_with(use.idx, copy)
        count += 1
    return count
