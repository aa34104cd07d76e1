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
first call only (a lazily built cache) is not such a schedule, nor is a buffer put in
anew at another shape on the first call and kept by the second (a cache sized to the
input: ``first_step.EagerSide._build_lazy_buffers`` builds it before the export). A
plain container that grows on every call (a list the forward appends to) counts too:
the graph would not append; so does a container of scalars whose items change
(``_container``).

The module-level values the model's own code reads (a global step counter, a schedule's
scalar in the user's script; ``python_reads``: names read by the methods of the model's
classes defined outside installed packages, by functions set on a module instance, by the
functions of that code they call, and by ``loss_fn``, its closure and defaults; with the
attributes of a module the model does not hold or a plain object found there: a loss
module's ``gamma``) count like attributes, owned by each module whose code reads them.
What the training loop changes between steps (``model.temperature = t``, a global
annealed by the loop) is watched too (``ValueWatch``): the graphs hold the values
their export saw.

ortrain's own eager runs of the model (the first-step check, the segments' recording
forward) leave the scalar attributes and those module-level values as they found them
(``kept``), so a counter advances once per training step, as in eager; and the random
generators a forward's Python code draws from (torch's on the CPU, NumPy's global one,
Python's ``random``: a LayerDrop's coin, SpecAugment's masks), so the first step draws
what an eager step would.
"""

from __future__ import annotations

import contextlib
import copy
import operator
import random
import types
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch

from ortrain.user_code import global_names, is_user_code

Key = tuple[str, str]  # (module name, attribute)
_SCALARS = (bool, int, float, str, type(None))
_CONTAINERS = (list, dict, set)
_TORCH = frozenset({"training"})  # module.train() changes it, not a forward


def scalars(module: torch.nn.Module, buffers: bool = False) -> dict[Key, Any]:
    """Every sub-module's scalar instance attributes, the length of its plain containers
    (a list the forward appends to), which tensor its plain tensor attributes hold when
    it takes no gradient (a state carried to the next call: ``self.h = hn.detach()``), and
    the scalars of the
    plain objects it holds (a config: key "config.tau", under the first module holding
    it); ``buffers``: which tensor each buffer is too (one a forward assigns anew)."""
    out: dict[Key, Any] = {}
    objects: set[int] = set()
    for name, m in module.named_modules():
        for attr, value in vars(m).items():
            if attr in _TORCH:
                continue
            if isinstance(value, _SCALARS):
                out[(name, attr)] = value
            elif type(value) in _CONTAINERS:
                out[(name, attr)] = _container(value)
            elif isinstance(value, torch.Tensor):
                # one that requires grad is this call's, made from the parameters (a
                # weight_norm hook's weight): traced with the call, not state
                if not value.requires_grad:  # (a constant of the graphs: by version too)
                    out[(name, attr)] = _Same(value, value._version)
            elif _plain_object(value) and id(value) not in objects:
                objects.add(id(value))
                out[(name, attr)] = _Same(value)
                _object_scalars(value, f"{attr}.", name, objects, out, 1)
        if buffers:
            for k, b in m._buffers.items():
                out[(name, f"buffer {k}")] = _Same(b)
    return out


_OBJECT_DEPTH = 3  # config.text_config.rope.theta: a nested config's values too


def _object_scalars(
    obj: Any, prefix: str, name: str, seen: set[int], out: dict[Key, Any], depth: int
) -> None:
    """``obj``'s scalars and container lengths under keys ``prefix + attr``, and those of
    the plain objects it holds, ``_OBJECT_DEPTH`` deep."""
    for k, v in vars(obj).items():
        if isinstance(v, _SCALARS):
            out[(name, f"{prefix}{k}")] = v
        elif type(v) in _CONTAINERS:
            out[(name, f"{prefix}{k}")] = _container(v)
        elif depth < _OBJECT_DEPTH and _plain_object(v) and id(v) not in seen:
            seen.add(id(v))
            _object_scalars(v, f"{prefix}{k}.", name, seen, out, depth + 1)


def _plain_object(value: Any) -> bool:
    """An object of plain attributes a forward may read settings from (a config); not one
    whose attributes will not be read (a proxy whose ``__dict__`` raises)."""
    try:
        if not isinstance(vars(value), dict):
            return False
    except Exception:
        return False
    return not callable(value) and not isinstance(value, (torch.Tensor, type, types.ModuleType))


def _size(v: Any) -> int:
    """A container's length, a tensor attribute's in-place version."""
    return v._version if isinstance(v, torch.Tensor) else len(v)


class _Length(int):
    """A container's length (what says that a forward appended to it)."""

    def __repr__(self) -> str:
        return f"{int(self)} items"


