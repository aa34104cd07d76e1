"""Eager PyTorch beside the graphs: the first step of every training graph checked against
it, and what evaluation falls back to.

``EagerSide`` holds what an eager run of the model needs (the module, the loss, the
device) and runs it three ways:

1. ``early_reference``: eager's loss and gradients of a batch, taken before its graph is
   built, in a forked child where the process can fork (as the builds): an eager step's
   activations would otherwise set the training process's peak (the graph's is lower),
   and the memory a process frees stays with it;
2. ``check``: a training graph's first step (its batch bound) against that reference
   (``ortrain/verify.py``), every tensor the step writes put back afterwards; a graph
   that draws random numbers eager cannot reproduce is trusted, with a warning;
3. ``outputs``: what an evaluation graph returns, computed in eval mode.

What a mismatch means (rebuild a cached graph, segments, or an error) is the caller's.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
import warnings
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, Literal, overload

import torch
from torch.utils import _pytree as pytree

from ortrain.core.names import DROPOUT_OPS, IN_BACKWARD_STATES, state_key
from ortrain.eager_grads import grads_of
from ortrain.export import LossFn, call_arguments, other_outputs, step_loss
from ortrain.forked import ForkedJob, can_fork
from ortrain.python_state import changed_every_call, kept, random_states_kept
from ortrain.spill import loaded_on_read
from ortrain.verify import (
    EagerStep,
    Tolerance,
    as_float64,
    eager_loss_and_grads,
    graph_step_mismatches,
    in_mode,
    lost_dropout,
    module_of,
    no_dropout,
    report,
    restoring,
)

if TYPE_CHECKING:
    from ortrain.build import BuiltGraph
    from ortrain.runtime.session import BoundSession
    from ortrain.runtime.training_state import TrainingState
    from ortrain.runtime.update_engines import UpdateEngine


@dataclasses.dataclass(frozen=True)
class EagerTimes:
    """Seconds of one warm eager step's forward and backward and of a forward without
    gradients, timed one after the other in the first-step check's child (one thread)."""

    step: float
    forward: float


class PendingReference:
    """An early reference under way (``EagerSide.start_reference``): ``finish()`` waits
    for its child where one runs, builds in this process the buffers the child's first
    call built lazily, and returns the reference (with the child's ``EagerTimes`` when
    ``timed``); ``lazy``: whether it built any."""

    def __init__(
        self,
        eager: EagerSide,
        batch: Mapping[str, Any],
        timed: bool,
        job: ForkedJob | None = None,
        ran: tuple[EagerStep, dict[str, str]] | None = None,
    ):
        self.eager, self.batch, self.timed = eager, batch, timed
        self.job, self.ran = job, ran
        self.lazy = False
        self._done: tuple[EagerStep | None, EagerTimes | None] | None = None

    @property
    def forked(self) -> bool:
        """Whether a child computes it (so a build can run beside it)."""
        return self.job is not None

    def finish(self) -> Any:
        if self._done is None:
            reference, seconds = None, None
            try:
                if self.job is not None:
                    reference, found, lazy, seconds = self.job.result()
                    if reference is not None:
                        reference = (reference[0], loaded_on_read(reference[1]), *reference[2:])
                    if lazy:  # built in the child: build them here too, before the export
                        self.eager._build_lazy_buffers(self.batch)
                        self.lazy = True
                elif self.ran is not None:
                    reference, found = self.ran
                else:
                    found = {}
                self.eager.stateful.update(found)
            except Exception:
                reference = None
            self._done = (reference, seconds)
        return self._done if self.timed else self._done[0]


