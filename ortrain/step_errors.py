"""What a failed step says: the graph, the batch it failed on, what was applied and what
the accumulation window lost."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from ortrain.core.errors import BatchError, first_line


def from_onnxruntime(exc: BaseException) -> bool:
    """An error ONNX Runtime raised (its own exception types)."""
    return type(exc).__module__.startswith("onnxruntime")


def failed_in_onnxruntime(exc: BaseException) -> bool:
    """An error from running a session: ONNX Runtime's own types, or the RuntimeError its
    bound runs raise ("Error in execution: ..." naming the node)."""
    return from_onnxruntime(exc) or (
        type(exc) is RuntimeError and str(exc).startswith("Error in execution")
    )


def window_restarts(discarded: int) -> str:
    """A failed micro-step ends its accumulation window: say what that threw away."""
    if not discarded:
        return ""
    some = "micro-batch" if discarded == 1 else f"{discarded} micro-batches"
    return f"; the accumulation window starts over, discarding its earlier {some}"


def run_failed(
    graph: str,
    batch: Mapping[str, Any],
    exc: Exception,
    updated: int = 0,
    params: int = 0,
    discarded: int = 0,
) -> BatchError:
    """ONNX Runtime's error with the batch it failed on (its message names the node);
    ``updated`` of ``params`` parameters had their update in the backward already;
    ``discarded`` micro-steps of the accumulation window were thrown away with it."""
    shapes = ", ".join(
        f"{k}: {list(v.shape)} {v.dtype}".replace("torch.", "")
        for k, v in batch.items()
        if isinstance(v, torch.Tensor)
    )
    applied = (
        f"{updated} of {params} parameters were updated in the backward before it failed"
        if updated
        else "no update was applied"
    )
    return BatchError(
        f"the {graph} graph failed on this batch ({shapes}); {applied}"
        f"{window_restarts(discarded)}: {first_line(exc)}"
    )
