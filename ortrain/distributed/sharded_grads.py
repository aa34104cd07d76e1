"""ZeRO-2: gradients are reduced bucket by bucket while the backward produces them, and a
rank keeps only its shard of their sums (as it keeps only its shard of the optimizer
state under ZeRO-1, whose layout, update graph and checkpoints this shares).

The model trains as segments cut at its repeated blocks (``segments="blocks"``), so its
gradients arrive through torch autograd block by block. Per micro-step:

    backward  -> each trainable parameter's gradient, when autograd has accumulated it
                 (a post-accumulate-grad hook), is copied into its bucket and dropped
    reduce    -> a bucket whose gradients are all in goes to the ranks that own its
                 stretches of the flat layout (``Comm.start_reduce_to_owners``) while the
                 backward goes on; once it has landed this rank adds its stretch to its
                 gradient shard, and the bucket is freed. At most ``IN_FLIGHT`` buckets
                 are on their way at once (the oldest lands before another goes out)
    end       -> buckets still open (parameters this batch did not reach) go out too,
                 and every bucket in flight lands

The flat layout follows the module's declaration order; buckets are contiguous ranges
of it and go out in one fixed order, the last first (a backward reaches the last layers
first), so every rank issues the same collectives whatever order its own gradients came
in. A bucket completed out of that order waits for the ones before it. Per optimizer step: ZeRO-1's
steps without its reduce-scatter (partial norm and all-reduce for clipping, the shard's
update graph, all-gather of the parameters).

Beside the whole parameters a rank holds 1/N of the optimizer state, 1/N of the
gradients and the buckets in flight (``peak_open_numel``): no whole gradient buffer.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import time
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING

import torch

from ortrain.core.own_hooks import own_hook
from ortrain.distributed.comm import Comm, InFlight
from ortrain.distributed.shard_config import IN_FLIGHT
from ortrain.distributed.sharded_state import ShardedState
from ortrain.runtime.buffer_pool import BufferPool
from ortrain.runtime.flat_layout import FlatLayout
from ortrain.runtime.heap import trim_heap
from ortrain.runtime.zero_pages import lazy_zeros

if TYPE_CHECKING:
    from ortrain.runtime.training_state import TrainingState
    from ortrain.runtime.update_engines import GraphUpdate


@dataclasses.dataclass(frozen=True)
class Bucket:
    start: int  # flat elements [start, stop) of the layout
    stop: int
    names: tuple[str, ...]  # the parameters laid out in it

    @property
    def numel(self) -> int:
        return self.stop - self.start


def make_buckets(layout: FlatLayout, numel: int) -> list[Bucket]:
    """Contiguous ranges covering the whole layout, each closed at the first parameter
    boundary at or past ``numel`` elements (a parameter larger than that is a bucket)."""
    out: list[Bucket] = []
    start, names = 0, []
    for e in layout.entries:
        if names and e.offset - start >= numel:
            out.append(Bucket(start, e.offset, tuple(names)))
            start, names = e.offset, []
        names.append(e.name)
    out.append(Bucket(start, layout.numel, tuple(names)))
    return out


class ShardedGradients(ShardedState):
    """ZeRO-2 (a ``Reducer`` that takes the gradients from torch autograd itself)."""

    takes_grads = True  # the trainer leaves ``.grad`` to it (``collecting``)

    def __init__(self, training: TrainingState, comm: Comm, bucket_numel: int):
        super().__init__(training, comm)
        layout = self.config.layout
        self.buckets = make_buckets(layout, bucket_numel)
        self._bucket_of = {n: k for k, b in enumerate(self.buckets) for n in b.names}
        self._entries = {e.name: e for e in layout.entries}
        # per bucket, the gradients that close it: all its parameters until the first
        # step says which ones the loss reaches
        self._expected = [len(b.names) for b in self.buckets]
        self._waiting = list(self._expected)
        self._open: dict[int, torch.Tensor] = {}
        self._flying: collections.deque[tuple[int, torch.Tensor, InFlight]] = collections.deque()
        self.bucket_pool = BufferPool(comm.device)  # the buckets, reused step to step
        self._pooled: set[int] = set()  # ids of the open or flying buckets taken from it
        self._next = len(self.buckets) - 1  # the next bucket to go out
        self._armed = False
        self.reached: set[str] = set()  # parameters with a gradient in this micro-step
        self.peak_open_numel = 0  # most bucket elements held at once so far
        self.reduce_seconds = 0.0  # waited on bucket reduces so far (a benchmark's figure)
        params = dict(training.module.named_parameters())
        self._hooks = [
            params[n].register_post_accumulate_grad_hook(own_hook(self._arrival(n)))
            for n in layout.names
        ]

    # ------------------------------------------------------------------ layout
    def _layout_order(self, state: TrainingState) -> list[str]:
        """The module's own order (parameter groups would mix every layer's biases into
        one bucket): modules are declared in about the order the forward calls them, so
        a bucket holds neighbouring layers and closes as the backward passes them."""
        trainable = set(state.trainable)
        return [n for n, _ in state.module.named_parameters() if n in trainable]

    def _make_grads(self, state: TrainingState) -> torch.Tensor:
        self.flat_grads = None  # no whole gradients: only this rank's shard of their sums
        shard = lazy_zeros(self.config.layout.shard_numel, self.comm.device)
        state.shard_grads.append(shard)  # zeroed where an accumulation window starts
        state.pristine_grads.add(id(shard))  # but not before the first: zeros already
        return shard

    def _adopt_grads(self, state: TrainingState) -> None:
        pass  # the update graph reads the shard; ``training.grads`` stays empty

    def prepare_update(self, state: TrainingState, engine: GraphUpdate) -> bool:
        bound = super().prepare_update(state, engine)
        reached = set(state.grad_params or ())
        self._expected = [sum(n in reached for n in b.names) for b in self.buckets]
        return bound

    # ------------------------------------------------------------------ the backward
    @contextlib.contextmanager
    def collecting(self) -> Iterator[None]:
        """Around one micro-step's forward and backward: gradients are bucketed and
        reduced as they arrive, the rest when it ends. ``reached`` then names the
        parameters that got one."""
        self.reached = set()
        self._waiting = list(self._expected)
        self._next = len(self.buckets) - 1
        self._armed = True
        try:
            yield
            self._send(every=True)
            while self._flying:
                self._land()
        finally:
            self._armed = False
            # a failed backward's buckets: its window starts over (those in flight may
            # still be written by their reduce: not reused)
            for buf in [*self._open.values(), *(b for _, b, _ in self._flying)]:
                if id(buf) in self._pooled:
                    self.bucket_pool.forget(buf)
            self._pooled.clear()
            self._open.clear()
            self._flying.clear()

    def _arrival(self, name: str) -> Callable[[torch.Tensor], None]:
        def arrived(p: torch.Tensor) -> None:
            if not self._armed or p.grad is None:
                return
            k = self._bucket_of[name]
            if k > self._next:
                raise RuntimeError(
                    f"ZeRO-2: a second gradient of {name} arrived after its bucket was "
                    "reduced (the loss was differentiated twice in one micro-step)"
                )
            bucket = self.buckets[k]
            grad = p.grad.detach().reshape(-1)
            buf = self._open.get(k)
            if buf is None:
                if bucket.names == (name,) and grad.numel() == bucket.numel:
                    # a parameter that is its bucket (an embedding): its gradient is the
                    # bucket, no copy of it is made (autograd's reference dies below)
                    buf = self._open[k] = grad if grad.is_contiguous() else grad.clone()
                else:
                    buf = self._open[k] = self._take_bucket(bucket.numel)
                self._count_held()
            e = self._entries[name]
            view = buf[e.offset - bucket.start : e.stop - bucket.start]
            if name in self.reached:  # accumulated twice in one backward: both count
                view.add_(grad)
            else:
                if view.data_ptr() != grad.data_ptr():
                    view.copy_(grad)
                self.reached.add(name)
                self._waiting[k] -= 1
            p.grad = None  # the whole gradient dies here
            self._send()

        return arrived

    def _count_held(self) -> None:
        held = sum(t.numel() for t in self._open.values())
        held += sum(buf.numel() for _, buf, _ in self._flying)
        self.peak_open_numel = max(self.peak_open_numel, held)

    def _send(self, every: bool = False) -> None:
        """Start the reduces of the buckets that are complete, in the fixed order
        (``every``: all left)."""
        n = self.config.layout.shard_numel
        while self._next >= 0 and (every or self._waiting[self._next] <= 0):
            k = self._next
            bucket = self.buckets[k]
            buf = self._open.pop(k, None)
            if buf is None:  # no gradient here on this rank: the others may have some
                buf = self._take_bucket(bucket.numel)
            while len(self._flying) >= IN_FLIGHT:
                self._land()
            started = time.perf_counter()
            flight = self.comm.start_reduce_to_owners(buf, bucket.start, n)
            self._flying.append((k, buf, flight))
            self._count_held()
            self.reduce_seconds += time.perf_counter() - started
            self._next -= 1

    def _land(self) -> None:
        """Wait for the oldest bucket in flight and add this rank's stretch of its sums."""
        k, buf, flight = self._flying.popleft()
        started = time.perf_counter()
        flight.wait()
        self.reduce_seconds += time.perf_counter() - started
        bucket = self.buckets[k]
        lo, hi = self.config.layout.shard(self.config.rank)
        a, b = max(bucket.start, lo), min(bucket.stop, hi)
        if a < b:
            self.grad_shard[a - lo : b - lo].add_(buf[a - bucket.start : b - bucket.start])
        if id(buf) in self._pooled:
            self._pooled.discard(id(buf))
            self.bucket_pool.give(buf)

    def _take_bucket(self, numel: int) -> torch.Tensor:
        buf = self.bucket_pool.take(numel, zero=True)
        self._pooled.add(id(buf))
        return buf

    # ------------------------------------------------------------------ the update
    def update(self, run_update: Callable[[], None]) -> None:
        self._make_room()
        if self._norm is not None:  # the shard holds the reduced sums already
            self._norm.run()
            self.comm.all_reduce(self.sq_norm)
        run_update()
        self.comm.all_gather(self.flat_params)
        trim_heap()

    def bucket_sizes(self) -> Sequence[int]:
        return [b.numel for b in self.buckets]
