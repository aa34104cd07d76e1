"""ZeRO-3: parameters too live as 1/N shards, gathered whole only while a segment runs.

On top of ZeRO-2 (``sharded_grads.py``: the model as segments cut at its repeated blocks,
gradients reduced bucket by bucket, the shard's update graph). The segments are planned
and checked against eager on whole parameters at the first micro-step; then each rank
keeps only its stretch of the flat parameters (``param_shard``) and every parameter
becomes an empty placeholder, before that step's own forward. From then on:

    segment forward   its module's parameters are gathered (``acquire``: each owner
                      broadcasts its stretch of their range of the flat layout), the
                      forward graph runs, they are dropped again (``release``), except
                      those the next acquire reads (a tied table is gathered for the
                      embedding's forward and again for the head's: held between them
                      it would be whole through every block's forward)
    segment backward  gathered again before the backward graph runs, if it reads any
                      (an embedding's backward adds rows and reads none); dropped after
                      it where no later acquire reads them (``after_backward``: the tied
                      table, whose gradient arrives only after the embedding's rows),
                      else when autograd has accumulated their gradient (the ZeRO-2 hook)
    update            the shard's update graph writes ``param_shard`` in place: no
                      all-gather after it

Every rank issues the same gathers in the same order (one autograd graph, run the same
way). The first sharded micro-step records the order in which segments acquire their
parameters; from the next one on, acquiring a segment starts the gather of the one
recorded after it, which travels while this one computes (ONNX Runtime releases the
GIL during a run), and a segment whose backward comes right after its forward keeps its
parameters between them. A micro-step that departs from the record stops prefetching
and records afresh; every rank departs alike, so the collectives still match. A gather
buffer goes back to the pool only if an acquire left in the micro-step takes one of its
size; else it is freed (kept, it would sit idle at the end of the backward, where the
step's memory peaks).

Parameters that eager code reads (the root's forward, a module that fell back to eager,
a weight tied by hand as ``h @ self.embed.weight.T``: ``segments/param_reads.py``) stay
whole on every rank (``keep_whole``): eager code reads ``.data`` where it likes and
autograd keeps what it read for the backward, so there is no point at which they could
be dropped. Their gradients are reduced as every other's; after each update every rank
gathers their new values from the ranks that own them. A compiled module whose call runs
in eager (a signature its plan could not compile) keeps its gathered parameters until
their gradients arrive. ``state_dict``, checkpoints and evaluation gather all parameters
for their duration (``materialized``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import mmap
import os
import time
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch

from ortrain.distributed.comm import Comm, InFlight
from ortrain.distributed.embedding_rows import (
    rows_held,
    table_of_rows,
    takes_rows,
    union_of_ids,
    worth_rows,
)
from ortrain.distributed.sharded_grads import ShardedGradients
from ortrain.runtime.buffer_pool import BufferPool
from ortrain.runtime.heap import available_bytes, trim_heap

if TYPE_CHECKING:
    from ortrain.runtime.training_state import TrainingState


def _free_bytes(device: torch.device, ranks: int) -> int | None:
    """Memory a rank may take: the device's free memory, or the host's available memory
    shared by the ranks on it (``LOCAL_WORLD_SIZE``, else all of ``ranks``); None where
    unknown."""
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    local = int(os.environ.get("LOCAL_WORLD_SIZE", ranks) or ranks)
    free = available_bytes()
    return None if free is None else free // max(local, 1)


def _release_outside(mapping: mmap.mmap, lo: int, hi: int) -> None:
    """Hand back to the system the whole pages of ``mapping`` outside bytes [lo, hi) (they
    read as zeros if touched again; nothing does)."""
    page = mmap.PAGESIZE
    first, last = (lo // page) * page, -(-hi // page) * page
    if first > 0:
        mapping.madvise(mmap.MADV_DONTNEED, 0, first)
    if last < len(mapping):
        mapping.madvise(mmap.MADV_DONTNEED, last, len(mapping) - last)


class _Gather:
    """Parameters gathered (or on their way) into one buffer."""

    def __init__(
        self,
        names: list[str],
        lo: int,
        buf: torch.Tensor,
        flight: InFlight,
        pooled: bool,
        held: int,
    ):
        self.names, self.lo, self.buf, self.flight = names, lo, buf, flight
        self.pooled = pooled  # from the pool, and back to it when done
        self.held = held  # elements of memory of its own (none: a view of the shard)


@dataclasses.dataclass(frozen=True)
class _Acquire:
    """One acquire of a micro-step: whose parameters, which of them, for which pass."""

    module: torch.nn.Module
    names: frozenset[str]
    backward: bool


class ShardedParams(ShardedGradients):
    """ZeRO-3 (a ``Reducer`` and the segments' ``ParamHome``)."""

    def __init__(self, training: TrainingState, comm: Comm, bucket_numel: int):
        super().__init__(training, comm, bucket_numel)
        self._module = training.module
        self._state = training
        self._params = dict(training.module.named_parameters())
        self._names_of: dict[int, list[str]] = {}  # id(module) -> its laid-out parameters
        self.param_shard: torch.Tensor | None = None  # this rank's stretch, once sharded
        self._kept_shard: torch.Tensor | None = None  # the same while ``unshard``ed
        self._placeholder = torch.empty(0, device=comm.device)
        self.gathered: set[str] = set()  # parameters whole right now
        self.peak_gathered_numel = 0  # most parameter elements gathered at once so far
        self.gather_seconds = 0.0  # waited on parameter gathers so far (a benchmark's figure)
        # whole while the first step plans: the elements beyond this rank's shard
        self.first_step_numel = self.config.layout.numel - self.config.layout.shard_numel
        self._held = 0  # elements of the gathered buffers alive now
        self._buffer_of: dict[str, int] = {}  # gathered parameter -> its buffer's id
        # buffer id -> [the buffer, its parameters still gathered]
        self._buffers: dict[int, list[Any]] = {}
        self.gather_pool = BufferPool(comm.device)  # gather buffers, reused step to step
        # the segments' acquires in a micro-step: recorded, then prefetched along; each
        # name's last acquire in it (``after_backward``); per position, the buffer sizes
        # the next acquires gather (``_give_back``)
        self._trace: list[_Acquire] | None = None
        self._last_use: dict[str, int] = {}
        self._sizes_soon: list[set[int]] = []
        self._recording: list[_Acquire] = []
        self._pos = 0  # acquires so far in this micro-step
        self._following = False  # this micro-step has kept to the trace so far
        self._ahead: _Gather | None = None  # the prefetched gather, on its way
        self.prefetched_numel = 0  # parameter elements that arrived by prefetch so far
        self.gathered_in_place = 0  # gathers within this rank's stretch: views of its shard
        self.whole: set[str] = set()  # read by eager code: whole on every rank (keep_whole)
        # dropped inside a micro-step, where autograd may yet accumulate a gradient into
        # them (a backward that reads no parameter does not gather them: an embedding's
        # rows; ``after_backward``): stand-ins of their shape over no memory, NaN to
        # anything that reads them, the empty placeholder again when the micro-step ends
        self._standing: set[str] = set()
        self._nan = torch.full((1,), float("nan"), device=comm.device)
        self._told_short = False  # bucketing's check had no room for whole parameters
        # an embedding's forward takes only the rows its batch reads (``acquire_rows``):
        # id(module) -> its weight's name while they are in place; elements so far
        self._rows_of: dict[int, str] = {}
        self.rows_gathered_numel = 0

    @property
    def sharded(self) -> bool:
        return self.param_shard is not None

    # ------------------------------------------------------------------ gathering
    def _module_names(self, module: torch.nn.Module) -> list[str]:
        names = self._names_of.get(id(module))
        if names is None:
            mine = {id(p) for p in module.parameters()}
            names = [
                n
                for n in self.config.layout.names
                if id(self._params[n]) in mine and n not in self.whole
            ]
            self._names_of[id(module)] = names
        return names

    def _names_in(self, module: torch.nn.Module, params: Sequence[torch.Tensor]) -> frozenset[str]:
        """The names of ``module``'s laid-out parameters among ``params``."""
        read = {id(p) for p in params}
        return frozenset(n for n in self._module_names(module) if id(self._params[n]) in read)

    def acquire(self, module: torch.nn.Module, only: Sequence[torch.Tensor] | None = None) -> None:
        """``module``'s parameters whole (``only``: those of them a graph reads; a
        collective: every rank calls it alike)."""
        if not self.sharded:
            return
        names = self._module_names(module)
        if only is not None:
            self._check_late(self._names_in(module, only))
        if only is not None and not self._names_in(module, only):
            # a graph that reads none of them (an embedding's backward: rows of the
            # gradient); one that reads some gathers them all, as the forward did (the
            # same range: one buffer size, reused step to step)
            names = []
        following = self._step_to(_Acquire(module, frozenset(names), only is not None))
        if self._ahead is not None:  # on its way since the previous acquire
            ahead, self._ahead = self._ahead, None
            self._finish(ahead)
            if following:
                self.prefetched_numel += ahead.buf.numel()
        self._gather([n for n in names if n not in self.gathered])
        nxt = self._upcoming()
        if following and nxt is not None and nxt.module is not module:
            ahead_names = [n for n in nxt.names if n not in self.gathered]
            if ahead_names:
                self._ahead = self._start(ahead_names)

    def acquire_rows(self, module: torch.nn.Module, ids: torch.Tensor) -> bool:
        """For a plain embedding's forward: only the rows of its table that the ranks'
        ``ids`` look up, gathered (``embedding_rows.py``; a collective: every rank calls
        it alike). False where the whole table is to be acquired instead (rows not worth
        it, the table gathered or on its way already, or not sharded)."""
        if not self.sharded or not self._armed or not takes_rows(module):
            return False
        names = self._module_names(module)
        if len(names) != 1 or names[0] in self.gathered:
            return False
        name = names[0]
        e = self._entries[name]
        shape = tuple(e.shape)
        union = union_of_ids(self.comm, ids, name)
        if len(shape) != 2 or not worth_rows(union, shape[0]):
            return False
        following = self._step_to(_Acquire(module, frozenset(), False))
        if self._ahead is not None:  # on its way since the previous acquire
            ahead, self._ahead = self._ahead, None
            self._finish(ahead)
            if following:
                self.prefetched_numel += ahead.buf.numel()
        if name not in self.gathered:  # (else the whole table came by prefetch: read it)
            shard = self.param_shard
            assert shard is not None
            rows = rows_held(union, shape[1], shard, e.offset, self.config.shard.start)
            self.comm.all_reduce(rows)
            table = table_of_rows(union, rows, shape)
            self._params[name].data = table
            self._state.params[name] = table
            self._rows_of[id(module)] = name
            self.rows_gathered_numel += rows.numel()
        nxt = self._upcoming()
        if following and nxt is not None and nxt.module is not module:
            ahead_names = [n for n in nxt.names if n not in self.gathered]
            if ahead_names:
                self._ahead = self._start(ahead_names)
        return True

    def _drop_rows(self, module: torch.nn.Module) -> None:
        """The rows ``acquire_rows`` put in ``module``'s weight, dropped (after its call)."""
        name = self._rows_of.pop(id(module), None)
        if name is None or name in self.gathered:  # gathered whole since (a tied head's)
            return
        stand_in = self._placeholder
        if self._armed:  # autograd may yet accumulate into its shape
            stand_in = self._nan.expand(self._entries[name].shape)
            self._standing.add(name)
        self._params[name].data = stand_in
        self._state.params[name] = stand_in

    def release(self, module: torch.nn.Module) -> None:
        """Drop ``module``'s gathered parameters (after its forward), unless its own
        backward is the next to acquire them; those the next acquire reads stay. A tied
        table read by the embedding and again by the head is gathered for each: held
        between them, it would sit whole through every block's forward (where a rank's
        memory peaked), and its second gather travels while the last blocks compute."""
        self._drop_rows(module)
        nxt = self._upcoming()
        if nxt is not None and nxt.module is module:
            return
        again = nxt.names if nxt is not None else frozenset()
        self._drop([n for n in self._module_names(module) if n not in again])

    def after_backward(self, module: torch.nn.Module) -> None:
        """Drop what ``module``'s backward read that no later acquire of the trace reads,
        before autograd accumulates its gradient (a tied embedding's table is read by
        the head's backward, and its gradient arrives only after the embedding's rows
        at the end of the backward). Off the trace nothing goes early: a later graph
        might read it."""
        if not self._following:
            return
        k = self._pos - 1  # this backward's own acquire
        done = [
            n
            for n in self._module_names(module)
            if n in self.gathered and self._last_use.get(n, -1) <= k
        ]
        self._drop(done)

    def _step_to(self, step: _Acquire) -> bool:
        """Advance along this micro-step's acquires; True while it keeps to the trace."""
        if not self._armed:  # evaluation, checkpoints: not part of a micro-step's order
            return False
        k = self._pos
        self._pos += 1
        self._recording.append(step)
        trace = self._trace
        self._following = (
            self._following
            and trace is not None
            and k < len(trace)
            and trace[k].module is step.module
        )
        return self._following

    def _upcoming(self) -> _Acquire | None:
        trace = self._trace
        if not self._following or trace is None or self._pos >= len(trace):
            return None
        return trace[self._pos]

    def _set_trace(self, trace: list[_Acquire]) -> None:
        self._trace = trace
        self._last_use = {n: k for k, a in enumerate(trace) for n in a.names}
        # per position, the buffer sizes its acquire and the one after gather: the next
        # to take from the pool (the prefetch keeps one acquire ahead)
        spans = [self._span(a.names) if a.names else 0 for a in trace] + [0, 0]
        self._sizes_soon = [{spans[k], spans[k + 1]} - {0} for k in range(len(trace) + 1)]

    def _span(self, names: frozenset[str] | list[str]) -> int:
        """Elements of the buffer gathering ``names`` (their range of the layout)."""
        return max(self._entries[n].stop for n in names) - min(
            self._entries[n].offset for n in names
        )

    def hold(self, module: torch.nn.Module) -> None:
        """After a call of ``module`` that ran in eager: autograd keeps what it read, so
        its parameters stay gathered until their gradients arrive (or the micro-step ends)."""

    def keep_whole(self, names: list[str]) -> None:
        """``names`` (read by eager code) are never sharded: whole on every rank."""
        assert not self.sharded, "which parameters stay whole is decided before sharding"
        self.whole = set(names) & set(self.config.layout.names)
        self._names_of.clear()
        self.first_step_numel -= sum(self._owned_elsewhere(n) for n in self.whole)

    def _owned_elsewhere(self, name: str) -> int:
        """Elements of ``name`` outside this rank's shard."""
        e, (lo, hi) = self._entries[name], self.config.layout.shard(self.config.rank)
        return (e.stop - e.offset) - max(0, min(e.stop, hi) - max(e.offset, lo))

    def planned(
        self,
        order: Sequence[torch.nn.Module] = (),
        backward_reads: Sequence[Sequence[torch.Tensor]] = (),
    ) -> None:
        if self.sharded:
            return
        self._shard_params()
        if order and self._armed:
            # the first sharded micro-step's acquires as the recording saw the forward's
            # calls, then the backward's in reverse: its gathers are prefetched too (a
            # backward that goes otherwise departs from it, as any micro-step may)
            fwd = [_Acquire(m, frozenset(self._module_names(m)), False) for m in order]
            bwd = [_Acquire(a.module, a.names, True) for a in fwd]
            if len(backward_reads) == len(order):  # as ``acquire`` will take them
                bwd = [
                    _Acquire(
                        a.module, a.names if self._names_in(a.module, ps) else frozenset(), True
                    )
                    for a, ps in zip(fwd, backward_reads)
                ]
            self._set_trace([*fwd, *reversed(bwd)])
            self._following = True

    def _gather(self, names: list[str]) -> None:
        if names:
            self._finish(self._start(names))

    def _start(self, names: list[str]) -> _Gather:
        """Start gathering ``names`` into one buffer spanning their range of the layout:
        one broadcast per owner of a stretch of it, all in flight together."""
        layout, shard = self.config.layout, self.param_shard
        assert shard is not None
        lo = min(self._entries[n].offset for n in names)
        hi = max(self._entries[n].stop for n in names)
        # a micro-step's gathers recur every step: pooled; a whole model's for a
        # checkpoint or an evaluation is not kept past it
        pooled = self._armed
        mine = self.config.shard
        if pooled and mine.start <= lo and hi <= mine.stop:
            # all of it in this rank's own stretch (a tied table at the layout's start,
            # a block within one shard): the parameters are views of the shard, sent to
            # the other ranks from there. The shard changes only in the update, after the
            # micro-step has dropped them; a copy would add its size to the rank's peak
            # (the tied table gathered for the head, where a ZeRO-3 step peaks).
            buf = shard[lo - mine.start : hi - mine.start]
            self.gathered_in_place += 1
            flight = self.comm.start_broadcasts([(buf, self.config.rank)], "gather of parameters")
            return _Gather(names, lo, buf, flight, pooled=False, held=0)
        if pooled:
            buf = self.gather_pool.take(hi - lo)
        else:
            buf = torch.empty(hi - lo, device=self.comm.device)
        n = layout.shard_numel
        pieces = []
        for rank in range(self.world_size):
            a, b = max(lo, rank * n), min(hi, (rank + 1) * n)
            if a >= b:
                continue
            if rank == self.config.rank:
                buf[a - lo : b - lo].copy_(shard[a - rank * n : b - rank * n])
            pieces.append((buf[a - lo : b - lo], rank))
        flight = self.comm.start_broadcasts(pieces, "gather of parameters")
        self._held += buf.numel()
        self.peak_gathered_numel = max(self.peak_gathered_numel, self._held)
        return _Gather(names, lo, buf, flight, pooled, held=buf.numel())

    def _finish(self, g: _Gather) -> None:
        """Wait for ``g`` and make its parameters views of its buffer."""
        started = time.perf_counter()
        g.flight.wait()
        self.gather_seconds += time.perf_counter() - started
        fresh = [n for n in g.names if n not in self.gathered]
        if not fresh:
            self._held -= g.held
            self._give_back(g.buf, g.pooled)
            return
        for name in fresh:
            e = self._entries[name]
            view = g.buf[e.offset - g.lo : e.stop - g.lo].view(e.shape)
            self._params[name].data = view
            self._state.params[name] = view
            self.gathered.add(name)
            self._buffer_of[name] = id(g.buf)
        self._buffers[id(g.buf)] = [g.buf, len(fresh), g.pooled, g.held]

    def _drop(self, names: list[str]) -> None:
        if not self.sharded:
            return
        for name in names:
            if name in self.gathered:
                self.gathered.discard(name)
                stand_in = self._placeholder
                if self._armed:  # autograd may yet accumulate into its shape
                    stand_in = self._nan.expand(self._entries[name].shape)
                    self._standing.add(name)
                self._params[name].data = stand_in
                self._state.params[name] = stand_in
                key = self._buffer_of.pop(name)
                held = self._buffers[key]
                held[1] -= 1
                if held[1] == 0:  # its last view gone: the buffer goes back to the pool
                    del self._buffers[key]
                    self._held -= held[3]
                    self._give_back(held[0], held[2])

    def _give_back(self, buf: torch.Tensor, pooled: bool) -> None:
        if not pooled:
            return
        if self._following and buf.numel() not in self._sizes_soon[self._pos]:
            # neither of the next two acquires takes a buffer of its size (the tied table
            # after the embedding and after the head's backward, the last block's before
            # the head): kept, it would sit idle while larger gathers are whole (the head's
            # table, where the step's memory peaks); made afresh when next needed
            self.gather_pool.forget(buf)
            return
        self.gather_pool.give(buf)

    def _shard_params(self) -> None:
        """Once planned: keep this rank's stretch, drop the rest of the whole buffer."""
        flat = self.flat_params
        assert flat is not None
        mapping = getattr(self, "_mapping", None)
        if self._kept_shard is not None:  # sharded again (``unshard``): the tensor the
            self.param_shard = self._kept_shard  # update graph writes stays
            if mapping is None:
                self.param_shard.copy_(flat[self.config.shard])
        else:
            # in a mapping the stretch stays where it is; elsewhere it is copied out
            self.param_shard = (
                flat[self.config.shard] if mapping is not None else flat[self.config.shard].clone()
            )
            self._state.shard_params.append(self.param_shard)
        for name in self.config.layout.names:
            # the whole ones get storages of their own: the flat buffer goes
            kept = self._params[name].data.clone() if name in self.whole else self._placeholder
            self._params[name].data = kept
            self._state.params[name] = kept
        self.flat_params = None  # type: ignore[assignment]
        if mapping is not None:
            _release_outside(mapping, self.config.shard.start * 4, self.config.shard.stop * 4)

    def unshard(self) -> None:
        """Every parameter whole again, as before the first step (a collective: every rank
        calls it alike), for the segments to be planned afresh on whole parameters (a
        Python value the loop changed that compiled segments read). The next ``planned``
        shards them again; the shard stays the tensor the update writes."""
        if not self.sharded:
            return
        shard, layout = self.param_shard, self.config.layout
        assert shard is not None and self._ahead is None and not self.gathered
        mapping = getattr(self, "_mapping", None)
        if mapping is not None:  # the stretch is where it was; the rest reads as zeros
            flat = torch.frombuffer(mapping, dtype=torch.float32, count=layout.numel)
        else:
            flat = torch.empty(layout.numel, device=self.comm.device)
            flat[self.config.shard].copy_(shard)
        self.comm.all_gather(flat)
        self.flat_params = flat
        for e in layout.entries:
            view = flat[e.offset : e.stop].view(e.shape)
            self._params[e.name].data = view
            self._state.params[e.name] = view
        self._kept_shard, self.param_shard = shard, None
        self.whole = set()
        self.first_step_numel = layout.numel - layout.shard_numel
        self._names_of.clear()
        self._standing.clear()
        self._trace, self._following, self._recording = None, False, []

    def _refresh_whole(self) -> None:
        """After an update: the whole parameters' new values, from the ranks owning them
        (one broadcast per owner of each one's range, all in flight together)."""
        shard, n = self.param_shard, self.config.layout.shard_numel
        assert shard is not None
        pieces = []
        for name in sorted(self.whole):
            e = self._entries[name]
            flat = self._params[name].data.view(-1)
            for rank in range(self.world_size):
                a, b = max(e.offset, rank * n), min(e.stop, (rank + 1) * n)
                if a >= b:
                    continue
                if rank == self.config.rank:
                    flat[a - e.offset : b - e.offset].copy_(shard[a - rank * n : b - rank * n])
                pieces.append((flat[a - e.offset : b - e.offset], rank))
        if pieces:
            started = time.perf_counter()
            self.comm.start_broadcasts(pieces, "gather of parameters read in eager").wait()
            self.gather_seconds += time.perf_counter() - started

    @contextlib.contextmanager
    def materialized(self, write_back: bool = False) -> Iterator[None]:
        """Every parameter whole for the duration (a collective); ``write_back``: what was
        written into them is kept (this rank's stretch of it)."""
        if not self.sharded:
            yield
            return
        names = [
            n for n in self.config.layout.names if n not in self.gathered and n not in self.whole
        ]
        self._gather(names)
        try:
            yield
            if write_back:
                self._write_back([*names, *self.whole])
        finally:
            self._drop(names)

    @contextlib.contextmanager
    def whole_if_any(self, needed: bool) -> Iterator[bool]:
        """Every parameter whole for the duration where any rank ``needed`` them (a
        collective while sharded: every rank calls it alike, once a micro-step) and every
        rank has room for them and as many gradients (an eager backward on them); yields
        whether they are whole."""
        if not self.sharded:
            yield True
            return
        numel = self.config.layout.numel - self.config.layout.shard_numel
        room = _free_bytes(self.comm.device, self.world_size)
        short = room is not None and room < 2 * 4 * numel
        votes = torch.tensor([float(needed), float(short)])
        self.comm.all_reduce(votes)
        if votes[0] == 0:
            yield False
            return
        if votes[1] > 0:
            if not self._told_short:
                self._told_short = True
                warnings.warn(
                    f"ortrain: ZeRO-3: bucketing's eager check needs every parameter whole "
                    f"with its gradient ({2 * 4 * numel / 2**30:.2f} GiB a rank) and a rank "
                    "has less memory free: batches run at their own length (a call "
                    "signature of the segments each)",
                    stacklevel=4,
                )
            yield False
            return
        with self.materialized():
            yield True

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
        self._pos, self._recording = 0, []
        self._following = self._trace is not None
        try:
            with super().collecting():
                yield
            if self._ahead is not None:  # the trace ran past this micro-step's acquires
                self._finish(self._ahead)
            if self.sharded:  # this micro-step's order and reads, for the next
                self._set_trace(self._recording)
        finally:  # frozen or unreached ones a backward gathered, or a failed step's
            if self._ahead is not None:  # a failed step's: its buffer goes with it
                self._held -= self._ahead.held
                if self._ahead.pooled:  # a broadcast may still write it: not reused
                    self.gather_pool.forget(self._ahead.buf)
                self._ahead = None
            self._following = False
            self._drop(list(self.gathered))
            for name in self._rows_of.values():  # a call that ran in eager, or failed
                if name not in self.gathered:
                    self._standing.add(name)
            self._rows_of.clear()
            for name in self._standing:  # between micro-steps: empty, as documented
                if name not in self.gathered:
                    self._params[name].data = self._placeholder
                    self._state.params[name] = self._placeholder
            self._standing.clear()
            # the buckets kept for the next backward would sit idle through the next
            # forward, which gathers (a tied table for all of it): that is a ZeRO-3 rank's
            # peak, so they go, and the next backward makes them afresh
            self.bucket_pool.clear()
            self._scratch_free.clear()
            trim_heap()
        if not self.sharded:
            self._shard_params()

    def _arrive(self, name: str, whole: torch.Tensor) -> None:
        super()._arrive(name, whole)
        self._drop([name])  # its last use in this backward is behind it

    # ------------------------------------------------------------------ the update
    def _param_piece(self, start: int, stop: int) -> torch.Tensor:
        shard = self.param_shard
        assert shard is not None, "ZeRO-3 lays out its update once the segments are planned"
        lo = self.config.shard.start
        return shard[start - lo : stop - lo]

    def update(self, run_update: Callable[[], None]) -> None:
        self._make_room()
        self._global_scaled_sq_norm()  # the shard holds the reduced sums already
        run_update()  # writes this rank's stretch in place; the others gather it when used
        if self.whole:
            self._refresh_whole()
        trim_heap()

    # ------------------------------------------------------------------ state
    def state_dict(self, training: TrainingState) -> dict[str, Any]:
        with self.materialized():
            return super().state_dict(training)

    def load_state_dict(self, training: TrainingState, state: Mapping[str, Any]) -> None:
        with self.materialized(write_back=True):
            super().load_state_dict(training, state)

    def load_shards(
        self,
        training: TrainingState,
        base: Mapping[str, Any],
        shard: Mapping,
        stateful: set[str],
        scalars: Mapping[str, Mapping[str, float]],
    ) -> None:
        with self.materialized(write_back=True):
            super().load_shards(training, base, shard, stateful, scalars)

    def save_checkpoint(self, training: TrainingState, path: str | os.PathLike) -> None:
        with self.materialized():
            super().save_checkpoint(training, path)

    def load_checkpoint(self, training: TrainingState, path: str | os.PathLike) -> None:
        with self.materialized(write_back=True):
            super().load_checkpoint(training, path)
