"""What the coverage table must cover, enumerated from torch itself, and every spec.

``nn_classes()``: every ``torch.nn.Module`` subclass that ``torch.nn`` exports (a class a
new torch adds is seen here and fails the coverage test until it has an entry);
``functional_names()``: every public callable of ``torch.nn.functional``.
"""

from __future__ import annotations

import functools

import torch

from ortrain.coverage.functional_specs import EXERCISED_BY, NOT_AN_OP, functional_specs
from ortrain.coverage.nn_specs import NOT_A_LAYER, nn_specs, utils_specs
from ortrain.coverage.spec import Spec

__all__ = [
    "EXERCISED_BY",
    "NOT_AN_OP",
    "NOT_A_LAYER",
    "all_specs",
    "functional_names",
    "nn_classes",
    "section",
    "spec_by_id",
]


def nn_classes() -> list[str]:
    return sorted(
        name
        for name, value in vars(torch.nn).items()
        if isinstance(value, type) and issubclass(value, torch.nn.Module)
    )


def functional_names() -> list[str]:
    return sorted(
        name
        for name, value in vars(torch.nn.functional).items()
        if not name.startswith("_") and callable(value) and not isinstance(value, type)
    )


@functools.cache
def all_specs() -> tuple[Spec, ...]:
    """The table's rows in order: the torch.nn classes', the functions', then the
    ``torch.nn.utils`` parametrizations'."""
    return (*nn_specs(), *functional_specs(), *utils_specs())


def section(spec: Spec) -> str:
    """Which table a spec is a row of: "nn", "functional" or "utils"."""
    if spec.covers.startswith("F."):
        return "functional"
    return "utils" if spec.covers.startswith("utils.") else "nn"


@functools.cache
def _index() -> dict[str, Spec]:
    return {s.id: s for s in all_specs()}


def spec_by_id(spec_id: str) -> Spec:
    return _index()[spec_id]
