"""A Sigmoid whose result a ``Log`` reads (directly, or as ``1 - p``) written out exactly.

ONNX Runtime's CPU Sigmoid is accurate to about 2e-7 absolute but not relative: in the
negative tail it is off by 1% at x = -12, by a factor of 2 at -16, and 0 from -18 on,
where torch gives 1.5e-8 (and 2e-9 at -20). Added to 1 that is nothing, but a log reads
it relatively: ``F.binary_cross_entropy(torch.sigmoid(x), y)`` clamped ``log(0)`` at -100
where eager's log was about x, and a loss of 45.1 where eager's was 37.8. Here those
Sigmoids become ``e = exp(-|x|)``, ``1 / (1 + e)`` for x >= 0 and ``e / (1 + e)`` below,
the same function exact in both tails. Its gradient is torch's, ``p (1 - p)`` of that
value (0 where p rounds to 1, as eager's; the exact form's own derivative is not): the
value goes through a stop-gradient and ``(x - sg(x)) sg(p (1 - p))``, exactly zero, is
added for autodiff to read. A Sigmoid read only by a Log is left to ``log_sigmoid.py``
(-Softplus(-x)); others keep ONNX Runtime's kernel (their absolute error is what a sum or
a gate sees). A numerical fix: it runs in every build.
"""

from __future__ import annotations

import onnx_ir as ir

from ortrain.core.names import GRAD_DOMAIN, STOP_GRADIENT
from ortrain.graph_passes.infra.emitter import Emitter

_STD = ("", "ai.onnx")
_FLOATS = (ir.DataType.FLOAT, ir.DataType.DOUBLE, ir.DataType.FLOAT16, ir.DataType.BFLOAT16)


def _is(node: ir.Node, op: str) -> bool:
    return node.op_type == op and node.domain in _STD


def _read_by_a_log(value: ir.Value) -> bool:
    """``value`` is read by a Log, or by ``Sub(c, value)`` that a Log reads (``log(1 - p)``)."""
    for user, index in value.uses():
        if _is(user, "Log"):
            return True
        if _is(user, "Sub") and index == 1:
            if any(_is(u, "Log") for u, _ in user.outputs[0].uses()):
                return True
    return False


def exact_sigmoid_under_log(model: ir.Model) -> int:
    """Returns the number of Sigmoids rewritten."""
    graph = model.graph
    todo = [
        n
        for n in graph
        if _is(n, "Sigmoid")
        and n.outputs[0].dtype in _FLOATS
        and _read_by_a_log(n.outputs[0])
        and not (len(n.outputs[0].uses()) == 1 and not n.outputs[0].is_graph_output())
    ]
    for node in todo:
        x, old = node.inputs[0], node.outputs[0]
        assert x is not None and old.dtype is not None
        dtype, shape = old.dtype, list(old.shape.dims) if old.shape is not None else None
        e = Emitter(graph, node.name or "sigmoid", metadata=dict(node.metadata_props))
        tail = e.op("Exp", e.op("Neg", e.op("Abs", x, shape=shape)), shape=shape)
        top = e.op("Div", e.const(1.0, dtype), e.op("Add", e.const(1.0, dtype), tail), shape=shape)
        below = e.op("Mul", tail, top, shape=shape)
        at_or_above = e.op("GreaterOrEqual", x, e.const(0.0, dtype), dtype=ir.DataType.BOOL)
        value = e.op(STOP_GRADIENT, e.op("Where", at_or_above, top, below, shape=shape),
                     domain=GRAD_DOMAIN, dtype=dtype, shape=shape)  # fmt: skip
        slope = e.op("Mul", value, e.op("Sub", e.const(1.0, dtype), value, shape=shape))
        still = e.op(STOP_GRADIENT, x, domain=GRAD_DOMAIN, dtype=dtype, shape=shape)
        zero = e.op("Sub", x, still, shape=shape)  # 0, with x's gradient
        slope = e.op(STOP_GRADIENT, slope, domain=GRAD_DOMAIN, dtype=dtype, shape=shape)
        exact = e.op("Add", value, e.op("Mul", zero, slope, shape=shape), shape=shape)
        e.flush_before(node)
        name, typ = old.name, old.type
        old.name = f"{name}__approximate"
        old.replace_all_uses_with(exact, replace_graph_outputs=True)
        exact.name, exact.type = name, typ
        graph.remove(node, safe=True)
    return len(todo)
