"""Tensors inside a batch's Python containers (``forward(self, views: list[Tensor])``, a
dict of tensors under one argument) as graph inputs of their own.

A batch value that is not a tensor is a constant of its graph (a flag, a temperature),
so a list of tensors was too: its tensors' values were baked into the graph, and every
step's new values built a new graph. Here each tensor leaf of a container becomes an
input named by its path (``views[0]``, ``extra['mask']``) and the container a template
that holds a ``Slot`` where the tensor goes; the graph is built for the leaves' shapes,
like any batch tensor, and the template is filled again in the trace.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import torch
from torch.utils import _pytree as pytree


@dataclasses.dataclass(frozen=True)
class Slot:
    """Where the tensor input ``name`` goes in a container's template."""

    name: str

    def __repr__(self) -> str:
        return f"<tensor {self.name}>"


def _nested(value: Any) -> bool:
    return not isinstance(value, torch.Tensor) and any(
        isinstance(leaf, torch.Tensor) for leaf in pytree.tree_leaves(value)
    )


def split(batch: Mapping[str, Any]) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """(every tensor by input name: the batch's own and the containers' leaves; the other
    values, containers as templates with a ``Slot`` for each tensor)."""
    tensors: dict[str, torch.Tensor] = {}
    consts: dict[str, Any] = {}
    for k, v in batch.items():
        if isinstance(v, torch.Tensor):
            tensors[k] = v
        elif _nested(v):
            leaves, spec = pytree.tree_flatten_with_path(v)
            slots = []
            for path, leaf in leaves:
                if isinstance(leaf, torch.Tensor):
                    name = f"{k}{pytree.keystr(path)}"
                    tensors[name] = leaf
                    slots.append(Slot(name))
                else:
                    slots.append(leaf)
            consts[k] = pytree.tree_unflatten(slots, spec)
        else:
            consts[k] = v
    return tensors, consts


def filled(template: Any, tensors: Mapping[str, Any]) -> Any:
    """``template`` (a value of ``split``'s constants) with its slots' tensors, in new
    containers."""
    return pytree.tree_map(lambda v: tensors[v.name] if isinstance(v, Slot) else v, template)


def flat(batch: Mapping[str, Any]) -> dict[str, Any]:
    """The batch as its graph sees it: every tensor by input name, then the constants
    (a container's template stands for its structure and its non-tensor items)."""
    tensors, consts = split(batch)
    return {**tensors, **consts}
