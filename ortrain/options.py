"""User-facing options of ORTTrainer."""

from __future__ import annotations

import dataclasses
import functools
import math
import numbers
import os
import sys
import types
import typing
from typing import Any

import torch

from ortrain.loss_scaler import DynamicLossScale


@dataclasses.dataclass(frozen=True)
class TrainerOptions:
    """How ORTTrainer builds and runs the training graph.

    device: "cpu", "cuda" or "cuda:N": where the graphs run (CUDA needs onnxruntime-gpu:
        ``pip install ortrain[gpu]``); the module is moved there.
    cuda_graph: capture each CUDA session once and replay it (ONNX Runtime's
        ``enable_cuda_graph``; static shapes, the batch is copied into fixed buffers).
    update_engine: what runs the optimizer update. "graph": the update ONNX graph;
        "kernels": the fused kernels of ``cuda_kernels/`` (AdamW/Adam/LAMB; build them with
        CMake); "torch": torch's fused Adam/AdamW kernels (``fused=True``'s) over flat
        buffers; "backward": each parameter's Adam/AdamW update inside the training
        graph, right after its gradient is made (CPU, one process, fp32, no accumulation,
        clipping or loss scaling): no gradient buffers at all (a gradient dies at its
        update, which lowers the peak), and ``trainer.grads`` stays empty; "auto" (default):
        "backward" where it applies, else on CUDA the kernels when built, on CPU torch's
        for Adam/AdamW in a single process, the graph otherwise.
    grad_accumulation_steps: micro-steps per optimizer update; gradients are averaged,
        so N micro-batches of size b train like one batch of size N*b.
    max_grad_norm: global L2 clipping (torch ``clip_grad_norm_`` semantics); None = off;
        ``math.inf``: no clipping, ``last_grad_norm`` still reported.
    seed: seeds dropout masks in the graph (two runs with one seed are identical).
    intra_op_threads: ONNX Runtime threads per session (None: ORT's default). On CPU the
        BLAS products and ortrain's kernels run on torch's OpenMP threads instead
        (``torch.set_num_threads``), as eager torch's would.
    save_graphs_dir: write the ONNX graph after each build stage there (for Netron).
    check_finite: raise NonFiniteLossError (without applying the update) on NaN/Inf loss.
    zero_stage: with torch.distributed initialised (torchrun): 0 = data parallel (every
        rank holds the whole state; gradients are averaged), 1 = ZeRO-1 (each rank keeps
        and updates only its shard of the optimizer state). Ignored single-process.
    process_group: the torch.distributed group to train over (None: the default group).
    dist_timeout: seconds a collective waits for the other ranks before failing with
        RankFailureError naming the rank that died or hangs.
    mixed_precision: "fp16" or "bf16": the graphs compute in half precision from copies
        of the fp32 parameters (master weights); the fp32 op list is in
        ``graph_passes/precision/mixed_precision.py``. bf16 needs a CUDA device. None: fp32.
    loss_scale: "dynamic" (or a ``DynamicLossScale`` with its settings), a fixed float, or
        None. "auto" (default): dynamic with fp16, none otherwise. With a loss scale,
        steps whose gradients overflow are skipped (see ``trainer.skipped_steps``).
    optimize_graph: run the optimization passes (constant folding, CSE, GELU / LayerNorm /
        FusedMatMul / Gemm / BiasGelu fusions, label sparsity, backward cleanup; see
        ``graph_passes/training_pipeline.py``). False builds the plain gradient graph, to
        compare or to debug a pass.
    memory_plan: recompute cheap forward values (casts, reshapes, activations,
        LayerNorm) in the backward instead of keeping them alive from the forward
        (``RecomputePolicy.CHEAP_OPS``); ``trainer.memory_report()`` shows what is kept.
    cpu_gemm: what runs the fp32 matrix products of CPU graphs. "onnxruntime": ONNX
        Runtime's own (MLAS); "blas": ``ortrain.blas.Gemm``, a custom op calling the BLAS
        torch loaded (MKL on x86), built with the package (``CMakeLists.txt``; loaded by
        ``ortrain/runtime/native.py``); "auto" (default): "blas" on Intel CPUs when
        torch has MKL and the op builds, MLAS elsewhere (MLAS is the faster one on AMD).
    cpu_kernels: what runs the fp32 GELU, LayerNorm and Softmax backwards, the Softmaxes
        (with an attention mask's Add) and the embedding gradients of CPU graphs.
        "ortrain": fused kernels of ortrain's CPU op library (``ortrain.cpu`` domain,
        ``ortrain/runtime/grad_kernels.c``, ``softmax.c``, the same library as
        ``cpu_gemm``'s op);
        "onnxruntime": chains of standard ONNX ops (stock onnxruntime has no training
        kernels); "auto" (default): "ortrain" when the library builds, with a warning
        and standard ops otherwise.
    bucketing: "auto" (default): pad each batch's sequence axis to one of a few bucket
        lengths (16, 32, 48, 64, 80, 96, 112, 128, 160, ...) so variable-length data builds
        a few graphs instead of one per length, where padding is exact: batches with an
        ``attention_mask`` whose loss and gradients (and ``eval_step``'s outputs, cut back
        to the batch's length) are checked eagerly to be unchanged by padding
        (``ortrain/bucketing.py``); "off": one graph per batch shape.
    graph_cache: keep built graphs on disk, keyed by the model's structure and code, the
        batch signature, the options and the library versions (not the weights), so a
        second run of a script does not export and run the passes again
        (``ortrain/build_cache.py``). True (default): ``$XDG_CACHE_HOME/ortrain/graphs``
        (``ORTRAIN_GRAPH_CACHE=<dir>`` moves it, ``=0`` turns it off); a path: that
        folder; False: off. Off with ``save_graphs_dir`` (its graphs need the passes run).
    build_progress: while a build has run 2 s, print on stderr which stage it is in
        (export, passes, session), one line per stage; False: quiet.
    verify: check every compiled graph's first step against eager PyTorch on the same
        batch and weights (the loss and every parameter's gradient, both without dropout;
        an evaluation graph's outputs), also a graph loaded from the graph cache
        (``ortrain/verify.py``). Its cost is about one eager step per graph built;
        ``ortrain.explain`` reports it. False: trust the graphs unchecked.
    fallback: what happens when the whole model cannot be one training graph (the export
        fails, an op has no gradient rule, or the first step disagrees with eager).
        "auto" (default): the largest sub-modules that compile run as compiled segments
        inside torch autograd and the rest in eager PyTorch, with one warning naming each
        module left in eager and why (``ortrain/segments``; ``ortrain.explain`` lists the
        segments and their time); "off": raise instead (an all-compiled guarantee).
    """

    device: str = "cpu"
    cuda_graph: bool = False
    update_engine: str = "auto"
    grad_accumulation_steps: int = 1
    max_grad_norm: float | None = None
    seed: int = 0
    intra_op_threads: int | None = None
    save_graphs_dir: str | os.PathLike | None = None
    check_finite: bool = True
    zero_stage: int = 0
    process_group: Any = None  # torch.distributed.ProcessGroup
    dist_timeout: float = 300.0
    mixed_precision: str | None = None
    loss_scale: str | float | DynamicLossScale | None = "auto"
    optimize_graph: bool = True
    memory_plan: bool = True
    cpu_gemm: str = "auto"
    cpu_kernels: str = "auto"
    bucketing: str = "auto"
    graph_cache: bool | str | os.PathLike = True
    build_progress: bool = True
    verify: bool = True
    fallback: str = "auto"

    def __post_init__(self) -> None:
        _check_types(self)  # every field against its annotation; no NaN
        kind, _, index = self.device.partition(":")
        if (
            kind not in ("cpu", "cuda")
            or (index and not index.isdigit())
            or (kind == "cpu" and index)
        ):
            raise ValueError(
                f"TrainerOptions.device={self.device!r}: use 'cpu', 'cuda' or 'cuda:N'"
            )
        if self.update_engine not in ("auto", "graph", "kernels", "torch", "backward"):
            raise ValueError(
                "TrainerOptions.update_engine must be 'auto', 'graph', 'kernels', 'torch' or "
                f"'backward', got {self.update_engine!r}"
            )
        if self.cuda_graph and kind != "cuda":
            raise ValueError("TrainerOptions.cuda_graph=True needs device='cuda'")
        if self.grad_accumulation_steps < 1:
            raise ValueError(
                "TrainerOptions.grad_accumulation_steps must be >= 1, got "
                f"{self.grad_accumulation_steps}"
            )
        if self.max_grad_norm is not None and self.max_grad_norm <= 0:
            raise ValueError(f"TrainerOptions.max_grad_norm must be > 0, got {self.max_grad_norm}")
        if self.zero_stage not in (0, 1):
            raise ValueError(f"TrainerOptions.zero_stage must be 0 or 1, got {self.zero_stage}")
        if not 0 < self.dist_timeout < math.inf:
            raise ValueError(
                f"TrainerOptions.dist_timeout must be finite and > 0, got {self.dist_timeout}"
            )
        if self.mixed_precision not in (None, "fp16", "bf16"):
            raise ValueError(
                "TrainerOptions.mixed_precision must be 'fp16', 'bf16' or None, got "
                f"{self.mixed_precision!r}"
            )
        if self.mixed_precision == "bf16" and self.device == "cpu":
            raise ValueError(
                "TrainerOptions.mixed_precision='bf16' needs a CUDA device: ONNX Runtime's CPU "
                "execution provider has no bf16 kernels (use 'fp16' on CPU)"
            )
        ls = self.loss_scale
        if isinstance(ls, str) and ls not in ("auto", "dynamic"):
            raise ValueError(
                f"TrainerOptions.loss_scale must be 'auto', 'dynamic', a float, a "
                f"DynamicLossScale or None, got {ls!r}"
            )
        if isinstance(ls, (int, float)) and not (ls > 0 and ls != float("inf")):
            raise ValueError(f"TrainerOptions.loss_scale must be a finite value > 0, got {ls}")
        if self.cpu_gemm not in ("auto", "blas", "onnxruntime"):
            raise ValueError(
                "TrainerOptions.cpu_gemm must be 'auto', 'blas' or 'onnxruntime', got "
                f"{self.cpu_gemm!r}"
            )
        if self.cpu_kernels not in ("auto", "ortrain", "onnxruntime"):
            raise ValueError(
                "TrainerOptions.cpu_kernels must be 'auto', 'ortrain' or 'onnxruntime', got "
                f"{self.cpu_kernels!r}"
            )
        if self.bucketing not in ("auto", "off"):
            raise ValueError(
                f"TrainerOptions.bucketing must be 'auto' or 'off', got {self.bucketing!r}"
            )
        if self.fallback not in ("auto", "off"):
            raise ValueError(
                f"TrainerOptions.fallback must be 'auto' or 'off', got {self.fallback!r}"
            )
        if self.intra_op_threads is not None and self.intra_op_threads < 1:
            raise ValueError(
                f"TrainerOptions.intra_op_threads must be >= 1, got {self.intra_op_threads}"
            )
        if self.process_group is not None and not _is_process_group(self.process_group):
            raise TypeError(
                "TrainerOptions.process_group must be a torch.distributed ProcessGroup or None, "
                f"got {type(self.process_group).__name__}"
            )

    @property
    def resolved_loss_scale(self) -> str | float | DynamicLossScale | None:
        """The loss scale in effect: "auto" resolved against ``mixed_precision``."""
        if self.loss_scale == "auto":
            return "dynamic" if self.mixed_precision == "fp16" else None
        return self.loss_scale


