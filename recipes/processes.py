"""The processes a run spans: ``Env`` (rank, world size, output folder, barriers and
rank-0 printing) and ``setup``, which joins torch.distributed under torchrun, sets the
thread count and makes the output folder.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ortrain.recipes.config import TrainConfig


@dataclasses.dataclass(frozen=True)
class Env:
    rank: int
    world: int
    out: Path
    owns_group: bool  # this process initialised torch.distributed (and tears it down)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def barrier(self) -> None:
        if self.world > 1:
            dist.barrier()

    @contextlib.contextmanager
    def main_first(self) -> Iterator[None]:
        """Rank 0 runs the block first (training a tokenizer, filling caches); the other
        ranks then run it too and find the cached results."""
        if not self.is_main:
            self.barrier()
        yield
        if self.is_main:
            self.barrier()

    def print(self, *args: Any) -> None:
        if self.is_main:
            from tqdm import tqdm

            tqdm.write(" ".join(str(a) for a in args))


def setup(cfg: TrainConfig, recipe: str) -> Env:
    """torch.distributed from torchrun's environment (gloo) when WORLD_SIZE > 1, threads,
    the output folder. Each rank later reads its own slice of every global batch."""
    owns = False
    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and not dist.is_initialized():
        dist.init_process_group("gloo")
        owns = True
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    if cfg.threads is not None:
        torch.set_num_threads(cfg.threads)
    out = Path(cfg.out or f"runs/{recipe}-{cfg.preset}")
    if rank == 0:
        out.mkdir(parents=True, exist_ok=True)
    return Env(rank, world, out, owns)
