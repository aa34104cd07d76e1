"""What a padded block of a value holds, and what each element-wise op makes of it
(``ortrain/padding/__init__.py``): a constant, a masked score (at or below ``MASK_LIMIT``:
its exp underflows to 0), or anything (data, or what padding made)."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    import onnx_ir as ir

MASK_LIMIT = -1e4  # at or below: a masked score (exp underflows to 0 in float32)
IGNORE_INDEX = -100


class _Neg:
    def __repr__(self) -> str:
        return "NEG"


class _Any:
    def __repr__(self) -> str:
        return "ANY"


NEG, ANY = _Neg(), _Any()


@dataclasses.dataclass(frozen=True)
class Const:
    value: float


Content = Const | _Neg | _Any
ZERO = Const(0.0)


def negative(c: Content) -> bool:
    return c is NEG or (isinstance(c, Const) and c.value <= MASK_LIMIT)


def join(cs: Sequence[Content]) -> Content:
    first = cs[0]
    return first if all(c == first for c in cs) else ANY


def _consts(cs: Sequence[Content]) -> list[float] | None:
    return [c.value for c in cs] if all(isinstance(c, Const) for c in cs) else None


def _num(fn: Callable[..., float], cs: Sequence[Content]) -> Content | None:
    vals = _consts(cs)
    if vals is None:
        return None
    with np.errstate(all="ignore"):
        return Const(float(fn(*vals)))


def _add(a: Content, b: Content) -> Content:
    c = _num(lambda x, y: x + y, (a, b))
    if c is not None:
        return c
    return NEG if negative(a) or negative(b) else ANY


def _sub(a: Content, b: Content) -> Content:
    c = _num(lambda x, y: x - y, (a, b))
    if c is not None:
        return c
    return NEG if negative(a) and not negative(b) else ANY


def _mul(a: Content, b: Content) -> Content:
    c = _num(lambda x, y: x * y, (a, b))
    if c is not None:
        return c
    for x, y in ((a, b), (b, a)):
        if x == ZERO and y is not NEG:
            return ZERO
        if negative(x) and isinstance(y, Const) and y.value > 0:
            return NEG
    return ANY


def _div(a: Content, b: Content) -> Content:
    c = _num(lambda x, y: x / y, (a, b))
    if c is not None:
        return c
    return NEG if negative(a) and isinstance(b, Const) and 0 < b.value <= 1e3 else ANY


def _where(c: Content, x: Content, y: Content) -> Content:
    if isinstance(c, Const):
        return x if c.value else y
    return x if x == y else ANY


def _and(*cs: Content) -> Content:
    if any(c == ZERO for c in cs):
        return ZERO
    return Const(1.0) if all(isinstance(c, Const) and c.value for c in cs) else ANY


def _or(*cs: Content) -> Content:
    if any(isinstance(c, Const) and c.value for c in cs):
        return Const(1.0)
    return ZERO if all(c == ZERO for c in cs) else ANY


def _compare(fn: Callable[[float, float], bool]) -> Callable[..., Content]:
    return lambda a, b: _num(lambda x, y: float(fn(x, y)), (a, b)) or ANY


def _numeric(fn: Callable[..., float]) -> Callable[..., Content]:
    return lambda *cs: _num(fn, cs) or ANY


ELEMENTWISE: dict[str, Callable[..., Content]] = {
    "Add": _add,
    "Sub": _sub,
    "Mul": _mul,
    "Div": _div,
    "Where": _where,
    "And": _and,
    "Or": _or,
    "Pow": _numeric(lambda x, y: x**y),
    "Max": _numeric(max),
    "Min": _numeric(min),
    "Equal": _compare(lambda x, y: x == y),
    "Less": _compare(lambda x, y: x < y),
    "LessOrEqual": _compare(lambda x, y: x <= y),
    "Greater": _compare(lambda x, y: x > y),
    "GreaterOrEqual": _compare(lambda x, y: x >= y),
    "BitwiseAnd": _and,
    "BitwiseOr": _or,
    "PRelu": _numeric(lambda x, a: x if x >= 0 else a * x),
}


def _unary(fn: Callable[[float], float] | None, neg: Content = ANY) -> Callable[..., Content]:
    def apply(c: Content) -> Content:
        if isinstance(c, Const) and fn is not None:
            return _num(fn, (c,)) or ANY
        return neg if negative(c) else ANY

    return apply


def same(c: Content) -> Content:
    return c


UNARY: dict[str, Callable[[Content], Content]] = {
    "Identity": same,
    "Neg": _unary(lambda x: -x),
    "Exp": _unary(math.exp, ZERO),
    "Relu": _unary(lambda x: max(x, 0.0), ZERO),
    "Sigmoid": _unary(lambda x: 1 / (1 + math.exp(-x)), ZERO),
    "Tanh": _unary(math.tanh),
    "Erf": _unary(math.erf),
    "Abs": _unary(abs),
    "Sqrt": _unary(math.sqrt),
    "Reciprocal": _unary(lambda x: 1 / x),
    "Log": _unary(math.log),
    "Not": _unary(lambda x: float(not x)),
    "Floor": _unary(math.floor),
    "Ceil": _unary(math.ceil),
    "Round": _unary(round),
    "Sin": _unary(math.sin),
    "Cos": _unary(math.cos),
    "Sign": _unary(lambda x: float(np.sign(x))),
    "Softplus": _unary(lambda x: math.log1p(math.exp(x)), ZERO),
    "Gelu": _unary(None, ZERO),
    "Elu": _unary(None),
    "Selu": _unary(None),
    "LeakyRelu": _unary(None),
    "HardSigmoid": _unary(None),
    "HardSwish": _unary(None),
    "Mish": _unary(None),
    "Softsign": _unary(None),
    "IsNaN": _unary(lambda x: float(math.isnan(x))),
    "IsInf": _unary(lambda x: float(math.isinf(x))),
    "Clip": _unary(None),
}


def uniform(array: np.ndarray | None) -> Content:
    if array is None or array.size == 0 or array.dtype.kind not in "biuf":
        return ANY
    flat = array.reshape(-1)
    first = float(flat[0])
    if bool((flat == flat[0]).all()):
        return Const(first)
    if array.dtype.kind == "f" and bool((flat <= MASK_LIMIT).all()):
        return NEG
    return ANY


def cast_content(node: ir.Node) -> Callable[[Content], Content]:
    to = node.attributes.get_int("to", 1)
    if to == 9:  # BOOL
        return lambda c: Const(float(bool(c.value))) if isinstance(c, Const) else ANY
    if to in (1, 10, 11, 16):  # floats keep a masked score masked
        return same
    return lambda c: Const(float(int(c.value))) if isinstance(c, Const) else ANY