class _Contents(_Length):
    """A small container of scalars by its items too: a value the loop or a forward sets
    in place (``cfg["tau"] = t``, ``scale[0] *= 0.9``) is read by the graphs as a constant
    as much as an attribute is."""

    items: tuple

    def __new__(cls, items: tuple) -> _Contents:
        obj = super().__new__(cls, len(items))
        obj.items = items
        return obj

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Contents) and self.items == other.items

    def __ne__(self, other: object) -> bool:
        return not self == other

    def __hash__(self) -> int:
        return hash(self.items)

    def __repr__(self) -> str:
        return repr(list(self.items))


# A container of scalars is compared by its items up to ``_CONTENT_ITEMS`` (they name
# the change), by a digest of them up to ``_DIGEST_ITEMS`` (a class-weight list, a
# schedule table: a few microseconds a step each); a larger one, or one holding more than
# scalars, by its length (reading every item at every step would cost in proportion).
_CONTENT_ITEMS = 64
_DIGEST_ITEMS = 4096


class _Digest(_Length):
    """A container of scalars by a digest of its items (``hash`` of them: a collision
    would hide a change with odds of about 2**-64)."""

    digest: int

    def __new__(cls, n: int, digest: int) -> _Digest:
        obj = super().__new__(cls, n)
        obj.digest = digest
        return obj

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Digest) and (int(self), self.digest) == (
            int(other),
            other.digest,
        )

    def __ne__(self, other: object) -> bool:
        return not self == other

    def __hash__(self) -> int:
        return hash((int(self), self.digest))

    def __repr__(self) -> str:
        return f"{int(self)} items (digest {self.digest & 0xFFFFFFFF:08x})"


def _scalar_items(v: list | dict) -> tuple | None:
    """A list's items or a dict's (key, value) pairs where all are scalars, else None."""
    if isinstance(v, dict):
        if all(isinstance(x, _SCALARS) for x in v.values()) and all(
            isinstance(k, _SCALARS) for k in v
        ):
            return tuple(v.items())
    elif isinstance(v, list) and all(isinstance(x, _SCALARS) for x in v):
        return tuple(v)
    return None


def _container(v: list | dict | set) -> _Length:
    """What a plain container is compared by: its scalar items where it holds only
    scalars and at most ``_CONTENT_ITEMS``, a digest of them up to ``_DIGEST_ITEMS``,
    else its length."""
    n = len(v)
    # (an empty one that gains items changes its length)
    if 0 < n <= _DIGEST_ITEMS and (items := _scalar_items(v)) is not None:
        return _Contents(items) if n <= _CONTENT_ITEMS else _Digest(n, hash(items))
    return _Length(n)


class _Same:
    """An object compared by identity (a tensor attribute assigned anew)."""

    def __init__(self, obj: Any, version: int | None = None) -> None:
        self.obj = obj
        self.version = version  # a tensor's in-place version, where it is a constant

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Same) and other.obj is self.obj and other.version == self.version

    def __hash__(self) -> int:
        return id(self.obj)

    def __repr__(self) -> str:
        if isinstance(self.obj, torch.Tensor):
            return f"a tensor {list(self.obj.shape)}"
        return f"a {type(self.obj).__name__}"


