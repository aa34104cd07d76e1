"""One build configuration: every option the graph passes read, resolved once.

``BuildConfig`` is made from the trainer's options and optimizer (``ProgramContext.settings``),
by ``ortrain/offline.py`` and by the benchmarks; ``graph_passes.training_pipeline``'s
``build_pipeline`` turns it into the ordered pass list. It is frozen: a build cannot
change it, and its ``repr`` is part of the graph cache's key (``ortrain/build_cache.py``).

What differs from one build of a trainer to the next (the loss output, the trainable
inputs the export kept, the labelled rows of a batch) is not configuration: it travels
in ``BuildInputs``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

RECOMPUTE_POLICIES = ("NOTHING", "CHEAP_VIEWS", "CHEAP_OPS")  # memory/recompute.py's names
TARGETS = ("cpu", "cuda")
PRECISIONS = ("fp16", "bf16")


@dataclasses.dataclass(frozen=True)
class BuildConfig:
    """What the passes take from the trainer's options and optimizer."""

    trainable: tuple[str, ...] = ()  # parameter names in optimizer order
    target: str = "cpu"  # where the graphs run: "cpu" lowerings apply only there
    seed: int = 0  # dropout seeds (prepare/dropout_seed.py)
    accumulate: bool = False  # grad_accumulation_steps > 1 (training/accumulate.py)
    mixed_precision: str | None = None  # "fp16" | "bf16" | None
    loss_scaling: bool = False  # differentiate loss * loss_scale (precision/loss_scaling.py)
    optimize: bool = True  # the optimization passes; False: only what training needs
    fusions: tuple[str, ...] | None = None  # names from ``fusions.FUSIONS``; None: the default set
    # a ``RecomputePolicy`` name (graph_passes/memory/recompute.py); "NOTHING": off
    recompute: str = "NOTHING"
    graph_dir: str | None = None  # TrainerOptions.save_graphs_dir
    blas_gemm: bool = False  # products on ortrain.blas.Gemm (targets/cpu/blas_gemm.py)
    blas_batch: bool = False  # batched products on ortrain.blas.BatchMatMul
    cpu_kernels: bool = False  # fused ortrain.cpu kernels (backward rules, Softmax, scatters)
    # (param, param group) of each trainable parameter when the Adam/AdamW update runs in the
    # backward (targets/cpu/update_in_backward.py); empty: after the session
    update_groups: tuple[tuple[str, int], ...] = ()
    # every training Dropout reads one bool input (prepare/dropout_switch.py), so a verified
    # first step (ortrain/verify.py) can run the graph without dropout
    dropout_switch: bool = False

    def __post_init__(self) -> None:
        if self.target not in TARGETS:
            raise ValueError(f"target {self.target!r}: use one of {TARGETS}")
        if self.mixed_precision is not None and self.mixed_precision not in PRECISIONS:
            raise ValueError(f"mixed_precision {self.mixed_precision!r}: use one of {PRECISIONS}")
        if self.recompute not in RECOMPUTE_POLICIES:
            raise ValueError(f"recompute {self.recompute!r}: use one of {RECOMPUTE_POLICIES}")
        if self.target != "cpu":
            cpu_only = [n for n in ("blas_gemm", "blas_batch", "cpu_kernels") if getattr(self, n)]
            if cpu_only:
                raise ValueError(
                    f"target {self.target!r}: {', '.join(cpu_only)} lower to ortrain's CPU "
                    "ops, which run on the CPU target only"
                )
        if self.update_groups and not self.cpu_kernels:
            raise ValueError("the update in the backward runs on ortrain's CPU kernels")
        if self.update_groups and (self.accumulate or self.loss_scaling):
            raise ValueError(
                "the update in the backward takes one micro-step per update and no loss scaling"
            )


@dataclasses.dataclass(frozen=True)
class BuildInputs:
    """The per-build inputs of one training graph (not configuration)."""

    loss: str  # the model's (unscaled) loss output
    wrt: tuple[str, ...] = ()  # trainable graph inputs
    # loss node -> rows to keep (training/label_sparsity.py); empty: every row
    label_rows: Mapping[str, int] = dataclasses.field(default_factory=dict)
    # a compiled segment's backward (ortrain/segments): each output value -> the graph input
    # holding its gradient; ``loss`` is then unused (no loss, no loss scaling)
    seeds: Mapping[str, str] = dataclasses.field(default_factory=dict)
