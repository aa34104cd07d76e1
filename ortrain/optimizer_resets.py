"""``optimizer.state`` emptied by the training loop, while ortrain keeps the state.

A compiled update keeps the optimizer's moments in ortrain's state, and ``optimizer.state``
stays empty (``ProgramContext._hook_optimizer``). A loop that resets Adam's moments the
way torch's optimizers allow (``optimizer.state.clear()``, or a new
``collections.defaultdict(dict)`` assigned to it: after pruning, at a warm restart)
changed nothing then, and training went on from the old moments with no error, where
eager starts them again from zero with a fresh step count. ``StateResets`` puts a dict
that notes its ``clear()`` in the optimizer's place and tells the trainer at the next step
that the state was emptied.

One parameter's state reset the same ways (``optimizer.state[p] = {}``, ``del
optimizer.state[p]``, ``optimizer.state.pop(p, None)``: a layer re-initialised) starts
that parameter's moments and step count again in torch while the others go on. The
compiled updates count one step for all, so the trainer moves the update to the
optimizer's own ``step()`` from there (``ProgramContext.update_in_eager``), its state
taken over, the reset parameters' left out. Before, the assignment raised a
``CheckpointError`` at the next step and the other two changed nothing, silently (the
``del`` raised ``KeyError``: the compiled update's state is not in ``optimizer.state``).
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
        self.reset: list[Any] = []  # keys whose state the loop reset since the last look
        self._reading = False

    def clear(self) -> None:
        self.cleared = True
        super().clear()

    def __missing__(self, key: Any) -> Any:
        # a read of a parameter without state here (torch's step() makes it so): not a reset
        self._reading = True
        try:
            return super().__missing__(key)
        finally:
            self._reading = False

    def __setitem__(self, key: Any, value: Any) -> None:
        if not self._reading and isinstance(value, dict) and not value:
            self.reset.append(key)  # ``state[p] = {}``: torch's step starts it again
        super().__setitem__(key, value)

    def __delitem__(self, key: Any) -> None:
        self.reset.append(key)  # (the compiled update's state is not here: no KeyError)
        if key in self:
            super().__delitem__(key)

    def pop(self, key: Any, *default: Any) -> Any:
        self.reset.append(key)
        return super().pop(key, *default)

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

    def reset_params(self) -> list[Any]:
        """The keys (parameters) whose own state user code reset since the last look."""
        state = self.optimizer.state
        if state is not self._noted or not state.reset:
            return []
        keys, state.reset = state.reset, []
        return keys


def drop_state(optimizer: torch.optim.Optimizer, param: torch.Tensor) -> None:
    """ortrain's own removal of ``param``'s entry from ``optimizer.state`` (lent state
    taken back): not the loop resetting it."""
    dict.pop(optimizer.state, param, None)
