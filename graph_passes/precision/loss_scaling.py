"""Loss scaling: differentiate ``loss * loss_scale`` instead of ``loss``.

1. A scalar fp32 graph input ``loss_scale`` is added (its role is LOSS_SCALE; the runtime
   binds the scaler's current value to it every step).
2. ``scaled_loss = Mul(loss, loss_scale)`` is appended; autodiff starts from it, so every
   gradient in the backward (fp16 ones included) is ``loss_scale`` times the true one and
   small gradients do not flush to zero in half precision.
3. The model's loss output stays the unscaled loss.

Unscaling and the all-finite check happen in the update graph
(``optimizer/update_graph.py``: ``skip_nonfinite``): the runtime folds ``1/loss_scale``
into the gradient scale it already applies for accumulation and data parallelism.
"""

from __future__ import annotations

import onnx_ir as ir

from ortrain.core.names import LOSS_SCALE_INPUT
from ortrain.graph_passes.infra.emitter import Emitter


def scale_loss(model: ir.Model, loss: str) -> str:
    """Returns the name of the scaled loss, the value to differentiate."""
    graph = model.graph
    loss_v = next((v for v in graph.outputs if v.name == loss), None)
    if loss_v is None:
        raise ValueError(f"loss '{loss}' is not an output of the graph")
    if loss_v.dtype != ir.DataType.FLOAT:
        raise ValueError(f"loss '{loss}' is {loss_v.dtype}; loss scaling expects a float32 loss")
    if any(v.name == LOSS_SCALE_INPUT for v in graph.inputs):
        raise ValueError(f"the graph already has an input named '{LOSS_SCALE_INPUT}'")
    scale = ir.Value(
        name=LOSS_SCALE_INPUT, shape=ir.Shape([]), type=ir.TensorType(ir.DataType.FLOAT)
    )
    graph.inputs.append(scale)
    em = Emitter(graph, "loss_scaling")
    scaled = em.op("Mul", loss_v, scale, shape=(), dtype=ir.DataType.FLOAT)
    scaled.name = "scaled_loss"
    em.flush_before(None)
    return scaled.name
