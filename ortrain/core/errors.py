"""Errors a user of ortrain can meet; each message says what and where."""

from ortrain.core.names import GradientError


class OrtrainError(RuntimeError):
    """Base class of ortrain's own errors."""


class ExportError(OrtrainError):
    """The module could not be exported to ONNX."""


class UnsupportedOptimizerError(OrtrainError, TypeError):
    """The torch optimizer or one of its options has no in-graph implementation."""


class TrainableChangedError(OrtrainError, ValueError):
    """A parameter's ``requires_grad`` changed after the trainer was made; nothing ran.
    ``requires_grad_only``: nothing else changed (layers frozen or unfrozen), ``changed``
    naming them."""

    requires_grad_only = False
    changed = ""


class BatchError(OrtrainError, ValueError):
    """A batch the compiled graph cannot take (names, dtypes)."""


class LossShapeError(ExportError, BatchError):
    """The loss has more than one element: eager's ``backward()`` refuses it too, so no
    segment or eager step is tried."""


class ParameterDtypeError(OrtrainError, TypeError):
    """Parameters other than float32, where only compiled graphs may train them."""


class NonFiniteLossError(OrtrainError, FloatingPointError):
    """The loss became NaN/Inf; the step was not applied."""


class BuildKilledError(OrtrainError, MemoryError):
    """A build's child process was killed by a signal it did not ask for (SIGKILL: most
    often the kernel's out-of-memory killer); not rerun in the training process."""


class DeviceError(OrtrainError):
    """The requested device cannot run ONNX Runtime sessions here."""


class CheckpointError(OrtrainError, ValueError):
    """A checkpoint that does not belong to this model/optimizer."""


class RankFailureError(OrtrainError):
    """Another rank died, or did not reach a collective within ``TrainerOptions.dist_timeout``.

    ``ranks`` holds the global ranks found responsible (empty when none could be named).
    """

    def __init__(self, message: str, ranks: list[int] | None = None):
        super().__init__(message)
        self.ranks = list(ranks or [])


__all__ = [
    "BatchError",
    "CheckpointError",
    "ExportError",
    "GradientError",
    "NonFiniteLossError",
    "OrtrainError",
    "RankFailureError",
    "UnsupportedOptimizerError",
]


def first_line(exc: BaseException) -> str:
    """An exception's message cut to its first line (ONNX Runtime and the exporter write
    pages), or its type name when it has none."""
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def deepest_cause(exc: BaseException) -> str:
    """``Type: first line`` of the innermost exception ``exc`` was raised from (a library's
    wrapper says less than what it wraps)."""
    seen = {id(exc)}
    while exc.__cause__ is not None and id(exc.__cause__) not in seen:
        exc = exc.__cause__
        seen.add(id(exc))
    return f"{type(exc).__name__}: {first_line(exc)}"


class PassError(OrtrainError):
    """A graph pass, or the last checks of a built graph, failed on a graph: a defect of
    ortrain's compiler, not of the model. With ``fallback="auto"`` the model trains as
    segments (the module concerned in eager); the message names the pass."""


class VerificationError(OrtrainError):
    """A compiled graph's first step disagrees with eager PyTorch on the same batch and
    weights (``ortrain/verify.py``)."""