def _changed(before: dict[Key, Any], after: dict[Key, Any]) -> dict[Key, tuple[Any, Any]]:
    return {k: (before.get(k), v) for k, v in after.items() if before.get(k, v) != v}


# ------------------------------------------------------------------ module-level values
READ = "<read>"  # Key[0] of a module-level value: (READ, its label)
LOSS_FN = "<loss_fn>"  # the owner of what ``loss_fn`` reads
_MISSING = object()
_MAX_DEPTH = 8


class _Read:
    """A module-level value (or a closure's cell) the model's code reads, and the modules
    whose code reads it."""

    def __init__(self, label: str, scope: dict | types.CellType, name: str | None) -> None:
        self.label, self.scope, self.name = label, scope, name
        self.owners: set[str] = set()
        # the trained module's tensors (a module read here may hold some: a base model
        # whose layers the model took): the update and the forward change them, not the loop
        self.own: frozenset[int] = frozenset()

    def value(self) -> Any:
        """What it is compared by (``_read_value``)."""
        return _read_value(self.get(), self.own)

    def get(self) -> Any:
        if self.name is None:
            try:
                return self.scope.cell_contents  # type: ignore[union-attr]
            except ValueError:  # an empty cell
                return _MISSING
        return self.scope.get(self.name, _MISSING)  # type: ignore[union-attr]

    def put(self, value: Any) -> None:
        if value is _MISSING:
            return
        if self.name is None:
            self.scope.cell_contents = value  # type: ignore[union-attr]
        else:
            self.scope[self.name] = value  # type: ignore[index]


def _watched(value: Any) -> bool:
    return (
        isinstance(value, _SCALARS)
        or type(value) in _CONTAINERS
        or isinstance(value, (torch.Tensor, torch.nn.Module))
    )


class _Versions(tuple):
    """A tensor's, or a module's tensors', identities and in-place versions: what says
    that a tensor or a module the model does not own (a GAN's discriminator in
    ``loss_fn``'s closure, a global table) changed, in place or anew, since the graphs
    took it as constants."""

    def __repr__(self) -> str:
        return f"{len(self)} tensor(s) at versions {[v for _, v in self][:4]}"


def _read_value(v: Any, own: frozenset[int] = frozenset()) -> Any:
    """What a module-level value is compared by: a container by length, a tensor or a
    module by its tensors' versions (not ``own``'s), a scalar by itself."""
    if type(v) in _CONTAINERS:
        return _container(v)
    if isinstance(v, torch.Tensor):
        return _Versions(((id(v), v._version),))
    if isinstance(v, torch.nn.Module):
        tensors = (t for t in (*v.parameters(), *v.buffers()) if id(t) not in own)
        return _Versions(tuple((id(t), t._version) for t in tensors))
    return v


def _foreign(value: Any, own: set[int]) -> bool:
    """A tensor or module holding a tensor that ``own`` (the trained module's parameters
    and buffers) does not: those are constants of the graphs."""
    if isinstance(value, torch.Tensor):
        return id(value) not in own
    if isinstance(value, torch.nn.Module):
        return any(id(t) not in own for t in (*value.parameters(), *value.buffers()))
    return True


_Found = dict[tuple[int, str | None], _Read]
# what every module has: torch's own bookkeeping, no value a forward computes with
_MODULE_INTERNALS = frozenset(vars(torch.nn.Module()))


