"""Reentrant ``torch.utils.checkpoint`` calls traced as the plain calls they wrap.

A reentrant checkpoint (``use_reentrant=True``, what ``gradient_checkpointing_enable``
gave in older transformers) runs its function under ``no_grad`` and runs it again in its
backward. Traced as it is, its outputs come out of the export detached: the graph would
give no gradient to the parameters inside (the first-step check refuses such a graph, and
the model trains as segments). The values are those of the plain call, and which
activations the backward recomputes is the recompute pass's choice
(``graph_passes/memory/recompute.py``), so while exporting the function is just called.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from torch.utils import checkpoint

_MISSING = object()


def _plain_call(function: Callable[..., Any], preserve_rng_state: bool, *args: Any) -> Any:
    del preserve_rng_state  # traced once: each draw is made once, as eager's forward and
    # its recompute share it
    return function(*args)


@contextmanager
def reentrant_checkpoints_inline() -> Iterator[None]:
    """``CheckpointFunction.apply`` as ``function(*args)`` for the duration."""
    cls = checkpoint.CheckpointFunction
    own = cls.__dict__.get("apply", _MISSING)
    cls.apply = staticmethod(_plain_call)  # type: ignore[method-assign, assignment]
    try:
        yield
    finally:
        if own is _MISSING:
            del cls.apply
        else:
            cls.apply = own  # type: ignore[method-assign]
