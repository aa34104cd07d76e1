"""Python attributes that a forward changes: what a compiled graph cannot follow.

A forward that keeps a schedule in a plain attribute (``self.calls += 1``, a temperature
annealed per call) computes with a new value on every call in eager PyTorch; its graph
holds the value the export saw, and from the second step on it trains another loss, with
no error (the first step agrees with eager). So does a forward that draws from NumPy's
global generator or Python's ``random`` (a mask, a coin): the export keeps the first
draw as a constant. The first-step check records which module's own code drew
(``generator_draws``: hooks around every module's forward) and names it like an
attribute. The first-step check runs the forward twice
and names the scalar attributes (bool, int, float, str, None) that changed both times,
with the module that owns them: that module cannot be compiled (``whole_program``
refuses the whole graph, the segments run the owner in eager). An attribute set on the
first call only (a lazily built cache) is not such a schedule. A plain container that
grows on every call (a list the forward appends to) counts too: the graph would not
append.

ortrain's own eager runs of the model (the first-step check, the segments' recording
forward) leave the scalar attributes as they found them (``kept``), so a counter advances
once per training step, as in eager; and the random generators a forward's Python code
draws from (torch's on the CPU, NumPy's global one, Python's ``random``: a LayerDrop's
coin, SpecAugment's masks), so the first step draws what an eager step would.
"""

from __future__ import annotations

import contextlib
import copy
import random
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch

Key = tuple[str, str]  # (module name, attribute)
_SCALARS = (bool, int, float, str, type(None))
_CONTAINERS = (list, dict, set)
_TORCH = frozenset({"training"})  # module.train() changes it, not a forward


def scalars(module: torch.nn.Module) -> dict[Key, Any]:
    """Every sub-module's scalar instance attributes, and the length of its plain
    containers (a list the forward appends to)."""
    out: dict[Key, Any] = {}
    for name, m in module.named_modules():
        for attr, value in vars(m).items():
            if attr in _TORCH:
                continue
            if isinstance(value, _SCALARS):
                out[(name, attr)] = value
            elif type(value) in _CONTAINERS:
                out[(name, attr)] = _Length(len(value))
    return out


class _Length(int):
    """A container's length (what says that a forward appended to it)."""

    def __repr__(self) -> str:
        return f"{int(self)} items"


def _changed(before: dict[Key, Any], after: dict[Key, Any]) -> dict[Key, tuple[Any, Any]]:
    return {k: (before.get(k), v) for k, v in after.items() if before.get(k, v) != v}


@contextlib.contextmanager
def random_states_kept() -> Iterator[None]:
    """The CPU generators of torch, NumPy (global) and Python as they were before."""
    py, npy = random.getstate(), np.random.get_state()
    try:
        with torch.random.fork_rng(devices=[]):
            yield
    finally:
        random.setstate(py)
        np.random.set_state(npy)


@contextlib.contextmanager
def kept(module: torch.nn.Module) -> Iterator[None]:
    """The forwards run inside leave ``module``'s scalar attributes and plain containers
    as they were (a container's items put back in the same object), and the random
    generators (``random_states_kept``)."""
    with random_states_kept(), _attributes_kept(module):
        yield


@contextlib.contextmanager
def _attributes_kept(module: torch.nn.Module) -> Iterator[None]:
    before = scalars(module)
    modules = dict(module.named_modules())
    held = {
        (name, attr): copy.copy(getattr(modules[name], attr))
        for (name, attr), v in before.items()
        if isinstance(v, _Length)
    }
    try:
        yield
    finally:
        for (name, attr), (old, _) in _changed(before, scalars(module)).items():
            m = modules[name]
            if (name, attr) not in held:
                setattr(m, attr, old)
                continue
            now, was = getattr(m, attr), held[(name, attr)]
            now.clear()
            if isinstance(now, list):
                now.extend(was)
            else:
                now.update(was)


# Generators whose draws a graph cannot make: the export runs the Python code once and
# keeps what it drew as constants (torch's own random ops are traced as graph ops instead).
_HOST_GENERATORS: dict[str, Callable[[], Any]] = {
    "NumPy's global random generator": lambda: np.random.get_state()[1:3],
    "Python's random module": lambda: random.getstate()[1:2],
}


def _generators() -> tuple[Any, ...]:
    """Where each host generator is (a draw moves it)."""
    out = []
    for where in _HOST_GENERATORS.values():
        state = where()
        out.append(tuple(np.asarray(x).tobytes() for x in state))
    return tuple(out)


