"""Lower 2-D ``SoftmaxCrossEntropyLoss`` to ``LogSoftmax`` + ``NegativeLogLikelihoodLoss``.

Stock (inference) ONNX Runtime has no SoftmaxCrossEntropyLoss kernel: it expands the
function body, which reshapes scores to [N, C, 1] and runs LogSoftmax over a strided
axis — about 3x slower than LogSoftmax over the contiguous last axis (measured 35 ms vs
12 ms for [1024, 8192] on 2 threads). Runs after autodiff, so the SCE gradient rule
(which reads the log-probabilities) still sees one node; its ``log_prob`` output becomes
the LogSoftmax output.

Cases: 1. scores of rank 2 are lowered (optional weights, ignore_index and reduction
kept); 2. rank > 2 (class axis not last) is left alone.
"""

from __future__ import annotations

import onnx_ir as ir


def lower_softmax_cross_entropy(model: ir.Model) -> int:
    """Returns the number of nodes lowered."""
    graph = model.graph
    count = 0
    for node in list(graph):
        if node.op_type != "SoftmaxCrossEntropyLoss" or node.domain not in ("", "ai.onnx"):
            continue
        scores = node.inputs[0]
        if scores.shape is None or len(scores.shape) != 2:
            continue
        lsm = ir.Node(
            "",
            "LogSoftmax",
            [scores],
            attributes=[ir.AttrInt64("axis", 1)],
            name=f"{node.name}/log_softmax",
            metadata_props=dict(node.metadata_props),
        )
        attrs = [a for k, a in node.attributes.items() if k in ("ignore_index", "reduction")]
        nll = ir.Node(
            "",
            "NegativeLogLikelihoodLoss",
            [lsm.outputs[0], *node.inputs[1:]],
            attributes=attrs,
            name=f"{node.name}/nll",
            metadata_props=dict(node.metadata_props),
        )
        pairs = [(node.outputs[0], nll.outputs[0])]
        if len(node.outputs) > 1:
            pairs.append((node.outputs[1], lsm.outputs[0]))
        else:
            lsm.outputs[0].name = f"{node.name}/log_prob"
        lsm.outputs[0].dtype, lsm.outputs[0].shape = scores.dtype, scores.shape
        graph.insert_before(node, [lsm, nll])
        for old, new in pairs:
            name, shape, typ = old.name, old.shape, old.type
            old.name = f"{name}__lowered"
            old.replace_all_uses_with(new, replace_graph_outputs=True)
            new.name, new.shape, new.type = name, shape, typ
        graph.remove(node, safe=True)
        count += 1
    return count
