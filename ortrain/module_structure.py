"""What of a module's structure its graphs were built from, looked at between steps.

A sub-module assigned anew (``model.act = nn.GELU()``), or a forward or backward hook
added or removed (on a module, or torch's global module hooks) after a graph was built,
changes what the forward computes where the graph keeps what its export saw: training
went on with the old forward, silently. ``structure`` is cheap (object identities and
hook keys, no tensor is read) so that it is taken at every step; ``changes`` names what
differs between two.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

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


# the dicts a hook handle's id keys: a hook's own, and the flags registered beside it
_HOOK_DICTS = (
    *_HOOKS,
    "_forward_hooks_with_kwargs",
    "_forward_hooks_always_called",
    "_forward_pre_hooks_with_kwargs",
)


@contextlib.contextmanager
def hooks_kept(module: torch.nn.Module) -> Iterator[None]:
    """Hooks registered inside (on ``module``'s sub-modules, or torch's global module
    hooks) are removed after: a forward of ortrain's own that installs hooks on its first
    call (transformers' output capturing) leaves them out as it leaves out the attribute
    that says they are in (``python_state.kept``), so the model's next forward installs
    them once, not again beside ours."""
    owners: list[object] = [*module.modules(), nn_module]
    names = [*_HOOK_DICTS, *(f"_global{h}" for h in _HOOK_DICTS)]
    before = {(id(o), n): set(getattr(o, n)) for o in owners for n in names if hasattr(o, n)}
    try:
        yield
    finally:
        for o in owners:
            for n in names:
                held = before.get((id(o), n))
                if held is None:
                    continue
                hooks = getattr(o, n)
                for key in [k for k in hooks if k not in held]:
                    del hooks[key]
