"""Dropout switched on and off by one graph input, so a step can run without dropout.

The exporter gives each training Dropout a constant ``training_mode`` of true. A first
step verified against eager (``ortrain/verify.py``) cannot draw eager's masks, so it runs
both sides without dropout; this pass makes that possible without a second graph:

1. every Dropout whose ``training_mode`` is a constant true reads the bool scalar graph
   input ``DROPOUT_SWITCH_INPUT`` instead (one input shared by all of them);
2. a Dropout in inference mode (absent or constant-false ``training_mode``) or with a
   constant ratio of 0 draws nothing and is left alone;
3. no Dropout to switch: the graph is unchanged and has no such input.

The Dropout gradient rule reads the same input (``Where(training_mode, 1/(1-r), 1)``), so
the backward follows the switch too.
"""

from __future__ import annotations

import onnx_ir as ir

from ortrain.core.names import DROPOUT_SWITCH_INPUT


def _const(v: ir.Value | None) -> float | None:
    t = ir.convenience.get_const_tensor(v) if v is not None else None
    return None if t is None or t.size != 1 else float(t.numpy().reshape(-1)[0])


def switch_dropouts(model: ir.Model) -> int:
    """Returns the number of Dropout nodes now read the switch."""
    graph = model.graph
    switch: ir.Value | None = None
    count = 0
    for node in graph:
        if node.op_type != "Dropout" or node.domain not in ("", "ai.onnx"):
            continue
        if len(node.inputs) < 3 or node.inputs[2] is None or _const(node.inputs[2]) != 1.0:
            continue
        ratio = node.inputs[1] if len(node.inputs) > 1 else None
        if ratio is not None and _const(ratio) == 0.0:
            continue
        if switch is None:
            if any(v.name == DROPOUT_SWITCH_INPUT for v in graph.inputs):
                raise ValueError(f"the graph already has an input named {DROPOUT_SWITCH_INPUT!r}")
            switch = ir.Value(
                name=DROPOUT_SWITCH_INPUT, shape=ir.Shape([]), type=ir.TensorType(ir.DataType.BOOL)
            )
            graph.inputs.append(switch)
        node.replace_input_with(2, switch)
        count += 1
    return count
