"""ORTTrainer: a PyTorch training loop's model + optimizer, run as ONNX Runtime graphs.

The trainer is a facade: it turns a step's arguments into a batch (``batch_input.py``,
padded where bucketing is exact: ``bucketing.py``) and runs the model's program on it
(``program.py``). Everything else lives beside it:

- ``program_context.py``: the state (``runtime/training_state.py``: parameters,
  gradients, optimizer state, which ONNX Runtime reads and writes in place), the
  distributed reducer, the update engine, build settings, sessions;
- ``whole_program.py``: the whole model as one training graph per batch signature, each
  bound to the state by role (``runtime/binder.py``) and its first step checked against
  eager (``first_step.py``);
- ``segmented_program.py``: compiled segments inside torch autograd, once the model
  cannot be one graph (fallback "auto") or by choice (``segments="blocks"``, ZeRO-2/3);
- ``evaluation.py``: evaluation graphs, checked, with eager as their fallback;
- ``trainer_views.py``: the properties loops, tests and tools read;
- ``trainer_state.py``: state dicts, checkpoints, whole parameters, the memory report.
"""

from __future__ import annotations

import gc
import time
import warnings
from typing import Any

import torch

from ortrain.batch_input import BatchInput
from ortrain.bucketing import Bucketing, Padded
from ortrain.build import StageRecord
from ortrain.core.errors import BatchError, OrtrainError, TrainableChangedError
from ortrain.evaluation import Evaluation, StepOutputs
from ortrain.export import LossFn
from ortrain.memory_estimate import storage_bytes
from ortrain.options import TrainerOptions
from ortrain.parallel_wrappers import unwrapped
from ortrain.program import TrainingProgram
from ortrain.program_context import ProgramContext
from ortrain.python_state import LOSS_FN
from ortrain.rank_memory import resident_bytes
from ortrain.runtime.heap import trim_heap
from ortrain.runtime.training_state import refuse_lazy
from ortrain.segmented_program import SegmentedProgram
from ortrain.segments.training import SegmentedTraining
from ortrain.step_errors import note_failed_step
from ortrain.trainer_state import TrainerState
from ortrain.trainer_views import TrainerViews
from ortrain.whole_graph import NotOneGraph
from ortrain.whole_program import WholeProgram

__all__ = ["ORTTrainer", "StageRecord", "StepOutputs"]


