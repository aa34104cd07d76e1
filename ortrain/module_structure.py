"""What of a module's structure its graphs were built from, looked at between steps.

A sub-module assigned anew (``model.act = nn.GELU()``), or a forward or backward hook
added or removed (on a module, or torch's global module hooks) after a graph was built,
changes what the forward computes where the graph keeps what its export saw: training
went on with the old forward, silently. ``structure`` is cheap (object identities and
hook keys, no tensor is read) so that it is taken at every step; ``changes`` names what
differs between two.
"""

from __future__ import annotations

import torch
from torch.nn.modules import module as nn_module

_HOOKS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")
_GLOBAL = tuple(f"_global{h}" for h in _HOOKS)
GLOBAL = "<global module hooks>"

Structure = dict[str, tuple]


def structure(module: torch.nn.Module) -> Structure:
    """Each sub-module's (shared ones under every name) identity and hook keys (a hook
    handle's id is never reused, so a hook removed and another added differ), and the
    global module hooks' keys."""
    out: Structure = {
        name: (id(m), *(tuple(getattr(m, h, ())) for h in _HOOKS))
        for name, m in module.named_modules(remove_duplicate=False)
    }
    out[GLOBAL] = tuple(tuple(getattr(nn_module, h, ())) for h in _GLOBAL)
    return out


def changes(before: Structure, after: Structure) -> list[str]:
    """What differs, in words ("act assigned anew", "l1: a forward hook added")."""
    said: list[str] = []
    for name in [*before, *(n for n in after if n not in before)]:
        old, new = before.get(name), after.get(name)
        what = name or "<root>"
        if old == new:
            continue
        if name == GLOBAL:
            said.append("torch's global module hooks changed")
        elif old is None:
            said.append(f"{what} added")
        elif new is None:
            said.append(f"{what} removed")
        elif old[0] != new[0]:
            said.append(f"{what} assigned anew")
        else:
            pairs = zip(_HOOKS, old[1:], new[1:], strict=True)
            kinds = [h.strip("_").replace("_", " ") for h, a, b in pairs if a != b]
            said.append(f"{what}: {', '.join(kinds)} changed")
    return said


class StructureWatch:
    """``structure`` at the last look; ``changes()`` says what changed since. A look that
    finds nothing changed compares each module's children and hook keys by identity
    (no names are made)."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.module = module
        self._take()

    def _take(self) -> None:
        self.named = structure(self.module)
        self._modules = list(self.module.modules())
        self._key = self._fast()

    @property
    def modules(self) -> list[torch.nn.Module]:
        """The modules as last taken (every sub-module, the root first)."""
        return self._modules

    def _fast(self) -> list[object]:
        out: list[object] = []
        for m in self._modules:
            d = m.__dict__
            out.extend(d["_modules"].values())
            out.extend(tuple(d.get(h, ())) for h in _HOOKS)
        out.extend(tuple(getattr(nn_module, h, ())) for h in _GLOBAL)
        return out

    def changes(self) -> list[str]:
        if self._fast() == self._key:
            return []
        before = self.named
        self._take()
        return changes(before, self.named)
