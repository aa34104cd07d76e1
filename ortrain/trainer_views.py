"""What a training loop, tests and tools read from an ``ORTTrainer``: views of its state,
its update engine and its builds (``TrainerViews``, a base of the trainer)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from ortrain.memory_estimate import StateBytes, held_state_bytes

if TYPE_CHECKING:
    import onnx_ir as ir

    from ortrain.build import StageRecord
    from ortrain.loss_scaler import LossScaler
    from ortrain.program_context import ProgramContext
    from ortrain.runtime.update_engines import Reducer, UpdateEngine
    from ortrain.whole_graph import WholeGraphs


class TrainerViews:
    _ctx: ProgramContext
    _program: Any  # the trainer's WholeProgram or SegmentedProgram

    @property
    def params(self) -> dict[str, torch.Tensor]:
        return self._ctx.state.params

    @property
    def buffers(self) -> dict[str, torch.Tensor]:
        return self._ctx.state.buffers

    @property
    def grads(self) -> dict[str, torch.Tensor]:
        return self._ctx.state.grads

    @property
    def opt_state(self) -> dict[str, torch.Tensor]:
        return self._ctx.state.opt_state

    @property
    def grad_params(self) -> list[str] | None:
        """Trainable parameters the loss reaches (known after the first build)."""
        return self._ctx.state.grad_params

    @property
    def trainable(self) -> list[str]:
        return self._ctx.state.trainable

    @property
    def step_tensor(self) -> torch.Tensor:
        return self._ctx.state.step_tensor

    @property
    def step(self) -> int:
        return self._ctx.state.step

    @property
    def scaler(self) -> LossScaler | None:
        return self._ctx.state.scaler

    @property
    def micro_step(self) -> int:
        """Micro-steps taken in the open accumulation window."""
        return self._ctx.state.micro_step

    @micro_step.setter
    def micro_step(self, value: int) -> None:
        self._ctx.state.micro_step = value

    @property
    def grad_multiplier(self) -> float:
        """What the update also scales the accumulated gradients by (a driver's loss
        weighting; the update in the backward ignores it)."""
        return self._ctx.state.grad_multiplier

    @grad_multiplier.setter
    def grad_multiplier(self, value: float) -> None:
        self._ctx.state.grad_multiplier = value

    @property
    def update_engine(self) -> UpdateEngine:
        """What runs the optimizer update (``update_engine.name``: "graph", "kernels", "zero-torch",
        "torch", "backward" or "zero1")."""
        return self._ctx.engine

    @property
    def _in_backward(self) -> bool:
        return self._ctx.engine.in_backward

    @property
    def update_graph(self) -> ir.Model | None:
        graph = self._ctx.engine.update_graph
        return graph.model if graph is not None else None

    @property
    def reducer(self) -> Reducer | None:
        """The distributed reducer (data parallel, ZeRO-1/2/3); None in a single process."""
        return self._ctx.reducer

    @property
    def last_grad_norm(self) -> float | None:
        """Global gradient norm (before clipping) of the last update; None without clipping."""
        clipping = self._ctx.options.max_grad_norm is not None
        return float(self._ctx.state.grad_norm) if clipping else None

    @property
    def loss_scale(self) -> float | None:
        """The loss scale the next step's backward uses (None without loss scaling)."""
        return self.scaler.scale if self.scaler is not None else None

    @property
    def skipped_steps(self) -> int:
        """Updates skipped because a gradient overflowed (always 0 without loss scaling)."""
        return self.scaler.skipped_steps if self.scaler is not None else 0

    @property
    def build_log(self) -> list[StageRecord]:
        """Every build's stages in order (``ortrain.explain`` prints them)."""
        return self._ctx.build_log

    @property
    def _graphs(self) -> WholeGraphs:
        return self._ctx.graphs

    @property
    def build_count(self) -> int:
        """Graphs built or loaded (training and eval): a build per step is a bug."""
        return self._ctx.graphs.count

    @property
    def cache_hits(self) -> int:
        """Graphs of ``build_count`` loaded from the on-disk graph cache, not built."""
        return self._ctx.graph_cache.hits

    @property
    def session_seconds(self) -> float:
        """Seconds spent making ONNX Runtime sessions for the training and eval graphs."""
        return sum(r.seconds for r in self._ctx.graph_cache.session_log)

    @property
    def verify_seconds(self) -> float:
        """Seconds the first-step checks against eager took (``ortrain/first_step.py``)."""
        return self._ctx.eager.seconds

    @property
    def eager_steps(self) -> int:
        """Steps that ran in eager PyTorch over the trainer's state: while their graph
        built in the background (``TrainerOptions.background_build``), where eager
        steps faster (``TrainerOptions.eager_if_faster``, its trial's steps included), or
        while a new batch shape's eager steps had not yet lost a build's time
        (``ortrain/deferred_builds.py``); 0 without any of them."""
        runs = (getattr(self._program, k, None) for k in ("background", "trial", "deferred"))
        return sum(r.eager.count for r in runs if r is not None)

    @property
    def deferred_builds(self) -> str:
        """Per batch shape whose steps ran in eager rather than build its graph (a new
        shape's graph is built once those steps have lost a build's time:
        ``ortrain/deferred_builds.py``): its eager steps and whether its graph came since,
        one line each; "" where none did."""
        deferred = getattr(self._program, "deferred", None)
        return deferred.summary() if deferred is not None else ""

    @property
    def speed_choices(self) -> str:
        """Per batch signature timed against eager (``TrainerOptions.eager_if_faster``):
        both median steps and which runs it, one line each; "" before any is decided."""
        trial = getattr(self._program, "trial", None)
        return trial.summary() if trial is not None else ""

    @property
    def train_graphs(self) -> list[ir.Model]:
        """The compiled gradient graphs, one per batch shape signature (and label-row
        count, see ``graph_passes/training/label_sparsity.py``)."""
        return [c.model for c in self._ctx.graphs.train.values()]

    def state_bytes(self) -> StateBytes:
        """The model-state bytes this rank holds now, by class (``ortrain/memory_estimate.py``;
        ``ortrain.estimate_memory`` predicts them before a run)."""
        ctx = self._ctx
        return held_state_bytes(ctx.state, ctx.reducer, ctx.options.zero_stage)
