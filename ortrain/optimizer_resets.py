"""``optimizer.state`` emptied by the training loop, while ortrain keeps the state.

A compiled update keeps the optimizer's moments in ortrain's state, and ``optimizer.state``
stays empty (``ProgramContext._hook_optimizer``). A loop that resets Adam's moments the
way torch's optimizers allow (``optimizer.state.clear()``, or a new
``collections.defaultdict(dict)`` assigned to it: after pruning, at a warm restart)
changed nothing then, and training went on from the old moments with no error, where
eager starts them again from zero with a fresh step count. ``StateResets`` puts a dict
that notes its ``clear()`` in the optimizer's place and tells the trainer at the next step
that the state was emptied.
"""

from __future__ import annotations

import collections
from typing import Any

import torch


class _NotedState(collections.defaultdict):
    """``optimizer.state`` as torch makes it (a ``defaultdict(dict)``) that notes a
    ``clear()``; copies and pickles of it are plain ones."""

    def __init__(self) -> None:
        super().__init__(dict)
        self.cleared = False

    def clear(self) -> None:
        self.cleared = True
        super().clear()

    def __reduce__(self) -> Any:
        return (collections.defaultdict, (dict,), None, None, iter(self.items()))


class StateResets:
    """Whether the loop emptied ``optimizer.state`` since the last look."""

    def __init__(self, optimizer: torch.optim.Optimizer):
        self.optimizer = optimizer
        self._noted = self.watch()

    def watch(self) -> _NotedState:
        """Watch the optimizer's state from now on (also after ortrain itself replaced or
        emptied it: a ``load_state_dict`` makes a new one)."""
        noted = _NotedState()
        noted.update(self.optimizer.state)
        self.optimizer.state = noted
        self._noted = noted
        return noted

    def emptied(self) -> bool:
        """Whether user code cleared ``optimizer.state`` or put an empty one in its place
        since the last look; watched again either way."""
        state = self.optimizer.state
        if state is self._noted:
            if not state.cleared:
                return False
            state.cleared = False
            return True
        self.watch()
        return not state
