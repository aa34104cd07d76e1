"""``Comm.start_reduce_to_owners`` on gloo by point-to-point sends: each owner's stretch of
a bucket becomes the sum over ranks, received a piece of at most ``chunk`` elements at a
time through one buffer, equal to gloo's reduce; bucket edges off the shard edges, a
stretch longer than a piece, a rank that owns none of the bucket."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ortrain.distributed.comm import Comm

WORLD = 3
SHARD = 40
# (start, numel, chunk): inside one shard, across two, across all three (the middle
# stretch whole), a stretch of one element, pieces of one element
CASES = [(3, 20, 64), (25, 30, 7), (10, 100, 16), (39, 2, 5), (0, 120, 1)]


def _part(rank: int, numel: int, case: int) -> torch.Tensor:
    return torch.randn(numel, generator=torch.Generator().manual_seed(100 * case + rank))


def _rank(rank: int, store_path: str, failures: str) -> None:
    torch.set_num_threads(1)
    store = dist.FileStore(store_path, WORLD)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=WORLD)
    comm = Comm(None, 60.0)
    problems = []
    for case, (start, numel, chunk) in enumerate(CASES):
        taken: list[int] = []

        def take(n: int, taken: list[int] = taken) -> torch.Tensor:
            taken.append(n)
            return torch.full((n,), float("nan"))

        got = _part(rank, numel, case)
        comm.start_reduce_to_owners(got, start, SHARD, take, chunk).wait()
        ref = _part(rank, numel, case)
        comm.start_reduce_to_owners(ref, start, SHARD).wait()  # gloo's reduce
        lo, hi = max(start, rank * SHARD), min(start + numel, (rank + 1) * SHARD)
        if lo < hi:
            mine = slice(lo - start, hi - start)
            # its own stretch first, then the others' in rank order
            want = _part(rank, numel, case)[mine].clone()
            for r in range(WORLD):
                if r != rank:
                    want += _part(r, numel, case)[mine]
            if not torch.equal(got[mine], want):
                problems.append(f"case {case}: stretch {lo}-{hi} is not the sum")
            if not torch.allclose(got[mine], ref[mine], rtol=1e-6, atol=1e-6):
                problems.append(f"case {case}: differs from gloo's reduce")
            if taken != [min(chunk, hi - lo)]:
                problems.append(f"case {case}: took {taken}, not one buffer of a piece")
        elif taken:
            problems.append(f"case {case}: took {taken} for no stretch of its own")
    dist.destroy_process_group()
    if problems:
        Path(failures).with_suffix(f".{rank}").write_text("\n".join(problems))


def test_point_to_point_reduce_sums_each_owners_stretch(tmp_path: Path) -> None:
    failures = str(tmp_path / "failures")
    mp.spawn(_rank, args=(str(tmp_path / "store"), failures), nprocs=WORLD)
    said = [p.read_text() for p in sorted(tmp_path.glob("failures.*"))]
    assert said == []
