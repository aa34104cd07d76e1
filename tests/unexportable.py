"""A loss and a product the ONNX exporter cannot translate, for tests of what runs in eager.

``smoothed_cross_entropy`` is a custom op (``torch.library.custom_op``) with torch's
label-smoothed cross entropy inside and its own backward: eager trains through it, and
the exporter has no ONNX function for it ("No ONNX function found"), so a model whose
loss it is cannot be one graph and trains as compiled segments with the loss in eager.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


@torch.library.custom_op("ortrain_tests::smoothed_cross_entropy", mutates_args=())
def _smoothed(logits: torch.Tensor, labels: torch.Tensor, smoothing: float) -> torch.Tensor:
    return F.cross_entropy(logits, labels, label_smoothing=smoothing)


@_smoothed.register_fake
def _(logits: torch.Tensor, labels: torch.Tensor, smoothing: float) -> torch.Tensor:
    return logits.new_empty(())


def _setup(ctx, inputs, output) -> None:  # type: ignore[no-untyped-def]
    logits, labels, smoothing = inputs
    ctx.save_for_backward(logits, labels)
    ctx.smoothing = smoothing


def _backward(ctx, grad: torch.Tensor):  # type: ignore[no-untyped-def]
    logits, labels = ctx.saved_tensors
    with torch.enable_grad():
        x = logits.detach().requires_grad_()
        loss = F.cross_entropy(x, labels, label_smoothing=ctx.smoothing)
        (dx,) = torch.autograd.grad(loss, x)
    return dx * grad, None, None


_smoothed.register_autograd(_backward, setup_context=_setup)


def smoothed_cross_entropy(
    logits: torch.Tensor, labels: torch.Tensor, smoothing: float = 0.1
) -> torch.Tensor:
    return _smoothed(logits, labels, smoothing)


@torch.library.custom_op("ortrain_tests::opaque_mul", mutates_args=())
def _opaque_mul(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return x * w


@_opaque_mul.register_fake
def _(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


def _setup_mul(ctx, inputs, output) -> None:  # type: ignore[no-untyped-def]
    ctx.save_for_backward(*inputs)


def _backward_mul(ctx, grad: torch.Tensor):  # type: ignore[no-untyped-def]
    x, w = ctx.saved_tensors
    dw = (grad * x).reshape(-1, w.numel()).sum(0).reshape(w.shape)
    return grad * w, dw


_opaque_mul.register_autograd(_backward_mul, setup_context=_setup_mul)


def opaque_mul(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``x * w`` for ``w`` of ``x``'s last dimension, in eager only (no ONNX function)."""
    return _opaque_mul(x, w)
