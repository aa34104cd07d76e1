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


class _Fields:
    """A dataclass instance opened for pytree (a hand-written output or argument class
    that pytree takes as one leaf): its class, its fields' names and values. Ours, so
    the user's class is not registered with pytree behind their back."""

    def __init__(self, cls: type, names: tuple[str, ...], values: list[Any]):
        self.cls, self.names, self.values = cls, names, values


pytree.register_pytree_node(
    _Fields,
    lambda f: (list(f.values), (f.cls, f.names)),
    lambda values, ctx: _Fields(ctx[0], ctx[1], list(values)),
    serialized_type_name="ortrain.segments.calls._Fields",
)


def _is_open_dataclass(value: Any) -> bool:
    return (
        dataclasses.is_dataclass(value)
        and not isinstance(value, type)
        and type(value) not in pytree.SUPPORTED_NODES  # HF's ModelOutput is registered
    )


def _open(tree: Any) -> Any:
    def opened(value: Any) -> Any:
        if not _is_open_dataclass(value):
            return value
        names = tuple(f.name for f in dataclasses.fields(value))
        return _Fields(type(value), names, [_open(getattr(value, n)) for n in names])

    return pytree.tree_map(opened, tree, is_leaf=_is_open_dataclass)


def _close(tree: Any) -> Any:
    def closed(value: Any) -> Any:
        if not isinstance(value, _Fields):
            return value
        obj = value.cls.__new__(value.cls)  # fields as they were, without __init__
        for name, v in zip(value.names, value.values, strict=True):
            object.__setattr__(obj, name, _close(v))
        return obj

    return pytree.tree_map(closed, tree, is_leaf=lambda v: isinstance(v, _Fields))


def flatten(tree: Any) -> tuple[list[Any], pytree.TreeSpec]:
    """``pytree.tree_flatten``, dataclass instances opened into their fields."""
    return pytree.tree_flatten(_open(tree))


def unflatten(leaves: list[Any], spec: pytree.TreeSpec) -> Any:
    return _close(pytree.tree_unflatten(leaves, spec))


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
        leaves, spec = flatten((args, kwargs))
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
        args, kwargs = unflatten(leaves, self.spec)
        return args, kwargs


@dataclasses.dataclass
class Result:
    """A segment's output, flattened: tensor leaves come from the graph, the rest were
    the same constants when it was exported."""

    spec: pytree.TreeSpec
    leaves: list[Any]
    tensor_at: list[int]
    # the tensors (by position among them) that are complex: the graph gives their real
    # view (a last dimension of 2), as the exporter represents a complex value
    complex_at: tuple[int, ...] = ()

    @classmethod
    def of(cls, output: Any) -> Result:
        leaves, spec = flatten(output)
        tensor_at = []
        for i, leaf in enumerate(leaves):
            if isinstance(leaf, torch.Tensor):
                tensor_at.append(i)
            else:
                _constant_token(leaf, f"output #{i}")
        kept = [None if i in tensor_at else leaf for i, leaf in enumerate(leaves)]
        complex_at = tuple(k for k, i in enumerate(tensor_at) if leaves[i].is_complex())
        return cls(spec, kept, tensor_at, complex_at)

    def tensors(self, output: Any) -> list[torch.Tensor]:
        leaves, _ = flatten(output)
        return [leaves[i] for i in self.tensor_at]

    def build(self, tensors: list[torch.Tensor]) -> Any:
        leaves = list(self.leaves)
        for i, t in zip(self.tensor_at, tensors, strict=True):
            leaves[i] = t
        return unflatten(leaves, self.spec)
