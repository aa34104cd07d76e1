"""ORTTrainer: a PyTorch training loop's model + optimizer, run as ONNX Runtime graphs.

The trainer decides what runs and steps it; the parts live beside it:

- the whole model's graphs by batch signature (``ortrain/whole_graph.py``: one export per
  signature, a training graph per label-row bucket, the evaluation graph from the same
  export), each bound to the state by role (``runtime/binder.py``);
- one update engine for all signatures (``runtime/update_engines.py``: the update graph,
  fused kernels, torch's, or the update inside the backward), chosen by
  ``choose_engine``;
- parameters, gradients and optimizer state in one ``TrainingState``
  (``runtime/training_state.py``) whose memory ONNX Runtime reads and writes in place
  through IOBinding, so a step moves only the batch in and the loss out; the reducers
  (``ortrain/distributed``) and the checkpoints take that state, never the trainer;
- eager PyTorch beside the graphs (``ortrain/first_step.py``): every graph's first step
  checked against it, evaluation that falls back to it;
- compiled segments inside torch autograd (``ortrain/segments``) once the model cannot be
  one graph, or by choice (``segments="blocks"``, ZeRO-2/3).

``ORTTrainer.program`` describes what the model is compiled into.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import warnings
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import torch

from ortrain import checkpoint
from ortrain.bucketing import Bucketing
from ortrain.build import (
    BuiltGraph,
    StageRecord,
)
from ortrain.build_cache import GraphCache
from ortrain.core.build_config import BuildConfig
from ortrain.core.errors import (
    BatchError,
    ExportError,
    NonFiniteLossError,
    VerificationError,
    first_line,
)
from ortrain.core.names import (
    GradientError,
    UpdateInBackwardError,
)
from ortrain.core.optimizer_spec import OptimizerSpec
from ortrain.distributed import join_process_group, sharded_checkpoint
from ortrain.export import (
    LossFn,
    normalize_batch,
    var_positional_keys,
    warn_sdpa,
)
from ortrain.first_step import EagerSide
from ortrain.forked import call_forked, can_fork
from ortrain.loss_scaler import LossScaler
from ortrain.memory_estimate import StateBytes, held_state_bytes, storage_bytes
from ortrain.optim.from_torch import group_values, optimizer_spec
from ortrain.options import TrainerOptions
from ortrain.program import ProgramSegment, TrainingProgram
from ortrain.rank_memory import RankMemory, resident_bytes
from ortrain.runtime.binder import bind_eval_graph, bind_training_graph
from ortrain.runtime.cpu_ops import has_sgemm_batch, use_blas_gemm, use_grad_kernels
from ortrain.runtime.heap import trim_heap
from ortrain.runtime.session import (
    BoundSession,
    CudaGraphCaptureError,
    check_device,
    make_session,
    register_cpu_arena,
)
from ortrain.runtime.training_state import TrainingState
from ortrain.runtime.update_engines import (
    EngineEnv,
    EngineFacts,
    Reducer,
    UpdateEngine,
    choose_engine,
    make_engine,
)
from ortrain.segments.grads import bind_grads, take_grads, take_reduced
from ortrain.segments.training import SegmentedTraining
from ortrain.verify import (
    EagerStep,
    Tolerance,
    compare,
    report,
)
from ortrain.whole_graph import CompiledGraph, NotOneGraph, WholeGraphs, signature

if TYPE_CHECKING:
    import onnx_ir as ir


__all__ = ["ORTTrainer", "StageRecord", "StepOutputs"]
T = TypeVar("T")


class StepOutputs(dict):
    """eval_step's result: a dict of tensors that also allows ``outputs.loss``."""

    def __getattr__(self, name: str) -> torch.Tensor:
        try:
            return self[name]
        except KeyError as exc:
            raise AttributeError(name) from exc


