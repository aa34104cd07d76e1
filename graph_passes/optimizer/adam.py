"""Adam and AdamW, in torch's order of operations (single-tensor implementation).

AdamW: p = p * (1 - lr * wd)          Adam: g = g + wd * p
m = m + (1 - b1) * (g - m)            (torch: exp_avg.lerp_(g, 1 - b1))
v = b2 * v + (1 - b2) * g * g
p = p - lr / (1 - b1^t) * m / (sqrt(v) / sqrt(1 - b2^t) + eps)
"""

from __future__ import annotations

import onnx_ir as ir

from graph_passes.emitter import Emitter


def group_scalars(em: Emitter, hp: dict[str, ir.Value], step: ir.Value) -> dict[str, ir.Value]:
    one = em.const(1.0, ir.DataType.FLOAT)
    bc1 = em.op("Sub", one, em.op("Pow", hp["beta1"], step))
    bc2 = em.op("Sub", one, em.op("Pow", hp["beta2"], step))
    return {
        "step_size": em.op("Div", hp["lr"], bc1),
        "bc2_sqrt": em.op("Sqrt", bc2),
        "one_minus_b1": em.op("Sub", one, hp["beta1"]),
        "one_minus_b2": em.op("Sub", one, hp["beta2"]),
        "decay": em.op("Sub", one, em.op("Mul", hp["lr"], hp["weight_decay"])),
    }


def update(
    em: Emitter,
    p: ir.Value,
    g: ir.Value,
    state: dict[str, ir.Value],
    hp: dict[str, ir.Value],
    sc: dict[str, ir.Value],
    *,
    decoupled: bool,
) -> tuple[ir.Value, dict[str, ir.Value]]:
    if decoupled:
        p = em.op("Mul", p, sc["decay"])
    else:
        g = em.op("Add", g, em.op("Mul", p, hp["weight_decay"]))
    m, v = state["exp_avg"], state["exp_avg_sq"]
    m_new = em.op("Add", m, em.op("Mul", em.op("Sub", g, m), sc["one_minus_b1"]))
    v_new = em.op(
        "Add",
        em.op("Mul", v, hp["beta2"]),
        em.op("Mul", em.op("Mul", g, g), sc["one_minus_b2"]),
    )
    denom = em.op("Add", em.op("Div", em.op("Sqrt", v_new), sc["bc2_sqrt"]), hp["eps"])
    p_new = em.op("Sub", p, em.op("Mul", em.op("Div", m_new, denom), sc["step_size"]))
    return p_new, {"exp_avg": m_new, "exp_avg_sq": v_new}