def _function_reads(
    fn: types.FunctionType, found: _Found, seen: set[int], depth: int, inside: frozenset[int]
) -> list[_Read]:
    """What ``fn`` and the user functions it names read (``_Read``s, made once each);
    ``inside``: ids of the trained module's sub-modules (their attributes are watched as
    the model's own)."""
    if id(fn) in seen or depth > _MAX_DEPTH:
        return []
    seen.add(id(fn))
    out: list[_Read] = []
    scope = fn.__globals__
    where = scope.get("__name__", "?")
    for n in sorted(global_names(fn.__code__)):
        if n not in scope:
            continue
        value = scope[n]
        if isinstance(value, types.FunctionType):
            if is_user_code(value.__module__ or ""):
                out += _function_reads(value, found, seen, depth + 1, inside)
            continue
        if _watched(value):
            key = (id(scope), n)
            read = found.get(key) or found.setdefault(key, _Read(f"{where}.{n}", scope, n))
            out.append(read)
        out += _attribute_reads(value, f"{where}.{n}", found, seen, depth, inside)
    for var, cell in zip(fn.__code__.co_freevars, fn.__closure__ or (), strict=False):
        try:
            value = cell.cell_contents
        except ValueError:
            continue
        if isinstance(value, types.FunctionType):
            out += _function_reads(value, found, seen, depth + 1, inside)
            continue
        label = f"{fn.__qualname__}'s {var}"
        if _watched(value):
            key = (id(cell), None)
            out.append(found.get(key) or found.setdefault(key, _Read(label, cell, None)))
        out += _attribute_reads(value, label, found, seen, depth, inside)
    # a default bound once (``lambda out, b, crit=crit: ...``)
    defaults = [*(fn.__defaults__ or ()), *(fn.__kwdefaults__ or {}).values()]
    for value in defaults:
        out += _attribute_reads(value, f"{fn.__qualname__}'s default", found, seen, depth, inside)
    return out


def _attribute_reads(
    obj: Any, label: str, found: _Found, seen: set[int], depth: int, inside: frozenset[int]
) -> list[_Read]:
    """The scalar attributes (and plain containers) of a module the trained one does not
    hold (a loss module in ``loss_fn``'s closure: a focal loss's ``gamma`` the loop
    anneals) and of a plain object (a config), with what their own classes' code reads:
    values the graphs hold as constants like the model's own attributes."""
    if isinstance(obj, torch.nn.Module):
        holders = [
            (f"{label}.{name}" if name else label, m)
            for name, m in obj.named_modules()
            if id(m) not in inside
        ]
    elif _plain_object(obj) and not isinstance(obj, torch.nn.Module):
        holders = [(label, obj)]
    else:
        return []
    out: list[_Read] = []
    for where, holder in holders:
        if id(holder) in seen:
            continue
        seen.add(id(holder))
        attrs = vars(holder)
        for attr, v in attrs.items():
            if attr in _MODULE_INTERNALS and isinstance(holder, torch.nn.Module):
                continue
            if isinstance(v, _SCALARS) or type(v) in _CONTAINERS:
                key = (id(attrs), attr)
                read = found.get(key) or found.setdefault(
                    key, _Read(f"{where}.{attr}", attrs, attr)
                )
                out.append(read)
            elif depth < _OBJECT_DEPTH and _plain_object(v):
                out += _attribute_reads(v, f"{where}.{attr}", found, seen, depth + 1, inside)
        for c in type(holder).__mro__:
            if c is torch.nn.Module or c is object:
                break
            if is_user_code(c.__module__):
                for f in vars(c).values():
                    f = getattr(f, "__func__", getattr(f, "fget", f))
                    if isinstance(f, types.FunctionType):
                        out += _function_reads(f, found, seen, depth + 1, inside)
    return out


