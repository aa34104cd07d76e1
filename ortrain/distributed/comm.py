"""The collectives the trainer runs, on its own groups with a timeout.

The groups span the ranks of the default process group (the one torchrun set up) or of
the group the user passes; being our own, they carry ``TrainerOptions.dist_timeout``
whatever the user's group was created with. Host tensors (the trainer's state on CPU,
and the small control messages on every device: flags, fingerprints, objects) go over
a gloo group; device tensors (the state of a trainer on CUDA: flat gradients,
parameters, shards) stay on the device and go over an NCCL group, ordered on torch's
current stream (the trainer's session stream) without host synchronisation. Each
collective picks the group by its tensor's device (``group_for``): the rest of the
distributed code is the same on both. Every collective is guarded: a failure (a peer
died, or did not arrive within the timeout) becomes a ``RankFailureError`` naming the
rank, as told by ``RankHealth``.
"""

from __future__ import annotations

import contextlib
import datetime
import socket
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist

from ortrain.core.errors import RankFailureError
from ortrain.distributed.health import RankHealth

# what torch's DistributedDataParallel broadcasts at once when it syncs a module's state
BROADCAST_BUCKET_BYTES = 250 * 2**20


def backend_for(device: torch.device) -> str:
    """The torch.distributed backend for tensors on ``device``."""
    return "nccl" if device.type == "cuda" else "gloo"