class ORTTrainer(TrainerState, TrainerViews):
    """Train ``model`` with ``optimizer`` through ONNX Runtime.

    ``train_step(*args, **kwargs)`` runs forward, backward and (every
    ``grad_accumulation_steps`` micro-steps) the optimizer update, and returns the loss
    as a 0-dim tensor. The model's output may be the loss, a tuple starting with it, or
    an object with ``.loss``; or pass ``loss_fn(outputs, batch) -> loss``. A loss of one
    element in another shape (``[1]``) trains as eager's ``backward()`` takes it.
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
        model = unwrapped(model)  # torch's own data-parallel wrappers: ortrain reduces itself
        refuse_lazy(model)
        self._runtime_bytes = resident_bytes() - storage_bytes(
            t for t in (*model.parameters(), *model.buffers()) if t.device.type == "cpu"
        )
        self.module = model
        self.optimizer = optimizer
        self.options = options or TrainerOptions()
        self.loss_fn = loss_fn
        self._ctx = ProgramContext(model, optimizer, self.options, loss_fn)
        self.device = self._ctx.device
        self.spec = self._ctx.spec
        self.state = self._ctx.state
        self._batch = BatchInput(model, allow_extra=loss_fn is not None)
        # variable lengths padded to a few bucket lengths where exact (ortrain/bucketing.py)
        self.bucketing = Bucketing(
            model, loss_fn, self.options.bucketing, self.sync_to_module, self._ctx.graph_cache
        )
        # the model's program: one training graph per signature until it cannot be (then
        # segments, fallback "auto"), or segments from the start by choice
        blocks = self._ctx.blocks_cause()
        self._program: WholeProgram | SegmentedProgram = (
            SegmentedProgram(self._ctx, blocks, blocks=True)
            if blocks
            else SegmentedProgram(self._ctx, self._ctx.dtype_cause)
            if self._ctx.dtype_cause
            else WholeProgram(self._ctx)
        )
        self._evaluation = Evaluation(self._ctx)

    @property
    def program(self) -> TrainingProgram:
        """What the model is compiled into (``ortrain/program.py``): one training graph, or
        compiled segments, fallbacks and eager glue; and where the update runs."""
        return self._program.describe()

    @property
    def segments(self) -> SegmentedTraining | None:
        """The model as compiled segments inside eager PyTorch (``fallback="auto"`` after it
        could not be one graph); None while it is one training graph."""
        program = self._program
        return program.training if isinstance(program, SegmentedProgram) else None

    def compile(self, *args: Any, **kwargs: Any) -> TrainingProgram:
        """The program for this batch's signature, compiled without training on it: its
        graph built or loaded from the graph cache (padded as ``train_step`` pads the
        batch), or, where the model cannot be one graph, the program it trains as then
        (segments compile on their first step, from a recording forward). Call it with a
        batch of each bucket's length to build before the loop."""
        # padded without the padding proof: it asks for eager's reference step on this
        # batch, which belongs to a step; the first step's proof reads the graph built here
        batch = self.bucketing.pad(self._batch(args, kwargs), train=True).batch
        with self._ctx.on_stream():
            try:
                self._program.prepare(batch)
            except NotOneGraph as exc:
                self._program = SegmentedProgram(self._ctx, exc.cause)
        return self.program

    def train_step(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        """Forward + backward (+ optimizer update at the end of an accumulation window)."""
        if not torch.is_grad_enabled():
            # eager's loss.backward() raises there; refused before anything runs
            raise BatchError(
                "train_step called with gradients off (inside torch.no_grad(), "
                "torch.inference_mode() or torch.set_grad_enabled(False)), where eager's "
                "loss.backward() raises; call it outside, or eval_step for a forward "
                "without an update; nothing was applied"
            )
        with self._ctx.on_stream():
            return self._train_step(args, kwargs)

    def _train_step(self, args: tuple, kwargs: dict) -> torch.Tensor:
        raw = self._batch(args, kwargs)
        try:
            self._ctx.check_trainable()
        except TrainableChangedError as exc:
            if not (exc.requires_grad_only and self._can_lay_out_anew()):
                raise
            self._lay_out_anew(f"parameters changed requires_grad ({exc.changed})")
        self._ctx.take_state_from_torch()  # eager steps after sync_to_module()
        modes = self._ctx.modes_changed()
        if (self._ctx.structure_changed() or modes) and isinstance(self._program, SegmentedProgram):
            old = self._program  # planned with the old modes or modules: planned again
            self._program = SegmentedProgram(self._ctx, old.training.cause, old.blocks)
        self._follow_python_values()
        program = self._program
        micro_step = self._ctx.state.micro_step
        padded = raw
        try:
            if isinstance(program, WholeProgram):
                program.refuse_autocast()
                program.step_started = time.perf_counter()
            padded = self._padded(raw, program)
            if isinstance(program, WholeProgram):
                return program.step(padded, raw)
            return program.step(padded)
        except NotOneGraph as exc:
            own = self._ctx.eager.fails(raw, grad=True)
            if own is not None and not isinstance(own, OrtrainError):
                # the model's own forward fails on this batch (an input eager refuses):
                # said before anything changes, the graphs built so far and the window kept
                hint = _odd_dtypes(raw, self.module)
                raise exc.eager_fails_too(own, type(self.module).__name__, hint) from own
            self._program = SegmentedProgram(self._ctx, exc.cause)
            try:
                return self._program.step(self._padded(raw, self._program))
            except Exception as eager:
                if self._program.training.model is not None:
                    raise
                # eager cannot run this batch either (its recording forward failed):
                # the model's own error, as the build named it, not a fallback's. Nothing
                # ran that adds to the window's sums: its earlier micro-batches stay.
                failed, self._program, self._ctx.segmented = self._program, program, False
                self._ctx.state.micro_step = micro_step
                own = self._ctx.eager.fails(raw) if failed.training.recorded is None else None
                if own is not None and not isinstance(own, OrtrainError):
                    # the model's own forward fails (not ortrain's reading of its output)
                    raise exc.eager_fails_too(own, type(self.module).__name__) from own
                raise exc.error from eager
        except Exception as exc:
            note_failed_step(exc, self.module, raw, padded)
            raise

    def _can_lay_out_anew(self) -> bool:
        """Whether a change of which parameters require grad can be taken here: at an
        accumulation window's start (mid-window the sums so far are laid out for the old
        set), in one process or under data parallel (every rank makes the same change at
        the same step, as its loop does; the new trainer's start checks that they agree).
        Under ZeRO the optimizer state is sharded: not handed to torch, refused."""
        if self._ctx.state.micro_step != 0:
            return False
        return self._ctx.reducer is None or self.options.zero_stage == 0

    def _lay_out_anew(self, what: str) -> None:
        """Layers frozen or unfrozen since the last step: the trainer is made anew over
        the same module and optimizer, as eager goes on (``sync_to_module`` hands the
        weights and the optimizer's state to torch; the new trainer takes the state of the
        parameters it trains and leaves the frozen ones' in ``optimizer.state``, where
        eager keeps it for when they thaw). What it built and loaded so far still counts."""
        cancel = getattr(self._program, "cancel_builds", None)
        if cancel is not None:
            cancel()
        self.sync_to_module()
        old = self._ctx
        scaler = old.state.scaler.state_dict() if old.state.scaler is not None else None
        log, count, hits = old.build_log, old.graphs.count, old.graph_cache.hits
        step = old.state.step
        old.release_optimizer()
        # the old graphs and sessions go before the new trainer measures the process
        del old
        self._program = self._evaluation = self._ctx = None  # type: ignore[assignment]
        gc.collect()
        ORTTrainer.__init__(self, self.module, self.optimizer, self.options, loss_fn=self.loss_fn)
        new = self._ctx
        new.build_log[:0] = log
        new.graphs.count += count
        new.graph_cache.hits += hits
        if scaler is not None and new.state.scaler is not None:
            new.state.scaler.load_state_dict(scaler)
        if new.spec.kind == "sgd":  # its state counts no steps (Adam's: each parameter's)
            new.state.set_counters(max(new.state.step, step), 0)
        warnings.warn(
            f"ortrain: {type(self.module).__name__}: {what}; its graphs and optimizer state "
            "are laid out anew for the parameters that require grad now",
            stacklevel=4,
        )

    def _follow_python_values(self) -> None:
        """Python values the forward reads that the training loop changed since the last
        step (``ProgramContext.values_changed``): graphs built again with them, or, for a
        value changed at a second step, the modules that read it in eager."""
        old = self._program
        if isinstance(old, SegmentedProgram):  # what runs in eager reads them as it goes
            model = old.training.model
            inside = [] if model is None else model.compiled

            def compiled(owner: str) -> bool:
                return owner != LOSS_FN and any(
                    c == "" or owner == c or owner.startswith(c + ".") for c in inside
                )
        else:

            def compiled(owner: str) -> bool:
                return True

        changed = self._ctx.values_changed(compiled)
        if changed is None:
            return
        if isinstance(old, SegmentedProgram):  # planned with the old values: planned again
            unshard = getattr(self._ctx.reducer, "unshard", None)
            if unshard is not None:  # ZeRO-3: on whole parameters, as at the first step
                unshard()
            self._program = SegmentedProgram(self._ctx, old.training.cause, old.blocks)
            return
        if changed.again:
            cause = (
                f"the training loop changes Python values its forward reads ({changed.said}), "
                "which a graph holds at the values its export saw"
            )
            self._program = SegmentedProgram(self._ctx, cause)

    def _padded(self, batch: dict[str, Any], program: WholeProgram | SegmentedProgram) -> dict:
        first = getattr(program, "proof_first", False)  # its proof may come later
        start = getattr(program, "start_early", None)
        whole_if_any = getattr(self._ctx.reducer, "whole_if_any", None)
        if whole_if_any is None or self.bucketing.mode == "off":
            return self.bucketing.pad(
                batch, train=True, prove=program.padding_proof, proof_first=first, start=start
            ).batch
        # ZeRO-3: a rank holds shards; bucketing's eager runs gather every parameter, on
        # every rank at once where any rank needs them (a vote each micro-step)
        needed = self.bucketing.needs_eager(batch, train=True)
        with whole_if_any(needed) as whole:
            if needed and not whole:
                return batch
            return self.bucketing.pad(
                batch, train=True, prove=program.padding_proof, proof_first=first, start=start
            ).batch

    @torch.no_grad()
    def eval_step(self, *args: Any, **kwargs: Any) -> StepOutputs:
        """Forward only in eval mode (no dropout), no update: loss and other outputs
        (host tensors), keyed by name (a mapping's key, ``output_<i>`` for a tuple's
        item) and, inside a tuple, list or dict, by path (``hidden_states.3``)."""
        self._ctx.state.adopt_rebound()  # ``p.data = ...`` since the last step
        if self._ctx.reducer is None:  # (collectives under torch.distributed: train_step's)
            self._ctx.structure_changed()
            self._follow_python_values()  # a value set since the last step: built anew
        batch = self._batch(args, kwargs)
        # ZeRO-3 evaluates in eager (its parameters gathered): no graph to share a length
        zero3 = hasattr(self._ctx.reducer, "whole_if_any")
        padded = Padded(batch) if zero3 else self.bucketing.pad(batch, train=False)
        outputs = self._evaluation.outputs(padded.batch)
        if self._ctx.reducer is None:  # looked at above: what changed since, its forward did
            self._ctx.forward_ran()
        # back to the batch's own length
        return StepOutputs(padded.cut(outputs))

    def apply_update(self) -> None:
        """End the accumulation window now: the optimizer update on the gradients of the
        micro-steps taken so far (an epoch's last, shorter window), scaled as a full window's
        (divided by ``grad_accumulation_steps``, times ``grad_multiplier``)."""
        if self.micro_step == 0:
            return
        self.micro_step = 0  # the in-backward update needs accumulation 1: never open here
        self._ctx.state.take_window_grads()  # a loaded window's sums, if no step took them
        with self._ctx.on_stream():
            self._ctx.apply_update()


def _odd_dtypes(batch: dict[str, Any], module: torch.nn.Module) -> str:
    """The batch's floating inputs of another dtype than the module's parameters (a
    float64 batch from numpy, token ids made float), as a clause of an error."""
    dtype = next((p.dtype for p in module.parameters() if p.is_floating_point()), None)
    odd = [
        f"'{k}' is {v.dtype}"
        for k, v in batch.items()
        if isinstance(v, torch.Tensor) and v.is_floating_point() and v.dtype != dtype
    ]
    if not odd or dtype is None:
        return ""
    return f" (batch input {', '.join(odd)}; the parameters are {dtype})"
