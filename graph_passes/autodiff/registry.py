"""The gradient rule table.

Three kinds of registration, kept apart on purpose (ORT's gradient_builder_registry,
JAX's ad.py):

1. ``gradient(op)``: a rule that emits input gradients ``GI(i)`` from forward values
   ``I(i)``/``O(i)`` and output gradients ``GO(i)``. ``nondiff_inputs`` names the
   index/shape/mask inputs that never carry a gradient (no gradient flows there).
2. ``no_gradient(op)``: outputs are piecewise constant in the inputs (comparisons,
   Shape, integer ops): nothing flows back through the op at all.
3. ``not_differentiable(op)``: the op must not lie on a path from a trainable
   input to the loss; the builder raises if it does.

A missing registration is an error naming the op, never a silent zero gradient.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable


@dataclasses.dataclass(frozen=True)
class Registration:
    op_type: str
    domain: str
    kind: str  # "rule" | "no_gradient" | "not_differentiable"
    fn: Callable | None = None
    nondiff_inputs: frozenset[int] = frozenset()
    min_opset: int = 1
    max_opset: int | None = None
    reason: str = ""
    forward_outputs: int = 0  # the rule reads O(i) for i < forward_outputs: expose them

    def covers(self, opset: int) -> bool:
        return self.min_opset <= opset and (self.max_opset is None or opset <= self.max_opset)

    def input_differentiable(self, i: int) -> bool:
        return self.kind == "rule" and i not in self.nondiff_inputs


_TABLE: dict[tuple[str, str], list[Registration]] = {}


def _add(reg: Registration) -> None:
    entries = _TABLE.setdefault((reg.domain, reg.op_type), [])
    for other in entries:
        overlap_hi = min(x for x in (reg.max_opset, other.max_opset, 10**6) if x is not None)
        if max(reg.min_opset, other.min_opset) <= overlap_hi:
            raise ValueError(f"overlapping gradient registrations for {reg.domain}::{reg.op_type}")
    entries.append(reg)


def gradient(
    op_type: str,
    *,
    domain: str = "",
    nondiff_inputs: tuple[int, ...] = (),
    opsets: tuple[int, int | None] = (1, None),
    forward_outputs: int = 0,
) -> Callable:
    """Register ``fn(ctx) -> {input_index: gradient}`` as the rule of ``op_type``.

    ``forward_outputs``: optional forward outputs the rule reads (Dropout's mask,
    LayerNormalization's mean/inv-std-dev); the builder makes the node produce them.
    """

    def deco(fn: Callable) -> Callable:
        _add(
            Registration(
                op_type,
                domain,
                "rule",
                fn,
                frozenset(nondiff_inputs),
                opsets[0],
                opsets[1],
                forward_outputs=forward_outputs,
            )
        )
        return fn

    return deco


def no_gradient(*op_types: str, domain: str = "") -> None:
    for op in op_types:
        _add(Registration(op, domain, "no_gradient"))


def not_differentiable(op_type: str, reason: str, *, domain: str = "") -> None:
    _add(Registration(op_type, domain, "not_differentiable", reason=reason))


def lookup(op_type: str, domain: str, opset: int) -> Registration | None:
    domain = "" if domain == "ai.onnx" else domain
    for reg in _TABLE.get((domain, op_type), []):
        if reg.covers(opset):
            return reg
    return None


def registered_ops() -> list[tuple[str, str]]:
    return sorted(_TABLE)
