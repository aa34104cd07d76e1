"""Casts of a module to what it already is, inside the forward, answered without casting.

A forward may cast one of its sub-modules on every call (Switch Transformers' and
NLLB-MoE's routers: ``self.classifier = self.classifier.to(self.dtype)``), which in eager
PyTorch changes nothing when the weights already have that dtype and device. Under the
exporter's trace the parameters are fake tensors that the tracer holds weak references
to, and ``Module._apply`` swaps fake parameters for their casts
(``torch.utils.swap_tensors``), which refuses a tensor with weak references: the export
failed and the module fell back to eager. During the export a module cast that changes
no parameter or buffer returns the module as it is, as eager's cast leaves it; any other
cast runs as before (and fails as before).
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Callable, Iterator
from typing import Any

import torch

_KEEPS_DTYPE = {
    "float": torch.float32,
    "double": torch.float64,
    "half": torch.float16,
    "bfloat16": torch.bfloat16,
}


def _changes_nothing(
    module: torch.nn.Module, device: torch.device | None, dtype: torch.dtype | None
) -> bool:
    for t in itertools.chain(module.parameters(), module.buffers()):
        if device is not None and (
            t.device.type != device.type
            or (device.index is not None and t.device.index != device.index)
        ):
            return False
        if dtype is not None and (t.is_floating_point() or t.is_complex()) and t.dtype != dtype:
            return False
    return True


def _to(original: Callable[..., Any]) -> Callable[..., Any]:
    def to(self: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
        try:
            device, dtype, _, memory_format = torch._C._nn._parse_to(*args, **kwargs)
        except (TypeError, RuntimeError):  # the original raises its own error
            return original(self, *args, **kwargs)
        real = dtype is None or dtype.is_floating_point
        if real and memory_format is None and _changes_nothing(self, device, dtype):
            return self
        return original(self, *args, **kwargs)

    return to


def _cast(original: Callable[..., Any], dtype: torch.dtype) -> Callable[..., Any]:
    def cast(self: torch.nn.Module) -> Any:
        return self if _changes_nothing(self, None, dtype) else original(self)

    return cast


@contextlib.contextmanager
def unchanged_module_casts() -> Iterator[None]:
    """Module casts that change nothing return the module during the trace (module
    docstring)."""
    module = torch.nn.Module
    saved = {name: getattr(module, name) for name in ("to", *_KEEPS_DTYPE)}
    module.to = _to(saved["to"])  # type: ignore[method-assign]
    for name, dtype in _KEEPS_DTYPE.items():
        setattr(module, name, _cast(saved[name], dtype))
    try:
        yield
    finally:
        for name, original in saved.items():
            setattr(module, name, original)