class Comm:
    """This trainer's groups: its rank, world size, and guarded collectives.

    ``device``: where the trainer's state lives; on CUDA a second group (NCCL) carries
    the tensors there, and this process must own that device alone.
    """

    def __init__(
        self, parent: dist.ProcessGroup | None, timeout_s: float, device: torch.device | None = None
    ):
        self.timeout_s = timeout_s
        self.device = device or torch.device("cpu")
        ranks = (
            sorted(dist.get_process_group_ranks(parent))
            if parent is not None
            else list(range(dist.get_world_size()))
        )
        self.global_ranks = ranks  # group rank i is global rank ranks[i] (new_group sorts)
        self.health = RankHealth.for_process()
        with self._guard("new_group"):
            self.group = dist.new_group(
                ranks,
                timeout=datetime.timedelta(seconds=timeout_s),
                backend="gloo",
                use_local_synchronization=True,
            )
        self.rank = dist.get_rank(self.group)
        self.world_size = len(ranks)
        self.device_group = self.group
        self._check_devices()
        if backend_for(self.device) != "gloo":
            torch.cuda.set_device(self.device)  # NCCL's communicator binds the current device
            with self._guard("new_group (nccl)"):
                self.device_group = dist.new_group(
                    ranks,
                    timeout=datetime.timedelta(seconds=timeout_s),
                    backend=backend_for(self.device),
                    use_local_synchronization=True,
                )

    def _check_devices(self) -> None:
        """Every rank on the same kind of device, and on CUDA each on a GPU of its own
        (NCCL needs that); otherwise every rank raises, naming the ranks."""
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        mine = (socket.gethostname(), self.device.type, self.device.index)
        everyone = self.all_gather_object(mine)
        kinds = [where[1] for where in everyone]
        if len(set(kinds)) > 1:
            raise ValueError(
                f"rank {dist.get_rank()}: the ranks' trainers run on different kinds of device "
                f"(device kind by group rank: {dict(enumerate(kinds))}); use one kind on every rank"
            )
        shared = [r for r, where in enumerate(everyone) if where == mine and r != self.rank]
        if self.device.type == "cuda" and shared:
            raise ValueError(
                f"rank {dist.get_rank()}: device {self.device} on {mine[0]} is also used by "
                f"group rank(s) {shared}; NCCL needs one GPU per rank: pass "
                "TrainerOptions(device=f'cuda:{int(os.environ[\"LOCAL_RANK\"])}')"
            )

    def group_for(self, t: torch.Tensor) -> dist.ProcessGroup:
        """The group that carries ``t``: NCCL for device tensors, gloo for host ones."""
        return self.group if t.device.type == "cpu" else self.device_group

    @property
    def backend(self) -> str:
        return backend_for(self.device)

    @contextlib.contextmanager
    def _guard(self, op: str) -> Iterator[None]:
        self.health.seq += 1
        seq, start = self.health.seq, time.monotonic()
        try:
            yield
        except RuntimeError as exc:  # gloo/NCCL errors (DistBackendError is a RuntimeError)
            elapsed = time.monotonic() - start
            me = dist.get_rank()
            peers = [r for r in self.global_ranks if r != me]
            blamed, why = self.health.diagnose(peers)
            raise RankFailureError(
                f"rank {me}: {op} (collective #{seq}) failed after {elapsed:.1f} s "
                f"(TrainerOptions.dist_timeout={self.timeout_s:g} s): {why}. "
                f"{self.backend} said: "
                f"{str(exc).splitlines()[0] if str(exc) else type(exc).__name__}",
                ranks=blamed,
            ) from exc

    def broadcast(self, t: torch.Tensor) -> None:
        """``t`` from group rank 0 to every rank, in place."""
        with self._guard("broadcast"):
            dist.broadcast(t, src=self.global_ranks[0], group=self.group_for(t))

    def broadcast_tensors(self, tensors: Sequence[torch.Tensor]) -> None:
        """Group rank 0's values of ``tensors`` to every rank, in place (gloo has no bool:
        those travel as bytes). A contiguous tensor of ``BROADCAST_BUCKET_BYTES`` or more
        goes as it is; the others of one device and dtype together, through buckets of
        about that size (a copy of a whole model would be the largest allocation of a
        ZeRO rank's start)."""
        by_dtype: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
        for t in tensors:
            t = t.view(torch.uint8) if t.dtype == torch.bool else t
            if t.is_contiguous() and t.nbytes >= BROADCAST_BUCKET_BYTES:
                self.broadcast(t)
                continue
            by_dtype.setdefault((t.device, t.dtype), []).append(t)
        for group in by_dtype.values():
            bucket: list[torch.Tensor] = []
            held = 0
            for t in group:
                bucket.append(t)
                held += t.nbytes
                if held >= BROADCAST_BUCKET_BYTES:
                    self._broadcast_together(bucket)
                    bucket, held = [], 0
            if bucket:
                self._broadcast_together(bucket)

    def _broadcast_together(self, tensors: list[torch.Tensor]) -> None:
        flat = torch.cat([t.reshape(-1) for t in tensors])
        self.broadcast(flat)
        offset = 0
        for t in tensors:
            t.copy_(flat[offset : offset + t.numel()].view_as(t))
            offset += t.numel()

    def broadcast_object(self, obj: Any) -> Any:
        box = [obj]
        with self._guard("broadcast_object"):
            dist.broadcast_object_list(box, src=self.global_ranks[0], group=self.group)
        return box[0]

    def all_gather_object(self, obj: Any) -> list[Any]:
        """Every rank's ``obj``, in group rank order (over gloo)."""
        out: list[Any] = [None] * self.world_size
        with self._guard("all_gather_object"):
            dist.all_gather_object(out, obj, group=self.group)
        return out

    def all_reduce(self, t: torch.Tensor) -> None:
        """In-place sum over ranks."""
        with self._guard("all_reduce"):
            dist.all_reduce(t, group=self.group_for(t))

    def all_reduce_buckets(self, buckets: Sequence[torch.Tensor]) -> None:
        """In-place sums, all buckets in flight at once (gloo runs them on its threads;
        NCCL queues them on its stream, and ``wait`` orders torch's current stream after)."""
        with self._guard(f"all_reduce of {len(buckets)} gradient buckets"):
            works = [dist.all_reduce(b, group=self.group_for(b), async_op=True) for b in buckets]
            for w in works:
                w.wait()

    def reduce_scatter(self, flat: torch.Tensor) -> None:
        """In place: rank i's shard (the i-th of ``world_size`` equal parts) of ``flat``
        becomes the sum over ranks of that shard; the other shards are left undefined.

        One reduce per shard, all in flight at once: on gloo that is faster than its
        reduce_scatter (which also needs a separate output buffer). NCCL reduce-scatters in
        place (its output is the input's shard of this rank)."""
        shards = flat.view(self.world_size, -1)
        group = self.group_for(flat)
        with self._guard("reduce_scatter"):
            if group is not self.group:
                dist.reduce_scatter_tensor(shards[self.rank], flat, group=group)
                return
            works = [
                dist.reduce(shards[i], dst=self.global_ranks[i], group=group, async_op=True)
                for i in range(self.world_size)
            ]
            for w in works:
                w.wait()

    def start_reduce_to_owners(
        self,
        part: torch.Tensor,
        start: int,
        shard_numel: int,
        take: Callable[[int], torch.Tensor] | None = None,
        chunk: int = 0,
    ) -> InFlight:
        """In place, for ``part`` = elements ``[start, start + part.numel())`` of a flat
        buffer whose rank-i shard is ``[i * shard_numel, (i + 1) * shard_numel)``: on the
        rank owning each stretch of it, that stretch becomes the sum over ranks once
        ``wait()`` returns; the rest is left undefined (ZeRO-2's bucket), all in flight at
        once.

        On gloo with ``take`` (a buffer of n elements) and ``chunk`` > 0: each rank sends
        every other owner its stretch, in pieces of at most ``chunk`` elements, and an
        owner adds the pieces it receives into its own, one at a time through one buffer
        (gloo's reduce per owner is slower: docs/distributed.md). Otherwise one reduce
        per owner."""
        stop, group = start + part.numel(), self.group_for(part)
        op = "reduce of a gradient bucket"
        stretches = [
            (max(start, i * shard_numel), min(stop, (i + 1) * shard_numel))
            for i in range(self.world_size)
        ]
        if take is not None and chunk > 0 and group is self.group:
            return self._send_to_owners(part, start, stretches, take, chunk, op)
        with self._guard(op):
            works = [
                dist.reduce(
                    part[lo - start : hi - start],
                    dst=self.global_ranks[i],
                    group=group,
                    async_op=True,
                )
                for i, (lo, hi) in enumerate(stretches)
                if lo < hi
            ]
        return InFlight(self, op, works)

    def _send_to_owners(
        self,
        part: torch.Tensor,
        start: int,
        stretches: list[tuple[int, int]],
        take: Callable[[int], torch.Tensor],
        chunk: int,
        op: str,
    ) -> InFlight:
        """``start_reduce_to_owners`` by point-to-point sends (gloo). Every send is posted
        at once; the owner receives into one buffer of at most ``chunk`` elements, a piece
        at a time (the first while the caller goes on, the others in ``wait``), so what
        it holds beside the bucket stays one piece whatever the world size."""
        works = []
        with self._guard(op):
            for i, (a, b) in enumerate(stretches):
                if i == self.rank:
                    continue
                to = self.global_ranks[i]
                for c in range(a, b, chunk):
                    piece = part[c - start : min(b, c + chunk) - start]
                    works.append(dist.isend(piece, dst=to, group=self.group))
        lo, hi = stretches[self.rank]
        pieces = [
            (self.global_ranks[i], c - start, min(hi, c + chunk) - start)
            for i in range(self.world_size)
            if i != self.rank
            for c in range(lo, hi, chunk)
        ]
        if not pieces:
            return InFlight(self, op, works)
        return InFlight(self, op, works, part, take(min(chunk, hi - lo)), pieces)

    def start_broadcasts(self, pieces: Sequence[tuple[torch.Tensor, int]], op: str) -> InFlight:
        """Each ``(tensor, rank)``: ``tensor`` from group rank ``rank`` to every rank, in
        place, all in flight at once; done when ``wait()`` returns."""
        with self._guard(op):
            works = [
                dist.broadcast(t, src=self.global_ranks[r], group=self.group_for(t), async_op=True)
                for t, r in pieces
            ]
        return InFlight(self, op, works)

    def all_gather(self, flat: torch.Tensor) -> None:
        """In place: every rank's shard of ``flat`` to every rank (one broadcast per shard,
        all in flight at once: on gloo several times faster than its all_gather; NCCL
        gathers in place)."""
        shards = flat.view(self.world_size, -1)
        group = self.group_for(flat)
        with self._guard("all_gather"):
            if group is not self.group:
                dist.all_gather_into_tensor(flat, shards[self.rank], group=group)
                return
            works = [
                dist.broadcast(shards[i], src=self.global_ranks[i], group=group, async_op=True)
                for i in range(self.world_size)
            ]
            for w in works:
                w.wait()

    def all_gather_rows(
        self, rows: torch.Tensor, updates: torch.Tensor, what: str
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Every rank's ``(rows, updates)`` (as many on each rank as it has: the counts go
        first), in group rank order; ``what`` names them in an error."""
        count = torch.tensor([rows.shape[0]], dtype=torch.int64)
        counts = [torch.empty_like(count) for _ in range(self.world_size)]
        with self._guard(f"all_gather of the counts of {what}"):
            dist.all_gather(counts, count, group=self.group)
        n = [int(c) for c in counts]
        most = max(n)
        out = []
        for t in (rows, updates):
            padded = t.contiguous()
            if t.shape[0] != most:  # (not where every rank has as many: no copy)
                padded = t.new_zeros((most, *t.shape[1:]))
                padded[: t.shape[0]] = t
            parts = [torch.empty_like(padded) for _ in range(self.world_size)]
            with self._guard(f"all_gather of {what}"):
                dist.all_gather(parts, padded, group=self.group_for(padded))
            out.append([p[:k] for p, k in zip(parts, n, strict=True)])
        return list(zip(out[0], out[1], strict=True))

    def gather(self, t: torch.Tensor) -> list[torch.Tensor] | None:
        """Every rank's ``t`` on group rank 0 (None elsewhere)."""
        out = [torch.empty_like(t) for _ in range(self.world_size)] if self.rank == 0 else None
        with self._guard("gather"):
            dist.gather(t, out, dst=self.global_ranks[0], group=self.group_for(t))
        return out

    def barrier(self) -> None:
        # An all-reduce on the host group rather than dist.barrier: same guard, same timeout,
        # no device hints.
        self.all_reduce(torch.zeros(1))

    def any(self, flag: bool) -> bool:
        """True on every rank when ``flag`` is True on any rank."""
        t = torch.tensor([1.0 if flag else 0.0])
        self.all_reduce(t)
        return bool(t.item() > 0)