class ORTTrainer:
    """Train ``model`` with ``optimizer`` through ONNX Runtime.

    ``train_step(*args, **kwargs)`` runs forward, backward and (every
    ``grad_accumulation_steps`` micro-steps) the optimizer update, and returns the loss
    as a 0-dim tensor. The model's output may be the loss, a tuple starting with it, or
    an object with ``.loss``; or pass ``loss_fn(outputs, batch) -> loss``.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        options: TrainerOptions | None = None,
        *,
        loss_fn: LossFn | None = None,
    ):
        # the process without the trainer and the module's tensors (``memory_report``);
        # what the heap holds free is handed back first, or later allocations reusing it
        # would count twice
        trim_heap()
        self._runtime_bytes = resident_bytes() - storage_bytes(
            t for t in (*model.parameters(), *model.buffers()) if t.device.type == "cpu"
        )
        self._session_bytes = 0  # resident bytes creating sessions added
        self.module = model
        self.optimizer = optimizer
        self.options = options or TrainerOptions()
        self.loss_fn = loss_fn
        # variable lengths padded to a few bucket lengths where exact (ortrain/bucketing.py)
        self.bucketing = Bucketing(model, loss_fn, self.options.bucketing, self.sync_to_module)
        self.device = torch.device(self.options.device)
        check_device(self.device)
        if self.device.type == "cuda" and self.device.index is None:
            # the current device (torchrun: the rank's, after torch.cuda.set_device), so that
            # ONNX Runtime's sessions, the stream and the collectives all use the same GPU
            self.device = torch.device("cuda", torch.cuda.current_device())
        # fp32 products on the BLAS custom op (graph_passes/targets/cpu/blas_gemm.py): decided
        # (and the op built) once, before any build
        self._blas_gemm = use_blas_gemm(self.options.cpu_gemm, self.device.type)
        self._blas_batch = self._blas_gemm and has_sgemm_batch()
        self._cpu_kernels = use_grad_kernels(self.options.cpu_kernels, self.device.type)
        # CUDA: the module lives on the device; ONNX Runtime runs on a stream of ours
        # (torch's default stream cannot be handed to it) that train_step makes current.
        self._stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        if self.device.type == "cuda":
            model.to(self.device)
        named = dict(model.named_parameters())
        self.spec: OptimizerSpec = optimizer_spec(optimizer, {id(p): n for n, p in named.items()})
        # Loss scaling: the backward is seeded with the scale; the update reports whether
        # the gradients were finite (and skips the update if not).
        ls = self.options.resolved_loss_scale
        # Parameters, gradients, optimizer state, counters, device scalars: one object that
        # the update engines, distributed/ and the checkpoints use (runtime/training_state.py).
        # Parameters share memory with the module on CPU: updates are visible in place.
        self.state = TrainingState.of_module(
            model,
            self.spec,
            self.device,
            optimizer=optimizer,
            scaler=None if ls is None else LossScaler.from_option(ls),
            max_grad_norm=self.options.max_grad_norm,
            accumulation=self.options.grad_accumulation_steps,
        )
        # built graphs kept on disk (ortrain/build_cache.py); its hits count in build_count
        self._graph_cache = GraphCache(self.options, model, loss_fn)
        self.build_log: list[StageRecord] = []
        # the whole model's graphs by batch signature (ortrain/whole_graph.py)
        self._graphs = WholeGraphs(
            model, loss_fn, self._graph_cache, self._run_build, self.build_log
        )
        self._graph_dir = (
            Path(self.options.save_graphs_dir) if self.options.save_graphs_dir else None
        )
        if self._graph_dir is not None:
            self._graph_dir.mkdir(parents=True, exist_ok=True)
        # torch.distributed (torchrun): data parallel or ZeRO-1 (ortrain.distributed);
        # None single-process. ZeRO-1 moves the trainable parameters into a flat buffer.
        self._reducer: Reducer | None = join_process_group(self.state, self.options)
        # The model as compiled segments inside eager PyTorch, once it cannot be one graph
        # (ortrain/segments); None while the whole model is one training graph.
        self._segments: SegmentedTraining | None = None
        # ...or from the first step by choice: cut at its repeated blocks (ZeRO-2 reduces
        # gradients block by block)
        zero2 = self._reducer is not None and self.options.zero_stage >= 2
        self._blocks = f"ZeRO-{self.options.zero_stage}" if zero2 else "segments='blocks'"
        if not zero2 and self.options.segments != "blocks":
            self._blocks = ""
        # every training Dropout's training_mode (prepare/dropout_switch.py): off only while
        # a first step is checked against eager; on the host, where ONNX Runtime reads it
        self._dropout_on = torch.ones((), dtype=torch.bool)
        # eager PyTorch beside the graphs: first-step checks, eager evaluation
        mp = self.options.mixed_precision
        comm = getattr(self._reducer, "comm", None)  # every rank takes the same way
        any_rank = bool if comm is None else comm.any
        self._eager = EagerSide(
            model, loss_fn, self.device, Tolerance.of(mp), exact=mp is None, any_rank=any_rank
        )
        self._eager_eval: set[tuple] = set()  # eval signatures whose graph disagreed
        # What runs the optimizer update (runtime/update_engines.py), chosen in one place:
        # here (an engine the options ask for and these facts cannot run fails now), and
        # once more where a gradient graph cannot take the update in its backward.
        self._engine: UpdateEngine = self._choose_engine()

    # ------------------------------------------------------------------ state
    # What a training loop, tests and tools read: views of ``self.state``.
    @property
    def params(self) -> dict[str, torch.Tensor]:
        return self.state.params

    @property
    def buffers(self) -> dict[str, torch.Tensor]:
        return self.state.buffers

    @property
    def grads(self) -> dict[str, torch.Tensor]:
        return self.state.grads

    @property
    def opt_state(self) -> dict[str, torch.Tensor]:
        return self.state.opt_state

    @property
    def grad_params(self) -> list[str] | None:
        """Trainable parameters the loss reaches (known after the first build)."""
        return self.state.grad_params

    @property
    def trainable(self) -> list[str]:
        return self.state.trainable

    @property
    def step_tensor(self) -> torch.Tensor:
        return self.state.step_tensor

    @property
    def scaler(self) -> LossScaler | None:
        return self.state.scaler

    @property
    def micro_step(self) -> int:
        """Micro-steps taken in the open accumulation window."""
        return self.state.micro_step

    @micro_step.setter
    def micro_step(self, value: int) -> None:
        self.state.micro_step = value

    @property
    def grad_multiplier(self) -> float:
        """What the update also scales the accumulated gradients by (a driver's loss
        weighting; the update in the backward ignores it)."""
        return self.state.grad_multiplier

    @grad_multiplier.setter
    def grad_multiplier(self, value: float) -> None:
        self.state.grad_multiplier = value

    @property
    def update_engine(self) -> UpdateEngine:
        """What runs the optimizer update (``update_engine.name``: "graph", "kernels",
        "torch", "backward" or "zero1")."""
        return self._engine

    @property
    def reducer(self) -> Reducer | None:
        """The distributed reducer (data parallel or ZeRO-1); None in a single process."""
        return self._reducer

    @property
    def _in_backward(self) -> bool:
        return self._engine.in_backward

    def _choose_engine(self, refused: UpdateInBackwardError | None = None) -> UpdateEngine:
        facts = EngineFacts(
            requested=self.options.update_engine,
            device=self.device,
            kind=self.spec.kind,
            zero_stage=None if self._reducer is None else self.options.zero_stage,
            cpu_kernels=self._cpu_kernels,
            accumulation=self.options.grad_accumulation_steps,
            clipping=self.options.max_grad_norm is not None,
            fp32=self.options.mixed_precision is None and self.scaler is None,
            refused=refused,
            first_build=self.grad_params is None,
            segmented=getattr(self, "_segments", None) is not None,
        )
        env = EngineEnv(
            session=self._session,
            save=self._save,
            reducer=self._reducer,
        )
        return make_engine(choose_engine(facts), self.state, env)

    @contextlib.contextmanager
    def _on_stream(self) -> Iterator[None]:
        """Run on the sessions' CUDA stream, ordered after the caller's stream's work (the
        batch) and before its later work (reading the loss); a no-op on CPU."""
        if self._stream is None:
            yield
            return
        caller = torch.cuda.current_stream(self.device)
        self._stream.wait_stream(caller)
        with torch.cuda.stream(self._stream):
            yield
        caller.wait_stream(self._stream)

    def _session(
        self, model: ir.Model | BuiltGraph, *, graph_capture: bool = False
    ) -> BoundSession:
        before = resident_bytes()
        session = make_session(
            model,
            threads=self.options.intra_op_threads,
            device=self.device,
            stream=self._stream,
            cuda_graph=graph_capture and self.options.cuda_graph,
        )
        self._session_bytes += max(0, resident_bytes() - before)
        return BoundSession(session)

    # ------------------------------------------------------------------ building
    def _save(self, model: ir.Model, name: str) -> None:
        if self._graph_dir is not None:
            import onnx_ir as ir

            ir.save(model, self._graph_dir / f"{name}.onnx")

    def _settings(self) -> BuildConfig:
        return BuildConfig(
            trainable=tuple(self.trainable),
            target="cuda" if self.device.type == "cuda" else "cpu",
            seed=self.options.seed,
            accumulate=self.options.grad_accumulation_steps > 1,
            mixed_precision=self.options.mixed_precision,
            loss_scaling=self.scaler is not None,
            optimize=self.options.optimize_graph,
            recompute="CHEAP_OPS" if self.options.memory_plan else "NOTHING",
            graph_dir=str(self._graph_dir) if self._graph_dir is not None else None,
            blas_gemm=self._blas_gemm,
            blas_batch=self._blas_batch,
            cpu_kernels=self._cpu_kernels,
            update_groups=tuple((p, gi) for gi, g in enumerate(self.spec.groups) for p in g.params)
            if self._in_backward
            else (),
            dropout_switch=self.options.verify,
        )

    def _segment_settings(self) -> BuildConfig:
        """A segment's graphs: fp32 inputs, outputs and gradients (the mixed precision
        pass computes in half inside and casts its outputs back; torch scales the seeds
        and accumulates the gradients), the update after the backward."""
        return dataclasses.replace(
            self._settings(),
            trainable=(),
            accumulate=False,
            loss_scaling=False,
            update_groups=(),
            dropout_switch=True,
        )

    def _run_build(self, job: Callable[[], T], batch: Mapping[str, Any]) -> T:
        """``job`` in a forked child where possible (``ortrain/build.py``)."""
        warn_sdpa(self.module)
        tensors = [*self.params.values(), *self.buffers.values()]
        tensors += [v for v in batch.values() if isinstance(v, torch.Tensor)]
        if can_fork(tensors):
            return call_forked(job, what="building the ONNX graph")
        return job()

    def _build_train(self, batch: Mapping[str, Any], fresh: bool = False) -> CompiledGraph:
        """``batch``'s training graph built (or loaded), given a session, bound by role."""
        while True:  # twice at most: the settings change with the engine
            try:
                rows, built, hit = self._graphs.build_train(batch, self._settings(), fresh)
                break
            except (ExportError, GradientError) as exc:
                if self.options.fallback == "off":
                    raise
                raise NotOneGraph(f"{type(exc).__name__}: {first_line(exc)}", exc) from exc
            except UpdateInBackwardError as exc:
                # "auto" takes the update after the session where the graph cannot run it
                # (choose_engine raises the refusal where the engine may not change)
                self._engine = self._choose_engine(refused=exc)
                warnings.warn(
                    f"ortrain: the optimizer update runs after the session: {exc}", stacklevel=5
                )
        if self.device.type == "cpu":  # sized by this graph, before the update's session
            register_cpu_arena(built.planned_peak_bytes)
        self._reach(built)  # the first graph's lays out the gradients and the update
        try:
            with self._graph_cache.session_stage("train"):
                session = self._session(built, graph_capture=True)
        except Exception as exc:
            if self.options.fallback == "off" or not _from_onnxruntime(exc):
                raise
            # a graph ONNX Runtime refuses (a kernel it lacks for these types): segments
            raise NotOneGraph(f"ONNX Runtime refused the graph: {first_line(exc)}", exc) from exc
        updates = bind_training_graph(session, built, self.state, self._engine, self._dropout_on)
        static = {} if self.options.cuda_graph else None
        compiled = CompiledGraph.of(
            session, built, batch, static_batch=static, buffer_updates=updates, cache_hit=hit
        )
        self._graphs.add_train(batch, rows, compiled)
        return compiled

    def _reach(self, built: BuiltGraph) -> None:
        """The parameters a training graph reaches: the first graph's set lays out the
        gradients and the update (every rank the same set); later graphs reach it too."""
        grad_params = sorted(built.grad_params, key=self.trainable.index)
        if self.grad_params is None and self._reducer is not None:  # before any gradient moves
            from ortrain.distributed.fingerprint import agree_on_graph

            agree_on_graph(self._reducer.comm, built, grad_params)  # type: ignore[attr-defined]
        if self.grad_params is None:
            self._lay_out(grad_params)
        elif grad_params != self.grad_params:
            raise BatchError(
                "this batch reaches a different set of parameters than the first one "
                f"({sorted(set(grad_params) ^ set(self.grad_params))}); ortrain needs one set"
            )

    def _lay_out(self, grad_params: list[str]) -> None:
        """The first step's reached parameters: their gradients and the update laid out."""
        self.state.grad_params = grad_params
        if self._engine.prepare():  # parameters or gradients moved: evals bind anew
            self._graphs.eval.clear()

    def _eval_graph(self, batch: Mapping[str, Any], fresh: bool = False) -> CompiledGraph:
        """``batch``'s evaluation graph (``WholeGraphs.build_eval``), bound by role."""
        if not fresh:
            compiled = self._graphs.eval.get(signature(batch))
            if compiled is not None:
                return compiled
        built = self._graphs.build_eval(
            batch, self._settings(), checked=self.options.verify, fresh=fresh
        )
        with self._graph_cache.session_stage("eval"):
            session = self._session(built)
        bind_eval_graph(session, built, self.state)
        compiled = CompiledGraph.of(session, built, batch)
        self._graphs.add_eval(batch, compiled)
        return compiled

    # ------------------------------------------------------------------ running
    def _normalize(self, args: tuple, kwargs: dict) -> dict[str, Any]:
        batch = normalize_batch(self.module, args, kwargs, allow_extra=self.loss_fn is not None)
        for k, v in batch.items():
            if isinstance(v, torch.Tensor) and v.is_floating_point() and v.dtype != torch.float32:
                raise BatchError(f"batch input '{k}' is {v.dtype}; expected float32")
        self._check_var_positional(batch)
        return batch

    def _check_var_positional(self, batch: Mapping[str, Any]) -> None:
        """A forward(*args) takes as many positional inputs on every step as on the first:
        a different count is a different model call, most likely a collate bug."""
        keys = var_positional_keys(self.module, batch)
        if keys is None:
            return
        first = self.__dict__.setdefault("_var_positional_count", len(keys))
        if len(keys) != first:
            raise BatchError(
                f"{type(self.module).__name__}.forward got {len(keys)} positional inputs for its "
                f"*args ({', '.join(keys) or 'none'}), the first step {first}: its graphs take "
                "the same positional inputs every step"
            )

    def train_step(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        """Forward + backward (+ optimizer update at the end of an accumulation window)."""
        with self._on_stream():
            return self._train_step(args, kwargs)

    def _train_step(self, args: tuple, kwargs: dict) -> torch.Tensor:
        batch = self.bucketing.pad(self._normalize(args, kwargs), train=True).batch
        if self._segments is None and self._blocks:
            self._start_segments(self._blocks, blocks=True)
        if self._segments is None:
            try:
                return self._graph_step(batch)
            except NotOneGraph as exc:
                self._start_segments(exc.cause)
                try:
                    return self._segment_step(batch)
                except Exception as eager:
                    if self._segments is None or self._segments.model is not None:
                        raise
                    # eager cannot run this batch either (its recording forward failed):
                    # the model's own error, as the build named it, not a fallback's
                    self._segments = None
                    raise exc.error from eager
        return self._segment_step(batch)

    def _graph_step(self, batch: dict[str, Any]) -> torch.Tensor:
        """A step of the whole model's training graph."""
        reference = self._early_reference(batch)
        for attempt in range(2):  # a cached graph that disagrees with eager is built anew
            fresh = attempt > 0
            compiled = None if fresh else self._graphs.find_train(batch)
            if compiled is None:
                compiled = self._build_train(batch, fresh)
            keep = compiled.bind_batch(batch, self.device)
            if self.options.grad_accumulation_steps > 1 and self.micro_step == 0:
                self.state.zero_grads()
            if self.scaler is not None:
                self.state.loss_scale.fill_(self.scaler.scale)
            if self._engine.in_backward:  # this step's hyperparameters go into the graph
                self._engine.before_run(group_values(self.optimizer, self.spec))
            if compiled.verified or not self.options.verify:
                break
            if self._checks_out(compiled, batch, reference if attempt == 0 else None):
                break
            if not compiled.cache_hit:
                raise AssertionError("unreachable: _checks_out raises for a built graph")
            warnings.warn(
                "ortrain: a graph from the graph cache disagrees with eager on its first step "
                "(what the forward reads changed since it was stored); building it again",
                stacklevel=4,
            )
        try:
            compiled.session.run()
        except CudaGraphCaptureError:  # its own message; the session restored the state
            raise
        except Exception as exc:
            # A partial run may have written into the gradients: the window starts again
            # (its first micro-step zeroes them); parameters and optimizer state are untouched
            # unless the update runs in the backward and got that far.
            discarded, self.micro_step = self.micro_step, 0
            updated, n = self._engine.applied()
            raise _run_failed("training", batch, exc, updated, n, discarded) from exc
        del keep
        for new, buffer in compiled.buffer_updates:  # as eager: every micro-step updates
            buffer.copy_(new)
        return self._end_micro_step(self.state.loss.clone())

    def _end_micro_step(self, loss: torch.Tensor) -> torch.Tensor:
        """A micro-step's loss counted (whichever way it ran); the update at the end of
        its accumulation window."""
        if self.options.check_finite and not math.isfinite(float(loss)):
            discarded, self.micro_step = self.micro_step, 0  # its gradients are in the sums
            raise NonFiniteLossError(
                f"loss is {float(loss)} at optimizer step {int(self.step_tensor)}; the update "
                "was not applied and parameters/optimizer state are unchanged"
                f"{_window_restarts(discarded)}"
            )
        self.micro_step += 1
        if self.micro_step == self.options.grad_accumulation_steps:
            self.micro_step = 0
            self._apply_update()
        return loss

    # ------------------------------------------------------------------ checks, fallback
    def _early_reference(self, batch: dict[str, Any]) -> EagerStep | None:
        """Eager's step on ``batch`` for the first-step check where this signature's first
        graph is due (``first_step.EagerSide.early_reference``); else None."""
        if not self.options.verify or self._graphs.has_train(batch):
            return None
        return self._eager.early_reference(batch)

    def _checks_out(
        self, compiled: CompiledGraph, batch: dict[str, Any], reference: EagerStep | None = None
    ) -> bool:
        """The graph's first step against eager (``ortrain/first_step.py``), its batch
        bound. True: it agrees. False: a cached graph disagrees (build it again). A graph
        built here that disagrees raises: ``_NotOneGraph`` (fallback "auto") or
        ``VerificationError``."""
        compiled.unchecked = self._eager.unchecked(compiled.graph)
        bad = compiled.unchecked or self._eager.check(
            compiled.graph,
            compiled.session,
            batch,
            self.state,
            self._engine,
            self._dropout_on,
            reference,
        )
        if compiled.unchecked or not bad:
            compiled.verified = True
            return True
        self._graphs.forget_train(compiled, batch)
        if compiled.cache_hit:
            return False
        hint = (
            "The exporter or a gradient rule changed what the model computes; "
            "fallback='auto' trains such a model as compiled segments and eager PyTorch"
        )
        if self.options.fallback == "off":
            raise VerificationError(f"{bad}. {hint}")
        cause = f"its first step disagrees with eager: {bad}"
        raise NotOneGraph(cause, VerificationError(f"{bad}. {hint}"))

    def _start_segments(self, cause: str, blocks: bool = False) -> None:
        """From now on the model trains as compiled segments inside eager PyTorch (cut at
        its repeated blocks with ``blocks``)."""
        self._graphs.clear_train()
        self._segments = SegmentedTraining(
            self.module,
            self.loss_fn,
            self._segment_settings(),
            lambda graph: self._session(graph),
            self._run_build,
            self.device,
            Tolerance.of(self.options.mixed_precision) if self.options.verify else None,
            cause,
            blocks,
            self._reducer if hasattr(self._reducer, "acquire") else None,  # ZeRO-3
        )
        if self._engine.in_backward:  # the update runs after torch's backward now
            self._engine = self._choose_engine()
            if self.grad_params is not None:
                self._engine.prepare()

    def _segment_step(self, batch: dict[str, Any]) -> torch.Tensor:
        """A step of the model as segments: eager forward and torch's backward, the
        segments' graphs inside; the update engine as for a graph."""
        assert self._segments is not None
        st = self.state
        if self.micro_step == 0:
            st.zero_grads()  # torch accumulates into .grad: every window starts at 0
        named = dict(self.module.named_parameters())
        # ZeRO-2 takes each gradient from autograd as it is made (distributed/sharded_grads.py)
        collecting = getattr(self._reducer, "collecting", None)
        if collecting is None:
            bind_grads(st, named)
        scale = self.scaler.scale if self.scaler is not None else None
        if scale is not None:
            st.loss_scale.fill_(scale)
        try:
            with collecting() if collecting is not None else contextlib.nullcontext():
                loss = self._segments.forward_backward(self._eager.on_device(batch), scale)
        except Exception:
            self.micro_step = 0  # the window starts over (its sums are incomplete)
            raise
        if collecting is None:
            take_grads(st, named, self._lay_out)
        else:
            take_reduced(st, self._reducer.reached, self._lay_out)  # type: ignore[union-attr]
        st.loss.copy_(loss)
        return self._end_micro_step(loss.clone())

    @property
    def program(self) -> TrainingProgram:
        """What the model is compiled into (``ortrain/program.py``): one training graph, or
        compiled segments, fallbacks and eager glue; and where the update runs."""
        if self._segments is None:
            graphs = list(self._graphs.train.values())
            checked = sum(c.verified and not c.unchecked for c in graphs)
            whole = ProgramSegment("", "graph", len(graphs), checked)
            return TrainingProgram((whole,), self._engine.name)
        model = self._segments.model
        segments = []
        if model is not None:
            for name, plan in model.plans.items():
                if plan.status == "compiled":
                    n = len(model.runners.get(name, {}))
                    segments.append(ProgramSegment(name, "compiled", n, n))
                else:
                    segments.append(ProgramSegment(name, plan.status, cause=plan.cause))
        return TrainingProgram(tuple(segments), self._engine.name)

    @property
    def segments(self) -> SegmentedTraining | None:
        """The model as compiled segments inside eager PyTorch (``fallback="auto"`` after it
        could not be one graph); None while it is one training graph."""
        return self._segments

    def _apply_update(self) -> None:
        world = self._reducer.world_size if self._reducer is not None else 1
        values = group_values(self.optimizer, self.spec)
        self._engine.step(values, self.state.grad_scale(world))
        self.state.finish_update()
        # torch LR schedulers warn unless they see the optimizer step; ours runs in the graph.
        self.optimizer._opt_called = True  # type: ignore[attr-defined]

    def apply_update(self) -> None:
        """End the accumulation window now: the optimizer update on the gradients of the
        micro-steps taken so far (an epoch's last, shorter window), scaled as a full window's
        (divided by ``grad_accumulation_steps``, times ``grad_multiplier``)."""
        if self.micro_step == 0:
            return
        self.micro_step = 0  # the in-backward update needs accumulation 1: never open here
        with self._on_stream():
            self._apply_update()

    @property
    def verify_seconds(self) -> float:
        """Seconds the first-step checks against eager took (``ortrain/first_step.py``)."""
        return self._eager.seconds

    @property
    def last_grad_norm(self) -> float | None:
        """Global gradient norm (before clipping) of the last update; None without clipping."""
        return float(self.state.grad_norm) if self.options.max_grad_norm is not None else None

    @property
    def loss_scale(self) -> float | None:
        """The loss scale the next step's backward uses (None without loss scaling)."""
        return self.scaler.scale if self.scaler is not None else None

    @property
    def session_seconds(self) -> float:
        """Seconds spent making ONNX Runtime sessions for the training and eval graphs."""
        return sum(r.seconds for r in self._graph_cache.session_log)

    @property
    def build_count(self) -> int:
        """Graphs built or loaded (training and eval): a build per step is a bug."""
        return self._graphs.count

    @property
    def cache_hits(self) -> int:
        """Graphs of ``build_count`` loaded from the on-disk graph cache, not built."""
        return self._graph_cache.hits

    @property
    def skipped_steps(self) -> int:
        """Updates skipped because a gradient overflowed (always 0 without loss scaling)."""
        return self.scaler.skipped_steps if self.scaler is not None else 0

    @property
    def train_graphs(self) -> list[ir.Model]:
        """The compiled gradient graphs, one per batch shape signature (and label-row
        count, see ``graph_passes/training/label_sparsity.py``)."""
        return [c.model for c in self._graphs.train.values()]

    def memory_report(self, top: int = 10) -> RankMemory:
        """This rank's bytes by class (``ortrain/rank_memory.py``) against its measured
        peak; with a whole-model gradient graph, also its plan (``.graph``: planned
        activation bytes and what the backward keeps, the ``top`` largest). Needs one
        ``train_step`` first."""
        if not self._graphs.train and (self._segments is None or self._segments.model is None):
            raise RuntimeError("memory_report() needs a compiled graph: run train_step first")
        from ortrain.graph_passes.memory.memory_plan import memory_report

        graph = memory_report(self.train_graphs[0], top=top) if self._graphs.train else None
        if self._segments is not None and self._segments.model is not None:
            activations = self._segments.model.tally.peak
        else:
            activations = graph.arena_peak_bytes if graph is not None else 0
        return RankMemory.measure(
            self.state_bytes(),
            self._reducer,
            runtime=self._runtime_bytes,
            sessions=self._session_bytes,
            activations=activations,
            graph=graph,
        )

    def state_bytes(self) -> StateBytes:
        """The model-state bytes this rank holds now, by class (``ortrain/memory_estimate.py``;
        ``ortrain.estimate_memory`` predicts them before a run)."""
        return held_state_bytes(self.state, self._reducer, self.options.zero_stage)

    @property
    def update_graph(self) -> ir.Model | None:
        graph = self._engine.update_graph
        return graph.model if graph is not None else None

    @property
    def step(self) -> int:
        return self.state.step

    @torch.no_grad()
    def eval_step(self, *args: Any, **kwargs: Any) -> StepOutputs:
        """Forward only in eval mode (no dropout), no update: loss and other outputs
        (host tensors)."""
        padded = self.bucketing.pad(self._normalize(args, kwargs), train=False)
        batch = padded.batch
        materialized = getattr(self._reducer, "materialized", None)
        if materialized is not None:  # ZeRO-3: eager, its parameters gathered meanwhile
            with materialized():
                return StepOutputs(padded.cut(self._eager.outputs(batch)))
        sig = signature(batch)
        if sig in self._eager_eval:
            return StepOutputs(padded.cut(self._eager.outputs(batch)))
        with self._on_stream():
            try:
                compiled = self._eval_graph(batch)
            except (ExportError, GradientError) as exc:
                if self.options.fallback == "off":
                    raise
                self._eval_in_eager(sig, f"{type(exc).__name__}: {first_line(exc)}")
                return StepOutputs(padded.cut(self._eager.outputs(batch)))
            keep = compiled.bind_batch(batch, self.device)
            try:
                compiled.session.run()
            except Exception as exc:
                raise _run_failed("eval", batch, exc) from exc
            del keep
        outputs = compiled.host_outputs()
        if self.options.verify and not compiled.verified:
            want = self._eager.outputs(batch)
            bad = compare(outputs, want, Tolerance.of(self.options.mixed_precision).loss)
            if bad and compiled.graph.from_training_export:
                # the model computes otherwise in evaluation mode (BatchNorm's running
                # statistics, ``if self.training``): its own export, checked in turn
                self._eval_graph(batch, fresh=True)
                return self.eval_step(*args, **kwargs)
            if bad:
                text = report(f"{type(self.module).__name__}'s evaluation graph", bad)
                if self.options.fallback == "off":
                    raise VerificationError(text)
                self._graphs.eval.pop(sig, None)
                self._eval_in_eager(sig, text)
                outputs = want
            compiled.verified = True
        return StepOutputs(padded.cut(outputs))  # back to the batch's own length

    def _eval_in_eager(self, sig: tuple, cause: str) -> None:
        self._eager_eval.add(sig)
        warnings.warn(
            f"ortrain: {type(self.module).__name__}'s evaluation runs in eager PyTorch for "
            f"this batch shape: {cause}",
            stacklevel=4,
        )

    # ------------------------------------------------------------------ state
    @torch.no_grad()
    @contextlib.contextmanager
    def whole_parameters(self) -> Iterator[torch.nn.Module]:
        """The module with its trained weights, every parameter whole, for the duration
        (under ZeRO-3 a gather, so every rank enters it together; ``save_model`` of the
        Hugging Face trainer saves inside it)."""
        self.sync_to_module()
        materialized = getattr(self._reducer, "materialized", None)
        with materialized() if materialized is not None else contextlib.nullcontext():
            yield self.module

    def sync_to_module(self) -> torch.nn.Module:
        """Copy trained weights into the module (a no-op where memory is shared)."""
        return self.state.sync_to_module()

    # Distributed: collectives (every rank calls them). ZeRO-1's state_dict() is the full
    # one on rank 0 and {} elsewhere; its checkpoints are directories of shards.
    def state_dict(self) -> dict[str, Any]:
        if self._reducer is not None:
            return self._reducer.state_dict(self.state)
        return checkpoint.trainer_state_dict(self.state)

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if self._reducer is not None:
            return self._reducer.load_state_dict(self.state, state)
        checkpoint.load_trainer_state_dict(self.state, state)

    def save_checkpoint(self, path: str | os.PathLike) -> None:
        if self._reducer is not None:
            return self._reducer.save_checkpoint(self.state, path)
        checkpoint.save(self.state, path)

    def load_checkpoint(self, path: str | os.PathLike) -> None:
        if self._reducer is not None:
            return self._reducer.load_checkpoint(self.state, path)
        sharded_checkpoint.load_any(self.state, path)


def _from_onnxruntime(exc: BaseException) -> bool:
    """An error ONNX Runtime raised (its own exception types)."""
    return type(exc).__module__.startswith("onnxruntime")


def _window_restarts(discarded: int) -> str:
    """A failed micro-step ends its accumulation window: say what that threw away."""
    if not discarded:
        return ""
    some = "micro-batch" if discarded == 1 else f"{discarded} micro-batches"
    return f"; the accumulation window starts over, discarding its earlier {some}"


def _run_failed(
    graph: str,
    batch: Mapping[str, Any],
    exc: Exception,
    updated: int = 0,
    params: int = 0,
    discarded: int = 0,
) -> BatchError:
    """ONNX Runtime's error with the batch it failed on (its message names the node);
    ``updated`` of ``params`` parameters had their update in the backward already;
    ``discarded`` micro-steps of the accumulation window were thrown away with it."""
    shapes = ", ".join(
        f"{k}: {list(v.shape)} {v.dtype}".replace("torch.", "")
        for k, v in batch.items()
        if isinstance(v, torch.Tensor)
    )
    applied = (
        f"{updated} of {params} parameters were updated in the backward before it failed"
        if updated
        else "no update was applied"
    )
    return BatchError(
        f"the {graph} graph failed on this batch ({shapes}); {applied}"
        f"{_window_restarts(discarded)}: {first_line(exc)}"
    )
