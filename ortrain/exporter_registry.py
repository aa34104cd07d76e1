"""The ONNX exporter's table of ATen translations, made once per process.

``torch.onnx.export`` builds its registry of torchlib functions anew on every call (about
a second: every function's ONNX IR is made from its source), which every build of a
graph pays. ``cached_registry`` patches the registry's constructor, for the duration of
an export, to hand out a copy of one table made once per process (a copy: the export
registers the custom translations into the table it gets). The table is made with the
same entries but without compiling the IR of each traced function, which the exporter's
constructor only reads a domain from (``_unparsed_table``): half the time of a cold
process's first build of the table. ``warm`` makes that table
ahead: a process that forks builds (the test suite, ``python -m ortrain.coverage``) calls
it once so that every child inherits it; the training process does not (it never
imports the graph libraries, ``ortrain/forked.py``), and its build children make the
table each.

Inside the same context, ``torch.export``'s list of the operators it may keep
undecomposed (every CompositeImplicitAutograd operator of every namespace, walked anew
by each ``run_decompositions``: about a tenth of a second, twice per export) is kept
while the dispatcher's registrations and the operator namespaces are the same. Torch does
not keep it because a custom operator registered later changes it; the key sees that.

And each ``run_decompositions`` registers a Python kernel for every one of those operators
on some 20 dispatch keys (``OperatorBase.py_impl``, about 57,000 calls an export); each
call defines a decorator whose annotations subscript ``collections.abc.Callable`` twice,
which builds a new generic alias each time and was most of the registration's time.
Inside the context ``torch._ops`` sees a ``Callable`` that hands out the same alias for
the same subscript (``_MemoCallable``): the annotations are equal objects, nothing reads
them, and ``isinstance`` against it answers as ``collections.abc.Callable``.
"""

from __future__ import annotations

import collections.abc
import contextlib
import functools
from collections.abc import Iterator
from typing import Any


@functools.cache
def _table(opset: int) -> Any:
    from torch.onnx._internal.exporter import _registration

    try:
        return _unparsed_table(_registration, opset)
    except Exception:  # another torch or onnxscript: the table as the exporter makes it
        return _ORIGINAL(_registration.ONNXRegistry, opset)


def _unparsed_table(reg: Any, opset: int) -> Any:
    """The table ``ONNXRegistry.from_torchlib`` makes, the same entries in the same order,
    without compiling each torchlib function's ONNX IR from its source: the exporter's
    list of functions reads each one's domain from it, which the table does not keep, so
    that every process paid for all 500 functions where an export translates a few dozen
    (each function compiles its IR when first used)."""
    from onnxscript.function_libs.torch_lib import ops, registration

    del ops  # importing it registers the functions
    registry = reg.ONNXRegistry()
    registry._opset_version = opset
    for meta in reg._torchlib_registry.get_torchlib_ops():
        registry._register(meta.fx_target, meta)
    for qualified_name, entry in registration.default_registry.items():
        if qualified_name.startswith("internal::"):
            continue
        funcs = [(f, False) for f in entry.overloads] + [(f, True) for f in entry.complex]
        if not funcs:
            continue
        try:  # as the exporter: a name it cannot resolve is skipped, not fatal
            target = reg._get_overload(qualified_name)
        except Exception:
            continue
        if target is None:
            continue
        for func, is_complex in funcs:
            meta = reg.OnnxDecompMeta(
                onnx_function=func,
                fx_target=target,
                signature=None,
                is_custom=False,
                is_complex=is_complex,
            )
            registry._register(target, meta)
    registry._cleanup_registry_based_on_opset_version()
    return registry


_ORIGINAL: Any = None


def _copy(cls: type, opset_version: int | None = None) -> Any:
    from torch.onnx._internal.exporter import _constants

    base = _table(opset_version if opset_version is not None else _constants.TORCHLIB_OPSET)
    registry = cls()
    registry._opset_version = base._opset_version
    registry.functions = {k: list(v) for k, v in base.functions.items()}
    from ortrain.export_aten import complex_translations

    # the exporter's custom_translation_table takes no complex functions: registered here
    for target, function in complex_translations().items():
        registry.register_op(target, function, is_complex=True)
    return registry


