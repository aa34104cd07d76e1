"""Ops that compare or order values, for the export where it has no function or stops.

1. ``amax`` / ``amin`` over every axis (``x.amax()``, ``torch.aminmax(x)``): the
   exporter's function requires ``dim``, so the whole-tensor form stopped the export.
   Here ``ReduceMax`` / ``ReduceMin`` over every axis where none is listed (the
   exporter's function where some are); the gradient rule spreads ties as torch does.
2. ``fmax`` / ``fmin``: their decomposition ends in ``prims.fmax``, which has no
   function. Here ``where(a >= b or isnan(b), a, b)`` (``<=`` for fmin), the selection
   torch's own backward masks by, so each operand gets its gradient where it is chosen.
3. ``sort(stable=True)`` (and ``argsort(stable=True)``): no function for that overload.
   ONNX Runtime's ``TopK`` over the whole axis keeps equal values in index order in both
   directions (what the ONNX spec asks of it), which is torch's stable order; the
   exporter's function for the plain ``sort`` is the same TopK.
4. ``searchsorted`` (decomposed, ``searchsorted_decompositions``): no function. Here the
   count of boundaries below each value (at or below with ``right`` / ``side="right"``),
   along the last axis of a 1-D or batched ``sorted_sequence``, after a ``sorter``'s
   gather where one is given: the same index as torch's binary search, as a comparison
   of every value with every boundary.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

aten = torch.ops.aten


def _axes(self: Any, dim: Any) -> list[int]:
    rank = len(self.shape)
    if isinstance(dim, int):
        return [dim]
    return list(dim) if dim else list(range(rank))


def _extremum(onnx_op: str) -> Callable:
    def translate(self: Any, dim: Any = (), keepdim: bool = False) -> Any:
        from onnxscript import opset18 as op
        from onnxscript.function_libs.torch_lib.ops import core

        if dim:  # the exporter's own function, as before: the same graph
            own = core.aten_amax if onnx_op == "ReduceMax" else core.aten_amin
            return own(self, op.Constant(value_ints=_axes(self, dim)), keepdim)
        if len(self.shape) == 0:
            return op.Identity(self)
        axes = op.Constant(value_ints=_axes(self, dim))
        return getattr(op, onnx_op)(self, axes, keepdims=int(keepdim))

    return translate


def _selected(keep_first: str) -> Callable:
    def translate(self: Any, other: Any) -> Any:
        from onnxscript import opset18 as op

        other = op.CastLike(other, self)
        first = op.Or(getattr(op, keep_first)(self, other), op.IsNaN(other))
        return op.Where(first, self, other)

    return translate


def _sort_stable(
    self: Any, *, stable: bool | None = None, dim: int = -1, descending: bool = False
) -> tuple[Any, Any]:
    from onnxscript import opset18 as op

    if len(self.shape) == 0:
        return op.Identity(self), op.Constant(value_int=0)
    size = op.Reshape(op.Gather(op.Shape(self), dim, axis=0), op.Constant(value_ints=[1]))
    return op.TopK(self, size, axis=dim, largest=int(descending), sorted=1)


def order_translations() -> dict[Callable, Callable]:
    return {
        aten.amax.default: _extremum("ReduceMax"),
        aten.amin.default: _extremum("ReduceMin"),
        aten.fmax.default: _selected("GreaterOrEqual"),
        aten.fmin.default: _selected("LessOrEqual"),
        aten.sort.stable: _sort_stable,
    }


def _searchsorted(
    sorted_sequence: torch.Tensor,
    self: torch.Tensor,
    *,
    out_int32: bool = False,
    right: bool = False,
    side: str | None = None,
    sorter: torch.Tensor | None = None,
) -> torch.Tensor:
    if sorter is not None:
        sorted_sequence = sorted_sequence.gather(-1, sorter)
    bounds = sorted_sequence if sorted_sequence.dim() == 1 else sorted_sequence.unsqueeze(-2)
    values = self.unsqueeze(-1)
    below = bounds <= values if right or side == "right" else bounds < values
    return below.sum(-1, dtype=torch.int32 if out_int32 else torch.int64)


def searchsorted_decompositions() -> dict[Any, Callable]:
    return {aten.searchsorted.Tensor: _searchsorted}
