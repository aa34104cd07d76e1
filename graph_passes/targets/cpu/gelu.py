"""fp32 GELU forwards -> ``ortrain.cpu.Gelu`` / ``ortrain.cpu.FastGelu``.

Between two products that run on torch's OpenMP team (``ortrain.blas``), ONNX Runtime's
Gelu runs on its intra-op threads while the team's workers still spin, and the two share
the cores: it takes several times what it takes alone. ortrain's kernels
(``ortrain/runtime/forward_kernels.c``) run on the team, with the exp the GELU backward
kernels use.

A kernel choice like ``softmax.py``: made last (after ``gelu_value``, which reads the
standard op), on CPU builds with ortrain's kernel library. Rewritten: float32 ``Gelu``
(opset 20; approximate "none" -> Gelu, "tanh" -> FastGelu) and ``com.microsoft``'s
one-input ``Gelu`` / ``FastGelu``; a GELU with a bias input stays.
"""

from __future__ import annotations

import onnx_ir as ir

from ortrain.core.names import CPU_DOMAIN

_STD = ("", "ai.onnx")
_MS = "com.microsoft"
_KERNEL = {"none": "Gelu", "tanh": "FastGelu"}


def lower_gelu(model: ir.Model) -> int:
    """Returns the number of GELU nodes rewritten."""
    count = 0
    for node in model.graph:
        kernel = _kernel(node)
        if kernel is None:
            continue
        node.op_type, node.domain, node.version = kernel, CPU_DOMAIN, None
        node.attributes.clear()
        count += 1
    if count:
        model.opset_imports[CPU_DOMAIN] = 1
    return count


def _kernel(node: ir.Node) -> str | None:
    """The ortrain.cpu op for ``node``, or None where it stays."""
    if len(node.inputs) != 1 or len(node.outputs) != 1 or node.inputs[0] is None:
        return None
    if node.inputs[0].dtype != ir.DataType.FLOAT or node.outputs[0].dtype != ir.DataType.FLOAT:
        return None
    if node.domain in _STD and node.op_type == "Gelu":
        approximate = node.attributes.get("approximate")
        return _KERNEL.get(approximate.value if approximate is not None else "none")
    if node.domain == _MS and node.op_type in ("Gelu", "FastGelu"):
        return node.op_type
    return None
