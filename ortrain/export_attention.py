"""The dropout of ``F.scaled_dot_product_attention``, kept in the exported graph.

The exporter translates ``aten::scaled_dot_product_attention`` (and its CPU / flash
variants) with ``Dropout(weights, dropout_p)`` and no ``training_mode`` input, which ONNX
defines as inference: the identity, and the export's cleanup removes it. Eager draws that
dropout whenever ``dropout_p > 0`` (the function has no training flag), so every model
calling it (``nn.MultiheadAttention(need_weights=False)``, ``nn.TransformerEncoderLayer``,
a model's own attention, a captured reference to the function included) trained without
its attention dropout. Here those Dropouts get ``training_mode = True``, the node the
exporter wrote is otherwise kept; the first-step check switches it off like any other.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import onnx_ir as ir

_FROM = "pkg.torch.onnx.fx_node"  # the exporter's record of the aten call a node came from


def draw_attention_dropout(model: ir.Model) -> int:
    """Give each Dropout the exporter wrote for an attention call its training mode;
    returns how many."""
    import numpy as np
    import onnx_ir as ir

    count = 0
    for node in list(model.graph):
        if node.op_type != "Dropout" or node.domain not in ("", "ai.onnx"):
            continue
        if len(node.inputs) > 2 and node.inputs[2] is not None:
            continue  # a training mode of its own
        if len(node.inputs) < 2 or node.inputs[1] is None:
            continue  # no ratio: the exporter writes dropout_p only where it is not 0
        if "scaled_dot_product" not in node.metadata_props.get(_FROM, ""):
            continue
        on = ir.Node("", "Constant", [], [ir.AttrTensor("value", ir.tensor(np.array(True)))])
        model.graph.insert_before(node, on)
        node.resize_inputs(3)
        node.replace_input_with(2, on.outputs[0])
        count += 1
    return count