def python_reads(module: torch.nn.Module, loss_fn: Callable | None = None) -> list[_Read]:
    """The module-level values (scalars, and plain containers by length) that the
    methods of ``module``'s own classes (not installed code), the user functions they
    call, and ``loss_fn`` read, each with the modules whose code reads it."""
    found: _Found = {}
    inside = frozenset(id(m) for m in module.modules())
    per_class: dict[type, list[_Read]] = {}
    for name, m in module.named_modules():
        cls = type(m)
        if cls not in per_class:
            reads: list[_Read] = []
            seen: set[int] = set()
            for c in cls.__mro__:
                if c is torch.nn.Module or c is object:
                    break
                if not is_user_code(c.__module__):
                    continue
                for v in vars(c).values():
                    f = getattr(v, "__func__", getattr(v, "fget", v))
                    if isinstance(f, types.FunctionType):
                        reads += _function_reads(f, found, seen, 0, inside)
            per_class[cls] = reads
        for read in per_class[cls]:
            read.owners.add(name)
        for v in vars(m).values():  # a function set on the instance (``m.forward = fn``)
            f = getattr(v, "__func__", v)
            if isinstance(f, types.FunctionType) and is_user_code(f.__module__ or ""):
                for read in _function_reads(f, found, set(), 0, inside):
                    read.owners.add(name)
    fn = getattr(loss_fn, "__func__", loss_fn)
    loss_reads: list[_Read] = []
    seen: set[int] = set()
    if isinstance(fn, types.FunctionType) and is_user_code(fn.__module__ or ""):
        loss_reads += _function_reads(fn, found, seen, 0, inside)
    # a loss module or object called as ``loss_fn`` (or whose method it is)
    holder = getattr(loss_fn, "__self__", None) if fn is not loss_fn else loss_fn
    if holder is not None and not isinstance(holder, types.FunctionType):
        loss_reads += _attribute_reads(holder, "loss_fn", found, seen, 0, inside)
    for read in loss_reads:
        read.owners.add(LOSS_FN)
    # the trained module's own tensors (the model itself in a closure) change every step
    # through the update: they are graph inputs, not constants
    own = frozenset(id(t) for t in (*module.parameters(), *module.buffers()))
    reads = [r for r in found.values() if r.owners and _foreign(r.get(), own)]
    for r in reads:
        r.own = own
    return reads


def _read_values(reads: list[_Read]) -> dict[Key, Any]:
    out: dict[Key, Any] = {}
    for r in reads:
        v = r.get()
        if v is _MISSING or _watched(v):
            out[(READ, r.label)] = r.value()
    return out


@contextlib.contextmanager
def _reads_kept(reads: list[_Read]) -> Iterator[None]:
    before = _read_values(reads)
    held = {r.label: copy.copy(r.get()) for r in reads if type(r.get()) in _CONTAINERS}
    try:
        yield
    finally:
        by_label = {r.label: r for r in reads}
        for (_, label), (old, _) in _changed(before, _read_values(reads)).items():
            r = by_label[label]
            if isinstance(old, _Versions):  # changed in place: nothing to put back
                continue
            if label not in held:
                r.put(old)
                continue
            now, was = r.get(), held[label]
            if type(now) is type(was):
                now.clear()
                now.extend(was) if isinstance(now, list) else now.update(was)


