"""Node order in the serialized graph for ONNX Runtime's execution order.

ONNX Runtime's default execution order is a reverse DFS from the graph's leaves (nodes
no other node reads: the gradient outputs, the loss), highest node index (position in the
file) first, that visits a node's producers highest index first. Written in the graph's
own order, that runs the whole input-gradient chain before the first weight gradient, and
every layer's output gradient and saved input stay alive until the end of the backward.

``order_for_ort(graph)`` moves the leaves to the end of the ``GraphProto`` handed to ONNX
Runtime in reverse graph order, so the leaf the graph computes first has the highest index
and ONNX Runtime finishes it first: each weight gradient right after the output gradient
it reads (gpt2-tiny: the last block's weight-gradient Gemm runs well before the end of
the backward; bert-tiny: a lower steady peak). The ``onnx_ir`` model and its
memory report keep the graph's order.

A value whose only reader is a late leaf still waits for it: the LM head's weight
gradient, into which the embedding's rows are scattered (``backward_cleanup`` case 5),
would run at the end of the backward and keep the [tokens x vocab] logit gradient alive
until then; ``scatter_in_place.py`` gives it a leaf of its own.
"""

from __future__ import annotations

import onnx


def leaves_last(nodes: list[onnx.NodeProto]) -> tuple[list[onnx.NodeProto], int]:
    """The nodes no node reads at the end in reverse order, and how many they are (a
    subgraph's reads of outer values count as reads by the node that owns it)."""
    read = {name for n in nodes for name in _reads(n)}
    leaves = [n for n in nodes if not any(o in read for o in n.output if o)]
    is_leaf = {id(n) for n in leaves}
    return [n for n in nodes if id(n) not in is_leaf] + leaves[::-1], len(leaves)


def _reads(node: onnx.NodeProto) -> list[str]:
    names = list(node.input)
    for attr in node.attribute:
        subgraphs = [attr.g] if attr.HasField("g") else list(attr.graphs)
        for sub in subgraphs:
            for inner in sub.node:
                names.extend(_reads(inner))
    return names


def order_for_ort(graph: onnx.GraphProto) -> int:
    """Reorder ``graph``'s nodes in place; returns the number of leaves."""
    ordered, count = leaves_last(list(graph.node))
    del graph.node[:]
    graph.node.extend(ordered)
    return count
