"""Global-norm gradient clipping with torch.nn.utils.clip_grad_norm_ semantics:

total = sqrt(sum_i ||g_i||^2);  coef = min(max_norm / (total + 1e-6), 1);  g_i *= coef
"""

from __future__ import annotations

from collections.abc import Sequence

import onnx_ir as ir

from ortrain.graph_passes.infra.emitter import Emitter


def global_norm(em: Emitter, grads: Sequence[ir.Value]) -> ir.Value:
    squares = [em.op("ReduceSumSquare", g, keepdims=0, shape=()) for g in grads]
    total = squares[0] if len(squares) == 1 else em.op("Sum", *squares, shape=())
    return em.op("Sqrt", total, shape=(), name_hint="global_norm")


def clip_coefficient(em: Emitter, total_norm: ir.Value, max_norm: ir.Value) -> ir.Value:
    f = ir.DataType.FLOAT
    coef = em.op("Div", max_norm, em.op("Add", total_norm, em.const(1e-6, f)))
    return em.op("Min", coef, em.const(1.0, f), shape=())
