"""``hypot``, ``copysign``, ``signbit`` and ``erfinv`` for the export, whose
decompositions end in prims (``prims.hypot``, ``prims.signbit``, ``prims.erf_inv``) that
have no ONNX function: a model calling one ran in eager.

- ``hypot(a, b)``: ``sqrt(a^2 + b^2)`` in float64, cast back (no overflow where float32's
  squares would); its gradient ``a / hypot``, as torch's (NaN at the origin, as torch's).
- ``signbit(x)``: ``x < 0``, or ``x == 0`` with ``1 / x < 0`` (-0.0); a NaN's sign bit is
  not read (False). The exporter has a function for ``signbit`` itself, ``x < 0``, which
  is False at -0.0 where torch's is True: replaced (``pointwise_translations``).
- ``copysign(a, b)``: ``|a|`` or ``-|a|`` by ``b``'s sign bit, in the promoted floating
  dtype; the gradient of ``a`` is the sign ratio (0 where ``a`` is 0, as torch's), ``b``
  gets none.
- ``erfinv(x)``: Giles' approximation (2010; a polynomial in ``w = -log(1 - x^2)``, two
  branches), evaluated in float64, then one Newton step against the graph's float32
  ``erf``, which leaves float32's rounding; outside ``(-1, 1)`` torch's values (+-inf
  at +-1, NaN beyond). The gradient is torch's formula, ``sqrt(pi) / 2 * exp(y^2)``,
  spelled with the export's stop-gradient (``ortrain/stop_gradient.py``) so autodiff
  does not differentiate the approximation. float64 inputs are refused (ONNX Runtime's
  Erf is float32 only): they run in eager.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

aten = torch.ops.aten

# Giles (2010), "Approximating the erfinv function": erfinv(x) = x * p(w), by branch
_CENTRAL = [
    2.81022636e-08,
    3.43273939e-07,
    -3.5233877e-06,
    -4.39150654e-06,
    0.00021858087,
    -0.00125372503,
    -0.00417768164,
    0.246640727,
    1.50140941,
]
_TAIL = [
    -0.000200214257,
    0.000100950558,
    0.00134934322,
    -0.00367342844,
    0.00573950773,
    -0.0076224613,
    0.00943887047,
    1.00167406,
    2.83297682,
]


def _floating(*tensors: torch.Tensor) -> torch.dtype:
    dtype = torch.result_type(*tensors)
    return dtype if dtype.is_floating_point else torch.get_default_dtype()


def _hypot(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    dtype = _floating(a, b)
    a64, b64 = a.to(torch.float64), b.to(torch.float64)
    return torch.sqrt(a64 * a64 + b64 * b64).to(dtype)


def _signbit(x: torch.Tensor) -> torch.Tensor:
    if not x.is_floating_point():
        return x < 0
    return (x < 0) | ((x == 0) & (torch.reciprocal(x) < 0))


def _copysign(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    dtype = _floating(a, b)
    size = a.to(dtype).abs()
    return torch.where(_signbit(b), -size, size)


def _copysign_scalar(a: torch.Tensor, b: float) -> torch.Tensor:
    dtype = a.dtype if a.is_floating_point() else torch.get_default_dtype()
    size = a.to(dtype).abs()
    return -size if math.copysign(1.0, float(b)) < 0 else size


def _horner(w: torch.Tensor, coefficients: list[float]) -> torch.Tensor:
    p = torch.full_like(w, coefficients[0])
    for c in coefficients[1:]:
        p = p * w + c
    return p


def _erfinv(x: torch.Tensor) -> torch.Tensor:
    from ortrain.stop_gradient import stop_gradient

    if x.dtype == torch.float64:
        raise NotImplementedError("erfinv of float64 (ONNX Runtime's Erf takes float32)")
    xf = x.float()
    inside = xf.abs() < 1
    safe = torch.where(inside, xf, torch.zeros_like(xf))
    x64 = safe.double()
    w = -torch.log((1 - x64) * (1 + x64))
    central = w < 5
    # each branch at a point of its own range where the other one is taken
    p = torch.where(
        central,
        _horner(torch.where(central, w, torch.full_like(w, 2.5)) - 2.5, _CENTRAL),
        _horner(torch.sqrt(torch.where(central, torch.full_like(w, 9.0), w)) - 3.0, _TAIL),
    )
    y = (p * x64).float()
    slope = math.sqrt(math.pi) / 2 * torch.exp(y * y)  # 1 / erf'(y)
    y = y - (torch.erf(y) - safe) * slope  # Newton, against float32's erf
    y = stop_gradient(y)
    # torch's gradient: sqrt(pi) / 2 * exp(erfinv(x)^2)
    slope = stop_gradient(math.sqrt(math.pi) / 2 * torch.exp(y * y))
    y = y + (xf - stop_gradient(xf)) * slope
    # constants: no gradient path (0 * inf would be NaN in the branch not taken)
    ends = torch.where(xf > 0, torch.full_like(xf, math.inf), torch.full_like(xf, -math.inf))
    edge = torch.where(xf.abs() == 1, ends, torch.full_like(xf, math.nan))
    return torch.where(inside, y, edge).to(x.dtype)


def _signbit_onnx(x: Any) -> Any:
    """``signbit`` as an ONNX translation: the exporter's own function reads ``x < 0``,
    False for -0.0 (torch: True)."""
    from onnxscript import ir
    from onnxscript import opset18 as op

    zero = op.CastLike(op.Constant(value_float=0.0), x)
    negative = op.Less(x, zero)
    if x.dtype not in (ir.DataType.FLOAT, ir.DataType.DOUBLE, ir.DataType.FLOAT16):
        return negative
    minus_zero = op.And(op.Equal(x, zero), op.Less(op.Reciprocal(x), zero))
    return op.Or(negative, minus_zero)


def pointwise_translations() -> dict[Callable, Callable]:
    return {aten.signbit.default: _signbit_onnx}


def pointwise_decompositions() -> dict[torch._ops.OpOverload, Callable]:
    return {
        aten.hypot.default: _hypot,
        aten.copysign.Tensor: _copysign,
        aten.copysign.Scalar: _copysign_scalar,
        aten.erfinv.default: _erfinv,
    }
