"""SGD with momentum, dampening, Nesterov and L2 weight decay, as torch.optim.SGD:

d = g + wd * p
buf = d                                   on the first step
buf = momentum * buf + (1 - dampening) * d  afterwards
d = d + momentum * buf (nesterov) | buf
p = p - lr * d
"""

from __future__ import annotations

import onnx_ir as ir

from ortrain.graph_passes.infra.emitter import Emitter


def group_scalars(em: Emitter, hp: dict[str, ir.Value], step: ir.Value) -> dict[str, ir.Value]:
    one = em.const(1.0, ir.DataType.FLOAT)
    return {
        "first": em.op("Equal", step, one),
        "one_minus_damp": em.op("Sub", one, hp["dampening"]),
    }


def update(
    em: Emitter,
    p: ir.Value,
    g: ir.Value,
    state: dict[str, ir.Value],
    hp: dict[str, ir.Value],
    sc: dict[str, ir.Value],
    *,
    momentum: bool,
    nesterov: bool,
) -> tuple[ir.Value, dict[str, ir.Value]]:
    d = em.op("Add", g, em.op("Mul", p, hp["weight_decay"]))
    new_state: dict[str, ir.Value] = {}
    if momentum:
        buf = state["momentum_buffer"]
        later = em.op(
            "Add", em.op("Mul", buf, hp["momentum"]), em.op("Mul", d, sc["one_minus_damp"])
        )
        buf_new = em.op("Where", sc["first"], d, later)
        new_state["momentum_buffer"] = buf_new
        d = em.op("Add", d, em.op("Mul", buf_new, hp["momentum"])) if nesterov else buf_new
    p_new = em.op("Sub", p, em.op("Mul", d, hp["lr"]))
    return p_new, new_state
