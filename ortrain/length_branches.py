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
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

import torch

from ortrain.export import LossFn, call_arguments, step_loss
from ortrain.forked import ForkedJob, can_fork

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
    """Per batch layout, the ranges of lengths that take the same Python branches.

    A range is traced once (``branch_free_lengths``) and kept in the graph cache beside
    the graphs (a second run does not trace again). The trace is a ``torch.export`` of
    the whole forward, as long as the graph's own export: it runs in a forked child
    (``ortrain/forked.py``) started while the padded batch's graph builds (after the
    first-step check's timed eager step, which it would slow), so the two run side by
    side, and dynamo's tracing state stays out of the training process. (Not at a lower
    priority: on a machine kept busy by other processes, the ranks of one machine,
    such a child would wait for all of them while its trainer waits for it.)
    Where a job cannot fork (CUDA), it runs here when its answer is asked for."""

    def __init__(
        self, module: torch.nn.Module, loss_fn: LossFn | None, cache: GraphCache | None
    ) -> None:
        self.module = module
        self.loss_fn = loss_fn
        self.cache = cache
        self.regions: dict[tuple, list[Region]] = {}
        self._pending: dict[tuple, _Trace] = {}

    def known(self, key: tuple, to: int) -> Region | None:
        """The traced range of layout ``key`` that holds the length ``to``, if any."""
        return next((r for r in self.regions.get(key, ()) if r[0] <= to <= r[1]), None)

    def start(
        self, key: tuple, padded: dict[str, Any], seq_keys: Sequence[str], upper: int, train: bool
    ) -> None:
        """Begin finding the range of ``padded``'s length (a no-op where it is known or
        being traced)."""
        to = int(padded[seq_keys[0]].shape[1])
        if self.known(key, to) is not None or (key, to) in self._pending:
            return
        what = f"length-branches/{'train' if train else 'eval'}/{upper}"
        kept = self.cache.recall(what, padded) if self.cache is not None else None
        if kept is not None:
            self.regions.setdefault(key, []).append(_region(kept[0]))
            return
        module, loss_fn = self.module, self.loss_fn

        def trace() -> Region | None:
            return branch_free_lengths(module, loss_fn, padded, seq_keys, upper, train)

        self._pending[(key, to)] = _Trace(trace, what, padded, self.cache, module)

    def finish(self, key: tuple, to: int) -> Region:
        """The range that holds ``to`` (waits for its trace; UNKNOWN where none was
        started, or a kept range did not hold ``to``)."""
        region = self.known(key, to)
        if region is None:
            trace = self._pending.pop((key, to), None)
            region = trace.result() if trace is not None else UNKNOWN
            self.regions.setdefault(key, []).append(region)
        return region


def _region(found: Region | None) -> Region:
    return UNKNOWN if found is None else (int(found[0]), int(found[1]))


class _Trace:
    """One range being traced: in a forked child where the module's tensors allow."""

    def __init__(
        self,
        trace: Callable[[], Region | None],
        what: str,
        padded: dict[str, Any],
        cache: GraphCache | None,
        module: torch.nn.Module,
    ) -> None:
        self.trace, self.what, self.padded, self.cache = trace, what, padded, cache
        tensors = [*module.parameters(), *module.buffers()]
        self.job = (
            ForkedJob(trace, what="tracing the forward with a symbolic length")
            if can_fork(tensors)
            else None
        )

    def result(self) -> Region:
        job, self.job = self.job, None
        try:
            found = job.result() if job is not None else self.trace()
        except Exception:  # (the trace catches its own errors: a child that died) unknown
            return UNKNOWN
        if self.cache is not None:
            self.cache.remember(self.what, self.padded, found)
        return _region(found)

    def cancel(self) -> None:
        if self.job is not None:
            job, self.job = self.job, None
            job.cancel()

    def __del__(self) -> None:  # a trainer let go while its trace runs: not wanted
        try:
            self.cancel()
        except Exception:  # (interpreter shutdown)
            pass
