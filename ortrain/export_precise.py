"""``log1p``, ``expm1``, ``logaddexp`` and ``logaddexp2`` translated as precisely as torch's.

The exporter writes ``log1p(x)`` as ``Log(1 + x)`` and ``expm1(x)`` as ``Exp(x) - 1``:
near zero, where these functions are used for their precision, the rounding of ``1 + x``
or the cancellation in ``Exp(x) - 1`` leaves few digits (``log1p(1e-7)`` came out
``1.19e-7``). It writes ``logaddexp(a, b)`` as ``Log(Exp(a) + Exp(b))``, which overflows
to ``inf`` once an input passes 88 (``logaddexp(0, 100)`` is 100 in torch). A first
batch without such values passes the first-step check, and later ones then train on
other numbers.

Here the value comes from a precise form and the gradient from the plain one (the two
differ by rounding only where both are finite, so the correction is a ``StopGradient``
constant to autodiff), which keeps torch's gradients, ``1 / (1 + x)`` and ``exp(x)``:

- ``log1p``: ``log(u) * x / (u - 1)`` with ``u = 1 + x`` (``x`` where ``u`` rounds to 1);
- ``expm1``: ``(u - 1) * x / log(u)`` with ``u = exp(x)`` (``x`` where ``u`` rounds to 1)
  for ``|x| < 1``, where ``exp(x) - 1`` cancels;
- ``logaddexp``: ``max(a, b) + log1p(exp(-|a - b|))`` (two equal infinities: themselves),
  base 2 for ``logaddexp2``; differentiated as written (the max splits a tie's gradient
  in half, as torch's ``logaddexp`` does).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch


def _const(op: Any, like: Any, value: float) -> Any:
    return op.CastLike(op.Constant(value_float=value), like)


def _with_value(op: Any, plain: Any, precise: Any, like: Any, shape: Any) -> Any:
    """``plain``'s gradient with ``precise``'s value where both are finite (``like``: a
    value of their type; ``shape``: theirs, which no shape inference gives the
    ``StopGradient`` inside a translation)."""
    from ortrain.stop_gradient import _translate as stop_gradient

    finite = op.And(_finite(op, plain), _finite(op, precise))
    correction = op.Where(finite, op.Sub(precise, plain), _const(op, plain, 0.0))
    held = stop_gradient(correction)
    held.dtype, held.shape = like.dtype, shape
    return op.Add(plain, held)


def _finite(op: Any, x: Any) -> Any:
    return op.Not(op.Or(op.IsInf(x), op.IsNaN(x)))


def _log1p(self: Any, shape: Any = None) -> Any:
    from onnxscript import opset18 as op

    one = _const(op, self, 1.0)
    u = op.Add(self, one)
    plain = op.Log(u)
    step = op.Sub(u, one)  # what 1 + x kept of x
    unit = op.Equal(step, _const(op, self, 0.0))
    precise = op.Where(unit, self, op.Div(op.Mul(plain, self), op.Where(unit, one, step)))
    return _with_value(op, plain, precise, self, shape if shape is not None else self.shape)


def _expm1(self: Any) -> Any:
    from onnxscript import opset18 as op

    one = _const(op, self, 1.0)
    u = op.Exp(self)
    plain = op.Sub(u, one)
    log_u = op.Log(u)
    unit = op.Equal(log_u, _const(op, self, 0.0))
    precise = op.Where(unit, self, op.Div(op.Mul(plain, self), op.Where(unit, one, log_u)))
    # the cancellation is near zero only; further out exp(x) - 1 is exact to rounding,
    # and log of a subnormal exp(x) would not be
    near = op.Less(op.Abs(self), one)
    return _with_value(op, plain, op.Where(near, precise, plain), self, self.shape)


def _broadcast(a: Any, b: Any) -> Any:
    """The static shape ``a`` and ``b`` broadcast to (else a translation cannot run)."""
    from onnxscript import ir

    dims_a, dims_b = list(a.shape or []), list(b.shape or [])
    if (
        a.shape is None
        or b.shape is None
        or not all(isinstance(d, int) for d in [*dims_a, *dims_b])
    ):
        raise NotImplementedError("logaddexp of operands without static shapes")
    n = max(len(dims_a), len(dims_b))
    dims_a, dims_b = [1] * (n - len(dims_a)) + dims_a, [1] * (n - len(dims_b)) + dims_b
    return ir.Shape([max(x, y) if 1 in (x, y) else x for x, y in zip(dims_a, dims_b)])


def _logaddexp_base(base2: bool) -> Callable:
    def translate(self: Any, other: Any) -> Any:
        from onnxscript import opset18 as op

        a, b = self, op.CastLike(other, self)
        shape = _broadcast(self, other)
        top = op.Max(a, b)
        gap = op.Neg(op.Abs(op.Sub(a, b)))
        if base2:  # log2(2^a + 2^b) = top + log1p(2^-gap) / ln 2
            ln2 = _const(op, a, math.log(2.0))
            tail = op.Div(_log1p(op.Exp(op.Mul(gap, ln2)), shape), ln2)
        else:
            tail = _log1p(op.Exp(gap), shape)
        out = op.Add(top, tail)
        # two equal infinities: a - b is NaN, torch gives them back
        same_inf = op.And(op.IsInf(a), op.Equal(a, b))
        return op.Where(same_inf, a, out)

    return translate


def precise_translations() -> dict[Callable, Callable]:
    return {
        torch.ops.aten.log1p.default: _log1p,
        torch.ops.aten.expm1.default: _expm1,
        torch.ops.aten.logaddexp.default: _logaddexp_base(False),
        torch.ops.aten.logaddexp2.default: _logaddexp_base(True),
    }
