"""ortrain's own gradient hooks on parameters, told apart from the user's.

Segments and ZeRO put hooks on parameters (a tied gradient's check, the reached set,
a bucket's arrival); a parameter that carries a hook of the user's trains as segments
(``ProgramContext.grad_hooked``), and must not be taken for one by ortrain's.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator
from typing import Any, TypeVar

import torch

F = TypeVar("F", bound=Callable[..., Any])
_MARK = "_ortrain_own_hook"


def own_hook(fn: F) -> F:
    """``fn``, marked as a hook of ortrain's."""
    setattr(fn, _MARK, True)
    return fn


def users_hooks(p: torch.Tensor) -> bool:
    """Whether ``p`` carries a gradient hook (pre- or post-accumulation) not ortrain's."""
    for hooks in (p._backward_hooks, p._post_accumulate_grad_hooks):
        if hooks and any(not getattr(h, _MARK, False) for h in hooks.values()):
            return True
    return False


@contextlib.contextmanager
def users_hooks_paused(params: Iterable[torch.Tensor]) -> Iterator[None]:
    """The user's gradient hooks (``register_hook``) on ``params`` do not run inside: an
    eager run of ortrain's that only looks (a padding check's gradients) is no step, and
    a hook that logs or counts (``wandb.watch`` registers such hooks) would see it as one.
    ortrain's own hooks stay; post-accumulation hooks never fire on
    ``torch.autograd.grad``, which such runs use."""
    paused: list[tuple[dict, dict]] = []
    for p in params:
        hooks = p._backward_hooks
        if hooks and any(not getattr(h, _MARK, False) for h in hooks.values()):
            paused.append((hooks, dict(hooks)))
            for key in [k for k, h in hooks.items() if not getattr(h, _MARK, False)]:
                del hooks[key]  # autograd reads this same dict when it runs the hooks
    try:
        yield
    finally:
        for hooks, before in paused:
            added = {k: h for k, h in hooks.items() if k not in before}
            hooks.clear()
            hooks.update(before)  # in their order; a hook of ortrain's added inside stays
            hooks.update(added)
