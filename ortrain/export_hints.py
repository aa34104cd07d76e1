"""Data-dependent hints that stop the tracer, read as "not given" while a model exports.

``nn.TransformerEncoder`` and ``nn.TransformerDecoder`` compare a given attention mask
with a causal one (``transformer._detect_is_causal_mask``) to tell the attention it may
skip the mask; that comparison is a boolean of the mask's values, which a trace cannot
branch on, so every model passing a mask to them failed to export. The hint only picks a
kernel: with it False the attention applies the mask it was given, the same math. So
during the export the detection answers with the caller's own hint (``is_causal=True``
stays True) and never looks at the values. Eager PyTorch is untouched.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch.nn.modules.transformer as transformer


def _given_hint(mask: Any, is_causal: bool | None = None, size: int | None = None) -> bool:
    return is_causal is True


@contextlib.contextmanager
def without_value_hints() -> Iterator[None]:
    """The trace's view of the hints above (module docstring)."""
    detect = transformer._detect_is_causal_mask
    transformer._detect_is_causal_mask = _given_hint
    try:
        yield
    finally:
        transformer._detect_is_causal_mask = detect
