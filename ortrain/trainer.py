"""ORTTrainer: a PyTorch training loop's model + optimizer, run as ONNX Runtime graphs.

Per batch shape signature the module is exported once and turned into a gradient
graph (forward + minimal backward); one update graph (clipping + optimizer) serves
all signatures. Parameters, gradients and optimizer state are tensors whose memory
ONNX Runtime reads and writes in place through IOBinding; a step moves only the
batch in and the loss out.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
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
    BuildSettings,
    BuiltGraph,
    ForwardSource,
    StageRecord,
    build_eval,
    build_train,
    graph_for,
    label_rows,
)
from ortrain.build_cache import GraphCache
from ortrain.core.errors import (
    BatchError,
    NonFiniteLossError,
    UnsupportedOptimizerError,
    first_line,
)
from ortrain.core.names import (
    HYPER_NAMES,
    IN_BACKWARD_STATES,
    LOSS_SCALE_INPUT,
    UpdateInBackwardError,
    hyper_name,
    state_key,
)
from ortrain.core.optimizer_spec import OptimizerSpec
from ortrain.core.roles import Role
from ortrain.distributed import Reducer, join_process_group, sharded_checkpoint
from ortrain.export import LossFn, normalize_batch, var_positional_keys, warn_sdpa
from ortrain.forked import call_forked, can_fork
from ortrain.index_check import check_batch
from ortrain.loss_scaler import LossScaler
from ortrain.optim.from_torch import group_values, optimizer_spec
from ortrain.options import TrainerOptions
from ortrain.runtime import kernels
from ortrain.runtime.cpu_ops import has_sgemm_batch, use_blas_gemm, use_grad_kernels
from ortrain.runtime.flat_update import flatten_update
from ortrain.runtime.fused_update import (
    KERNEL_KINDS,
    FusedUpdate,
    check_supported,
    kernels_available,
)
from ortrain.runtime.session import (
    BoundSession,
    check_device,
    make_session,
    register_cpu_arena,
)
from ortrain.runtime.torch_update import TORCH_KINDS, TorchFusedUpdate

if TYPE_CHECKING:
    import onnx_ir as ir

    from ortrain.graph_passes.memory.memory_plan import MemoryReport
    from ortrain.graph_passes.training.optimizer import UpdateGraph

__all__ = ["ORTTrainer", "StageRecord", "StepOutputs"]
T = TypeVar("T")


@dataclasses.dataclass
class _Compiled:
    """One batch shape signature: its gradient (or eval) session and batch names."""

    session: BoundSession
    graph: BuiltGraph  # what the session runs, serialized (for inspection and tests)
    batch_names: list[str]
    batch_dtypes: dict[str, torch.dtype]
    output_keys: list[str]
    # CUDA graphs replay fixed addresses: each batch is copied into these buffers.
    static_batch: dict[str, torch.Tensor] | None = None
    # (the graph's new value, the buffer) per buffer a training step updates
    buffer_updates: list[tuple[torch.Tensor, torch.Tensor]] = dataclasses.field(
        default_factory=list
    )

    @functools.cached_property
    def model(self) -> ir.Model:
        return self.graph.model()


class StepOutputs(dict):
    """eval_step's result: a dict of tensors that also allows ``outputs.loss``."""

    def __getattr__(self, name: str) -> torch.Tensor:
        try:
            return self[name]
        except KeyError as exc:
            raise AttributeError(name) from exc