class EagerSide:
    """Eager runs of ``module`` on ``device``; ``any_rank(flag)`` makes a check's outcome
    every rank's (a collective; the identity in one process)."""

    def __init__(
        self,
        module: torch.nn.Module,
        loss_fn: LossFn | None,
        device: torch.device,
        tol: Tolerance,
        *,
        exact: bool,
        half: torch.dtype | None = None,
        any_rank: Callable[[bool], bool] = bool,
    ):
        self.module = module
        self.loss_fn = loss_fn
        self.device = device
        self.tol = tol
        self.exact = exact  # float32 graphs: mismatches get a float64 second look
        self.half = half  # mixed precision's dtype: mismatches get a look under autocast
        self.any_rank = any_rank
        self.seconds = 0.0  # first-step checks so far
        self.trusted = ""  # why the last check compared nothing (eager's unfixed draws)
        # the scalar attributes the forward changes on every call, by owning module
        # (``ortrain/python_state.py``): found by the first early reference
        self.stateful: dict[str, str] = {}
        # buffers the first call built anew at another shape, built in this process too
        # (``_build_lazy_buffers``): the training state takes them before the export
        self.lazily_built = False

    def on_device(self, batch: Mapping[str, Any]) -> dict[str, Any]:
        """``batch`` with its tensors where the module is: eager PyTorch (the checks, the
        segments, eager evaluation) does not move a host batch as the graphs' binding does."""
        return {
            k: v.to(self.device, non_blocking=True)
            if isinstance(v, torch.Tensor) and v.device != self.device
            else v
            for k, v in batch.items()
        }

    def loss_of(
        self, batch: Mapping[str, Any], module: torch.nn.Module, look: bool = True
    ) -> torch.Tensor:
        """Eager PyTorch's loss of ``batch`` through ``module`` (the trainer's, or a float64
        copy of it: the batch's floating tensors follow its dtype); ``look``: one of
        ortrain's own runs, on copies of the batch's tensors (a forward that changes its
        input in place changes the caller's only in the step eager would take)."""
        batch = self.on_device(copied(batch) if look else batch)
        if any(p.dtype == torch.float64 for p in module.parameters()):
            batch = as_float64(batch)
        args, kwargs = call_arguments(module, batch)
        with in_mode(module, True):  # what the training graph computes
            out = module(*args, **kwargs)
            return step_loss(out, batch, self.loss_fn)

    @overload
    def early_reference(self, batch: Mapping[str, Any]) -> EagerStep | None: ...

    @overload
    def early_reference(
        self, batch: Mapping[str, Any], timed: Literal[True]
    ) -> tuple[EagerStep | None, EagerTimes | None]: ...

    def early_reference(self, batch: Mapping[str, Any], timed: bool = False) -> Any:
        """Eager's step on ``batch`` (case 1): ``start_reference`` waited for."""
        return self.start_reference(batch, timed).finish()

    def start_reference(
        self, batch: Mapping[str, Any], timed: bool = False, beside: bool = False
    ) -> PendingReference:
        """Eager's step on ``batch`` (case 1), started; ``finish()`` returns it. ``beside``:
        a build runs while the child does (``finish`` waits for it after the build); else
        it is waited for here. The child runs on one thread (OpenMP's team does not
        survive a fork). None where eager fails on the batch: the check then runs
        after the build, in this process, where errors are named as before. ``timed``:
        with the seconds of a second eager forward and backward in the child, warm (the
        first pays for first-call allocations) and as a step runs it (the check's runs
        fix their random draws through a dispatch mode), and of a forward without
        gradients after it (``EagerTimes``); None where no child ran them."""
        module = self.module
        names = [n for n, p in module.named_parameters() if p.requires_grad]

        def again() -> None:  # a second forward: what changes on every call
            # with grad: a forward may take gradients itself (a penalty, on this call only)
            with restoring(list(module.buffers())), no_dropout():
                self.loss_of(batch, module)

        def run() -> EagerStep:
            return eager_loss_and_grads(lambda: self.loss_of(batch, module), module, names)

        def step() -> tuple[EagerStep, dict[str, str]]:
            return changed_every_call(module, run, again, self.loss_fn)

        def warm() -> EagerTimes | None:  # as a step's: no check's machinery, nothing put back
            try:
                start = time.perf_counter()
                loss = self.loss_of(batch, module, look=False)
                wrt = [p for p in module.parameters() if p.requires_grad]
                if wrt and loss.requires_grad:
                    grads_of([loss], wrt)
                step = time.perf_counter() - start
            except Exception:  # the reference stands; the gate goes without these times
                return None
            forwards = []
            try:
                for _ in range(2):  # as the gate times them: the faster of two
                    start = time.perf_counter()
                    with torch.no_grad():  # as the gate's forward runs (``EagerSteps.look``)
                        self.loss_of(batch, module)
                    forwards.append(time.perf_counter() - start)
            except Exception:  # a forward that needs gradients: the step's time alone
                return EagerTimes(step=step, forward=0.0)
            return EagerTimes(step=step, forward=min(forwards))

        def forked() -> tuple[EagerStep, dict[str, str], list[str], EagerTimes | None]:
            reference, found, lazy = step()
            return reference, found, lazy, warm() if timed else None

        if can_fork([*module.parameters(), *module.buffers()]):
            try:
                # eager's gradients stay in the child's spill file until compared, one
                # at a time: never a second copy of the model's size in this process
                job = ForkedJob(forked, what="the first step's eager check", spill=True)
            except Exception:
                return PendingReference(self, batch, timed)
            pending = PendingReference(self, batch, timed, job=job)
            if not beside:
                pending.finish()  # waited for here, as before a build
            return pending
        try:
            reference, found, _ = step()  # built here already
        except Exception:
            return PendingReference(self, batch, timed)
        return PendingReference(self, batch, timed, ran=(reference, found))

    def _build_lazy_buffers(self, batch: Mapping[str, Any]) -> None:
        """One forward of ``batch`` that leaves only what a first call builds lazily: a
        buffer put in anew at another shape (a cache sized on the first call) stays, every
        other buffer, the Python attributes and the random generators are put back. So
        the export sees the module as eager's second step does, and holds the branch of
        every later call, not the first call's rebuild."""
        module = self.module
        modules = dict(module.named_modules())

        def buffers() -> dict[tuple[str, str], torch.Tensor]:
            own = ((n, k, b) for n, m in modules.items() for k, b in m._buffers.items())
            return {(n, k): b for n, k, b in own if b is not None}

        old = {key: tuple(b.shape) for key, b in buffers().items()}
        with (
            restoring(list(module.buffers())),
            kept(module, self.loss_fn),  # would put the new buffers back too: kept below
            random_states_kept(),
            no_dropout(),
        ):
            self.loss_of(batch, module)
            built = {
                key: b for key, b in buffers().items() if old.get(key, tuple(b.shape)) != b.shape
            }
        for (name, key), b in built.items():
            modules[name]._buffers[key] = b
        self.lazily_built = bool(built)

    def fails(self, batch: Mapping[str, Any], grad: bool = False) -> Exception | None:
        """What eager PyTorch's own forward of ``batch`` raises, if anything (no hooks of
        ortrain's, the buffers and Python attributes put back); without autograd unless
        ``grad`` (a forward that differentiates inside needs it)."""
        module = self.module
        try:
            with (
                restoring(list(module.buffers())),
                kept(module, self.loss_fn),
                torch.set_grad_enabled(grad),
            ):
                self.loss_of(batch, module)
        except Exception as exc:
            return exc
        return None

    def loss_requires_grad(self, batch: Mapping[str, Any]) -> bool:
        """Whether eager's loss of ``batch`` has a ``grad_fn`` (eager's ``backward()`` runs
        on it), the buffers and Python attributes put back."""
        module = self.module
        with restoring(list(module.buffers())), kept(module, self.loss_fn), torch.enable_grad():
            return bool(self.loss_of(batch, module).requires_grad)

    def unchecked(self, graph: BuiltGraph) -> str:
        """Why ``graph`` cannot be compared with eager ("" where it can): it draws random
        numbers no switch fixes (a Multinomial), which eager draws otherwise. It is
        trusted, with a warning."""
        drawn = sorted(set(graph.unfixed_draws))
        if not drawn:
            return ""
        return self._trust(f"it draws random numbers ({', '.join(drawn)})")

    def _trust(self, why: str) -> str:
        warnings.warn(
            f"ortrain: {type(self.module).__name__}'s training graph is not checked against "
            f"eager: {why}, which eager draws otherwise",
            stacklevel=7,
        )
        return why

    def check(
        self,
        graph: BuiltGraph,
        session: BoundSession,
        batch: Mapping[str, Any],
        state: TrainingState,
        engine: UpdateEngine,
        dropout_on: torch.Tensor,
        reference: EagerStep | None = None,
    ) -> str:
        """The first step of ``graph`` (run by ``session``, its batch bound) against eager
        (case 2): "" where it agrees, else what disagrees (on this rank: ranks build
        graphs of their own batches' shapes at steps of their own; the program votes)."""
        self.trusted = ""
        names = list(state.grad_params or [])
        # at loss scale 1: a dynamic scale's first steps may overflow, which is no mismatch
        written = [state.loss_scale, *session.written_in_place().values()]
        hyper: list[torch.Tensor] = []
        if engine.in_backward:
            # the update with lr 0 and beta1 0 leaves the parameters and writes each
            # gradient into exp_avg; every moment is put back afterwards
            hyper = engine.hyper  # type: ignore[attr-defined]
            moments = [state.opt_state[state_key(s, p)] for p in names for s in IN_BACKWARD_STATES]
            written += [*hyper, *(state.params[p] for p in names), *moments]
            grads = {p: state.opt_state[state_key("exp_avg", p)] for p in names}
        else:
            written += [state.grads[p] for p in names]
            grads = {p: state.grads[p] for p in names}

        def run() -> None:  # inside the check: what it changes is put back after
            state.loss_scale.fill_(1.0)
            for t in hyper:
                t[0] = 0.0  # lr
                t[1] = 0.0  # beta1
                t[4] = 0.0  # weight decay
            if not engine.in_backward:
                for g in grads.values():
                    g.zero_()
            session.run()

        # every parameter the optimizer trains: one the graph computes no gradient for
        # (read only where the export saw no_grad) must get none in eager either. One that
        # requires grad in no param group gets eager's gradient and no update: nothing
        # that trains reads it
        trained = set(names)
        others = state.trainable
        bad, draws, seconds = graph_step_mismatches(
            lambda module: self.loss_of(batch, module),
            self.module,
            run,
            names + [n for n in others if n not in trained],
            lambda: grads,
            written,
            dropout_on,
            self.tol,
            state.loss,
            exact=self.exact,
            reference=reference,
            half=None if self.half is None else (self.device.type, self.half),
        )
        self.seconds += seconds
        if draws.unverified:  # eager drew what no check can fix: trusted, as said
            self.trusted = self._trust(f"it draws random numbers ({', '.join(draws.unverified)})")
            return ""
        drawn = sum(op in DROPOUT_OPS for op, _ in graph.random_ops)
        lost = lost_dropout(draws.dropouts, drawn)
        if not bad and lost is None:
            return ""
        what = f"{type(self.module).__name__}'s training graph"
        bad = [*bad, lost] if lost is not None else bad
        return report(what, bad, {m.name: module_of(m.name) for m in bad}, limit=3)

    def outputs(self, batch: Mapping[str, Any], check: bool = False) -> dict[str, torch.Tensor]:
        """What an evaluation graph returns, from eager PyTorch in eval mode (case 3);
        ``check``: a look to compare a graph with, which advances no Python attribute
        (an evaluation run in eager does, as eager's own)."""
        module = self.module
        keep = kept(module, self.loss_fn) if check else contextlib.nullcontext()
        with in_mode(module, False), keep:  # every sub-module's mode as it was after
            args, kwargs = call_arguments(module, self.on_device(copied(batch) if check else batch))
            out = module(*args, **kwargs)
            loss = step_loss(out, batch, self.loss_fn)
        found = {"loss": loss, **dict(other_outputs(out))}
        return {k: v.detach().to("cpu", copy=True) for k, v in found.items()}


def copied(batch: Mapping[str, Any]) -> dict[str, Any]:
    """``batch`` with its tensors (nested ones too) copied, for a run of ortrain's own."""
    return pytree.tree_map_only(torch.Tensor, torch.clone, dict(batch))
