"""Which parameters eager code reads: those ZeRO-3 cannot shard.

A compiled segment gathers its module's parameters around its own graphs; code that runs
in eager PyTorch (the root's forward, a module that fell back, a functional weight tie
such as ``h @ self.embed.weight.T``) reads ``.data`` directly, and autograd saves what it
read for the backward. ``ParamReads`` watches one eager forward (the recording one) with
a torch function mode and notes, for every parameter an op takes, the sub-modules whose
forward was running; once the plan says which modules are compiled, a parameter read
with none of them running is read by eager code.
"""

from __future__ import annotations

import collections
from collections.abc import Iterable
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch.overrides import TorchFunctionMode


class ParamReads(TorchFunctionMode):
    """Inside: every op's parameter arguments, with the sub-modules running at the time."""

    def __init__(self, module: torch.nn.Module):
        super().__init__()
        self._module = module
        self._names = {id(p): n for n, p in module.named_parameters()}
        self._running: list[str] = []  # the sub-modules whose forward is running
        self.reads: dict[str, set[tuple[str, ...]]] = collections.defaultdict(set)
        self._handles: list[Any] = []

    def __enter__(self) -> ParamReads:
        for name, m in self._module.named_modules():
            if not name or isinstance(m, torch.jit.ScriptModule):
                continue

            def pre(mod: torch.nn.Module, args: tuple, name: str = name) -> None:
                self._running.append(name)

            def post(mod: torch.nn.Module, args: tuple, out: Any) -> None:
                self._running.pop()

            self._handles.append(m.register_forward_pre_hook(pre))
            # always_call: a forward that raises leaves the stack as it found it
            self._handles.append(m.register_forward_hook(post, always_call=True))
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
        super().__exit__(*exc)

    def __torch_function__(
        self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None
    ) -> Any:
        kwargs = kwargs or {}
        for leaf in pytree.tree_leaves((args, kwargs)):
            if isinstance(leaf, torch.nn.Parameter):
                name = self._names.get(id(leaf))
                if name is not None:
                    self.reads[name].add(tuple(self._running))
        return func(*args, **kwargs)

    def outside(self, compiled: Iterable[str]) -> list[str]:
        """The parameters read at least once with no module of ``compiled`` running."""
        inside = set(compiled)
        return sorted(
            name
            for name, stacks in self.reads.items()
            if any(not inside.intersection(stack) for stack in stacks)
        )