class InFlight:
    """Collectives started together; ``wait`` finishes them, failing as a guarded
    collective does (a peer that died or did not arrive is named)."""

    def __init__(
        self,
        comm: Comm,
        op: str,
        works: list[Any],
        into: torch.Tensor | None = None,
        scratch: torch.Tensor | None = None,
        pieces: Sequence[tuple[int, int, int]] = (),
    ):
        self._comm, self._op, self._works = comm, op, works
        # point-to-point sums: each (peer, lo, hi) of ``pieces`` is received into
        # ``scratch`` in turn and added to ``into[lo:hi]`` (the first is on its way from
        # the start)
        self._into, self._pieces = into, list(pieces)
        self.received = [] if scratch is None else [scratch]
        self._first: Any = None
        if self._pieces:
            peer, lo, hi = self._pieces[0]
            with comm._guard(op):
                self._first = dist.irecv(scratch[: hi - lo], src=peer, group=comm.group)

    def wait(self) -> None:
        works, self._works = self._works, []
        with self._comm._guard(self._op):
            if self._into is not None:
                # receives first, in order (every step sums alike): a send may wait for
                # its receiver to post, so none of them is waited before these
                scratch = self.received[0]
                for k, (peer, lo, hi) in enumerate(self._pieces):
                    got = scratch[: hi - lo]
                    work = (
                        self._first if k == 0 else dist.irecv(got, src=peer, group=self._comm.group)
                    )
                    work.wait()
                    self._into[lo:hi].add_(got)
                self._into = self._first = None
            for w in works:
                w.wait()
