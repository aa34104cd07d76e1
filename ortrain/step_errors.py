"""What a failed step says: the graph, the batch it failed on, what was applied and what
the accumulation window lost."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from ortrain.core.errors import BatchError, OrtrainError, first_line

_OURS = str(Path(__file__).resolve().parent)  # the package: a raise there is ortrain's


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
    shapes = batch_shapes(batch)
    applied = (
        f"; {updated} of {params} parameters were updated in the backward before it failed"
        if updated
        else "; no update was applied"
    )
    if graph == "eval":  # (it updates nothing)
        applied = ""
    return BatchError(
        f"the {graph} graph failed on this batch ({shapes}){applied}"
        f"{window_restarts(discarded)}: {first_line(exc)}"
    )


def batch_shapes(batch: Mapping[str, Any]) -> str:
    """``input_ids: [2, 40] int64, labels: [2, 40] int64``: the batch's tensors."""
    return ", ".join(
        f"{k}: {list(v.shape)} {v.dtype}".replace("torch.", "")
        for k, v in batch.items()
        if isinstance(v, torch.Tensor)
    )


def raised_in(exc: BaseException, model: torch.nn.Module) -> str:
    """Where in ``model``'s own code ``exc`` was raised: its innermost module on the
    traceback, ``"transformer.wpe (Embedding)"``; "" where it was raised by ortrain's
    code or outside the model's modules."""
    tb = exc.__traceback__
    if tb is None:
        return ""
    names = {id(m): n for n, m in model.named_modules()}
    found, last = "", tb
    while tb is not None:
        owner = tb.tb_frame.f_locals.get("self")
        if isinstance(owner, torch.nn.Module) and id(owner) in names:
            found = f"{names[id(owner)] or 'the root module'} ({type(owner).__name__})"
        last, tb = tb, tb.tb_next
    if last.tb_frame.f_code.co_filename.startswith(_OURS):
        return ""
    return found


def note_failed_step(
    exc: BaseException,
    model: torch.nn.Module,
    given: Mapping[str, Any],
    ran: Mapping[str, Any],
) -> None:
    """Notes on what a step raised: the module of the user's model whose eager code
    raised it (a batch eager PyTorch refuses: the first step's check and the fallback
    run that code as eager training does), and the batch as given where bucketing padded
    it before it ran. An error the model's code raises keeps its own type; nothing is
    applied before it (the check runs eager before the graph's step is kept)."""
    where = "" if isinstance(exc, OrtrainError) else raised_in(exc, model)
    padded = batch_shapes(given) != batch_shapes(ran)
    if where:
        also = "" if padded else ": eager training fails on it too"
        exc.add_note(
            f"ortrain: raised in eager PyTorch by {where} in {type(model).__name__}'s "
            f"forward, on the batch it ran ({batch_shapes(ran)}){also}"
        )
    if padded:
        exc.add_note(
            f"ortrain: the batch as given: {batch_shapes(given)}; padded by bucketing to "
            f"{batch_shapes(ran)}"
        )