class ValueWatch:
    """The Python values a forward reads as they were at the last look: the modules'
    attributes (``scalars``; not their buffers: ``TrainingState.adopt_rebound`` follows a
    buffer assigned anew) and ``python_reads``. ``changes()`` says which changed since; a
    look that finds nothing changed costs a pass over the modules' attributes."""

    def __init__(self, module: torch.nn.Module, loss_fn: Callable | None) -> None:
        self.module = module
        self.dicts: list[dict[str, Any]] = []
        self.holders: dict[Key, list[str]] = {}  # (first holder, attr) -> every holder
        watched: set[int] = set()
        first: dict[int, Key] = {}
        for name, m in module.named_modules():
            self.dicts.append(vars(m))
            for attr, value in vars(m).items():
                if _plain_object(value):
                    key = first.setdefault(id(value), (name, attr))
                    if key == (name, attr):
                        self._watch_object(value, watched, 1)
                    self.holders.setdefault(key, []).append(name)
        self.reads = python_reads(module, loss_fn)
        self.owners = {(READ, r.label): sorted(r.owners) for r in self.reads}
        self.fast = self._fast()
        self.full = self._full()
        self._seen = self._objects()

    def _watch_object(self, obj: Any, seen: set[int], depth: int) -> None:
        """``obj``'s attributes, and those of the plain objects it holds (as ``scalars``)."""
        if id(obj) in seen:
            return
        seen.add(id(obj))
        self.dicts.append(vars(obj))
        if depth < _OBJECT_DEPTH:
            for v in vars(obj).values():
                if _plain_object(v):
                    self._watch_object(v, seen, depth + 1)

    def _fast(self) -> list[Any]:
        out: list[Any] = []
        for d in self.dicts:
            for v in d.values():
                t = type(v)
                if t in _CONTAINERS:
                    out.append(_container(v))
                elif isinstance(v, _SCALARS):
                    out.append(v)
                elif isinstance(v, torch.Tensor):
                    out.append((id(v), v._version))
                elif _plain_object(v):
                    out.append(id(v))
        out.extend(r.value() for r in self.reads)
        return out

    def _full(self) -> dict[Key, Any]:
        return {**scalars(self.module), **_read_values(self.reads)}

    def _objects(self) -> tuple[list[list[Any]], list[tuple[Any, int]], list, list[Any]]:
        """Every watched attribute's object; each container by its length, or as compared
        where that is by its items (``_container``), and each tensor by its version; each
        module-level value: held, so that no id is reused while they are compared."""
        values = [list(d.values()) for d in self.dicts]
        sized: list[tuple[Any, int]] = []
        items: list[tuple[Any, _Contents | _Digest]] = []
        for vs in values:
            for v in vs:
                if type(v) in _CONTAINERS:
                    seen = _container(v)
                    (items if isinstance(seen, (_Contents, _Digest)) else sized).append((v, seen))
                elif isinstance(v, torch.Tensor):
                    sized.append((v, v._version))
        return values, sized, items, [r.value() for r in self.reads]

    def _same_objects(self) -> bool:
        """Whether every watched attribute still holds the very object it held at the last
        look (and no container changed its length or its scalar items): nothing can have
        changed. A value
        assigned anew, even an equal one, takes ``_fast``'s comparison."""
        values, sized, items, reads = self._seen
        for d, vs in zip(self.dicts, values, strict=True):
            if len(d) != len(vs) or not all(map(operator.is_, d.values(), vs)):
                return False
        # module-level values by what they are compared by (a tensor by its version)
        return (
            all(_size(c) == n for c, n in sized)
            and all(_container(c) == n for c, n in items)
            and all(a is b or a == b for a, b in zip((r.value() for r in self.reads), reads))
        )

    def changes(self) -> dict[Key, tuple[Any, Any]]:
        """What changed since the last call (or since the watch was made)."""
        if self._same_objects():
            return {}
        self._seen = self._objects()
        fast = self._fast()
        if fast == self.fast:
            return {}
        full = self._full()
        diff = _changed(self.full, full)
        self.fast, self.full = fast, full
        return diff

    def owners_of(self, key: Key) -> list[str]:
        """The modules whose code reads ``key`` (``LOSS_FN``: the loss function)."""
        if key[0] == READ:
            return self.owners.get(key, [])
        head = key[1].split(".", 1)[0]
        return self.holders.get((key[0], head), [key[0]])


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
def kept(module: torch.nn.Module, loss_fn: Callable | None = None) -> Iterator[None]:
    """The forwards run inside leave ``module``'s scalar attributes and plain containers
    as they were (a container's items put back in the same object), the module-level
    values its code reads (``python_reads``), and the random generators
    (``random_states_kept``)."""
    with random_states_kept(), _attributes_kept(module), _reads_kept(python_reads(module, loss_fn)):
        yield


