"""``cumprod``, ``cummax`` and ``cummin`` for the export, which has no ONNX function for
them (torch's decompositions end in ``prims.prod`` or have none): a model calling one
ran in eager.

Each is a scan in ``ceil(log2 n)`` steps over an axis of length ``n`` (Hillis and
Steele): at step ``s`` every position combines with the one ``s`` before it (the first
``s`` with the operation's identity), so after the steps position ``j`` holds the
combination of positions ``0..j``.

- ``cumprod``: products of the shifted copies. The gradient is autodiff's over those
  products (the product rule, no division), exact where an element is 0 as torch's is.
- ``cummax`` / ``cummin``: the scan carries (value, index) pairs and keeps the later
  pair where its value is at least (at most) the earlier one's, as torch's kernel
  updates on ties, or is NaN, and never after a NaN for a number (NaN propagates, its
  index the last NaN's). The values are then gathered from the input at the indices, so
  the gradient goes to the element each position took, as torch's scatter does.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

aten = torch.ops.aten


def _steps(n: int) -> list[int]:
    steps, s = [], 1
    while s < n:
        steps.append(s)
        s *= 2
    return steps


def _shifted(t: torch.Tensor, dim: int, s: int, fill: torch.Tensor) -> torch.Tensor:
    """``t`` moved ``s`` along ``dim``, ``fill`` (broadcast) in the first ``s`` places."""
    n = t.shape[dim]
    head = fill.expand(*t.shape[:dim], s, *t.shape[dim + 1 :])
    return torch.cat([head, t.narrow(dim, 0, n - s)], dim)


def _cumprod(x: torch.Tensor, dim: int, dtype: torch.dtype | None = None) -> torch.Tensor:
    if dtype is not None:
        x = x.to(dtype)
    if x.dim() == 0:
        return x.clone()
    dim %= x.dim()
    one = torch.ones((), dtype=x.dtype, device=x.device)
    y = x
    for s in _steps(x.shape[dim]):
        y = y * _shifted(y, dim, s, one)
    return y


def _cum_extreme(x: torch.Tensor, dim: int, larger: bool) -> tuple[torch.Tensor, torch.Tensor]:
    if x.dim() == 0:
        return x.clone(), torch.zeros((), dtype=torch.long, device=x.device)
    dim %= x.dim()
    n = x.shape[dim]
    at = [1] * x.dim()
    at[dim] = n
    index = torch.arange(n, device=x.device).reshape(at).expand(x.shape)
    floating = x.is_floating_point()
    if floating:
        far = float("-inf") if larger else float("inf")
    elif x.dtype == torch.bool:
        far = not larger
    else:
        info = torch.iinfo(x.dtype)
        far = info.min if larger else info.max
    identity = torch.full((), far, dtype=x.dtype, device=x.device)
    zero = torch.zeros((), dtype=torch.long, device=x.device)
    v, i = x.detach(), index
    for s in _steps(n):
        pv, pi = _shifted(v, dim, s, identity), _shifted(i, dim, s, zero)
        if x.dtype == torch.bool:
            beats = v | ~pv if larger else ~v | pv
        else:
            beats = v >= pv if larger else v <= pv
        if floating:
            beats = torch.isnan(v) | (~torch.isnan(pv) & beats)
        v, i = torch.where(beats, v, pv), torch.where(beats, i, pi)
    return torch.gather(x, dim, i), i


def _cummax(x: torch.Tensor, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    return _cum_extreme(x, dim, larger=True)


def _cummin(x: torch.Tensor, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    return _cum_extreme(x, dim, larger=False)


def scan_decompositions() -> dict[torch._ops.OpOverload, Callable]:
    return {
        aten.cumprod.default: _cumprod,
        aten.cummax.default: _cummax,
        aten.cummin.default: _cummin,
    }
