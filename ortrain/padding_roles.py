"""What a batch tensor with a name bucketing does not know holds, for its padding.

Bucketing (``ortrain/bucketing.py``) pads ``labels`` with -100 and ``input_ids`` with the
pad token because of their names. Models written by hand name them otherwise: nanoGPT's
``forward(idx, targets)``, whose loss skips the targets -1. ``padding_values`` runs the
forward and the loss once, without gradients, on the batch as given, and follows every
integer batch tensor through the ops that carry its values on (views, slices, casts,
``F.pad``, copies) to where they are read: one whose values reach a classification loss's
target is padded with that loss's ``ignore_index`` (every padded row skipped); any other
(token ids, indices, segment ids; a tensor that is both tokens and targets) with the
model's pad token. Floating-point tensors on the sequence axis are padded with zeros.
The graph's proof takes each padding as the constant it is (a key mask computed as
``ids == pad`` masks the padded keys). Whether the padding is exact is then for the
layout's eager check and its graph's proof to say, as for named inputs.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves

DEFAULT_IGNORE = -100  # cross_entropy's and nll_loss's default ignore_index
# losses over class indices that skip a target value; (their ignore_index's position)
_LOSSES: dict[Callable[..., Any], int] = {F.cross_entropy: 4, F.nll_loss: 4}


Pad = int | float  # what a tensor's padding holds (the graph's proof assumes it too)


def _integer(t: torch.Tensor) -> bool:
    return not t.is_floating_point() and not t.is_complex()


class _Follow(TorchFunctionMode):
    """Which batch tensors' values reach which losses' targets (module docstring)."""

    def __init__(self, sources: Mapping[str, torch.Tensor]) -> None:
        super().__init__()
        self.of: dict[int, frozenset[str]] = {id(t): frozenset({k}) for k, t in sources.items()}
        self.kept: list[torch.Tensor] = list(sources.values())  # alive: their ids stay theirs
        self.targets: dict[str, set[int]] = {}  # batch name -> ignore_index values reached
        self.indices: set[str] = set()  # batch names whose values index an embedding table

    def _sources(self, values: Any) -> frozenset[str]:
        found: frozenset[str] = frozenset()
        for v in tree_leaves(values):
            if isinstance(v, torch.Tensor):
                found |= self.of.get(id(v), frozenset())
        return found

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        at = _LOSSES.get(func)
        if at is not None:
            target = args[1] if len(args) > 1 else kwargs.get("target")
            ignore = args[at] if len(args) > at else kwargs.get("ignore_index", DEFAULT_IGNORE)
            for name in self._sources(target):
                self.targets.setdefault(name, set()).add(int(ignore))
        elif func is F.embedding:
            self.indices |= self._sources(args[0] if args else kwargs.get("input"))
        out = func(*args, **kwargs)
        sources = self._sources((args, kwargs))
        if sources:
            for t in tree_leaves(out):
                if isinstance(t, torch.Tensor) and _integer(t):
                    self.of[id(t)] = self.of.get(id(t), frozenset()) | sources
                    self.kept.append(t)
        return out


def padding_values(
    run: Callable[[Mapping[str, Any]], object],
    batch: Mapping[str, Any],
    names: list[str],
    pad_id: int,
) -> dict[str, Pad]:
    """The padding of each batch tensor ``names`` names (integer ones followed through
    ``run``, the forward and the loss on ``batch``; module docstring)."""
    out: dict[str, Pad] = {}
    ints = {}
    for k in names:
        t = batch[k]
        if _integer(t) and t.dtype != torch.bool:
            ints[k] = t.clone()
        else:  # floats and flags: zeros (False)
            out[k] = 0
    follow = _Follow(ints)
    if ints:
        with follow:
            run({**batch, **ints})
    for k in ints:
        reached = follow.targets.get(k, set())
        if len(reached) == 1 and k not in follow.indices:
            (ignore,) = reached
            out[k] = ignore
        else:  # token ids and the like (targets that are token ids too: no value is exact)
            out[k] = pad_id
    return out
