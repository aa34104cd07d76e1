"""One call of a sub-module, flattened: the tensors a compiled segment takes as graph
inputs and the rest, which its graph holds as constants.

A call's ``signature`` (the tensors' shapes and dtypes, the constants' values) picks the
graph that runs it: another signature is another graph, as another batch shape is for
the whole model.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Any

import torch
import torch.utils._pytree as pytree

# Constants a graph may hold: values compared by ``==`` whose repr names them exactly.
_CONSTANT_TYPES = (type(None), bool, int, float, str, torch.dtype, torch.device, torch.layout)


class Uncompilable(Exception):
    """This call cannot run as a compiled segment (why, in words)."""


def _constant_token(value: Any, where: str) -> tuple:
    if isinstance(value, _CONSTANT_TYPES) or isinstance(value, enum.Enum):
        return (type(value).__qualname__, repr(value))
    raise Uncompilable(
        f"argument {where} is a {type(value).__qualname__}, which a compiled graph cannot take "
        "(tensors and plain constants only)"
    )


def _in_functorch_transform() -> bool:
    level = getattr(torch._C._functorch, "maybe_current_level", None)
    return level is not None and level() is not None


@dataclasses.dataclass
class Call:
    """``module(*args, **kwargs)``, flattened with torch's pytree."""

    spec: pytree.TreeSpec
    leaves: list[Any]
    tensor_at: list[int]  # positions of the tensor leaves
    signature: tuple

    @classmethod
    def of(cls, args: tuple, kwargs: dict) -> Call:
        for device in ("cpu", "cuda"):  # the user's own autocast region: eager's dtypes
            if torch.is_autocast_enabled(device):
                raise Uncompilable(
                    f"called inside torch.autocast({device!r}, "
                    f"{torch.get_autocast_dtype(device)}), whose casts a graph does not make"
                )
        if _in_functorch_transform():
            raise Uncompilable(
                "called inside a torch.func transform (vmap, grad, jacrev, ...), whose "
                "batched or tracked tensors a graph cannot take"
            )
        leaves, spec = pytree.tree_flatten((args, kwargs))
        tensor_at, sig = [], [str(spec)]
        for i, leaf in enumerate(leaves):
            if isinstance(leaf, torch.Tensor):
                tensor_at.append(i)
                # requires_grad: a graph computes the input gradients its call asked for
                sig.append(
                    ("tensor", tuple(leaf.shape), leaf.dtype, str(leaf.device), leaf.requires_grad)
                )
            else:
                sig.append(_constant_token(leaf, f"#{i}"))
        return cls(spec, leaves, tensor_at, tuple(sig))

    @property
    def tensors(self) -> list[torch.Tensor]:
        return [self.leaves[i] for i in self.tensor_at]

    def detached(self) -> Call:
        """The call with its tensors cut from the autograd graph (each keeps its
        ``requires_grad``): a record that does not keep the recorded forward's graph and
        every activation it saved alive."""
        leaves = list(self.leaves)
        for i in self.tensor_at:
            t = leaves[i]
            leaves[i] = t.detach().requires_grad_(t.requires_grad)
        return dataclasses.replace(self, leaves=leaves)

    def with_tensors(self, tensors: list[torch.Tensor]) -> tuple[tuple, dict]:
        """The call's (args, kwargs) with its tensors replaced by ``tensors``."""
        leaves = list(self.leaves)
        for i, t in zip(self.tensor_at, tensors, strict=True):
            leaves[i] = t
        args, kwargs = pytree.tree_unflatten(leaves, self.spec)
        return args, kwargs


@dataclasses.dataclass
class Result:
    """A segment's output, flattened: tensor leaves come from the graph, the rest were
    the same constants when it was exported."""

    spec: pytree.TreeSpec
    leaves: list[Any]
    tensor_at: list[int]

    @classmethod
    def of(cls, output: Any) -> Result:
        leaves, spec = pytree.tree_flatten(output)
        tensor_at = []
        for i, leaf in enumerate(leaves):
            if isinstance(leaf, torch.Tensor):
                tensor_at.append(i)
            else:
                _constant_token(leaf, f"output #{i}")
        kept = [None if i in tensor_at else leaf for i, leaf in enumerate(leaves)]
        return cls(spec, kept, tensor_at)

    def tensors(self, output: Any) -> list[torch.Tensor]:
        leaves, _ = pytree.tree_flatten(output)
        return [leaves[i] for i in self.tensor_at]

    def build(self, tensors: list[torch.Tensor]) -> Any:
        leaves = list(self.leaves)
        for i, t in zip(self.tensor_at, tensors, strict=True):
            leaves[i] = t
        return pytree.tree_unflatten(leaves, self.spec)
