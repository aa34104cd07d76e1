"""Reverse-mode autodiff over ONNX graphs: a rule table plus a minimal-graph builder."""

from ortrain.graph_passes.autodiff.builder import (
    GradientError,
    GradientGraphResult,
    build_gradient_graph,
)
from ortrain.graph_passes.autodiff.registry import gradient, lookup, no_gradient, not_differentiable

__all__ = [
    "GradientError",
    "GradientGraphResult",
    "build_gradient_graph",
    "gradient",
    "lookup",
    "no_gradient",
    "not_differentiable",
]
