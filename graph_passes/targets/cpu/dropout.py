"""fp32 training Dropouts -> ``ortrain.cpu.Dropout``.

ONNX Runtime's CPU Dropout draws each element's number from one Mersenne twister on one
thread; ortrain's kernel (``ortrain/runtime/dropout_kernels.c``) draws a counter-based
hash of (seed, run, index) on the kernels' threads. Same contract: ``Y`` and the boolean
``mask`` the backward reads, a stream per node seed (``prepare/dropout_seed.py``) that
advances every run, identity where ``training_mode`` is false (the first step's check
switches it off through ``DROPOUT_SWITCH_INPUT``).

A kernel choice made last, on CPU builds with ortrain's kernel library, after every pass
that reads the standard op (recompute never makes a Dropout again). Left as they are: a
Dropout that cannot draw (a constant ratio of 0 or a constant false ``training_mode``:
ONNX Runtime removes those), one on another dtype or with a non-float ratio.
"""

from __future__ import annotations

import onnx_ir as ir

from ortrain.core.names import CPU_DOMAIN

_STD = ("", "ai.onnx")


def lower_dropout(model: ir.Model) -> int:
    """Returns the number of Dropout nodes rewritten."""
    count = 0
    for node in model.graph:
        if not _lowers(node):
            continue
        seed = node.attributes.get("seed")
        node.op_type, node.domain, node.version = "Dropout", CPU_DOMAIN, None
        node.attributes.clear()
        if seed is not None:
            node.attributes["seed"] = ir.AttrInt64("seed", int(seed.value))
        count += 1
    if count:
        model.opset_imports[CPU_DOMAIN] = 1
    return count


def _lowers(node: ir.Node) -> bool:
    if node.op_type != "Dropout" or node.domain not in _STD or not node.inputs:
        return False
    x, y = node.inputs[0], node.outputs[0]
    if x is None or x.dtype != ir.DataType.FLOAT or y.dtype not in (ir.DataType.FLOAT, None):
        return False
    ratio = node.inputs[1] if len(node.inputs) > 1 else None
    training = node.inputs[2] if len(node.inputs) > 2 else None
    if training is None or _dtype(training) != ir.DataType.BOOL:
        return False  # no training_mode: inference, nothing drawn
    if ratio is not None and _dtype(ratio) != ir.DataType.FLOAT:
        return False
    return _const(ratio) != 0.0 and _const(training) != 0.0


def _dtype(value: ir.Value) -> ir.DataType | None:
    """``value``'s element type, from its constant where shape inference has not run."""
    if value.dtype is not None:
        return value.dtype
    tensor = ir.convenience.get_const_tensor(value)
    return tensor.dtype if tensor is not None else None


def _const(value: ir.Value | None) -> float | None:
    tensor = ir.convenience.get_const_tensor(value) if value is not None else None
    if tensor is None or tensor.size != 1:
        return None
    return float(tensor.numpy().reshape(-1)[0])
