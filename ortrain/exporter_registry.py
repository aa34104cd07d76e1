"""The ONNX exporter's table of ATen translations, made once per process.

``torch.onnx.export`` builds its registry of torchlib functions anew on every call (about
a second: every function's ONNX IR is made from its source), which every build of a
graph pays. ``cached_registry`` patches the registry's constructor, for the duration of
an export, to hand out a copy of one table made once per process (a copy: the export
registers the custom translations into the table it gets). ``warm`` makes that table
ahead: a process that forks builds (the test suite, ``python -m ortrain.coverage``) calls
it once so that every child inherits it; the training process does not (it never
imports the graph libraries, ``ortrain/forked.py``), and its build children make the
table each.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from typing import Any


@functools.cache
def _table(opset: int) -> Any:
    from torch.onnx._internal.exporter import _registration

    return _ORIGINAL(_registration.ONNXRegistry, opset)


_ORIGINAL: Any = None


def _copy(cls: type, opset_version: int | None = None) -> Any:
    from torch.onnx._internal.exporter import _constants

    base = _table(opset_version if opset_version is not None else _constants.TORCHLIB_OPSET)
    registry = cls()
    registry._opset_version = base._opset_version
    registry.functions = {k: list(v) for k, v in base.functions.items()}
    return registry


@contextlib.contextmanager
def cached_registry() -> Iterator[None]:
    """Inside: the exporter's registry is a copy of this process's (module docstring).
    Where this torch's exporter has no such registry, nothing changes."""
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
    """Make this process's table now (see the module docstring)."""
    with cached_registry():
        from torch.onnx._internal.exporter import _registration

        _registration.ONNXRegistry.from_torchlib()