_CIA_SITES = ("torch._export.utils", "torch.export.exported_program", "torch.export.decomp_utils")


def _cia_key() -> tuple:
    import torch

    regs = torch._C._dispatch_get_registrations_for_dispatch_key("CompositeImplicitAutograd")
    return tuple(regs), tuple(torch.ops._dir)


@contextlib.contextmanager
def _cached_cia_ops() -> Iterator[None]:
    """Inside: ``_collect_all_valid_cia_ops`` answers from a memo keyed on what it reads
    (module docstring); where this torch has no such function, nothing changes."""
    import importlib

    try:
        modules = [importlib.import_module(m) for m in _CIA_SITES]
        sites = [m for m in modules if callable(getattr(m, "_collect_all_valid_cia_ops", None))]
        original = modules[0]._collect_all_valid_cia_ops
    except Exception:  # another torch
        yield
        return
    memo: dict[tuple, Any] = _CIA_MEMO

    def collect() -> Any:
        key = _cia_key()
        if key not in memo:
            memo.clear()
            memo[key] = original()
        return memo[key]

    for m in sites:
        m._collect_all_valid_cia_ops = collect  # type: ignore[attr-defined]
    try:
        yield
    finally:
        for m in sites:
            m._collect_all_valid_cia_ops = original  # type: ignore[attr-defined]


_CIA_MEMO: dict[tuple, Any] = {}


@contextlib.contextmanager
def cached_registry() -> Iterator[None]:
    """Inside: the exporter's registry is a copy of this process's, and torch.export's
    list of undecomposed operators is kept (module docstring). Where this torch's
    exporter has no such registry or list, nothing changes."""
    with _cached_cia_ops(), _cached_table(), _memoized_callable():
        yield


class _MemoCallable:
    """``collections.abc.Callable`` whose subscripts are made once (module docstring)."""

    def __init__(self, base: Any) -> None:
        self._base = base
        self._memo: dict[Any, Any] = {}

    def __getitem__(self, item: Any) -> Any:
        try:
            return self._memo[item]
        except KeyError:
            alias = self._memo[item] = self._base[item]
            return alias
        except TypeError:  # an unhashable subscript (a list of argument types)
            return self._base[item]

    def __instancecheck__(self, obj: Any) -> bool:
        return isinstance(obj, self._base)

    def __subclasscheck__(self, cls: type) -> bool:
        return issubclass(cls, self._base)


_MEMO_CALLABLE = _MemoCallable(collections.abc.Callable)


@contextlib.contextmanager
def _memoized_callable() -> Iterator[None]:
    import torch._ops as ops

    if getattr(ops, "Callable", None) is not collections.abc.Callable:
        yield  # another torch, or already inside
        return
    ops.Callable = _MEMO_CALLABLE  # type: ignore[attr-defined]
    try:
        yield
    finally:
        ops.Callable = collections.abc.Callable  # type: ignore[attr-defined]


@contextlib.contextmanager
def _cached_table() -> Iterator[None]:
    global _ORIGINAL
    try:
        from torch.onnx._internal.exporter import _registration

        cls = _registration.ONNXRegistry
        original = cls.__dict__["from_torchlib"]
        probe = cls()
        assert isinstance(probe.functions, dict) and hasattr(probe, "_opset_version")
    except Exception:  # another torch: its own registry, made as it makes it
        yield
        return
    if _ORIGINAL is None:
        _ORIGINAL = original.__func__
    cls.from_torchlib = classmethod(_copy)
    try:
        yield
    finally:
        cls.from_torchlib = original


def warm() -> None:
    """Make this process's table and operator list now (see the module docstring)."""
    with cached_registry():
        from torch._export import utils
        from torch.onnx._internal.exporter import _registration

        _registration.ONNXRegistry.from_torchlib()
        collect = getattr(utils, "_collect_all_valid_cia_ops", None)
        if callable(collect):
            collect()