@contextlib.contextmanager
def generator_draws(module: torch.nn.Module) -> Iterator[dict[str, list[str]]]:
    """Which modules' own code (not their children's) drew from a host generator in the
    forwards run inside: {module name: [generator, ...]}, filled on exit."""
    found: dict[str, list[str]] = {}
    names = {id(m): n for n, m in module.named_modules()}
    stack: list[list[Any]] = []  # per open call: [module name, generators at its last event]

    def note(frame: list[Any], now: tuple[Any, ...]) -> None:
        for label, a, b in zip(_HOST_GENERATORS, frame[1], now, strict=True):
            if a != b and label not in found.setdefault(frame[0], []):
                found[frame[0]].append(label)
        frame[1] = now

    def pre(m: torch.nn.Module, *_: Any) -> None:
        now = _generators()
        if stack:
            note(stack[-1], now)  # the parent's own code since its last event
        stack.append([names.get(id(m), ""), now])

    def post(m: torch.nn.Module, *_: Any) -> None:
        now = _generators()
        if stack:
            note(stack.pop(), now)
        if stack:
            stack[-1][1] = now  # the child's draws are not the parent's

    handles = []
    for m in module.modules():
        handles.append(m.register_forward_pre_hook(pre))
        handles.append(m.register_forward_hook(post))
    try:
        yield found
    finally:
        for h in handles:
            h.remove()
        for name in [n for n, labels in found.items() if not labels]:
            del found[name]


@contextlib.contextmanager
def buffer_resizes(module: torch.nn.Module) -> Iterator[dict[str, list[str]]]:
    """Which modules' calls inside changed the shape of a buffer of their own (an
    observer's ``min_val`` made per channel on its first call, a cache grown in place):
    {module name: ["min_val ([0] -> [32])", ...]}. A graph would take such a buffer at one
    shape and hold the branch its first shape took (QAT's "first batch" initialisation)."""
    found: dict[str, list[str]] = {}
    names = {id(m): n for n, m in module.named_modules()}
    shapes: dict[int, list[dict[str, tuple[int, ...]]]] = {}

    def own(m: torch.nn.Module) -> dict[str, tuple[int, ...]]:
        return {k: tuple(b.shape) for k, b in m._buffers.items() if b is not None}

    def pre(m: torch.nn.Module, *_: Any) -> None:
        shapes.setdefault(id(m), []).append(own(m))

    def post(m: torch.nn.Module, *_: Any) -> None:
        before = shapes[id(m)].pop()
        for k, now in own(m).items():
            was = before.get(k)
            if was is not None and was != now:
                said = f"buffer {k} ({list(was)} -> {list(now)})"
                if said not in found.setdefault(names.get(id(m), ""), []):
                    found[names.get(id(m), "")].append(said)

    handles = []
    for m in module.modules():
        if m._buffers:
            handles.append(m.register_forward_pre_hook(pre))
            handles.append(m.register_forward_hook(post))
    try:
        yield found
    finally:
        for h in handles:
            h.remove()


def changed_every_call(
    module: torch.nn.Module, first: Callable[[], Any], again: Callable[[], Any]
) -> tuple[Any, dict[str, str]]:
    """``first()`` (a forward and backward), then, where it changed scalar attributes,
    ``again()`` (a forward): (``first()``'s result, what both changed by owning module:
    "attr (a -> b)", the host generators its own code drew from, and its buffers whose
    shape ``first()`` changed). The attributes and the generators are put back
    afterwards."""
    with kept(module):
        before = scalars(module)
        with generator_draws(module) as drawn, buffer_resizes(module) as resized:
            result = first()
        after = scalars(module)
        once = _changed(before, after)
        twice = {}
        if once:
            try:
                again()
                twice = _changed(after, scalars(module))
            except Exception:
                # the second call fails where the first did not: what the first changed
                # decides what the next call does
                twice = once
    owners: dict[str, list[str]] = {}
    for (name, attr), (old, new) in twice.items():
        if (name, attr) in once:
            owners.setdefault(name, []).append(f"{attr} ({old!r} -> {new!r})")
    for name, labels in drawn.items():
        owners.setdefault(name, []).extend(f"draws from {label}" for label in labels)
    for name, said in resized.items():
        owners.setdefault(name, []).extend(said)
    return result, {name: ", ".join(attrs) for name, attrs in owners.items()}


def describe(stateful: dict[str, str], model: str) -> str:
    """The attributes for a message: "M.calls (1 -> 2); M.block.t (...)"."""
    return "; ".join(
        f"{model}{'.' + name if name else ''}: {attrs}" for name, attrs in sorted(stateful.items())
    )
