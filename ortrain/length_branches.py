"""The sequence lengths over which a forward takes the same Python branches.

Bucketing pads a batch of length ``L`` to a bucket length ``P`` and runs the graph
exported at ``P``. A forward that branches in Python on the length (BigBird's block-sparse
attention above a few blocks, a chunked path for long inputs, ``if T > k``) computes
another function at ``P`` than at ``L`` when a threshold lies between them, and the
checks that sample one batch per layout cannot see a threshold that later batches cross.

``branch_free_lengths`` traces the forward and the loss once with the sequence axis
symbolic (``torch.export`` with a dynamic dimension, non-strict: the Python code runs on
fake tensors, nothing is computed); every Python decision on the length becomes a guard
on its symbol, so the symbol's range after the trace is exactly the lengths that take the
branches the example took. Padding is exact only within one such range.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

import torch

from ortrain.export import LossFn, call_arguments, step_loss

LOWEST = 2  # torch specializes sizes 0 and 1: a symbolic length starts at 2


class _Loss(torch.nn.Module):
    """forward(*tensors) -> the loss of the batch they fill (its other values fixed)."""

    def __init__(self, module: torch.nn.Module, loss_fn: LossFn | None, batch: Mapping[str, Any]):
        super().__init__()
        self.module = module
        self.loss_fn = loss_fn
        self.keys = [k for k, v in batch.items() if isinstance(v, torch.Tensor)]
        self.fixed = {k: v for k, v in batch.items() if not isinstance(v, torch.Tensor)}

    def forward(self, *tensors: torch.Tensor) -> torch.Tensor:
        batch = {**self.fixed, **dict(zip(self.keys, tensors, strict=True))}
        args, kwargs = call_arguments(self.module, batch)
        out = self.module(*args, **kwargs)
        return step_loss(out, batch, self.loss_fn)


def branch_free_lengths(
    module: torch.nn.Module,
    loss_fn: LossFn | None,
    batch: Mapping[str, Any],
    seq_keys: Sequence[str],
    upper: int,
    train: bool,
) -> tuple[int, int] | None:
    """The lengths (lo, hi) within ``[LOWEST, upper]`` that take the Python branches
    ``batch``'s length takes (its tensors ``seq_keys`` have the length on axis 1); None
    where the trace fails (nothing is known: the caller decides as before)."""
    from torch.export import Dim

    from ortrain.export import _quiet_torch_logs
    from ortrain.export_casts import unchanged_module_casts
    from ortrain.export_hints import without_value_hints
    from ortrain.python_state import kept
    from ortrain.verify import in_mode, no_kv_cache, restoring

    wrapper = _Loss(module, loss_fn, batch)
    tensors = tuple(batch[k] for k in wrapper.keys)
    length = Dim.AUTO(min=LOWEST, max=max(upper, LOWEST + 1))
    dims = tuple({1: length} if k in seq_keys else None for k in wrapper.keys)
    try:
        with (
            in_mode(module, train),
            kept(module, loss_fn),
            restoring(list(module.buffers())),
            no_kv_cache(module),
            warnings.catch_warnings(),
            _quiet_torch_logs(),
            contextlib.redirect_stdout(None),
            without_value_hints(),  # (as the graph's own export: ortrain/export.py)
            unchanged_module_casts(),
        ):
            warnings.simplefilter("ignore")
            program = torch.export.export(wrapper, tensors, dynamic_shapes=(dims,), strict=False)
    except Exception:
        return None
    first = wrapper.keys.index(seq_keys[0])
    name = program.graph_signature.user_inputs[first]
    node = next(n for n in program.graph.nodes if n.op == "placeholder" and n.name == name)
    size = node.meta["val"].shape[1]
    if not isinstance(size, torch.SymInt):  # specialized: this length alone
        return (int(size), int(size))
    found = program.range_constraints.get(size.node.expr)
    if found is None:
        return None
    hi = found.upper if found.upper.is_finite else upper
    return (int(found.lower), int(hi))


Region = tuple[int, int]


class GraphCache(Protocol):
    """What is kept of a trace: ``ortrain.build_cache.GraphCache``'s small entries."""

    def recall(self, what: str, batch: Mapping[str, Any]) -> tuple[Any] | None: ...

    def remember(self, what: str, batch: Mapping[str, Any], value: Any) -> None: ...


UNKNOWN: Region = (1, 1 << 62)  # a trace that failed: nothing is known, padding decides as before


class BranchRegions:
    """Per batch layout, the ranges of lengths that take the same Python branches, each
    traced once (``branch_free_lengths``, in this process: its imports and caches are
    then the build children's too) and kept in the graph cache beside the graphs, so a
    later run does not trace again."""

    def __init__(
        self, module: torch.nn.Module, loss_fn: LossFn | None, cache: GraphCache | None
    ) -> None:
        self.module = module
        self.loss_fn = loss_fn
        self.cache = cache
        self.regions: dict[tuple, list[Region]] = {}

    def known(
        self, key: tuple, padded: dict[str, Any], seq_keys: Sequence[str], upper: int, train: bool
    ) -> bool:
        """Whether ``region`` answers for ``padded`` without a trace."""
        to = int(padded[seq_keys[0]].shape[1])
        if any(r[0] <= to <= r[1] for r in self.regions.get(key, [])):
            return True
        what = f"length-branches/{'train' if train else 'eval'}/{upper}"
        return self.cache is not None and self.cache.recall(what, padded) is not None

    def region(
        self, key: tuple, padded: dict[str, Any], seq_keys: Sequence[str], upper: int, train: bool
    ) -> Region:
        """The range of layout ``key`` that holds ``padded``'s length (UNKNOWN where its
        trace failed)."""
        to = int(padded[seq_keys[0]].shape[1])
        ranges = self.regions.setdefault(key, [])
        found = next((r for r in ranges if r[0] <= to <= r[1]), None)
        if found is not None:
            return found
        what = f"length-branches/{'train' if train else 'eval'}/{upper}"
        kept = self.cache.recall(what, padded) if self.cache is not None else None
        if kept is not None:
            traced = kept[0]
        else:
            traced = branch_free_lengths(self.module, self.loss_fn, padded, seq_keys, upper, train)
            if self.cache is not None:
                self.cache.remember(what, padded, traced)
        found = UNKNOWN if traced is None else (int(traced[0]), int(traced[1]))
        if not found[0] <= to <= found[1]:  # (a kept range of another length: unknown)
            found = UNKNOWN
        ranges.append(found)
        return found
