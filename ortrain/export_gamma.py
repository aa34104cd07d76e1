"""``lgamma``, ``digamma`` and ``polygamma(1, x)`` for the export, which has no ONNX function
for them (``prims.lgamma``): the log-probabilities of ``torch.distributions``' Gamma,
Beta, Dirichlet, Poisson, negative binomial and Student's t, a count model's loss, a
``mvlgamma``, all ran in eager.

Each is computed in float64 and cast back: the argument (``1 - x`` below 0.5, by the
reflection formulas) is shifted by 8 with the recurrences, ``f(y) = f(y + 8) - sum over
k < 8 of the step`` (log, reciprocal, squared reciprocal), and the asymptotic series is
taken at ``y + 8 >= 8.5``, where its terms up to ``z^-11`` leave an error near float64's
rounding; cast to the input's dtype the value is torch's to within its rounding. The
gradient is autodiff's over the same formula: the series differentiated term by term is
the next function's series (``lgamma' = digamma``, ``digamma' = trigamma``), as accurate.
Infinite arguments give torch's values (``lgamma(+-inf) = inf``, ``digamma(inf) = inf``,
``digamma(-inf)`` NaN) with the formula evaluated at 1 beside them, and the reflection's
sine is taken at ``pi / 4`` for the elements it does not serve, so no NaN reaches a
gradient from the branch not taken. At the poles (zero, the negative integers) the values
are the reflection's quotient by ``sin(pi x)``: infinite where that sine is 0, not always
with torch's sign or NaN.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

SHIFT = 8


class _Double:
    """float64 constants and the steps the three functions share."""

    def __init__(self, x: Any):
        from onnxscript import ir
        from onnxscript import opset18 as op

        self.op = op
        self.x = op.Cast(x, to=ir.DataType.DOUBLE)
        inf = op.IsInf(self.x)
        self.inf = inf
        safe = op.Where(inf, self.c(1.0), self.x)
        self.reflected = op.Less(safe, self.c(0.5))
        self.safe = safe
        self.y = op.Where(self.reflected, op.Sub(self.c(1.0), safe), safe)  # >= 0.5
        self.z = op.Add(self.y, self.c(float(SHIFT)))

    def c(self, value: float) -> Any:
        import numpy as np
        from onnxscript import ir

        return self.op.Constant(value=ir.tensor(np.array(value, dtype=np.float64)))

    def steps(self, each: Callable[[Any], Any]) -> Any:
        """sum over k < SHIFT of ``each(y + k)``."""
        op = self.op
        total = each(self.y)
        for k in range(1, SHIFT):
            total = op.Add(total, each(op.Add(self.y, self.c(float(k)))))
        return total

    def series(self, coefficients: list[float], first: int) -> Any:
        """sum of ``c_i z^-(first + 2 i)`` (products and quotients: each has a rule)."""
        op = self.op
        inv = op.Div(self.c(1.0), self.z)
        inv2 = op.Mul(inv, inv)
        term = inv
        for _ in range(first - 1):
            term = op.Mul(term, inv)
        total = None
        for c in coefficients:
            piece = op.Mul(term, self.c(c))
            total = piece if total is None else op.Add(total, piece)
            term = op.Mul(term, inv2)
        return total

    def pi_x(self) -> Any:
        """``pi x`` for the reflected elements, ``pi / 4`` for the others: ONNX Runtime's
        sine is exactly 0 at integers, and the branch not taken must not make a 0 / 0 in
        its gradient there."""
        op = self.op
        x = op.Where(self.reflected, self.safe, self.c(0.25))
        return op.Mul(x, self.c(math.pi))

    def back(self, value: Any, like: Any, at_inf: float, at_minus_inf: float) -> Any:
        op = self.op
        ends = op.Where(op.Greater(self.x, self.c(0.0)), self.c(at_inf), self.c(at_minus_inf))
        return op.CastLike(op.Where(self.inf, ends, value), like)


def _lgamma(self: Any) -> Any:
    d = _Double(self)
    op = d.op
    z = d.z
    stirling = op.Add(
        op.Sub(op.Mul(op.Sub(z, d.c(0.5)), op.Log(z)), z),
        d.c(0.5 * math.log(2 * math.pi)),
    )
    # 1/(12 z) - 1/(360 z^3) + 1/(1260 z^5) - 1/(1680 z^7) + 1/(1188 z^9) - 691/(360360 z^11)
    tail = d.series([1 / 12, -1 / 360, 1 / 1260, -1 / 1680, 1 / 1188, -691 / 360360], 1)
    shifted = op.Sub(op.Add(stirling, tail), d.steps(op.Log))
    # lgamma(x) = log(pi / |sin(pi x)|) - lgamma(1 - x)
    reflected = op.Sub(op.Sub(d.c(math.log(math.pi)), op.Log(op.Abs(op.Sin(d.pi_x())))), shifted)
    return d.back(op.Where(d.reflected, reflected, shifted), self, math.inf, math.inf)


def _digamma(self: Any) -> Any:
    d = _Double(self)
    op = d.op
    z = d.z
    # log z - 1/(2z) - 1/(12 z^2) + 1/(120 z^4) - 1/(252 z^6) + 1/(240 z^8) - 1/(132 z^10)
    tail = d.series([-1 / 12, 1 / 120, -1 / 252, 1 / 240, -1 / 132], 2)
    asym = op.Add(op.Sub(op.Log(z), op.Div(d.c(0.5), z)), tail)
    shifted = op.Sub(asym, d.steps(lambda v: op.Div(d.c(1.0), v)))
    # digamma(x) = digamma(1 - x) - pi cos(pi x) / sin(pi x)
    t = d.pi_x()
    reflected = op.Sub(shifted, op.Div(op.Mul(d.c(math.pi), op.Cos(t)), op.Sin(t)))
    value = op.Where(d.reflected, reflected, shifted)
    return d.back(value, self, math.inf, math.nan)


def _trigamma(d: _Double) -> Any:
    op = d.op
    # 1/z + 1/(2 z^2) + 1/(6 z^3) - 1/(30 z^5) + 1/(42 z^7) - 1/(30 z^9) + 5/(66 z^11)
    odd = d.series([1 / 6, -1 / 30, 1 / 42, -1 / 30, 5 / 66], 3)
    asym = op.Add(op.Add(op.Div(d.c(1.0), d.z), op.Div(d.c(0.5), op.Mul(d.z, d.z))), odd)
    shifted = op.Add(asym, d.steps(lambda v: op.Div(d.c(1.0), op.Mul(v, v))))
    # trigamma(x) = pi^2 / sin^2(pi x) - trigamma(1 - x)
    sin = op.Sin(d.pi_x())
    reflected = op.Sub(op.Div(d.c(math.pi**2), op.Mul(sin, sin)), shifted)
    return op.Where(d.reflected, reflected, shifted)


def _polygamma(n: int, self: Any) -> Any:
    if n == 0:
        return _digamma(self)
    if n != 1:
        raise NotImplementedError(f"polygamma of order {n} is not translated (0 and 1 are)")
    d = _Double(self)
    return d.back(_trigamma(d), self, 0.0, math.nan)


def gamma_translations() -> dict[Callable, Callable]:
    return {
        torch.ops.aten.lgamma.default: _lgamma,
        torch.ops.aten.digamma.default: _digamma,
        torch.ops.aten.polygamma.default: _polygamma,
    }
