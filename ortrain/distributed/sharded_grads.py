"""ZeRO-2: gradients are reduced bucket by bucket while the backward produces them, and a
rank keeps only its shard of their sums (as it keeps only its shard of the optimizer
state under ZeRO-1, whose layout, update graph and checkpoints this shares).

The model trains as segments cut at its repeated blocks (``segments="blocks"``), so its
gradients arrive through torch autograd block by block. Per micro-step:

    backward  -> each trainable parameter's gradient, when autograd has accumulated it
                 (a post-accumulate-grad hook), is copied into its bucket and dropped; a
                 compiled segment's backward graph writes it there in the first place
                 (``grad_home``), so no gradient-sized output is made beside the bucket
    reduce    -> a bucket whose gradients are all in goes to the ranks that own its
                 stretches of the flat layout (``Comm.start_reduce_to_owners``) while the
                 backward goes on; once it has landed this rank adds its stretch to its
                 gradient shard, and the bucket is freed. At most ``IN_FLIGHT`` buckets
                 are on their way at once (the oldest lands before another goes out)
    end       -> buckets still open (parameters this batch did not reach) go out too,
                 and every bucket in flight lands

The flat layout follows the module's declaration order; buckets are contiguous ranges
of it, none across a repeated block's edge (a block's backward opens its own buckets
only), and go out in one fixed order, the last first (a backward reaches the last layers
first), so every rank issues the same collectives whatever order its own gradients came
in. A bucket completed out of that order waits for the ones before it. Per optimizer step: ZeRO-1's
steps without its reduce-scatter (partial norm and all-reduce for clipping, the shard's
update graph, all-gather of the parameters).

A tied table (GPT-2's embedding and LM head, each its own segment) whose head's
gradient is smaller as its product's factors (few tokens: ``runner.SegmentRunner
.parts_of``) is ``route``d: its gradient never goes through autograd (which would hold
the head's table-sized part until the embedding's rows are added, at the very end of
the backward) and is never made whole. The embedding's backward hands over its rows as
rows, the head's its product's two factors; at the micro-step's end every rank's are
gathered (``Comm.all_gather_rows``) and each rank adds only the rows of its own shard
(``add_rows_in_range``, ``add_product_in_range``).

Beside the whole parameters a rank holds 1/N of the optimizer state, 1/N of the
gradients and the buckets in flight (``peak_open_numel``): no whole gradient buffer.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import time
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING

import torch

from ortrain.core.own_hooks import own_hook
from ortrain.distributed.comm import Comm, InFlight
from ortrain.distributed.shard_config import IN_FLIGHT
from ortrain.distributed.sharded_state import ShardedState
from ortrain.runtime.buffer_pool import BufferPool
from ortrain.runtime.flat_layout import FlatLayout
from ortrain.runtime.heap import trim_heap
from ortrain.runtime.zero_pages import lazy_zeros, populate
from ortrain.segments.blocks import repeated_blocks

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


def make_buckets(
    layout: FlatLayout,
    numel: int,
    alone: Collection[str] = (),
    groups: Mapping[str, str] | None = None,
) -> list[Bucket]:
    """Contiguous ranges covering the whole layout, made from its end (the backward's
    order), each closed at the first parameter boundary at or past ``numel`` elements (a
    parameter that large is a bucket of its own, its gradient the bucket itself), as is
    each parameter of ``alone``; no bucket holds parameters of two ``groups`` (a
    parameter's group: its repeated block, "" outside one). A block's remainder is thus
    its first bucket, the one still on its way when the next block's backward opens its
    buckets."""
    group = (groups or {}).get
    out: list[Bucket] = []
    stop, names = layout.numel, []  # names from the last on
    head = None  # the bucket's earliest entry so far
    for e in reversed(layout.entries):
        if head is not None and (
            stop - head.offset >= numel
            or e.stop - e.offset >= numel  # a parameter of a bucket's size: one of its own
            or e.name in alone
            or head.name in alone
            or group(e.name, "") != group(head.name, "")
        ):
            out.append(Bucket(head.offset, stop, tuple(reversed(names))))
            stop, names = head.offset, []
        names.append(e.name)
        head = e
    out.append(Bucket(0, stop, tuple(reversed(names))))
    return out[::-1]


def block_of(module: torch.nn.Module, names: Collection[str]) -> dict[str, str]:
    """Each parameter's outermost repeated block (``repeated_blocks``; "" outside one)."""
    blocks = sorted(repeated_blocks(module), key=len)
    return {n: next((b for b in blocks if n.startswith(b + ".")), "") for n in names}


def add_rows_in_range(
    dst: torch.Tensor, first: int, width: int, rows: torch.Tensor, updates: torch.Tensor
) -> None:
    """Of a table of rows ``width`` elements wide, flattened, ``dst`` holds the elements
    from ``first`` on: add ``updates[i]`` to row ``rows[i]`` where ``dst`` holds it (in
    place; rows already in [0, number of rows))."""
    end = first + dst.numel()
    r0, r1 = -(-first // width), end // width  # the rows ``dst`` holds whole
    if r0 < r1:
        keep = (rows >= r0) & (rows < r1)
        whole = dst[r0 * width - first : r1 * width - first].view(r1 - r0, width)
        whole.index_add_(0, rows[keep] - r0, updates[keep])
    for r in sorted({first // width, (end - 1) // width}):
        if r0 <= r < r1:
            continue
        hit = rows == r
        if bool(hit.any()):  # the shard's edge cuts this row
            a, b = max(first, r * width), min(end, (r + 1) * width)
            dst[a - first : b - first] += updates[hit].sum(0)[a - r * width : b - r * width]


def add_product_in_range(
    dst: torch.Tensor, first: int, width: int, left: torch.Tensor, right: torch.Tensor
) -> None:
    """As ``add_rows_in_range`` for the table ``left^T @ right`` (``left [T, rows]``,
    ``right [T, width]``): only the rows ``dst`` holds are multiplied out."""
    end = first + dst.numel()
    r0, r1 = -(-first // width), end // width
    if r0 < r1:
        whole = dst[r0 * width - first : r1 * width - first].view(r1 - r0, width)
        whole.addmm_(left[:, r0:r1].t(), right)
    for r in sorted({first // width, (end - 1) // width}):
        if not r0 <= r < r1:  # the shard's edge cuts this row
            a, b = max(first, r * width), min(end, (r + 1) * width)
            dst[a - first : b - first] += (left[:, r] @ right)[a - r * width : b - r * width]


def _stacked(
    parts: list[tuple[torch.Tensor, torch.Tensor]],
    widths: int | tuple[int, int],
    dtype: torch.dtype,
    device: torch.device,
    rows: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """A micro-step's pieces of one gradient, stacked: rows [N] int64 and updates
    [N, width] (``rows``), or factors [T, n] and [T, width] (``widths`` = (n, width))."""
    if rows:
        assert isinstance(widths, int)
        if not parts:  # this rank's batch did not reach it: the others' still count
            return (
                torch.empty(0, dtype=torch.int64, device=device),
                torch.empty((0, widths), dtype=dtype, device=device),
            )
        return (
            torch.cat([r.reshape(-1) for r, _ in parts]),
            torch.cat([u.reshape(r.numel(), widths).to(dtype) for r, u in parts]),
        )
    assert isinstance(widths, tuple)
    if not parts:
        return (
            torch.empty((0, widths[0]), dtype=dtype, device=device),
            torch.empty((0, widths[1]), dtype=dtype, device=device),
        )
    return (
        torch.cat([f.to(dtype) for f, _ in parts]),
        torch.cat([g.to(dtype) for _, g in parts]),
    )


class ShardedGradients(ShardedState):
    """ZeRO-2 (a ``Reducer`` that takes the gradients from torch autograd itself)."""

    takes_grads = True  # the trainer leaves ``.grad`` to it (``collecting``)

    def __init__(self, training: TrainingState, comm: Comm, bucket_numel: int):
        super().__init__(training, comm)
        layout = self.config.layout
        self._entries = {e.name: e for e in layout.entries}
        self._bucket_numel = bucket_numel
        # a block's backward graph writes its gradients into their buckets at once: buckets
        # that end at its edges hold no other block's gradients open beside them
        self._groups = block_of(training.module, layout.names)
        # parameters whose gradient comes outside autograd (``route``), in pieces
        self.routed: tuple[str, ...] = ()
        # this rank's last offer of parameters to route, and what the ranks agreed on
        self._offer: tuple[frozenset[str], ...] | None = None
        self._agreed_routes: tuple[frozenset[str], frozenset[str], frozenset[str]] = (
            frozenset(),
            frozenset(),
            frozenset(),
        )
        self._row_params: frozenset[str] = frozenset()  # routed ones with rows
        self._factor_params: frozenset[str] = frozenset()  # routed ones with factors
        self._rows: dict[str, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        self._factors: dict[str, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        self.rows_gathered = 0  # routed parameters' rows gathered so far (a test's figure)
        self.factors_gathered = 0  # and their product factors
        self.routed_stretches = 0  # stretches of them updated as they were summed (a test's)
        self._reaching: set[str] | None = None  # what the first step reached (``_expected``)
        self._lay_out_buckets()
        self._open: dict[int, torch.Tensor] = {}
        self._flying: collections.deque[tuple[int, torch.Tensor, InFlight]] = collections.deque()
        self.bucket_pool = BufferPool(comm.device)  # the buckets, reused step to step
        # receive buffers of the point-to-point reduces (``_take_scratch``): free ones,
        # and the one behind each view handed out
        self._scratch_free: list[torch.Tensor] = []
        self._scratch_base: dict[int, torch.Tensor] = {}
        self._pooled: set[int] = set()  # ids of the open or flying buckets taken from it
        self._unzeroed: set[int] = set()  # open buckets taken without zeros (``grad_home``)
        self._next = 0  # the position in ``_order`` of the next bucket to go out
        self._armed = False
        self.reached: set[str] = set()  # parameters with a gradient in this micro-step
        self.peak_open_numel = 0  # most bucket elements held at once so far
        self.reduce_seconds = 0.0  # waited on bucket reduces so far (a benchmark's figure)
        params = dict(training.module.named_parameters())
        self._name_of = {id(params[n]): n for n in layout.names}
        self._homed: set[str] = set()  # given a view of their bucket in this micro-step
        self.written_in_place = 0  # gradients that arrived in their bucket (a test's figure)
        # ZeRO-2/3's update in the backward (``ShardBackwardUpdate``): given each landed
        # bucket's stretch of this rank's shard (its first flat element) and the summed
        # gradient of it, which is then not added to the gradient shard
        self.on_landing: Callable[[int, torch.Tensor], None] | None = None
        self.landed: set[str] = set()  # parameters whose bucket landed in this micro-step
        self.grads_released = False  # the gradient shard handed back (``memory_report``)
        # parameters a backward graph read after their gradient had arrived (a read that
        # contributes none, e.g. through ``detach()``): the update in the backward would
        # change them before that read (``ShardBackwardUpdate`` then runs after it)
        self.late_reads: set[str] = set()
        self._hooks = [
            params[n].register_post_accumulate_grad_hook(own_hook(self._arrival(n)))
            for n in layout.names
        ]

    # ------------------------------------------------------------------ layout
    def _lay_out_buckets(self) -> None:
        self.buckets = make_buckets(
            self.config.layout, self._bucket_numel, self.routed, self._groups
        )
        self._bucket_of = {n: k for k, b in enumerate(self.buckets) for n in b.names}
        # per bucket, the gradients that close it: all its parameters until the first
        # step says which ones the loss reaches
        self._expected = [self._closing(b) for b in self.buckets]
        self._waiting = list(self._expected)
        # the order they go out in, the same on every rank: from the last (a backward
        # reaches the last layers first); a routed parameter's bucket never goes (its
        # gradient comes in pieces, ``_land_pieces``)
        self._order = [
            k
            for k in reversed(range(len(self.buckets)))
            if self.buckets[k].names[0] not in self.routed
        ]
        self._position = {k: i for i, k in enumerate(self._order)}

    def _closing(self, bucket: Bucket) -> int:
        """How many gradients close ``bucket`` in a micro-step: one per parameter the
        loss reaches (all until the first step says)."""
        reaching = self._reaching
        return sum(reaching is None or n in reaching for n in bucket.names)

    def agree_routes(
        self, routed: frozenset[str], rows: frozenset[str], factors: frozenset[str]
    ) -> tuple[frozenset[str], frozenset[str], frozenset[str]]:
        """The parameters every rank could route (each rank's batches build call
        signatures of their own: what one rank could route another may not), with the
        rows and factors any rank hands over (each gathers every rank's, its own
        possibly none). One all-reduce a micro-step; an all-gather where a rank's offer
        changed."""
        offer = (routed, rows, factors)
        if not self.comm.any(offer != self._offer):
            return self._agreed_routes
        self._offer = offer
        every = self.comm.all_gather_object(offer)
        names = frozenset.intersection(*(o[0] for o in every))
        rows = frozenset().union(*(o[1] for o in every)) & names
        factors = frozenset().union(*(o[2] for o in every)) & names
        self._agreed_routes = (names, rows, factors)
        return self._agreed_routes

    def route(self, rows: Collection[str], factors: Collection[str]) -> None:
        """The gradients of parameters ``rows`` and ``factors`` name come from now on only
        in pieces, outside autograd: rows (``add_rows``) of those in ``rows``, product
        factors (``take_factors``) of those in ``factors``; every rank's are added into
        the shard at the end of the micro-step. Each is a bucket of its own that never
        goes out."""
        if self._open or self._flying:
            raise RuntimeError("ZeRO-2: parameters routed while gradients are on their way")
        self._row_params, self._factor_params = frozenset(rows), frozenset(factors)
        self.routed = tuple(sorted(self._row_params | self._factor_params))
        self._lay_out_buckets()

    def _layout_order(self, state: TrainingState) -> list[str]:
        """The module's own order (parameter groups would mix every layer's biases into
        one bucket): modules are declared in about the order the forward calls them, so
        a bucket holds neighbouring layers and closes as the backward passes them."""
        trainable = set(state.trainable)
        return [n for n, _ in state.module.named_parameters() if n in trainable]

    def _make_grads(self, state: TrainingState) -> torch.Tensor:
        self.flat_grads = None  # no whole gradients: only this rank's shard of their sums
        shard = lazy_zeros(self.config.layout.shard_numel, self.comm.device)
        self._shard_lazy = True  # until the first micro-step has written it
        state.shard_grads.append(shard)  # zeroed where an accumulation window starts
        state.pristine_grads.add(id(shard))  # but not before the first: zeros already
        return shard

    def _adopt_grads(self, state: TrainingState) -> None:
        pass  # the update graph reads the shard; ``training.grads`` stays empty

    def prepare_update(self, state: TrainingState, engine: GraphUpdate) -> bool:
        bound = super().prepare_update(state, engine)
        self._reaching = set(state.grad_params or ())
        self._expected = [self._closing(b) for b in self.buckets]
        return bound

    # ------------------------------------------------------------------ the backward
    @contextlib.contextmanager
    def collecting(self) -> Iterator[None]:
        """Around one micro-step's forward and backward: gradients are bucketed and
        reduced as they arrive, the rest when it ends. ``reached`` then names the
        parameters that got one."""
        self.reached = set()
        self.landed = set()
        self._homed.clear()
        self._unzeroed.clear()
        self._waiting = list(self._expected)
        self._next = 0
        self._rows.clear()
        self._factors.clear()
        self._armed = True
        try:
            yield
            for name in self._homed - self.reached:  # written there, never accumulated
                if self._bucket_of[name] in self._open:
                    self._home_view(name).zero_()
            self._send(every=True)
            while self._flying:
                self._land()
            self._land_rows()
            self._shard_lazy = False
        finally:
            self._rows.clear()
            self._factors.clear()
            self._armed = False
            # a failed backward's buckets: its window starts over (those in flight may
            # still be written by their reduce: not reused)
            for buf in [*self._open.values(), *(b for _, b, _ in self._flying)]:
                if id(buf) in self._pooled:
                    self.bucket_pool.forget(buf)
            self._pooled.clear()
            self._open.clear()
            self._flying.clear()
            self._homed.clear()
            self._scratch_base.clear()  # (one a receive may still write is not reused)

    def grad_home(self, param: torch.Tensor) -> torch.Tensor | None:
        """Where ``param``'s gradient of this micro-step goes: a view of its bucket of the
        parameter's shape, for a graph to write it into (its arrival then copies nothing,
        and no gradient-sized output is made beside the bucket). None outside a
        micro-step and for a parameter handed one already in it (a module called twice:
        its second gradient is added). A parameter that is a bucket of its own (a tied
        table) gets it too: its memory is the pool's, kept from step to step, where the
        graph's own output would be made afresh on every step."""
        name = self._name_of.get(id(param))
        if not self._armed or name is None or name in self.reached or name in self._homed:
            return None
        k = self._bucket_of[name]
        if k not in self._position or self._position[k] < self._next:
            return None
        if k not in self._open:
            # not zeroed: a graph writes its outputs whole, and what no gradient wrote is
            # zeroed when the bucket goes out (``_zero_unwritten``)
            self._open[k] = self._take_bucket(self.buckets[k].numel, zero=False)
            self._unzeroed.add(k)
            self._count_held()
        self._homed.add(name)
        return self._home_view(name)

    def _home_view(self, name: str) -> torch.Tensor:
        e, k = self._entries[name], self._bucket_of[name]
        start = self.buckets[k].start
        return self._open[k][e.offset - start : e.stop - start].view(e.shape)

    def _arrival(self, name: str) -> Callable[[torch.Tensor], None]:
        def arrived(p: torch.Tensor) -> None:
            if not self._armed or p.grad is None:
                return
            grad, p.grad = p.grad, None  # the whole gradient dies in ``_arrive``
            self._arrive(name, grad)

        return arrived

    def check_reads(self, params: Sequence[torch.Tensor]) -> None:
        """A compiled segment's backward graph is about to read ``params``."""
        self._check_late(frozenset(self._name_of[id(p)] for p in params if id(p) in self._name_of))

    def _check_late(self, read: frozenset[str]) -> None:
        """A backward graph reads ``read``: note those whose gradient arrived already (a
        routed table's pieces are added at the micro-step's end: not among them); where
        the update runs in the backward and one of them was updated, the read would see
        the new value, so the step stops."""
        if not self._armed:
            return
        late = (read & self.reached) - set(self.routed)
        self.late_reads |= late
        changed = read & self.landed
        if changed:
            raise RuntimeError(
                f"ZeRO: a backward graph reads {', '.join(sorted(changed)[:3])}, which this "
                "step's update in the backward changed already (its gradient had arrived; "
                "the first step read no parameter so): this step's update is incomplete; "
                "resume from a checkpoint with TrainerOptions(update_engine='graph')"
            )

    def add_rows(self, name: str, rows: torch.Tensor, updates: torch.Tensor) -> None:
        """Rows of a routed parameter's gradient, kept until the micro-step's end."""
        if not self._armed:
            raise RuntimeError(f"ZeRO-2: rows of {name}'s gradient came outside a training step")
        self._rows.setdefault(name, []).append((rows, updates))
        self.reached.add(name)

    def take_factors(self, name: str, left: torch.Tensor, right: torch.Tensor) -> None:
        """A routed parameter's gradient as a product's factors (``left^T @ right``),
        kept until the micro-step's end."""
        if not self._armed:
            raise RuntimeError(f"ZeRO-2: factors of {name}'s gradient came outside a training step")
        self._factors.setdefault(name, []).append((left, right))
        self.reached.add(name)

    def _arrive(self, name: str, whole: torch.Tensor) -> None:
        k = self._bucket_of[name]
        if k not in self._position:
            raise RuntimeError(
                f"ZeRO-2: a whole gradient of {name} arrived, which comes only in pieces "
                "(rows, factors): eager code read it where the plan saw none"
            )
        if self._position[k] < self._next:
            raise RuntimeError(
                f"ZeRO-2: a second gradient of {name} arrived after its bucket was "
                "reduced (the loss was differentiated twice in one micro-step)"
            )
        bucket = self.buckets[k]
        grad = whole.detach().reshape(-1)
        del whole
        buf = self._open.get(k)
        if buf is None:
            if bucket.names == (name,) and grad.numel() == bucket.numel:
                # a parameter that is its bucket (an embedding): its gradient is the
                # bucket, no copy of it is made
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
            else:
                self.written_in_place += 1
            self.reached.add(name)
            self._waiting[k] -= 1
        del grad
        self._send()

    def _zero_unwritten(self, bucket: Bucket, buf: torch.Tensor) -> None:
        """Zeros in a bucket taken without them wherever no gradient of this micro-step
        was written: the gaps between its parameters (the layout's alignment) and the
        parameters not reached (sent as zeros, as an eager rank's missing ``.grad`` adds
        nothing to the sum)."""
        at = bucket.start
        for name in bucket.names:
            e = self._entries[name]
            if e.offset > at:
                buf[at - bucket.start : e.offset - bucket.start].zero_()
            if name not in self.reached:
                buf[e.offset - bucket.start : e.stop - bucket.start].zero_()
            at = max(at, e.stop)
        if bucket.stop > at:
            buf[at - bucket.start :].zero_()

    def _count_held(self) -> None:
        held = sum(t.numel() for t in self._open.values())
        held += sum(buf.numel() for _, buf, _ in self._flying)
        held += sum(b.numel() for b in self._scratch_base.values())
        self.peak_open_numel = max(self.peak_open_numel, held)

    def _send(self, every: bool = False) -> None:
        """Start the reduces of the buckets that are complete, in the fixed order
        (``every``: all left)."""
        n = self.config.layout.shard_numel
        while self._next < len(self._order):
            k = self._order[self._next]
            if not every and self._waiting[k] > 0:
                break
            bucket = self.buckets[k]
            buf = self._open.pop(k, None)
            if buf is None:  # no gradient here on this rank: the others may have some
                buf = self._take_bucket(bucket.numel)
            elif k in self._unzeroed:
                self._unzeroed.discard(k)
                self._zero_unwritten(bucket, buf)
            while len(self._flying) >= IN_FLIGHT:
                self._land()
            started = time.perf_counter()
            flight = self.comm.start_reduce_to_owners(
                buf, bucket.start, n, self._take_scratch, self._bucket_numel
            )
            self._flying.append((k, buf, flight))
            self._count_held()
            self.reduce_seconds += time.perf_counter() - started
            self._next += 1

    def _land(self) -> None:
        """Wait for the oldest bucket in flight and add this rank's stretch of its sums."""
        k, buf, flight = self._flying.popleft()
        started = time.perf_counter()
        flight.wait()
        self.reduce_seconds += time.perf_counter() - started
        bucket = self.buckets[k]
        lo, hi = self.config.layout.shard(self.config.rank)
        a, b = max(bucket.start, lo), min(bucket.stop, hi)
        if self.on_landing is not None:
            self.landed.update(bucket.names)
            if a < b:
                self.on_landing(a, buf[a - bucket.start : b - bucket.start])
        elif a < b:
            dst = self.grad_shard[a - lo : b - lo]
            if self._shard_lazy:  # its first sums: read before written
                populate(dst)
            dst.add_(buf[a - bucket.start : b - bucket.start])
        for got in flight.received:
            self._give_scratch(got)
        if id(buf) in self._pooled:
            self._pooled.discard(id(buf))
            self.bucket_pool.give(buf)

    def _land_rows(self) -> None:
        """Every rank's rows and factors of each routed parameter, added where this rank's
        shard holds them (the same collectives on every rank, in ``routed``'s order).
        Where the update runs as gradients land, they are summed a bucket's worth of rows
        at a time into a pooled buffer, each stretch updated before the next is summed (a
        whole table's stretch at once would be a table-sized buffer)."""
        lo, hi = self.config.layout.shard(self.config.rank)
        dtype, device = self.grad_shard.dtype, self.grad_shard.device
        landing = self.on_landing
        for name in self.routed:
            e = self._entries[name]
            n_rows = e.shape[0] if e.shape else 1
            width = max(1, e.numel // max(1, n_rows))
            a, b = max(lo, e.offset), min(hi, e.stop)
            started = time.perf_counter()
            rows_every: list[tuple[torch.Tensor, torch.Tensor]] = []
            factors_every: list[tuple[torch.Tensor, torch.Tensor]] = []
            if name in self._row_params:
                rows, updates = _stacked(self._rows.pop(name, []), width, dtype, device, True)
                got = self.comm.all_gather_rows(rows, updates, f"rows of {name}'s gradient")
                rows_every = [(r.remainder(n_rows), u) for r, u in got]  # in rank order
                del rows, updates, got
                self.rows_gathered += 1
            if name in self._factor_params:
                left, right = _stacked(self._factors.pop(name, []), (n_rows, width), dtype, device)
                factors_every = self.comm.all_gather_rows(
                    left, right, f"factors of {name}'s gradient"
                )
                del left, right
                self.factors_gathered += 1
            step = b - a if landing is None else max(width, self._bucket_numel // width * width)
            for c0 in range(a, b, max(step, 1)):
                c1 = min(b, c0 + step)
                if landing is None:
                    dst = self.grad_shard[c0 - lo : c1 - lo]
                else:
                    dst = self._take_bucket(c1 - c0)
                for r, u in rows_every:
                    add_rows_in_range(dst, c0 - e.offset, width, r, u)
                for f, g in factors_every:
                    add_product_in_range(dst, c0 - e.offset, width, f, g)
                if landing is not None:
                    landing(c0, dst)
                    self.routed_stretches += 1
                    self._pooled.discard(id(dst))
                    self.bucket_pool.give(dst)
                del dst
            del rows_every, factors_every
            if landing is not None:
                self.landed.add(name)
            self.reduce_seconds += time.perf_counter() - started

    def _take_scratch(self, numel: int) -> torch.Tensor:
        """Where a bucket's owner receives the other ranks' stretches of it: a buffer of
        the bucket size (larger stretches come in pieces), kept from step to step
        (stretch sizes vary by bucket: a buffer per size would be made afresh, its pages
        faulted, every step)."""
        free = next((b for b in self._scratch_free if b.numel() >= numel), None)
        if free is None:
            largest = max(self.buckets[k].numel for k in self._order)  # ones that go out
            free = torch.empty(
                max(numel, min(largest, self._bucket_numel)), device=self.comm.device
            )
            populate(free)
        else:
            self._scratch_free.remove(free)
        view = free[:numel]
        self._scratch_base[id(view)] = free
        return view

    def _give_scratch(self, view: torch.Tensor) -> None:
        base = self._scratch_base.pop(id(view), None)
        if base is not None:
            self._scratch_free.append(base)

    def _take_bucket(self, numel: int, zero: bool = True) -> torch.Tensor:
        buf = self.bucket_pool.take(numel, zero=zero)
        self._pooled.add(id(buf))
        return buf

    # ------------------------------------------------------------------ the update
    def update(self, run_update: Callable[[], None]) -> None:
        self._make_room()
        self._global_scaled_sq_norm()  # the shard holds the reduced sums already
        run_update()
        self.comm.all_gather(self.flat_params)
        trim_heap()

    def bucket_sizes(self) -> Sequence[int]:
        return [b.numel for b in self.buckets]
