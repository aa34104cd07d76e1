"""Eager's random draws at the fixed values a graph's switched draws give, for a check.

A first step is checked against eager with dropout off on both sides (``verify.py``).
The graph's other draws are switched off too (``graph_passes/prepare/random_switch.py``):
each element then takes a fixed value from its flat index. Under ``FixedDraws`` eager's
draws give the same values, element for element, computed as the exporter's translation
of each op computes from the draw it makes, so the two sides compare:

    u[i]                        frac((i + 1) * (sqrt(5) - 1) / 2), float64
    rand, rand_like             u
    uniform_(a, b)              a + (b - a) * u
    randn, randn_like           2u - 1
    normal_(m, s)               m + s * (2u - 1)
    normal(mean, std)           (2u - 1) * std + mean
    bernoulli(p), bernoulli_    u < p
    randint(low, high)          low + floor(u * (high - low))
    exponential(rate)           -log(u) / rate       (log(u) -> -eps/2 where u >= 1 - eps/2)
    log_normal(m, s)            exp(m + s * (2u - 1))
    cauchy(m, s)                m + s * tan(pi * (u - 1/2))
    geometric(p)                floor(log1p(-u) / log1p(-p)) + 1

The last four are torch's own decompositions of the draws (``torch._refs``, which the
exporter translates) with ``u`` for their uniform or normal draw: Gumbel-softmax's noise
is ``exponential_``. A draw with no such value here (``randperm``, ``multinomial``, RReLU's
slopes, ...) runs as drawn and is named in ``unverified``: the check cannot compare that
step, and trusts the graph, saying so. The mode is entered only for a run that draws
(``verify.eager_run``): a dispatch mode is not free, and torch.cond's dense kernel cannot
run under one.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

GOLDEN = (math.sqrt(5.0) - 1.0) / 2.0

aten = torch.ops.aten


def fixed_u(shape: Sequence[int], device: torch.device | str = "cpu") -> torch.Tensor:
    """``u`` (float64) in ``shape``."""
    n = math.prod(shape)
    x = (torch.arange(n, dtype=torch.float64, device=device) + 1.0) * GOLDEN
    return (x - torch.floor(x)).reshape(tuple(shape))


def _dtype(kwargs: dict, default: torch.dtype | None = None) -> torch.dtype:
    return kwargs.get("dtype") or default or torch.get_default_dtype()


def _device(kwargs: dict, default: torch.device | str = "cpu") -> torch.device | str:
    return kwargs.get("device") or default


def _uniform(shape: Sequence[int], kw: dict, like: torch.Tensor | None = None) -> torch.Tensor:
    dtype = _dtype(kw, like.dtype if like is not None else None)
    device = _device(kw, like.device if like is not None else "cpu")
    return fixed_u(shape, device).to(dtype)


def _normal(shape: Sequence[int], kw: dict, like: torch.Tensor | None = None) -> torch.Tensor:
    dtype = _dtype(kw, like.dtype if like is not None else None)
    device = _device(kw, like.device if like is not None else "cpu")
    return (2.0 * fixed_u(shape, device) - 1.0).to(dtype)


def _fill(self: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return self.copy_(value)


def _between(t: torch.Tensor, low: float, high: float) -> torch.Tensor:
    return low + (high - low) * fixed_u(t.shape, t.device)


def _around(t: torch.Tensor, mean: float, std: float) -> torch.Tensor:
    return mean + std * (2.0 * fixed_u(t.shape, t.device) - 1.0)


def _mean_std(mean: Any, std: Any, size: Sequence[int] | None, kw: dict) -> torch.Tensor:
    """normal(mean, std): the exporter's ``randn * std + mean``, in the result's type."""
    tensors = [t for t in (mean, std) if isinstance(t, torch.Tensor)]
    if size is not None:
        shape, like = list(size), None
    else:
        shape, like = list(torch.broadcast_shapes(*(t.shape for t in tensors))), tensors[0]
    noise = _normal(shape, kw, like)
    return noise * std + mean


def _randint(low: int, high: int, size: Sequence[int], kw: dict) -> torch.Tensor:
    u = fixed_u(size, _device(kw)).to(torch.float32)
    return (torch.floor(u * float(high - low)) + low).to(kw.get("dtype") or torch.int64)


def _exponential(t: torch.Tensor, rate: float = 1.0) -> torch.Tensor:
    u = fixed_u(t.shape, t.device).to(t.dtype)
    eps = torch.finfo(t.dtype).eps / 2
    return -1 / rate * torch.where(u >= 1.0 - eps, -eps, torch.log(u))


def _log_normal(t: torch.Tensor, mean: float = 1.0, std: float = 2.0) -> torch.Tensor:
    return torch.exp(std * (2.0 * fixed_u(t.shape, t.device) - 1.0).to(t.dtype) + mean)


def _cauchy(t: torch.Tensor, median: float = 0.0, sigma: float = 1.0) -> torch.Tensor:
    u = fixed_u(t.shape, t.device).to(t.dtype)
    return median + sigma * torch.tan(math.pi * (u - 0.5))


def _geometric(t: torch.Tensor, p: float) -> torch.Tensor:
    u = fixed_u(t.shape, t.device).to(t.dtype)
    return (torch.floor(torch.log1p(-u) / math.log1p(-p)) + 1).to(t.dtype)


def _bernoulli_of(shape_of: torch.Tensor, p: Any) -> torch.Tensor:
    u = fixed_u(shape_of.shape, shape_of.device)
    u = u.to(p.dtype if isinstance(p, torch.Tensor) else shape_of.dtype)
    return (u < p).to(shape_of.dtype)


def _handlers() -> dict[Any, Callable[..., torch.Tensor]]:
    h: dict[Any, Callable[..., torch.Tensor]] = {}

    def on(packet: Any, overloads: Sequence[str], fn: Callable[..., torch.Tensor]) -> None:
        for name in overloads:
            op = getattr(packet, name, None)
            if op is not None:
                h[op] = fn

    on(aten.rand, ("default", "generator", "names", "generator_with_names"),
       lambda size, *a, **kw: _uniform(size, kw))  # fmt: skip
    on(aten.rand_like, ("default",), lambda t, *a, **kw: _uniform(t.shape, kw, t))
    on(aten.randn, ("default", "generator", "names", "generator_with_names"),
       lambda size, *a, **kw: _normal(size, kw))  # fmt: skip
    on(aten.randn_like, ("default",), lambda t, *a, **kw: _normal(t.shape, kw, t))
    on(aten.uniform_, ("default",), lambda t, a=0.0, b=1.0, **kw: _fill(t, _between(t, a, b)))
    on(aten.normal_, ("default",), lambda t, m=0.0, s=1.0, **kw: _fill(t, _around(t, m, s)))
    on(aten.normal, ("Tensor_float", "float_Tensor", "Tensor_Tensor"),
       lambda mean, std=1.0, **kw: _mean_std(mean, std, None, kw))  # fmt: skip
    on(aten.normal, ("float_float",),
       lambda mean, std, size, **kw: _mean_std(mean, std, size, kw))  # fmt: skip
    on(aten.bernoulli, ("default",), lambda p, **kw: _bernoulli_of(p, p))
    on(aten.bernoulli, ("p",), lambda t, p, **kw: _bernoulli_of(t, p))
    on(aten.bernoulli_, ("Tensor", "float"), lambda t, p=0.5, **kw: _fill(t, _bernoulli_of(t, p)))
    for packet, fn in [
        (aten.exponential, _exponential),
        (aten.log_normal, _log_normal),
        (aten.cauchy, _cauchy),
        (aten.geometric, _geometric),
    ]:
        on(packet, ("default",), lambda t, *a, fn=fn, **kw: fn(t, *a, **kw))
    for packet, fn in [
        (aten.exponential_, _exponential),
        (aten.log_normal_, _log_normal),
        (aten.cauchy_, _cauchy),
        (aten.geometric_, _geometric),
    ]:
        on(packet, ("default",), lambda t, *a, fn=fn, **kw: _fill(t, fn(t, *a, **kw)))
    on(aten.randint, ("default", "generator"),
       lambda high, size, *a, **kw: _randint(0, high, size, kw))  # fmt: skip
    on(aten.randint, ("low", "low_generator"),
       lambda low, high, size, *a, **kw: _randint(low, high, size, kw))  # fmt: skip
    return h


_HANDLERS: dict[Any, Callable[..., torch.Tensor]] | None = None

# the tag torch gives every op that may draw
_SEEDED = getattr(torch.Tag, "nondeterministic_seeded", None)


def _dropout_only(name: str) -> bool:
    """Seeded ops whose only draw is a dropout (attention, recurrent layers, the dropouts):
    ``verify.no_dropout`` sets their probability to 0 above this mode."""
    return any(k in name for k in ("dropout", "attention", "rnn")) or name in ("gru", "lstm")


class FixedDraws(TorchDispatchMode):
    """Eager's draws at the switched graph's fixed values; ``unverified``: the draws made
    that have none."""

    def __init__(self) -> None:
        super().__init__()
        self.unverified: set[str] = set()
        self.fixed = 0  # draws given their fixed value

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        global _HANDLERS
        kwargs = dict(kwargs or {})
        if _HANDLERS is None:
            _HANDLERS = _handlers()
        handler = _HANDLERS.get(func)
        if handler is not None:
            kwargs.pop("generator", None)
            self.fixed += 1
            return handler(*args, **kwargs)
        if _SEEDED is not None and _SEEDED in getattr(func, "tags", ()):
            name = func._schema.name.split("::")[-1]
            if not _dropout_only(name):
                self.unverified.add(name)
        return func(*args, **kwargs)
