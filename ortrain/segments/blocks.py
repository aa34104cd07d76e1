"""A model's repeated blocks: the sub-modules a deep model repeats (a transformer's
layers), where segments are cut by choice (``segments="blocks"``, ZeRO-2 and -3) and which
share one compiled graph. Torch only: ``ortrain.estimate_memory`` reads them before any
build."""

from __future__ import annotations

import collections

import torch

_CONTAINERS = (torch.nn.ModuleList, torch.nn.Sequential, torch.nn.ModuleDict)


def repeated_blocks(module: torch.nn.Module) -> frozenset[str]:
    """The sub-modules that are one of two or more children of a ``ModuleList``,
    ``Sequential`` or ``ModuleDict`` with the same class and parameter shapes (a
    transformer's layers, a stack of residual blocks)."""
    out: set[str] = set()
    for name, m in module.named_modules():
        if not isinstance(m, _CONTAINERS):
            continue
        groups: dict[tuple, list[str]] = collections.defaultdict(list)
        for child, cm in m.named_children():
            shapes = tuple((n, tuple(p.shape)) for n, p in cm.named_parameters())
            if shapes:
                groups[(type(cm), shapes)].append(f"{name}.{child}" if name else child)
        for names in groups.values():
            if len(names) > 1:
                out.update(names)
    return frozenset(out)
