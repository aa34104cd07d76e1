"""Warm a process whose builds run in forked children.

A build's child (``ortrain/forked.py``) starts from its parent's memory and throws away
what it made. What the first export in a process makes (the modules ``torch.export``,
dynamo and the ONNX exporter import on first use, their caches, the exporter's
translation table) is therefore made again by every child of a cold parent: most of a
small model's build. ``warm_builds`` trains one step of a small model with its build in
this process, so every later child inherits all of it.

What it made is then frozen (``gc.freeze``): it lives as long as the process, and every
full collection of the cyclic garbage collector would otherwise walk it again. In a
process that runs many small builds itself (the coverage table's, one per spec) those
walks were a fifth of the time.

The training process does not call it (it keeps the graph libraries out of its own
memory); processes that fork many builds do: the test suite's workers and the coverage
table's (``python -m ortrain.coverage``).
"""

from __future__ import annotations

import contextlib
import gc
import os
import warnings
from collections.abc import Iterator

import torch

from ortrain import exporter_registry
from ortrain.forked import IN_PROCESS_ENV


class _Warmup(torch.nn.Module):
    """The ops most models start with: an embedding, a linear layer, layer norm, GELU,
    softmax attention and cross-entropy."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(11, 8)
        self.norm = torch.nn.LayerNorm(8)
        self.proj = torch.nn.Linear(8, 8)
        self.head = torch.nn.Linear(8, 11)

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        h = self.norm(self.emb(ids))
        q = torch.nn.functional.gelu(self.proj(h))
        h = h + torch.softmax(q @ h.transpose(-1, -2), dim=-1) @ h
        return torch.nn.functional.cross_entropy(self.head(h).flatten(0, 1), labels.flatten())


@contextlib.contextmanager
def _builds_here() -> Iterator[None]:
    before = os.environ.get(IN_PROCESS_ENV)
    os.environ[IN_PROCESS_ENV] = "1"
    try:
        yield
    finally:
        if before is None:
            del os.environ[IN_PROCESS_ENV]
        else:
            os.environ[IN_PROCESS_ENV] = before


def warm_builds() -> None:
    """Make the exporter's table, then build and train the small model here, and freeze
    what the process holds then (module docstring); no graph cache is read or written."""
    from ortrain.options import TrainerOptions
    from ortrain.trainer import ORTTrainer

    exporter_registry.warm()
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 11, (2, 5), generator=gen)
    labels = torch.randint(0, 11, (2, 5), generator=gen)
    with torch.random.fork_rng(devices=[]), warnings.catch_warnings(), _builds_here():
        warnings.simplefilter("ignore")
        torch.manual_seed(0)
        model = _Warmup()
        options = TrainerOptions(graph_cache=False, build_progress=False)
        trainer = ORTTrainer(model, torch.optim.SGD(model.parameters(), lr=0.1), options)
        trainer.train_step(ids, labels)
    del model, trainer
    gc.collect()
    gc.freeze()
