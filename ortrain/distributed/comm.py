"""The collectives the trainer runs, on its own gloo group with a timeout.

The group spans the ranks of the default process group (the one torchrun set up) or of
the group the user passes; being our own, it carries ``TrainerOptions.dist_timeout``
whatever the user's group was created with, and it is gloo whatever the default backend,
because the trainer's tensors live in host memory. Every collective is guarded: a
failure (a peer died, or did not arrive within the timeout) becomes a
``RankFailureError`` naming the rank, as told by ``RankHealth``.
"""

from __future__ import annotations

import contextlib
import datetime
import time
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist

from ortrain.core.errors import RankFailureError
from ortrain.distributed.health import RankHealth


class Comm:
    """This trainer's group: its rank, world size, and guarded collectives."""

    def __init__(self, parent: dist.ProcessGroup | None, timeout_s: float):
        self.timeout_s = timeout_s
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

    @contextlib.contextmanager
    def _guard(self, op: str) -> Iterator[None]:
        self.health.seq += 1
        seq, start = self.health.seq, time.monotonic()
        try:
            yield
        except RuntimeError as exc:  # gloo errors (DistBackendError is a RuntimeError)
            elapsed = time.monotonic() - start
            me = dist.get_rank()
            peers = [r for r in self.global_ranks if r != me]
            blamed, why = self.health.diagnose(peers)
            raise RankFailureError(
                f"rank {me}: {op} (collective #{seq}) failed after {elapsed:.1f} s "
                f"(TrainerOptions.dist_timeout={self.timeout_s:g} s): {why}. "
                f"gloo said: {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}",
                ranks=blamed,
            ) from exc

    def broadcast(self, t: torch.Tensor) -> None:
        """``t`` from group rank 0 to every rank, in place."""
        with self._guard("broadcast"):
            dist.broadcast(t, src=self.global_ranks[0], group=self.group)

    def broadcast_tensors(self, tensors: Sequence[torch.Tensor]) -> None:
        """Group rank 0's values of ``tensors`` to every rank, in place; one broadcast per
        dtype (gloo has no bool: those travel as bytes)."""
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for t in tensors:
            t = t.view(torch.uint8) if t.dtype == torch.bool else t
            by_dtype.setdefault(t.dtype, []).append(t)
        for group in by_dtype.values():
            flat = torch.cat([t.reshape(-1) for t in group])
            self.broadcast(flat)
            offset = 0
            for t in group:
                t.copy_(flat[offset : offset + t.numel()].view_as(t))
                offset += t.numel()

    def broadcast_object(self, obj: Any) -> Any:
        box = [obj]
        with self._guard("broadcast_object"):
            dist.broadcast_object_list(box, src=self.global_ranks[0], group=self.group)
        return box[0]

    def all_reduce(self, t: torch.Tensor) -> None:
        """In-place sum over ranks."""
        with self._guard("all_reduce"):
            dist.all_reduce(t, group=self.group)

    def all_reduce_buckets(self, buckets: Sequence[torch.Tensor]) -> None:
        """In-place sums, all buckets in flight at once (gloo runs them on its threads)."""
        with self._guard(f"all_reduce of {len(buckets)} gradient buckets"):
            works = [dist.all_reduce(b, group=self.group, async_op=True) for b in buckets]
            for w in works:
                w.wait()

    def reduce_scatter(self, flat: torch.Tensor) -> None:
        """In place: rank i's shard (the i-th of ``world_size`` equal parts) of ``flat``
        becomes the sum over ranks of that shard; the other shards are left undefined.

        One reduce per shard, all in flight at once: on gloo that is faster than its
        reduce_scatter (which also needs a separate output buffer)."""
        shards = flat.view(self.world_size, -1)
        with self._guard("reduce_scatter"):
            works = [
                dist.reduce(shards[i], dst=self.global_ranks[i], group=self.group, async_op=True)
                for i in range(self.world_size)
            ]
            for w in works:
                w.wait()

    def all_gather(self, flat: torch.Tensor) -> None:
        """In place: every rank's shard of ``flat`` to every rank (one broadcast per shard,
        all in flight at once: on gloo several times faster than its all_gather)."""
        shards = flat.view(self.world_size, -1)
        with self._guard("all_gather"):
            works = [
                dist.broadcast(shards[i], src=self.global_ranks[i], group=self.group, async_op=True)
                for i in range(self.world_size)
            ]
            for w in works:
                w.wait()

    def gather(self, t: torch.Tensor) -> list[torch.Tensor] | None:
        """Every rank's ``t`` on group rank 0 (None elsewhere)."""
        out = [torch.empty_like(t) for _ in range(self.world_size)] if self.rank == 0 else None
        with self._guard("gather"):
            dist.gather(t, out, dst=self.global_ranks[0], group=self.group)
        return out

    def barrier(self) -> None:
        # An all-reduce rather than dist.barrier: same guard, same timeout, no device hints.
        self.all_reduce(torch.zeros(1))

    def any(self, flag: bool) -> bool:
        """True on every rank when ``flag`` is True on any rank."""
        t = torch.tensor([1.0 if flag else 0.0])
        self.all_reduce(t)
        return bool(t.item() > 0)
