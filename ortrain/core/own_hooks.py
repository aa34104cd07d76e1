"""ortrain's own gradient hooks on parameters, told apart from the user's.

Segments and ZeRO put hooks on parameters (a tied gradient's check, the reached set,
a bucket's arrival); a parameter that carries a hook of the user's trains as segments
(``ProgramContext.grad_hooked``), and must not be taken for one by ortrain's.
"""

from __future__ import annotations

from collections.abc import Callable
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