def _signature(batch: Mapping[str, Any]) -> tuple:
    sig = []
    for k, v in batch.items():
        if isinstance(v, torch.Tensor):
            sig.append((k, tuple(v.shape), v.dtype))
        else:
            sig.append((k, "const", repr(v)))
    return tuple(sig)


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
        self.module = model
        self.optimizer = optimizer
        self.options = options or TrainerOptions()
        self.loss_fn = loss_fn
        # variable lengths padded to a few bucket lengths where exact (ortrain/bucketing.py)
        self.bucketing = Bucketing(model, loss_fn, self.options.bucketing, self.sync_to_module)
        self.device = torch.device(self.options.device)
        check_device(self.device)
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
        self.trainable = [n for g in self.spec.groups for n in g.params]
        # Parameters share memory with the module on CPU: updates are visible in place.
        self.params: dict[str, torch.Tensor] = {}
        for n, p in named.items():
            if p.dtype != torch.float32:
                raise TypeError(f"parameter {n} is {p.dtype}; ortrain trains float32 parameters")
            if not p.data.is_contiguous():
                p.data = p.data.contiguous()
            self.params[n] = p.data
        self.buffers = {n: b.data.contiguous() for n, b in model.named_buffers()}
        self.grads: dict[str, torch.Tensor] = {}
        self.opt_state: dict[str, torch.Tensor] = {}
        dev = self.device
        self.step_tensor = torch.zeros((), dtype=torch.float32, device=dev)
        self._scalars = {
            "grad_scale": torch.ones((), dtype=torch.float32, device=dev),
            "max_grad_norm": torch.zeros((), dtype=torch.float32, device=dev),
        }
        self._loss = torch.zeros((), dtype=torch.float32, device=dev)
        self._grad_norm = torch.zeros((), dtype=torch.float32, device=dev)
        # Loss scaling: the backward is seeded with the scale; the update graph reports
        # whether the gradients were finite (and skips the update if not).
        ls = self.options.resolved_loss_scale
        self.scaler: LossScaler | None = None if ls is None else LossScaler.from_option(ls)
        self._loss_scale = torch.ones((), dtype=torch.float32, device=dev)
        self._grads_finite = torch.ones((), dtype=torch.bool, device=dev)
        self._train: dict[tuple, _Compiled] = {}
        # Per batch signature: the exported training forward (each label-row count
        # builds from a copy of it) and its losses whose ignored rows can be dropped.
        self._forwards: dict[tuple, ForwardSource] = {}
        self.build_count = 0  # graphs built (training and eval): a build per step is a bug
        # built graphs kept on disk (ortrain/build_cache.py); its hits count in build_count
        self._graph_cache = GraphCache(self.options, model, loss_fn)
        self._eval: dict[tuple, _Compiled] = {}
        self._update: BoundSession | None = None
        # the kernels (cuda_kernels/ or torch's) run the update instead of a graph
        self._fused: FusedUpdate | TorchFusedUpdate | None = None
        self._update_graph: UpdateGraph | None = None
        self.grad_params: list[str] | None = None  # trainable params reached by the loss
        self.micro_step = 0
        # The update also scales the accumulated gradients by this: a driver's loss weighting
        # (ortrain/hf_trainer.py matches transformers.Trainer's). The in-backward update,
        # which has no gradient buffers to scale, ignores it.
        self.grad_multiplier = 1.0
        self.build_log: list[StageRecord] = []
        self._graph_dir = (
            Path(self.options.save_graphs_dir) if self.options.save_graphs_dir else None
        )
        if self._graph_dir is not None:
            self._graph_dir.mkdir(parents=True, exist_ok=True)
        # torch.distributed (torchrun): data parallel or ZeRO-1 (ortrain.distributed);
        # None single-process. ZeRO-1 moves the trainable parameters into a flat buffer.
        self._reducer: Reducer | None = join_process_group(self)
        if self.options.update_engine == "kernels":  # fail now, not at the first step
            self._use_kernels()
            kernels.library(self.device.type)
        elif self.options.update_engine == "torch":
            self._use_torch_kernels()
        # Adam/AdamW updated in the backward (graph_passes/targets/cpu/update_in_backward.py): no
        # gradient buffers; per param group the hyperparameters the graph reads, and per
        # parameter whether its update ran.
        self._in_backward = self._use_backward_update()
        self._hyper_in: list[torch.Tensor] = []
        self._applied = torch.zeros(0, dtype=torch.float32, device=dev)

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
        return BoundSession(
            make_session(
                model,
                threads=self.options.intra_op_threads,
                device=self.device,
                stream=self._stream,
                cuda_graph=graph_capture and self.options.cuda_graph,
            )
        )

    # ------------------------------------------------------------------ building
    def _save(self, model: ir.Model, name: str) -> None:
        if self._graph_dir is not None:
            import onnx_ir as ir

            ir.save(model, self._graph_dir / f"{name}.onnx")

    def _settings(self) -> BuildSettings:
        return BuildSettings(
            trainable=tuple(self.trainable),
            seed=self.options.seed,
            accumulate=self.options.grad_accumulation_steps > 1,
            mixed_precision=self.options.mixed_precision,
            loss_scaling=self.scaler is not None,
            optimize=self.options.optimize_graph,
            memory_plan=self.options.memory_plan,
            graph_dir=str(self._graph_dir) if self._graph_dir is not None else None,
            blas_gemm=self._blas_gemm,
            blas_batch=self._blas_batch,
            cpu_kernels=self._cpu_kernels,
            update_groups=tuple((p, gi) for gi, g in enumerate(self.spec.groups) for p in g.params)
            if self._in_backward
            else (),
        )

    def _run_build(self, job: Callable[[], T], batch: Mapping[str, Any]) -> T:
        """``job`` in a forked child where possible (``ortrain/build.py``)."""
        warn_sdpa(self.module)
        tensors = [*self.params.values(), *self.buffers.values()]
        tensors += [v for v in batch.values() if isinstance(v, torch.Tensor)]
        if can_fork(tensors):
            return call_forked(job, what="building the ONNX graph")
        return job()

    def _build_train(self, sig: tuple, batch: Mapping[str, Any]) -> _Compiled:
        job = functools.partial(
            build_train,
            self.module,
            batch,
            self.loss_fn,
            self._settings(),
            self._forwards.get(sig),
            len(self.build_log) + 1,
        )
        new_shape = sig not in self._forwards
        try:
            run = functools.partial(self._run_build, batch=batch)
            forward, rows, built = self._graph_cache.build_train(run, *job.args)
        except UpdateInBackwardError as exc:
            if self.options.update_engine != "auto" or self.grad_params is not None:
                raise
            # "auto" takes the update after the session where the graph cannot run it
            warnings.warn(
                f"ortrain: the optimizer update runs after the session: {exc}", stacklevel=3
            )
            self._in_backward = False
            return self._build_train(sig, batch)
        self._forwards[sig] = forward
        if new_shape:
            _warn_many_shapes(len(self._forwards), batch)
        self.build_log.extend(built.log)
        grad_params = sorted(built.grad_outputs, key=self.trainable.index)
        if self.device.type == "cpu":  # sized by this graph, before the update's session
            register_cpu_arena(built.planned_peak_bytes)
        if self.grad_params is None and self._reducer is not None:  # before any gradient moves
            from ortrain.distributed.fingerprint import agree_on_graph

            agree_on_graph(self._reducer.comm, built, grad_params)  # type: ignore[attr-defined]
        if self.grad_params is None:
            self.grad_params = grad_params
            if self._in_backward:
                self._prepare_backward_update()
            else:
                self._build_update()
        elif grad_params != self.grad_params:
            raise BatchError(
                "this batch reaches a different set of parameters than the first one "
                f"({sorted(set(grad_params) ^ set(self.grad_params))}); ortrain needs one set"
            )
        with self._graph_cache.session_stage("train"):
            session = self._session(built, graph_capture=True)
        session.bind_inputs({**self.params, **self.buffers, LOSS_SCALE_INPUT: self._loss_scale})
        session.bind_inputs(
            {acc: self.grads[out[len("grad:") :]] for acc, out in built.accumulators.items()}
        )
        session.bind_outputs({built.output_names[0]: self._loss})
        updates = self._bind_buffer_updates(session, built)
        if self._in_backward:
            self._bind_backward_update(session, built)
        else:
            session.bind_outputs({built.grad_outputs[p]: self.grads[p] for p in grad_params})
            param_of = {out: p for p, out in built.grad_outputs.items()}
            session.bind_outputs(
                {out: self.grads[param_of[grad]] for out, grad in built.shared_outputs.items()}
            )
        batch_names = [r.name for r in built.io if r.role is Role.BATCH]
        dtypes = {k: batch[k].dtype for k in batch_names}
        static = {} if self.options.cuda_graph else None
        compiled = _Compiled(
            session, built, batch_names, dtypes, built.output_keys, static, updates
        )
        self._train[(sig, rows)] = compiled
        self.build_count += 1
        return compiled

    def _bind_buffer_updates(
        self, session: BoundSession, built: BuiltGraph
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Each buffer update (``Role.UPDATED_BUFFER``: BatchNorm statistics) into a tensor of
        its own, copied into the buffer after the run: bound to the buffer itself, the new
        value could be written while a later node (the backward) still reads the old one."""
        updates = []
        for r in built.io:
            if r.role is Role.UPDATED_BUFFER:
                assert r.of is not None
                new = torch.empty_like(self.buffers[r.of])
                session.bind_outputs({r.name: new})
                updates.append((new, self.buffers[r.of]))
        return updates

    def _build_update(self) -> None:
        assert self.grad_params is not None
        # Distributed: gradients become views of one flat buffer; ZeRO-1 also builds and
        # binds the update graph of this rank's shard instead of the one below.
        if self._reducer is not None and self._reducer.prepare_update(self):
            return
        if self._use_kernels():
            flat = flatten_update(self, KERNEL_KINDS, whole_groups=True)
            assert flat is not None
            self._eval.clear()
            self._fused = FusedUpdate(self, flat, flat.segments)
            return
        if self._use_torch_kernels():
            flat = flatten_update(self, TORCH_KINDS, whole_groups=True, move_params=False)
            assert flat is not None
            self._eval.clear()
            self._fused = TorchFusedUpdate(self, flat)
            return
        from ortrain.graph_passes.training.optimizer import (
            build_update_graph,  # the graph libraries: only here
        )

        flat = flatten_update(self)
        if flat is not None:  # one update chain per param group (memory moved: rebuild evals)
            self._eval.clear()
            spec, shapes = flat.spec, flat.shapes
            params, grads, states = flat.params, flat.grads, flat.states
        else:
            spec = self.spec
            shapes = {p: tuple(self.params[p].shape) for p in self.grad_params}
            for p in self.grad_params:
                self.grads.setdefault(p, torch.zeros_like(self.params[p]))
                for g in self.spec.groups:
                    if p in g.params:
                        for s in self.spec.state_names(g):
                            key = state_key(s, p)
                            self.opt_state.setdefault(key, torch.zeros_like(self.params[p]))
            params = {p: self.params[p] for p in self.grad_params}
            grads = {p: self.grads[p] for p in self.grad_params}
            states = self.opt_state
        ug = build_update_graph(
            spec,
            shapes,
            clip_grad_norm=self.options.max_grad_norm is not None,
            skip_nonfinite=self.scaler is not None,
        )
        self._save(ug.model, "update")
        grads = {f"grad:{p}": t for p, t in grads.items()}
        self._bind_update(ug, params, grads, states)

    def _use_backward_update(self) -> bool:
        """Whether each parameter's Adam/AdamW update runs in the backward: ``update_engine=
        "backward"``, or "auto" wherever it can (it needs no look at all the gradients)."""
        why = []
        if self.device.type != "cpu" or not self._cpu_kernels:
            why.append("ortrain's CPU kernels (device='cpu', cpu_kernels)")
        if self.spec.kind not in TORCH_KINDS:
            why.append(f"Adam or AdamW (not {self.spec.kind})")
        if self._reducer is not None:
            why.append("a single process")
        if self.options.grad_accumulation_steps != 1:
            why.append("grad_accumulation_steps=1")
        if self.options.max_grad_norm is not None:
            why.append("no clipping (max_grad_norm=None)")
        if self.options.mixed_precision is not None or self.scaler is not None:
            why.append("fp32 training without loss scaling")
        if self.options.update_engine == "backward" and why:
            raise ValueError("TrainerOptions.update_engine='backward' needs " + ", ".join(why))
        return self.options.update_engine in ("auto", "backward") and not why

    def _prepare_backward_update(self) -> None:
        """The moments the graphs update in place, and the tensors they read and write."""
        assert self.grad_params is not None
        for p in self.grad_params:
            for s in IN_BACKWARD_STATES:
                self.opt_state.setdefault(state_key(s, p), torch.zeros_like(self.params[p]))
        self._hyper_in = [
            torch.zeros(len(HYPER_NAMES), dtype=torch.float32, device=self.device)
            for _ in self.spec.groups
        ]
        self._applied = torch.zeros(len(self.grad_params), dtype=torch.float32, device=self.device)

    def _bind_backward_update(self, session: BoundSession, built: BuiltGraph) -> None:
        assert self.grad_params is not None
        index = {p: i for i, p in enumerate(self.grad_params)}
        states = {
            r.name: self.opt_state[r.name] for r in built.io if r.role is Role.OPTIMIZER_STATE
        }
        session.bind_inputs(states)
        session.bind_inputs({hyper_name(gi): t for gi, t in enumerate(self._hyper_in)})
        session.bind_outputs(
            {out: self._applied[index[p]] for p, out in built.update_outputs.items()}
        )

    def _fill_hyperparameters(self) -> None:
        """This step's values of what ``hyper:group<i>`` holds (``HYPER_NAMES``)."""
        step = float(self.step_tensor) + 1.0  # the 1-based t of this update
        decoupled = 1.0 if self.spec.kind == "adamw" else 0.0
        for t, hp in zip(self._hyper_in, group_values(self.optimizer, self.spec), strict=True):
            values = [hp[h] for h in HYPER_NAMES[:5]] + [step, decoupled]
            t.copy_(torch.tensor(values, dtype=torch.float32))

    def _use_torch_kernels(self) -> bool:
        """Whether torch's fused Adam/AdamW kernels run the update: ``update_engine="torch"``,
        or "auto" on CPU in a single process."""
        engine = self.options.update_engine
        if engine == "torch":
            if self.spec.kind not in TORCH_KINDS:
                raise UnsupportedOptimizerError(
                    f"update_engine='torch' supports {', '.join(TORCH_KINDS)}, not "
                    f"{self.spec.kind}; use update_engine='graph'"
                )
            if self._reducer is not None:
                raise ValueError(
                    "TrainerOptions.update_engine='torch' is single-process only; distributed "
                    "training updates through the update graph (use 'graph' or 'auto')"
                )
            return True
        return (
            engine == "auto"
            and self.device.type == "cpu"
            and self.spec.kind in TORCH_KINDS
            and self._reducer is None
        )

    def _use_kernels(self) -> bool:
        """Whether the fused kernels run the update (``TrainerOptions.update_engine``)."""
        engine = self.options.update_engine
        if engine in ("graph", "torch") or (engine == "auto" and self.device.type != "cuda"):
            return False
        if engine == "auto":  # CUDA: the kernels when built and they cover the optimizer
            return self.spec.kind in KERNEL_KINDS and kernels_available(self.device)
        check_supported(self.spec.kind)
        if self._reducer is not None:
            raise ValueError(
                "TrainerOptions.update_engine='kernels' is single-process only; distributed "
                "training updates through the update graph (use 'graph' or 'auto')"
            )
        return True

    def _bind_update(
        self,
        ug: UpdateGraph,
        params: Mapping[str, torch.Tensor],
        grads: Mapping[str, torch.Tensor],
        states: Mapping[str, torch.Tensor],
        extra: Mapping[str, torch.Tensor] | None = None,
    ) -> None:
        """Session for an update graph; every aliased output bound to its input's buffer.

        ``grads`` are keyed by graph input name (``grad:<param>``); ``extra`` holds other
        inputs (ZeRO-1's ``global_sq_norm``).
        """
        self._update_graph = ug
        self._hyper = {
            io.name: torch.zeros((), dtype=torch.float32, device=self.device)
            for io in ug.io
            if io.role is Role.HYPERPARAMETER
        }
        sess = self._session(ug.model, graph_capture=True)
        sess.bind_inputs({**params, **grads, **states, **self._hyper, **self._scalars})
        sess.bind_inputs({"step": self.step_tensor, **(extra or {})})
        outputs = {"new:step": self.step_tensor}
        if self.options.max_grad_norm is not None:
            outputs["grad_norm"] = self._grad_norm
        if any(o.role is Role.GRADS_FINITE for o in ug.outputs):
            outputs["grads_finite"] = self._grads_finite
        for out, src in ug.aliases.items():
            if src != "step":
                outputs[out] = params[src] if src in params else states[src]
        sess.bind_outputs(outputs)
        self._update = sess

    def _compiled(self, batch: Mapping[str, Any], *, train: bool) -> _Compiled:
        sig = _signature(batch)
        if not train:
            if sig not in self._eval:
                self._eval[sig] = self._build_eval(batch)
            return self._eval[sig]
        forward = self._forwards.get(sig)
        if forward is not None:  # this signature's graphs differ in labelled rows only
            built = [rows for s, rows in self._train if s == sig]
            rows = graph_for(forward.sites, label_rows(forward.sites, batch), built)
            if rows is None:  # what a build for this batch would make, if it exists already
                target = label_rows(forward.sites, batch, headroom=True)
                rows = target if target in built else None
            if rows is not None:
                return self._train[(sig, rows)]
        return self._build_train(sig, batch)

    def _build_eval(self, batch: Mapping[str, Any]) -> _Compiled:
        job = functools.partial(
            build_eval, self.module, batch, self.loss_fn, self._settings(), len(self.build_log) + 1
        )
        run = functools.partial(self._run_build, batch=batch)
        built = self._graph_cache.build_eval(run, *job.args)
        self.build_log.extend(built.log)
        with self._graph_cache.session_stage("eval"):
            session = self._session(built)
        session.bind_inputs({**self.params, **self.buffers})
        for name in built.output_names:
            session.bind_output_to_cpu(name)
        batch_names = [r.name for r in built.io if r.role is Role.BATCH]
        dtypes = {k: batch[k].dtype for k in batch_names}
        self.build_count += 1
        return _Compiled(session, built, batch_names, dtypes, built.output_keys)

    # ------------------------------------------------------------------ running
    def _bind_batch(self, compiled: _Compiled, batch: Mapping[str, Any]) -> list[torch.Tensor]:
        keep = []
        for name in compiled.batch_names:
            t = batch[name]
            if compiled.static_batch is not None:  # CUDA graph: the captured addresses
                buf = compiled.static_batch.get(name)
                if buf is None:
                    buf = compiled.static_batch[name] = torch.empty(
                        t.shape, dtype=t.dtype, device=self.device
                    )
                buf.copy_(t, non_blocking=True)
                t = buf
            elif t.device != self.device:  # a host batch: one copy (CUDA: on our stream)
                t = t.to(self.device, non_blocking=True)
            t = t.contiguous()
            keep.append(t)
            compiled.session.bind_batch(name, t)
        return keep

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
        compiled = self._compiled(batch, train=True)
        check_batch(compiled.graph.index_checks, batch)  # ids/labels in range, as eager
        keep = self._bind_batch(compiled, batch)
        accum = self.options.grad_accumulation_steps
        if accum > 1 and self.micro_step == 0:
            for g in self.grads.values():
                g.zero_()
        if self.scaler is not None:
            self._loss_scale.fill_(self.scaler.scale)
        if self._in_backward:
            self._fill_hyperparameters()
            self._applied.zero_()
        try:
            compiled.session.run()
        except Exception as exc:
            # A partial run may have written into the gradients: the window starts again
            # (its first micro-step zeroes them); parameters and optimizer state are untouched
            # unless the update runs in the backward and got that far.
            discarded, self.micro_step = self.micro_step, 0
            updated = int(self._applied.sum()) if self._in_backward else 0
            n = len(self._applied)
            raise _run_failed("training", batch, exc, updated, n, discarded) from exc
        del keep
        for new, buffer in compiled.buffer_updates:  # as eager: every micro-step updates
            buffer.copy_(new)
        loss = self._loss.clone()
        if self.options.check_finite and not math.isfinite(float(loss)):
            discarded, self.micro_step = self.micro_step, 0  # its gradients are in the sums
            raise NonFiniteLossError(
                f"loss is {float(loss)} at optimizer step {int(self.step_tensor)}; the update "
                "was not applied and parameters/optimizer state are unchanged"
                f"{_window_restarts(discarded)}"
            )
        self.micro_step += 1
        if self.micro_step == accum:
            self.micro_step = 0
            if self._in_backward:  # the graph ran the update (unless the loss was not finite)
                if bool(self._applied.all()):
                    self.step_tensor.add_(1.0)
                self.optimizer._opt_called = True  # type: ignore[attr-defined]
            else:
                self._apply_update()
        return loss

    def _apply_update(self) -> None:
        values = group_values(self.optimizer, self.spec)
        # Gradients are sums over micro-steps (and ranks) of the loss-scaled gradients: the
        # update scales them to the unscaled mean.
        world = self._reducer.world_size if self._reducer is not None else 1
        scale = self.scaler.scale if self.scaler is not None else 1.0
        grad_scale = self.grad_multiplier / (self.options.grad_accumulation_steps * world * scale)
        if self._fused is not None:
            self._fused.run(values, grad_scale)
        else:
            assert self._update is not None
            for gi, group in enumerate(values):
                for h, v in group.items():
                    self._hyper[f"group{gi}.{h}"].fill_(v)
            self._scalars["grad_scale"].fill_(grad_scale)
            if self.options.max_grad_norm is not None:
                self._scalars["max_grad_norm"].fill_(self.options.max_grad_norm)
            if self._reducer is None:
                self._update.run()
            else:
                self._reducer.update(self._update.run)
        if self.scaler is not None:
            self.scaler.update(bool(self._grads_finite))
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
    def last_grad_norm(self) -> float | None:
        """Global gradient norm (before clipping) of the last update; None without clipping."""
        return float(self._grad_norm) if self.options.max_grad_norm is not None else None

    @property
    def loss_scale(self) -> float | None:
        """The loss scale the next step's backward uses (None without loss scaling)."""
        return self.scaler.scale if self.scaler is not None else None

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
        return [c.model for c in self._train.values()]

    def memory_report(self, top: int = 10) -> MemoryReport:
        """Planned activation bytes of the (first) gradient graph and what its backward
        keeps from the forward; needs one ``train_step`` first."""
        if not self._train:
            raise RuntimeError("memory_report() needs a compiled graph: run train_step first")
        from ortrain.graph_passes.memory.memory_plan import memory_report

        return memory_report(self.train_graphs[0], top=top)

    @property
    def update_graph(self) -> ir.Model | None:
        return self._update_graph.model if self._update_graph is not None else None

    @property
    def step(self) -> int:
        return int(self.step_tensor)

    @torch.no_grad()
    def eval_step(self, *args: Any, **kwargs: Any) -> StepOutputs:
        """Forward only in eval mode (no dropout), no update: loss and other outputs
        (host tensors)."""
        padded = self.bucketing.pad(self._normalize(args, kwargs), train=False)
        batch = padded.batch
        with self._on_stream():
            compiled = self._compiled(batch, train=False)
            check_batch(compiled.graph.index_checks, batch)
            keep = self._bind_batch(compiled, batch)
            try:
                compiled.session.run()
            except Exception as exc:
                raise _run_failed("eval", batch, exc) from exc
            del keep
        values = compiled.session.binding.get_outputs()
        # copies: the session's output buffers are reused by the next eval step
        outputs = {
            k: torch.from_numpy(v.numpy()).clone() for k, v in zip(compiled.output_keys, values)
        }
        return StepOutputs(padded.cut(outputs))  # back to the batch's own length

    # ------------------------------------------------------------------ state
    @torch.no_grad()
    def sync_to_module(self) -> torch.nn.Module:
        """Copy trained weights into the module (a no-op where memory is shared)."""
        for n, p in self.module.named_parameters():
            if p.data.data_ptr() != self.params[n].data_ptr():
                p.data.copy_(self.params[n])
        for n, b in self.module.named_buffers():
            if b.data_ptr() != self.buffers[n].data_ptr():
                b.copy_(self.buffers[n])
        return self.module

    # Distributed: collectives (every rank calls them). ZeRO-1's state_dict() is the full
    # one on rank 0 and {} elsewhere; its checkpoints are directories of shards.
    def state_dict(self) -> dict[str, Any]:
        if self._reducer is not None:
            return self._reducer.state_dict(self)
        return checkpoint.trainer_state_dict(self)

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if self._reducer is not None:
            return self._reducer.load_state_dict(self, state)
        checkpoint.load_trainer_state_dict(self, state)

    def save_checkpoint(self, path: str | os.PathLike) -> None:
        if self._reducer is not None:
            return self._reducer.save_checkpoint(self, path)
        checkpoint.save(self, path)

    def load_checkpoint(self, path: str | os.PathLike) -> None:
        if self._reducer is not None:
            return self._reducer.load_checkpoint(self, path)
        sharded_checkpoint.load_any(self, path)


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


SHAPES_WARNING_AT = 4  # then at every doubling


def _warn_many_shapes(count: int, batch: Mapping[str, Any]) -> None:
    """Each batch shape exports and builds its own graph: say so when shapes keep coming."""
    if count < SHAPES_WARNING_AT or count & (count - 1):
        return
    shapes = ", ".join(
        f"{k}: {list(v.shape)}" for k, v in batch.items() if isinstance(v, torch.Tensor)
    )
    warnings.warn(
        f"ortrain has built training graphs for {count} batch shapes (latest: {shapes}); "
        "each new shape is exported and compiled again and keeps its own session. "
        "bucketing='auto' pads right-padded batches with an attention_mask and -100 labels "
        "to a few lengths by itself; other batches: pad them to a few lengths, e.g. "
        "DataCollatorWithPadding(tokenizer, pad_to_multiple_of=64).",
        stacklevel=4,
    )
