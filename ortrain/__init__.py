"""ortrain: a graph-compiler training backend for PyTorch on ONNX Runtime."""

from ortrain.errors import (
    BatchError,
    CheckpointError,
    ExportError,
    GradientError,
    NonFiniteLossError,
    OrtrainError,
    RankFailureError,
    UnsupportedOptimizerError,
)
from ortrain.explain import explain
from ortrain.options import TrainerOptions
from ortrain.trainer import ORTTrainer, StepOutputs

__all__ = [
    "BatchError",
    "CheckpointError",
    "ExportError",
    "GradientError",
    "NonFiniteLossError",
    "ORTTrainer",
    "OrtrainError",
    "RankFailureError",
    "StepOutputs",
    "TrainerOptions",
    "UnsupportedOptimizerError",
    "explain",
]
