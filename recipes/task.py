"""What a recipe hands to the loop: ``Task`` (model, optimizer, schedule, batches,
evaluation metrics, FLOPs per token, tokenizer), the ``Batch`` type and ``count_params``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping

import torch

from ortrain.recipes.schedules import Schedule

Batch = dict[str, torch.Tensor]


@dataclasses.dataclass
class Task:
    """What a recipe hands to ``run``."""

    name: str  # "gpt2" | "bert"
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    schedule: Schedule  # lr multiplier by optimizer step
    batch: Callable[[int, int], Batch]  # (step, micro) -> this rank's micro-batch
    eval_batches: list[Batch]  # the same held-out batches at every evaluation
    eval_metrics: Callable[[Mapping[str, torch.Tensor], Batch], dict[str, float]]
    eval_keys: tuple[str, ...]  # what eval_metrics returns; the first is "loss"
    flops_per_token: Callable[[int], float]  # sequence length -> training FLOPs per token
    tokenizer_json: str  # serialized tokenizer, written to <out>/tokenizer.json
    tokenizer_fingerprint: str
    ppl_key: str = "loss"  # the eval metric whose exp() is the reported perplexity
    header: list[str] = dataclasses.field(default_factory=list)  # printed at the start


def count_params(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())  # tied weights counted once
