"""LAMB (ortrain.optim.Lamb semantics, as used for BERT pretraining):

m = b1 m + (1 - b1) g ;  v = b2 v + (1 - b2) g^2
m_hat = m / (1 - b1^t), v_hat = v / (1 - b2^t)   (when bias_correction)
u = m_hat / (sqrt(v_hat) + eps) + wd * p
trust = ||p|| / ||u||  if both norms > 0, else 1
p = p - lr * trust * u
"""

from __future__ import annotations

import onnx_ir as ir

from ortrain.graph_passes.infra.emitter import Emitter


def group_scalars(em: Emitter, hp: dict[str, ir.Value], step: ir.Value) -> dict[str, ir.Value]:
    one = em.const(1.0, ir.DataType.FLOAT)
    return {
        "bc1": em.op("Sub", one, em.op("Pow", hp["beta1"], step)),
        "bc2": em.op("Sub", one, em.op("Pow", hp["beta2"], step)),
        "one_minus_b1": em.op("Sub", one, hp["beta1"]),
        "one_minus_b2": em.op("Sub", one, hp["beta2"]),
    }


def _norm(em: Emitter, x: ir.Value) -> ir.Value:
    return em.op("Sqrt", em.op("ReduceSumSquare", x, keepdims=0))


def update(
    em: Emitter,
    p: ir.Value,
    g: ir.Value,
    state: dict[str, ir.Value],
    hp: dict[str, ir.Value],
    sc: dict[str, ir.Value],
    *,
    bias_correction: bool,
) -> tuple[ir.Value, dict[str, ir.Value]]:
    m, v = state["exp_avg"], state["exp_avg_sq"]
    m_new = em.op("Add", em.op("Mul", m, hp["beta1"]), em.op("Mul", g, sc["one_minus_b1"]))
    v_new = em.op(
        "Add", em.op("Mul", v, hp["beta2"]), em.op("Mul", em.op("Mul", g, g), sc["one_minus_b2"])
    )
    m_hat, v_hat = m_new, v_new
    if bias_correction:
        m_hat, v_hat = em.op("Div", m_new, sc["bc1"]), em.op("Div", v_new, sc["bc2"])
    u = em.op(
        "Add",
        em.op("Div", m_hat, em.op("Add", em.op("Sqrt", v_hat), hp["eps"])),
        em.op("Mul", p, hp["weight_decay"]),
    )
    w_norm, u_norm = _norm(em, p), _norm(em, u)
    zero = em.const(0.0, ir.DataType.FLOAT)
    ok = em.op("And", em.op("Greater", w_norm, zero), em.op("Greater", u_norm, zero))
    trust = em.op("Where", ok, em.op("Div", w_norm, u_norm), em.const(1.0, ir.DataType.FLOAT))
    p_new = em.op("Sub", p, em.op("Mul", u, em.op("Mul", hp["lr"], trust)))
    return p_new, {"exp_avg": m_new, "exp_avg_sq": v_new}
