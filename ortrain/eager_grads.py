"""Gradients of an eager forward for the checks, whatever checkpointing the model uses.

The checks take eager's gradients with ``torch.autograd.grad`` (nothing a user hooked to
``.grad`` accumulation fires). A reentrant ``torch.utils.checkpoint`` (``use_reentrant=True``,
what ``gradient_checkpointing_enable`` gave in older transformers) refuses ``.grad()``;
where the graph holds one, the gradients come from ``backward()`` instead: read from
``.grad`` and put back as they were, with the post-accumulation hooks of the tensors
asked about held back (``torch.autograd.grad`` never fires them; ZeRO-2's would take the
check's gradients for the step's).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch

# the backward node of ``torch.utils.checkpoint.CheckpointFunction``
REENTRANT_NODE = "CheckpointFunctionBackward"


def has_reentrant_checkpoint(outputs: Sequence[torch.Tensor]) -> bool:
    """Whether the autograd graph behind ``outputs`` holds a reentrant checkpoint."""
    seen: set[int] = set()
    stack = [o.grad_fn for o in outputs if o.grad_fn is not None]
    while stack:
        node = stack.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        if type(node).__name__ == REENTRANT_NODE:
            return True
        stack.extend(n for n, _ in node.next_functions if n is not None)
    return False


@contextmanager
def post_accumulate_hooks_paused(tensors: Sequence[torch.Tensor]) -> Iterator[None]:
    """No post-accumulation hook of ``tensors`` runs inside (all of them, ortrain's too)."""
    paused: list[tuple[dict, dict]] = []
    for t in tensors:
        hooks = t._post_accumulate_grad_hooks
        if hooks:
            paused.append((hooks, dict(hooks)))
            hooks.clear()  # autograd reads this same dict when it runs the hooks
    try:
        yield
    finally:
        for hooks, before in paused:
            added = {k: h for k, h in hooks.items() if k not in before}
            hooks.clear()
            hooks.update(before)
            hooks.update(added)


def grads_of(
    outputs: Sequence[torch.Tensor],
    wrt: Sequence[torch.Tensor],
    grad_outputs: Sequence[torch.Tensor] | None = None,
) -> tuple[torch.Tensor | None, ...]:
    """``torch.autograd.grad(outputs, wrt, grad_outputs, allow_unused=True)``, through a
    reentrant checkpoint too. There a leaf outside ``wrt`` that requires grad gets its
    ``.grad`` accumulated, as ``backward()`` does; callers collect their module's
    (``verify.written_grads``)."""
    if not has_reentrant_checkpoint(outputs):
        return torch.autograd.grad(outputs, wrt, grad_outputs, allow_unused=True)
    held = [w.grad for w in wrt]
    for w in wrt:
        w.grad = None
    try:
        with post_accumulate_hooks_paused(wrt):
            torch.autograd.backward(list(outputs), grad_outputs)
        return tuple(w.grad for w in wrt)
    finally:
        for w, g in zip(wrt, held, strict=True):
            w.grad = g
