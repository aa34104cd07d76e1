"""ZeRO-3: parameters too live as 1/N shards, gathered whole only while a segment runs.

On top of ZeRO-2 (``sharded_grads.py``: the model as segments cut at its repeated blocks,
gradients reduced bucket by bucket, the shard's update graph). The segments are planned
and checked against eager on whole parameters at the first micro-step; then each rank
keeps only its stretch of the flat parameters (``param_shard``) and every parameter
becomes an empty placeholder, before that step's own forward. From then on:

    segment forward   its module's parameters are gathered (``acquire``: each owner
                      broadcasts its stretch of their range of the flat layout), the
                      forward graph runs, they are dropped again (``release``)
    segment backward  gathered again before the backward graph runs; each one is dropped
                      when autograd has accumulated its gradient (the ZeRO-2 hook)
    update            the shard's update graph writes ``param_shard`` in place: no
                      all-gather after it

Every rank issues the same gathers in the same order (one autograd graph, run the same
way). A module that runs in eager cannot drop parameters autograd has saved, so ZeRO-3
needs every module with parameters compiled and says which is not. ``state_dict``,
checkpoints and evaluation gather all parameters for their duration (``materialized``).
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

import torch

from ortrain.distributed.comm import Comm
from ortrain.distributed.sharded_grads import ShardedGradients
from ortrain.runtime.heap import trim_heap

if TYPE_CHECKING:
    from ortrain.runtime.training_state import TrainingState


class ShardedParams(ShardedGradients):
    """ZeRO-3 (a ``Reducer`` and the segments' ``ParamHome``)."""

    def __init__(self, training: TrainingState, comm: Comm, bucket_numel: int):
        super().__init__(training, comm, bucket_numel)
        self._module = training.module
        self._state = training
        self._params = dict(training.module.named_parameters())
        self._names_of: dict[int, list[str]] = {}  # id(module) -> its laid-out parameters
        self.param_shard: torch.Tensor | None = None  # this rank's stretch, once sharded
        self._placeholder = torch.empty(0, device=comm.device)
        self.gathered: set[str] = set()  # parameters whole right now
        self.peak_gathered_numel = 0  # most parameter elements gathered at once so far
        self.gather_seconds = 0.0  # waited on parameter gathers so far (a benchmark's figure)
        # whole while the first step plans: the elements beyond this rank's shard
        self.first_step_numel = self.config.layout.numel - self.config.layout.shard_numel
        self._held = 0  # elements of the gathered buffers alive now
        self._buffer_of: dict[str, int] = {}  # gathered parameter -> its buffer's id
        self._buffers: dict[int, list[int]] = {}  # buffer id -> [numel, parameters in it]

    @property
    def sharded(self) -> bool:
        return self.param_shard is not None

    # ------------------------------------------------------------------ gathering
    def _module_names(self, module: torch.nn.Module) -> list[str]:
        names = self._names_of.get(id(module))
        if names is None:
            mine = {id(p) for p in module.parameters()}
            names = [n for n in self.config.layout.names if id(self._params[n]) in mine]
            self._names_of[id(module)] = names
        return names

    def acquire(self, module: torch.nn.Module) -> None:
        """``module``'s parameters whole (a collective: every rank calls it alike)."""
        if self.sharded:
            self._gather([n for n in self._module_names(module) if n not in self.gathered])

    def release(self, module: torch.nn.Module) -> None:
        """Drop ``module``'s gathered parameters (after its forward)."""
        self._drop(self._module_names(module))

    def planned(self) -> None:
        if not self.sharded:
            self._shard_params()

    def _gather(self, names: list[str]) -> None:
        if not names:
            return
        layout, shard = self.config.layout, self.param_shard
        assert shard is not None
        entries = {e.name: e for e in layout.entries}
        lo = min(entries[n].offset for n in names)
        hi = max(entries[n].stop for n in names)
        started = time.perf_counter()
        buf = torch.empty(hi - lo, device=self.comm.device)
        n = layout.shard_numel
        for rank in range(self.world_size):
            a, b = max(lo, rank * n), min(hi, (rank + 1) * n)
            if a >= b:
                continue
            if rank == self.config.rank:
                buf[a - lo : b - lo].copy_(shard[a - rank * n : b - rank * n])
            self.comm.broadcast_from(buf[a - lo : b - lo], rank)
        self.gather_seconds += time.perf_counter() - started
        for name in names:
            e = entries[name]
            view = buf[e.offset - lo : e.stop - lo].view(e.shape)
            self._params[name].data = view
            self._state.params[name] = view
            self.gathered.add(name)
            self._buffer_of[name] = id(buf)
        self._buffers[id(buf)] = [buf.numel(), len(names)]
        self._held += buf.numel()
        self.peak_gathered_numel = max(self.peak_gathered_numel, self._held)

    def _drop(self, names: list[str]) -> None:
        if not self.sharded:
            return
        for name in names:
            if name in self.gathered:
                self.gathered.discard(name)
                self._params[name].data = self._placeholder
                self._state.params[name] = self._placeholder
                held = self._buffers[self._buffer_of.pop(name)]
                held[1] -= 1
                if held[1] == 0:  # its last view gone: the buffer is freed
                    self._held -= held[0]

    def _shard_params(self) -> None:
        """Once planned: keep this rank's stretch, drop the whole buffer."""
        assert self.flat_params is not None
        self.param_shard = self.flat_params[self.config.shard].clone()
        self._state.shard_params.append(self.param_shard)
        for name in self.config.layout.names:
            self._params[name].data = self._placeholder
            self._state.params[name] = self._placeholder
        self.flat_params = None  # type: ignore[assignment]

    @contextlib.contextmanager
    def materialized(self, write_back: bool = False) -> Iterator[None]:
        """Every parameter whole for the duration (a collective); ``write_back``: what was
        written into them is kept (this rank's stretch of it)."""
        if not self.sharded:
            yield
            return
        names = [n for n in self.config.layout.names if n not in self.gathered]
        self._gather(names)
        try:
            yield
            if write_back:
                self._write_back(names)
        finally:
            self._drop(names)

    def _write_back(self, names: list[str]) -> None:
        shard = self.param_shard
        assert shard is not None
        lo, hi = self.config.layout.shard(self.config.rank)
        with torch.no_grad():
            for e in self.config.layout.entries:
                if e.name not in names:
                    continue
                a, b = max(e.offset, lo), min(e.stop, hi)
                if a < b:
                    flat = self._params[e.name].data.reshape(-1)
                    shard[a - lo : b - lo].copy_(flat[a - e.offset : b - e.offset])

    # ------------------------------------------------------------------ the backward
    @contextlib.contextmanager
    def collecting(self) -> Iterator[None]:
        try:
            with super().collecting():
                yield
        finally:  # frozen or unreached ones a backward gathered, or a failed step's
            self._drop(list(self.gathered))
        if not self.sharded:
            self._shard_params()

    def _arrival(self, name: str) -> Callable[[torch.Tensor], None]:
        reduce = super()._arrival(name)

        def arrived(p: torch.Tensor) -> None:
            reduce(p)
            if self._armed:
                self._drop([name])  # its last use in this backward is behind it

        return arrived

    # ------------------------------------------------------------------ the update
    def _param_piece(self, start: int, stop: int) -> torch.Tensor:
        shard = self.param_shard
        assert shard is not None, "ZeRO-3 lays out its update once the segments are planned"
        lo = self.config.shard.start
        return shard[start - lo : stop - lo]

    def update(self, run_update: Callable[[], None]) -> None:
        if self._norm is not None:
            self._norm.run()
            self.comm.all_reduce(self.sq_norm)
        run_update()  # writes this rank's stretch in place; the others gather it when used
        trim_heap()

    # ------------------------------------------------------------------ state
    def state_dict(self, training: TrainingState) -> dict[str, Any]:
        with self.materialized():
            return super().state_dict(training)

    def load_state_dict(self, training: TrainingState, state: Mapping[str, Any]) -> None:
        with self.materialized(write_back=True):
            super().load_state_dict(training, state)

    def load_shards(
        self, training: TrainingState, base: Mapping[str, Any], shard: Mapping, stateful: set[str]
    ) -> None:
        with self.materialized(write_back=True):
            super().load_shards(training, base, shard, stateful)

    def save_checkpoint(self, training: TrainingState, path: str | os.PathLike) -> None:
        with self.materialized():
            super().save_checkpoint(training, path)

    def load_checkpoint(self, training: TrainingState, path: str | os.PathLike) -> None:
        with self.materialized(write_back=True):
            super().load_checkpoint(training, path)
