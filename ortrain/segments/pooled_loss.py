"""The eager cross-entropy of a segmented model, over buffers kept from step to step.

A segmented model's loss runs in eager PyTorch around its compiled segments (the loss of
``GPT2LMHeadModel`` is code in its forward, not a sub-module). ``F.cross_entropy`` over
an LM's logits makes three logits-sized tensors a step (``log_softmax``'s output, the
zeros ``nll_loss``'s backward scatters into, ``log_softmax``'s backward), each a fresh
mapping above glibc's mmap threshold whose every page faults in and is zeroed again
step after step. ``PooledCrossEntropy`` runs the same kernels into buffers of a
``ReusePool``, which come back to the pool when autograd lets go of them.

``pooled_cross_entropy`` routes ``F.cross_entropy`` calls to it while it is active,
only the calls whose meaning it keeps exactly (class-index targets, float32 logits of
shape ``(N, C)`` on CPU, no class weights or label smoothing, ``mean`` or ``sum``,
gradients wanted); every other call runs as it would.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from ortrain.runtime.buffer_pool import ReusePool
from ortrain.segments.twice import SecondOrderError


class PooledCrossEntropy(torch.autograd.Function):
    """``F.cross_entropy(logits, target, ignore_index=..., reduction=...)`` for 2-D float32
    ``logits`` and int64 ``target``, its logits-sized tensors from ``pool``. The kernels
    are eager's own (``log_softmax``, ``nll_loss``, their backwards, each into a pooled
    buffer): the loss and the gradient are eager's to the bit."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        logits: torch.Tensor,
        target: torch.Tensor,
        ignore_index: int,
        reduction: str,
        pool: ReusePool,
    ) -> torch.Tensor:
        logp = pool.empty(logits.shape, logits.dtype)
        torch.log_softmax(logits, 1, out=logp)
        how = _REDUCTIONS[reduction]
        # a target outside [0, C) fails here as eager's does
        loss, total = torch.ops.aten.nll_loss_forward(logp, target, None, how, ignore_index)
        ctx.save_for_backward(logp, target, total)
        ctx.how, ctx.ignore_index, ctx.pool = how, ignore_index, pool
        return loss

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        if torch.is_grad_enabled():  # create_graph=True: its gradient would be a constant
            raise SecondOrderError(
                "ortrain: the cross-entropy in a segmented model's forward was differentiated "
                "with create_graph=True after the first step, which did not; its backward "
                "gives first-order gradients only. Take that gradient on the first step too "
                "(eager's own cross-entropy then runs); this step's update was not applied"
            )
        logp, target, total = ctx.saved_tensors
        pool: ReusePool = ctx.pool
        of_nll = pool.empty(logp.shape, logp.dtype)
        torch.ops.aten.nll_loss_backward.grad_input(
            grad, logp, target, None, ctx.how, ctx.ignore_index, total, grad_input=of_nll
        )
        out = pool.empty(logp.shape, logp.dtype)
        torch.ops.aten._log_softmax_backward_data.out(of_nll, logp, 1, logp.dtype, out=out)
        return out, None, None, None, None


# ATen's reduction enum
_REDUCTIONS = {"mean": 1, "sum": 2}

# F.cross_entropy's parameters, in order
_PARAMETERS = (
    "input",
    "target",
    "weight",
    "size_average",
    "ignore_index",
    "reduce",
    "reduction",
    "label_smoothing",
)


def _pooled_call(args: tuple, kwargs: dict) -> tuple[torch.Tensor, torch.Tensor, int, str] | None:
    """(logits, target, ignore_index, reduction) of an ``F.cross_entropy`` call that
    ``PooledCrossEntropy`` computes exactly as eager does, else None."""
    bound = dict(zip(_PARAMETERS, args))
    bound.update(kwargs)
    logits, target = bound.get("input"), bound.get("target")
    if not (isinstance(logits, torch.Tensor) and isinstance(target, torch.Tensor)):
        return None
    if set(bound) - set(_PARAMETERS):
        return None
    if any(bound.get(k) is not None for k in ("weight", "size_average", "reduce")):
        return None
    reduction = bound.get("reduction", "mean")
    if reduction not in ("mean", "sum") or bound.get("label_smoothing", 0.0) != 0.0:
        return None
    if type(logits) is not torch.Tensor or type(target) is not torch.Tensor:
        return None  # a subclass (a DTensor, a fake tensor) keeps its own dispatch
    if (
        logits.dim() != 2
        or target.dim() != 1
        or logits.dtype != torch.float32
        or target.dtype != torch.int64
        or logits.device.type != "cpu"
        or target.device.type != "cpu"
        or target.shape[0] != logits.shape[0]
        or logits.shape[1] == 0
        or not logits.requires_grad
        or not torch.is_grad_enabled()
    ):
        return None
    ignore_index = bound.get("ignore_index", -100)
    if not isinstance(ignore_index, int):
        return None
    return logits, target, ignore_index, reduction


# Logits below this come from the C heap's reused pages, not fresh mappings: routing
# them gains nothing, and the mode costs every torch call of the eager code about a
# microsecond (``SegmentedTraining`` keeps it only where a routed call reaches this)
WORTH_BYTES = 1 << 20


class _Route(TorchFunctionMode):
    def __init__(self, pool: ReusePool) -> None:
        super().__init__()
        self.pool = pool
        self.calls = 0  # calls routed to the pooled loss (a test's figure)
        self.largest = 0  # bytes of the largest logits routed

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        if func is F.cross_entropy:
            found = _pooled_call(args, kwargs)
            if found is not None:
                self.calls += 1
                self.largest = max(self.largest, found[0].nbytes)
                return PooledCrossEntropy.apply(*found, self.pool)
        return func(*args, **kwargs)

    def worth_it(self) -> bool:
        """Whether a call routed here had logits large enough to gain from the pool."""
        return self.largest >= WORTH_BYTES


@contextlib.contextmanager
def pooled_cross_entropy(pool: ReusePool | None) -> Iterator[_Route | None]:
    """While active, ``F.cross_entropy`` calls that ``PooledCrossEntropy`` computes as eager
    does take their buffers from ``pool`` (None: nothing is routed)."""
    if pool is None:
        yield None
        return
    with _Route(pool) as route:
        yield route
