"""Remove the ``ortrain.grad::StopGradient`` nodes once autodiff has read them.

They stand for ``x.detach()`` and ``torch.no_grad()`` (``ortrain/stop_gradient.py``):
autodiff lets no gradient through them, and after it they are identities that ONNX
Runtime has no kernel for. Each node's readers read its input instead; where its output
is a graph output, an Identity keeps the output's name.
"""

from __future__ import annotations

import onnx_ir as ir

from ortrain.core.names import GRAD_DOMAIN, STOP_GRADIENT


def drop_stop_gradients(model: ir.Model) -> int:
    """Remove every StopGradient of ``model`` (subgraphs included); returns how many."""
    dropped = 0
    for node in list(ir.traversal.RecursiveGraphIterator(model.graph)):
        if node.domain != GRAD_DOMAIN or node.op_type != STOP_GRADIENT:
            continue
        graph = node.graph
        source, out = node.inputs[0], node.outputs[0]
        assert source is not None
        if out.is_graph_output():  # keep the output's name: an Identity
            node.op_type, node.domain = "Identity", ""
        else:
            out.replace_all_uses_with(source)
            graph.remove(node, safe=True)
        dropped += 1
    if GRAD_DOMAIN in model.opset_imports and not any(
        n.domain == GRAD_DOMAIN for n in ir.traversal.RecursiveGraphIterator(model.graph)
    ):
        del model.opset_imports[GRAD_DOMAIN]
    return dropped
