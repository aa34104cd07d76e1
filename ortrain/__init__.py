"""ortrain: a graph-compiler training backend for PyTorch on ONNX Runtime."""

from ortrain.core.errors import (
    BatchError,
    CheckpointError,
    ExportError,
    GradientError,
    NonFiniteLossError,
    OrtrainError,
    ParameterDtypeError,
    RankFailureError,
    UnsupportedOptimizerError,
)
from ortrain.explain import explain
from ortrain.memory_estimate import StateBytes, estimate_memory
from ortrain.options import TrainerOptions
from ortrain.trainer import ORTTrainer, StepOutputs

# ORTHFTrainer subclasses transformers.Trainer: importing ortrain does not import transformers.
_LAZY = {"ORTHFTrainer": "ortrain.hf_trainer"}


def __getattr__(name: str) -> object:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'ortrain' has no attribute {name!r}")


__all__ = [
    "BatchError",
    "CheckpointError",
    "ExportError",
    "GradientError",
    "NonFiniteLossError",
    "ORTHFTrainer",
    "ORTTrainer",
    "OrtrainError",
    "ParameterDtypeError",
    "RankFailureError",
    "StateBytes",
    "StepOutputs",
    "TrainerOptions",
    "UnsupportedOptimizerError",
    "estimate_memory",
    "explain",
]
