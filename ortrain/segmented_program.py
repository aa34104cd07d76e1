"""The model as compiled segments inside eager PyTorch: ``SegmentedProgram``.

Made when the model cannot be one training graph (the cause is reported) or by choice
(cut at its repeated blocks: ``segments="blocks"``, ZeRO-2/3). A step runs the module's
own forward in eager with the segments' graphs inside (``ortrain/segments``), torch's
backward through them, and takes the gradients into the state where the update engines
read them (``ortrain/segments/grads.py``); the update runs after the backward.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Collection
from typing import Any

import torch

from ortrain.core.errors import NonFiniteLossError
from ortrain.optim.from_torch import group_values
from ortrain.program import ProgramSegment, TrainingProgram
from ortrain.program_context import ProgramContext
from ortrain.segments.grads import Reached, bind_grads, take_grads, take_reduced
from ortrain.segments.training import SegmentedTraining
from ortrain.verify import Tolerance


class SegmentedProgram:
    """``ctx``'s model as segments from now on; ``cause``: why it is not one graph."""

    def __init__(self, ctx: ProgramContext, cause: str, blocks: bool = False):
        self.ctx = ctx
        self.blocks = blocks
        ctx.graphs.clear_train()
        options = ctx.options
        self.training = SegmentedTraining(
            ctx.module,
            ctx.loss_fn,
            ctx.segment_settings(),
            lambda graph: ctx.session(graph),
            ctx.run_build,
            ctx.device,
            Tolerance.of(options.mixed_precision) if options.verify else None,
            cause,
            blocks,
            ctx.reducer if hasattr(ctx.reducer, "acquire") else None,  # ZeRO-3
            ctx.eager.stateful,
            # ZeRO-2/3: a step's peak is in its backward (buckets, gathers), so outputs'
            # memory kept from one backward into the next forward adds to no peak; in one
            # process the peak is at the forward's end, where it would (+300 MB at GPT-2
            # small's shape, measured)
            reuse_outputs=getattr(ctx.reducer, "takes_grads", False),
            sink=ctx.reducer if hasattr(ctx.reducer, "add_rows") else None,  # type: ignore[arg-type]
            # as a new batch shape's whole graph is deferred (``eager_if_faster``): in one
            # process (ranks would decide apart on their own times) and full precision
            # (an eager call would run in float32 where its graph runs in half)
            rent_signatures=(
                options.eager_if_faster is not False
                and ctx.reducer is None
                and options.mixed_precision is None
            ),
        )
        ctx.segmented = True
        self._reached: Reached | None = None  # made at the first step (one process)
        if ctx.engine.in_backward:  # the update runs after torch's backward now
            ctx.engine = ctx.choose_engine()
            if ctx.state.grad_params is not None:
                ctx.engine.prepare()

    def describe(self) -> TrainingProgram:
        model = self.training.model
        segments = []
        if model is not None:
            for name, plan in model.plans.items():
                if plan.status == "compiled":
                    n = len(model.runners.get(name, {}))
                    segments.append(ProgramSegment(name, "compiled", n, n))
                else:
                    segments.append(ProgramSegment(name, plan.status, cause=plan.cause))
        return TrainingProgram(tuple(segments), self.ctx.engine.name)

    def memory_plan(self, top: int) -> tuple[None, int]:
        """No whole-model plan; the segments' peak of activation bytes."""
        if self.training.model is None:
            raise RuntimeError("memory_report() needs a compiled graph: run train_step first")
        return None, self.training.model.tally.peak

    def prepare(self, batch: dict[str, Any]) -> None:
        """Segments compile on their first step (a recording forward finds them)."""
        return None

    def padding_proof(self, batch: dict[str, Any], holds: object = None) -> None:
        """No whole training graph to analyse: the eager check decides alone."""
        return None

    def step(self, batch: dict[str, Any]) -> torch.Tensor:
        """A micro-step: eager forward and torch's backward, the segments' graphs inside;
        the update engine as for a graph."""
        ctx, st = self.ctx, self.ctx.state
        named = dict(ctx.module.named_parameters())
        # ZeRO-2 takes each gradient from autograd as it is made (distributed/sharded_grads.py)
        collecting = getattr(ctx.reducer, "collecting", None)
        # the set each window reaches is followed (ZeRO-2/3 take the gradients themselves)
        if collecting is None and self._reached is None:
            self._reached = Reached(named, st.trainable)
        # ZeRO-2/3's update in the backward (``ShardBackwardUpdate``) takes this step's
        # hyperparameters now, and the loss is checked before its backward starts
        begin = getattr(ctx.engine, "begin_micro_step", None)
        if begin is not None:
            begin(group_values(ctx.optimizer, ctx.spec), st.grad_scale(ctx.world_size))
        landing = bool(getattr(ctx.engine, "landing", False))
        self.training.before_backward = self._refuse_nonfinite if landing else None
        if st.micro_step == 0:
            st.zero_grads()  # torch accumulates into .grad: every window starts at 0
            if self._reached is not None:
                self._reached.clear()
        if collecting is None:
            bind_grads(st, named)
        scale = st.scaler.scale if st.scaler is not None else None
        if scale is not None:
            st.loss_scale.fill_(scale)
        try:
            with collecting() if collecting is not None else contextlib.nullcontext():
                loss = self.training.forward_backward(ctx.eager.on_device(batch), scale)
            ctx.forward_ran()  # hooks the module's forward adds as it runs are its own
        except Exception as exc:
            st.micro_step = 0  # the window starts over (its sums are incomplete)
            done = getattr(ctx.engine, "updated_numel", 0) if landing else 0
            if done:
                exc.add_note(
                    f"ortrain: this step's update runs in its backward (ZeRO, "
                    f"update engine {ctx.engine.name!r}): {done} of this rank's parameter "
                    "elements had taken it when the step failed"
                )
            raise
        agreed: set[str] | None = None
        if collecting is None:
            agreed = self._agreed()
            take_grads(st, named, ctx.lay_out, self._widen, agreed)
        else:
            take_reduced(st, ctx.reducer.reached, ctx.lay_out)  # type: ignore[union-attr]
        st.loss.copy_(loss)
        if agreed is not None and st.micro_step + 1 == ctx.options.grad_accumulation_steps:
            st.unreached = frozenset(set(st.grad_params or ()) - agreed)
            if st.unreached:
                ctx.update_in_eager(f"this step does not reach {_some(st.unreached)}")
        try:
            # in the dtype a graph reports it in (a float64 target promotes eager's loss);
            # a model whose parameters are not float32 trains in eager: in eager's
            dtype = loss.dtype if ctx.dtype_cause else st.loss.dtype
            return ctx.end_micro_step(loss.detach().to(dtype, copy=True))
        finally:
            st.unreached = frozenset()

    def _refuse_nonfinite(self, loss: torch.Tensor) -> None:
        """Before a backward that updates as it goes: a NaN/Inf loss on any rank stops
        the step on every rank (one all-reduce), before any gradient or update; where
        ``check_finite`` is off, nothing is checked."""
        ctx = self.ctx
        if not ctx.options.check_finite:
            return
        bad = not math.isfinite(float(loss))
        if not ctx.reducer.comm.any(bad):  # type: ignore[union-attr]
            return
        ctx.refuse_nonfinite(loss)  # this rank's own
        st = ctx.state
        st.window_grads, st.micro_step = None, 0
        raise NonFiniteLossError(
            f"the loss of another rank is NaN or infinite at optimizer step "
            f"{int(st.step_tensor)}; the update was not applied and parameters/optimizer "
            "state are unchanged"
        )

    def _agreed(self) -> set[str]:
        """The parameters this window reached on any rank (one all-reduce of a mask under
        data parallel or ZeRO-1; in one process, its own)."""
        assert self._reached is not None
        names = self._reached.names
        comm = getattr(self.ctx.reducer, "comm", None)
        if comm is None:
            return set(names)
        trainable = self.ctx.state.trainable
        mask = torch.tensor([1.0 if n in names else 0.0 for n in trainable])
        comm.all_reduce(mask)
        return {n for n, v in zip(trainable, mask.tolist(), strict=True) if v > 0}

    def _widen(self, extra: list[str]) -> None:
        """This step reaches ``extra``, which no step before did: the update in eager, and
        the gradients laid out for them too."""
        ctx, st = self.ctx, self.ctx.state
        ctx.update_in_eager(f"this step reaches {_some(extra)}, which the first did not")
        known = set(st.grad_params or ()) | set(extra)
        ctx.lay_out([n for n in st.trainable if n in known])


def _some(names: Collection[str]) -> str:
    """A few of ``names`` (a layer's parameters share its prefix), and how many."""
    shown = sorted(names)[:3]
    more = f" and {len(names) - len(shown)} more" if len(names) > len(shown) else ""
    return f"parameters {', '.join(shown)}{more}"
