"""Learning-rate multipliers by optimizer step, for ``torch.optim.lr_scheduler.LambdaLR``.

Step s (0-based) trains with ``base_lr * f(s)``. Warmup is linear from ``1/warmup`` at
step 0 to 1 at step ``warmup - 1`` (the first step never has lr 0).
"""

from __future__ import annotations

import math
from collections.abc import Callable

Schedule = Callable[[int], float]


def _warmup(step: int, warmup: int) -> float | None:
    return (step + 1) / warmup if step < warmup else None


def warmup_cosine(warmup: int, total: int, min_ratio: float = 0.1) -> Schedule:
    """GPT-2 / nanoGPT: linear warmup, then cosine decay to ``min_ratio`` at ``total``."""

    def f(step: int) -> float:
        w = _warmup(step, warmup)
        if w is not None:
            return w
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))

    return f


def warmup_poly(warmup: int, total: int, power: float = 1.0) -> Schedule:
    """BERT: linear warmup, then polynomial decay ``(1 - progress) ** power`` to 0 at
    ``total`` (power 1: linear; NVIDIA's LAMB recipe uses 0.5)."""

    def f(step: int) -> float:
        w = _warmup(step, warmup)
        if w is not None:
            return w
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        return (1.0 - progress) ** power

    return f


def phased(first: Schedule, first_steps: int, second: Schedule, second_scale: float) -> Schedule:
    """``first`` for steps below ``first_steps``; after that ``second`` restarts at 0,
    scaled by ``second_scale`` (the ratio of the second phase's base lr to the first's)."""

    def f(step: int) -> float:
        if step < first_steps:
            return first(step)
        return second_scale * second(step - first_steps)

    return f
