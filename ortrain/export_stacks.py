"""``hstack``, ``vstack``, ``dstack`` and ``column_stack`` for the export.

torch decomposes them into ``atleast_1d/2d/3d`` over the list and a ``cat``; the
exporter's function for the list form builds an ONNX sequence (``SequenceMap`` of a
reshape, then ``SequenceAt``), which has no gradient rule here: a module stacking
tensors ran in eager. With the shapes known at the export each tensor is reshaped on
its own (torch's rules: a scalar to ``[1]``, ``[1, 1]`` or ``[1, 1, 1]``; a vector to
``[1, n]`` for vstack, ``[1, n, 1]`` for dstack, ``[n, 1]`` for column_stack; a matrix
to ``[m, n, 1]`` for dstack), then one ``cat``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

aten = torch.ops.aten


def _at_least_2d(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(1, -1) if t.dim() < 2 else t


def _at_least_3d(t: torch.Tensor) -> torch.Tensor:
    if t.dim() == 0:
        return t.reshape(1, 1, 1)
    if t.dim() == 1:
        return t.reshape(1, -1, 1)
    return t.unsqueeze(-1) if t.dim() == 2 else t


def _hstack(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    ts = [t.reshape(1) if t.dim() == 0 else t for t in tensors]
    return torch.cat(ts, 0 if ts[0].dim() == 1 else 1)


def _vstack(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    return torch.cat([_at_least_2d(t) for t in tensors], 0)


def _dstack(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    return torch.cat([_at_least_3d(t) for t in tensors], 2)


def _column_stack(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    return torch.cat([t.reshape(-1, 1) if t.dim() < 2 else t for t in tensors], 1)


def stack_decompositions() -> dict[Any, Callable]:
    return {
        aten.hstack.default: _hstack,
        aten.vstack.default: _vstack,
        aten.dstack.default: _dstack,
        aten.column_stack.default: _column_stack,
    }