# Type checks of TrainerOptions: from the annotations, so a new field is checked too.


@functools.cache
def _field_types(cls: type) -> dict[str, Any]:
    """Each field's annotation; one naming a type this module cannot see (imported for
    type checking only) is not checked here rather than breaking every construction."""
    try:
        return typing.get_type_hints(cls)
    except NameError:
        pass
    names = vars(sys.modules[cls.__module__])
    hints = {}
    for field in dataclasses.fields(cls):
        try:  # the string annotation (``from __future__ import annotations``) evaluated
            hints[field.name] = typing.get_type_hints(
                types.SimpleNamespace(__annotations__={"x": field.type}), names
            )["x"]
        except NameError:
            hints[field.name] = Any
    return hints


def _conforms(value: Any, tp: Any) -> bool:
    if tp is Any:
        return True
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        return any(_conforms(value, arg) for arg in typing.get_args(tp))
    if tp is type(None):
        return value is None
    if tp is bool:
        return isinstance(value, bool)
    if tp is int:  # bool is an int to Python, not to an option
        return isinstance(value, numbers.Integral) and not isinstance(value, bool)
    if tp is float:
        return isinstance(value, numbers.Real) and not isinstance(value, bool)
    if isinstance(tp, type):
        return isinstance(value, tp)
    return True  # an annotation this cannot read: the field's own check decides


def _type_name(tp: Any) -> str:
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        return " or ".join(_type_name(arg) for arg in typing.get_args(tp))
    return "None" if tp is type(None) else getattr(tp, "__name__", str(tp))


def _check_types(options: TrainerOptions) -> None:
    """TypeError for a value of the wrong type (``grad_accumulation_steps=2.5``, a bool
    given as 1), ValueError for a NaN (it passes every ``<``/``>`` range check)."""
    hints = _field_types(type(options))
    for field in dataclasses.fields(options):
        value, tp = getattr(options, field.name), hints[field.name]
        if not _conforms(value, tp):
            raise TypeError(
                f"TrainerOptions.{field.name} must be {_type_name(tp)}, got {value!r} "
                f"({type(value).__name__})"
            )
        is_float = isinstance(value, numbers.Real) and not isinstance(value, numbers.Integral)
        if is_float and math.isnan(value):
            raise ValueError(f"TrainerOptions.{field.name} must be a number, got {value}")


def _is_process_group(value: Any) -> bool:
    dist = torch.distributed
    return dist.is_available() and isinstance(value, dist.ProcessGroup)
