"""Adam and AdamW, in torch's order of operations (single-tensor implementation).

AdamW: p = p * (1 - lr * wd)          Adam: g = g + wd * p
m = m + (1 - b1) * (g - m)            (torch: exp_avg.lerp_(g, 1 - b1))
v = b2 * v + (1 - b2) * g * g
p = p - lr / (1 - b1^t) * m / (sqrt(v) / sqrt(1 - b2^t) + eps)
"""

from __future__ import annotations

import onnx_ir as ir

from ortrain.graph_passes.infra.emitter import Emitter


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


def fold_grad_scale(
    em: Emitter, sc: dict[str, ir.Value], hp: dict[str, ir.Value], scale: ir.Value
) -> dict[str, ir.Value]:
    """AdamW on ``scale * g`` without scaling g: the scale moves into the coefficients,
    and sqrt(1 - b2^t) into eps and the step size (two fewer passes over the state):

        m = b1 m + ((1 - b1) s) g ;  v = b2 v + ((1 - b2) s^2) g^2
        p = p - (lr / (1 - b1^t) * c) * m / (sqrt(v) + eps * c),  c = sqrt(1 - b2^t)
    """
    return {
        "c1": em.op("Mul", sc["one_minus_b1"], scale),
        "c2": em.op("Mul", sc["one_minus_b2"], em.op("Mul", scale, scale)),
        "eps_hat": em.op("Mul", hp["eps"], sc["bc2_sqrt"]),
        "step_hat": em.op("Mul", sc["step_size"], sc["bc2_sqrt"]),
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
    if "c1" in sc:  # folded form (see fold_grad_scale)
        m_new = em.op("Add", em.op("Mul", m, hp["beta1"]), em.op("Mul", g, sc["c1"]))
        v_new = em.op(
            "Add", em.op("Mul", v, hp["beta2"]), em.op("Mul", em.op("Mul", g, g), sc["c2"])
        )
        denom = em.op("Add", em.op("Sqrt", v_new), sc["eps_hat"])
        p_new = em.op("Sub", p, em.op("Mul", em.op("Div", m_new, denom), sc["step_hat"]))
        return p_new, {"exp_avg": m_new, "exp_avg_sq": v_new}
    m_new = em.op("Add", m, em.op("Mul", em.op("Sub", g, m), sc["one_minus_b1"]))
    v_new = em.op(
        "Add",
        em.op("Mul", v, hp["beta2"]),
        em.op("Mul", em.op("Mul", g, g), sc["one_minus_b2"]),
    )
    denom = em.op("Add", em.op("Div", em.op("Sqrt", v_new), sc["bc2_sqrt"]), hp["eps"])
    p_new = em.op("Sub", p, em.op("Mul", em.op("Div", m_new, denom), sc["step_size"]))
    return p_new, {"exp_avg": m_new, "exp_avg_sq": v_new}
