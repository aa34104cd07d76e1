"""Small helpers shared by the fusion rules (static shapes, constant scalars)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import onnx_ir as ir
from onnxscript.rewriter import pattern

from ortrain.graph_passes.infra.constant_value import constant_tensor
from ortrain.graph_passes.infra.rule_index import by_root

MS_DOMAIN = "com.microsoft"
STANDARD = ("", "ai.onnx")


def dims(v: ir.Value | None) -> tuple[int, ...] | None:
    """The static shape of ``v``, or None if any dimension is unknown or symbolic."""
    if v is None or v.shape is None or not all(isinstance(d, int) for d in v.shape.dims):
        return None
    return tuple(int(d) for d in v.shape.dims)


def scalar(v: ir.Value | None) -> float | None:
    """The value of a one-element constant (initializer or Constant node), else None."""
    t = constant_tensor(v)
    if t is None:
        return None
    arr = np.asarray(t.numpy())
    return float(arr.reshape(-1)[0]) if arr.size == 1 else None


def ints(v: ir.Value | None) -> list[int] | None:
    """The value of a constant integer tensor, else None."""
    if v is None or v.const_value is None:
        return None
    return [int(x) for x in np.asarray(v.const_value.numpy()).reshape(-1)]


def typed(v: ir.Value, like: ir.Value | None, shape: Sequence[int] | None = None) -> ir.Value:
    """Give a value built in a rewrite the dtype of ``like`` and a static shape."""
    if like is not None and like.dtype is not None:
        v.dtype = like.dtype
    if shape is not None:
        v.shape = ir.Shape(list(shape))
    return v


def apply(rules: pattern.RewriteRuleSet, model: ir.Model, max_rounds: int = 8) -> int:
    """Apply ``rules`` until nothing matches (a rewrite can enable another: a Transpose
    folded into a MatMul, then its scale); returns the number of rewrites."""
    total = 0
    rules = by_root(rules)
    for _ in range(max_rounds):
        count = rules.apply_to_model(model)
        total += count
        if not count:
            break
    return total