@contextlib.contextmanager
def _attributes_kept(module: torch.nn.Module) -> Iterator[None]:
    before = scalars(module, buffers=True)
    modules = dict(module.named_modules())
    held = {
        (name, attr): copy.copy(getattr(modules[name], attr))
        for (name, attr), v in before.items()
        if isinstance(v, _Length) and "." not in attr
    }
    # plain tensor attributes' values: a forward may change them in place (a center)
    values = {
        key: v.obj.detach().clone()
        for key, v in before.items()
        if isinstance(v, _Same) and v.version is not None
    }
    try:
        yield
    finally:
        for (name, attr), (old, _) in _changed(before, scalars(module, buffers=True)).items():
            m = modules[name]
            if isinstance(old, _Same) and (name, attr) in values:
                if getattr(m, attr) is not old.obj:
                    setattr(m, attr, old.obj)
                if old.obj._version != old.version:  # changed in place: its values back
                    with torch.no_grad():
                        old.obj.copy_(values[(name, attr)])
                continue
            if attr.startswith("buffer "):
                m._buffers[attr[len("buffer ") :]] = old.obj
            elif "." in attr:  # a plain object's: put back where it was still held
                *path, leaf = attr.split(".")
                if old is not None and not isinstance(old, _Length):
                    owner = m
                    for part in path:
                        owner = getattr(owner, part)
                    setattr(owner, leaf, old)
            elif isinstance(old, _Same):
                setattr(m, attr, old.obj)
            elif (name, attr) not in held:
                setattr(m, attr, old)
            else:
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
    module: torch.nn.Module,
    first: Callable[[], Any],
    again: Callable[[], Any],
    loss_fn: Callable | None = None,
) -> tuple[Any, dict[str, str], list[str]]:
    """``first()`` (a forward and backward), then, where it changed scalar attributes or
    buffer shapes, ``again()`` (a forward): (``first()``'s result, what both changed by
    owning module: "attr (a -> b)", the host generators its own code drew from, and its
    buffers whose shape both calls changed; the modules that put a buffer in anew at
    another shape on the first call only). The attributes and the generators are put
    back afterwards."""
    reads = python_reads(module, loss_fn)
    by_label = {r.label: r for r in reads}

    def values() -> dict[Key, Any]:
        return {**scalars(module, buffers=True), **_read_values(reads)}

    with random_states_kept(), _attributes_kept(module), _reads_kept(reads):
        before = values()
        with generator_draws(module) as drawn, buffer_resizes(module) as resized:
            result = first()
        after = values()
        once = _changed(before, after)
        twice = {}
        resized_again: dict[str, list[str]] | None = None
        if once or resized:
            try:
                with buffer_resizes(module) as resized_again:
                    again()
                twice = _changed(after, values())
            except Exception:
                # the second call fails where the first did not: what the first changed
                # decides what the next call does
                twice, resized_again = once, None
    owners: dict[str, list[str]] = {}
    for (name, attr), (old, new) in twice.items():
        if (name, attr) not in once:
            continue
        if name != READ:
            owners.setdefault(name, []).append(f"{attr} ({old!r} -> {new!r})")
            continue
        for owner in sorted(by_label[attr].owners - {LOSS_FN}) or [""]:
            owners.setdefault(owner, []).append(f"global {attr} ({old!r} -> {new!r})")
    for name, labels in drawn.items():
        owners.setdefault(name, []).extend(f"draws from {label}" for label in labels)
    for name, said in resized.items():
        # a buffer put in anew at another shape on the first call only (a cache built
        # lazily: ConViT's ``rel_indices``) is the module's from then on
        # (``lazy_buffers``); one resized on every call, or in place (an observer's,
        # which the check's restore shrinks back), is state a graph cannot follow
        if resized_again is None or name in resized_again:
            owners.setdefault(name, []).extend(said)
    lazy = [name for name in resized if name not in owners]
    return result, {name: ", ".join(attrs) for name, attrs in owners.items()}, lazy


def describe(stateful: dict[str, str], model: str) -> str:
    """The attributes for a message: "M.calls (1 -> 2); M.block.t (...)"."""
    return "; ".join(
        f"{model}{'.' + name if name else ''}: {attrs}" for name, attrs in sorted(stateful.items())
    )
