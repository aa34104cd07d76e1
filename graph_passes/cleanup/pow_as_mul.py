"""``Pow(x, 2)`` -> ``Mul(x, x)`` and ``Pow(x, 3)`` -> ``Mul(Mul(x, x), x)``.

ONNX Runtime's CPU ``Pow`` calls the generic ``pow`` per element: on Llama's RMSNorm
(``x.pow(2).mean(-1)``) it ran much slower than a ``Mul`` of the same shape. The
gradient rule of ``Pow`` also emits a ``Pow`` (``e * x^(e-1)``), so a squared value costs
two slow calls per step; as a product its gradient is two Muls and a sum. ``x * x`` is
bit-identical to ``pow(x, 2)`` (one rounding either way); ``Pow(x, 3)`` as two products
differs by at most an ulp.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from ortrain.graph_passes.infra.constant_value import constant_tensor
from ortrain.graph_passes.infra.emitter import Emitter

_STD = ("", "ai.onnx")


def pow_as_mul(model: ir.Model) -> int:
    """Returns the number of Pows rewritten."""
    count = 0
    for node in list(model.graph):
        if node.op_type != "Pow" or node.domain not in _STD or len(node.inputs) != 2:
            continue
        x, exponent = node.inputs
        t = constant_tensor(exponent)
        if x is None or t is None or t.size != 1 or x.shape is None:
            continue
        if len(t.shape) > len(x.shape):  # the exponent would broadcast x's rank up
            continue
        e = float(np.asarray(t.numpy()).reshape(-1)[0])
        if e not in (2.0, 3.0) or x.dtype is None or not x.dtype.is_floating_point():
            continue
        em = Emitter(model.graph, node.name or "pow")
        shape = list(x.shape.dims)
        out = em.op("Mul", x, x, shape=shape)
        if e == 3.0:
            out = em.op("Mul", out, x, shape=shape)
        em.flush_before(node)
        old = node.outputs[0]
        name, typ, old_shape = old.name, old.type, old.shape
        old.name = f"{name}__pow"
        old.replace_all_uses_with(out, replace_graph_outputs=True)
        out.name, out.type, out.shape = name, typ, old_shape
        model.graph.remove(node, safe=True)
        count += 1
    return count
