"""Node order in the serialized graph for ONNX Runtime's execution order.

ONNX Runtime's default execution order is a reverse DFS from the graph's leaves that
visits a node's producers highest node index (position in the file) first. A node whose
inputs are a value finished early and a value finished at the end of the backward (an
embedding gradient scattered into the LM head's weight gradient, ``backward_cleanup``
case 5) therefore gets the late value's whole chain first and the early value's producer
just before itself: the producer's own inputs (the [rows x vocab] logit gradient) stay
alive through the whole backward (gpt2-tiny batch 32: +114 MiB steady peak).

``order_for_ort(graph)`` moves the producer of the input named by a node's
``ortrain.run_input_first`` tag right before that node, when the node is its only
consumer: a later position means a higher index, so ONNX Runtime computes it before the
node's other inputs, as early as its own inputs allow. It works on the ``GraphProto``
that is handed to ONNX Runtime, so the ``onnx_ir`` model (and its memory report, which
reads the graph's order, where that producer sits early) is unchanged.
"""

from __future__ import annotations

import onnx

from graph_passes.tags import RUN_INPUT_FIRST


def _tag(node: onnx.NodeProto) -> int | None:
    for prop in node.metadata_props:
        if prop.key == RUN_INPUT_FIRST:
            return int(prop.value)
    return None


def order_for_ort(graph: onnx.GraphProto) -> int:
    """Move the tagged inputs' producers; returns how many moved."""
    nodes = list(graph.node)
    producer = {out: n for n in nodes for out in n.output if out}
    readers: dict[str, int] = {}
    for n in nodes:
        for name in n.input:
            readers[name] = readers.get(name, 0) + 1
    graph_outputs = {o.name for o in graph.output}
    moved = 0
    for node in [n for n in nodes if _tag(n) is not None]:
        index = _tag(node)
        if index is None or index >= len(node.input):
            continue
        value = node.input[index]
        src = producer.get(value)
        if src is None or readers.get(value) != 1 or value in graph_outputs:
            continue
        if any(readers.get(out, 0) or out in graph_outputs for out in src.output if out != value):
            continue
        nodes.remove(src)
        nodes.insert(nodes.index(node), src)
        moved += 1
    if moved:
        del graph.node[:]
        graph.node.extend(nodes)
    return moved
