"""The whole model as one training graph per batch signature: ``WholeProgram``.

A step finds (or builds, or loads from the graph cache) its batch's training graph
(``ortrain/whole_graph.py``), binds it to the state by role (``runtime/binder.py``), checks
its first step against eager (``ortrain/first_step.py``) and runs it; the update runs
inside the graph or after it (``ProgramContext.end_micro_step``).

Where the model cannot be one graph (an export or gradient error, a graph ONNX Runtime
refuses, a first step that disagrees with eager) a step raises ``NotOneGraph`` with the
cause, and the trainer compiles the model into segments instead (fallback "auto"); with
fallback "off" the error itself is raised.
"""

from __future__ import annotations

import contextlib
import os
import time
import warnings
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any, NoReturn

import torch

from ortrain.background_build import PENDING, BackgroundBuild, collect_build, start_build
from ortrain.build import BuiltGraph
from ortrain.core.errors import (
    BatchError,
    ExportError,
    LossShapeError,
    PassError,
    VerificationError,
    first_line,
)
from ortrain.core.names import GradientError, UpdateInBackwardError
from ortrain.core.optimizer_spec import EAGER
from ortrain.deferred_builds import DEFERRED, DeferredBuilds
from ortrain.eager_steps import unsupported
from ortrain.first_step import PendingReference
from ortrain.forked import ForkedJob, can_fork
from ortrain.optim.from_torch import group_values
from ortrain.program import ProgramSegment, TrainingProgram
from ortrain.program_context import ProgramContext
from ortrain.python_state import describe
from ortrain.runtime.binder import bind_training_graph
from ortrain.runtime.heap import available_bytes, trim_heap
from ortrain.runtime.session import CudaGraphCaptureError, UnbindableError, register_cpu_arena
from ortrain.speed_trial import SpeedTrial
from ortrain.step_errors import failed_in_onnxruntime, from_onnxruntime, run_failed
from ortrain.verify import EagerStep, compare, module_of, report
from ortrain.whole_graph import CompiledGraph, NotOneGraph, signature, without_sizes

if TYPE_CHECKING:
    from ortrain.graph_passes.memory.memory_plan import MemoryReport


# the build beside the check's child only with this much free memory: that many copies
# of the model's tensors (its gradients and a graph's in each child) and a spare
BESIDE_MODEL_COPIES = 6
BESIDE_SPARE = 1 << 30


def _nothing() -> None:
    pass


def _cores() -> int:
    """The cores this process's training may use: those it may run on, at most torch's
    thread count (a user who runs several trainings side by side, one thread each,
    gives none of them a second core to build on)."""
    try:
        allowed = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        allowed = os.cpu_count() or 1
    return min(allowed, torch.get_num_threads())


class WholeProgram:
    """The training graphs of ``ctx.graphs`` run as the model's program."""

    def __init__(self, ctx: ProgramContext):
        self.ctx = ctx
        self.graphs = ctx.graphs
        # eager's step on a batch whose graph ``padding_proof`` built just before its step
        # (taken before the build, as the step takes it: ``_early_reference``)
        self._references: dict[tuple, EagerStep] = {}
        # graphs built beside their eager reference step (``_build_beside``), by signature:
        # (the settings they were built with, the result or what the build raised)
        self._prebuilt: dict[tuple, tuple[Any, Any]] = {}
        self._fresh: set[tuple] = set()  # built anew at their next build (not the cache's)
        # graphs and their eager reference steps started before the step knows it takes
        # them (``start_early``), by signature: (the reference, the build, its settings)
        self._started: dict[tuple, tuple[PendingReference, ForkedJob | None, Any]] = {}
        self.started_early = self.dropped_early = 0  # graphs so started, and so dropped
        # graphs built while steps run in eager (TrainerOptions.background_build)
        self.background: BackgroundBuild | None = None
        if ctx.options.background_build:
            why = unsupported(ctx)
            if why:
                raise ValueError(f"TrainerOptions.background_build=True: {why}")
            self.background = BackgroundBuild(ctx)
        # each graph timed against eager on its first steps (TrainerOptions.eager_if_faster)
        self.trial: SpeedTrial | None = None
        chosen = ctx.options.eager_if_faster
        if chosen is not False:
            why = unsupported(ctx)
            if why and chosen is True:
                raise ValueError(f"TrainerOptions.eager_if_faster=True: {why}")
            # "auto": where eager steps can stand in, a gated trial; not for an optimizer
            # whose own step runs in eager, whose time the gate's estimate (eager's
            # forward) leaves out while the graph's steps include it
            if not why and (chosen is True or ctx.spec.kind != EAGER):
                self.trial = SpeedTrial(ctx, gated=chosen == "auto")
        # a new shape's steps in eager until they have lost a build's time
        # (``ortrain/deferred_builds.py``); the background build has its own eager steps
        self.deferred: DeferredBuilds | None = None
        if chosen is not False and self.background is None and not unsupported(ctx):
            self.deferred = DeferredBuilds(ctx)
        # a padded shape whose padding proof (its graph) was deferred: the next step's
        # unpadded batch runs in eager, its time counted to that shape
        self._rent_as: tuple[tuple, dict[str, Any]] | None = None
        self.step_started: float | None = None  # the trainer's step, before its padding
        self._saved_priced = 0.0  # the graph cache's saved build seconds priced so far
        # a deferred shape's graph, once due, built in a forked child while its steps
        # go on in eager (on one thread fewer), as ``background_build`` builds every one
        self._aside: BackgroundBuild | None = None

    @property
    def proof_first(self) -> bool:
        """Whether a layout's padding proof is asked before its eager check (its graph
        may come later: built in the background, or deferred while its batches run
        unpadded in eager), rather than its graph started before the check."""
        deferring = self.deferred is not None and self.deferred.build_seconds is not None
        return self.background is not None or deferring

    def describe(self) -> TrainingProgram:
        graphs = list(self.graphs.train.values())
        checked = sum(c.verified and not c.unchecked for c in graphs)
        whole = ProgramSegment("", "graph", len(graphs), checked)
        return TrainingProgram((whole,), self.ctx.engine.name)

    def memory_plan(self, top: int) -> tuple[MemoryReport, int]:
        """The first training graph's memory plan (its ``top`` largest tensors) and its
        activation bytes."""
        if not self.graphs.train:
            raise RuntimeError("memory_report() needs a compiled graph: run train_step first")
        from ortrain.graph_passes.memory.memory_plan import memory_report

        graph = memory_report(next(iter(self.graphs.train.values())).model, top=top)
        return graph, graph.arena_peak_bytes

    def step(self, batch: dict[str, Any], unpadded: dict[str, Any] | None = None) -> torch.Tensor:
        """A micro-step of ``batch`` on its training graph (in eager while it builds in the
        background: ``ortrain/background_build.py``, or while its shape's eager steps
        have not lost a build's time: ``ortrain/deferred_builds.py``). ``unpadded``: the
        batch as given, where bucketing padded it (what an eager step runs)."""
        # a build's cost is the whole step's: bucketing's checks may run beside its child
        started, self.step_started = self.step_started, None
        if self._in_background(batch):
            return self.background.eager_step(batch)  # type: ignore[union-attr]
        sig = signature(batch)
        deferred = self.deferred
        as_padded, self._rent_as = self._rent_as, None
        raw = batch if unpadded is None else unpadded
        if deferred is not None and as_padded is not None:  # its padding proof deferred
            return deferred.step(*as_padded, raw, beside=self._aside is not None)
        if deferred is not None and self._defers(sig, batch):
            return deferred.step(sig, batch, raw, beside=self._aside is not None)
        route = self.trial.route(sig) if self.trial is not None else "graph"
        start, count = started or time.perf_counter(), self.graphs.count
        if self.trial is not None:  # the graph or eager, whichever steps faster
            loss = self.trial.run(sig, route, self._graph_step, batch)
        else:
            loss = self._graph_step(batch)
        if deferred is not None and route == "graph":
            built = self.graphs.count > count or not deferred.stepped(sig)
            seconds = time.perf_counter() - start
            if built:  # a graph the cache held: what its build took where it was made
                # prices the next shape's, which the cache does not hold (loads since the
                # last such step: bucketing may have taken it before this step began)
                cache = self.graphs.cache
                seconds += cache.saved_seconds - self._saved_priced
                self._saved_priced = cache.saved_seconds
            deferred.graph_step(sig, batch, seconds, built)
        return loss

    def _defers(self, sig: tuple, batch: dict[str, Any]) -> bool:
        """Whether ``batch``'s step runs in eager instead of building its graph: a shape
        with no graph, none building for it, and its eager steps short of a build's time.
        Only another size of a signature built already (same inputs, dtypes, ranks and
        Python values): what else makes a new graph (a changed value, a mode) has its
        own rules, and the graphs' step times say nothing of its cost."""
        if self.graphs.has_train(batch) or sig in self._started or sig in self._prebuilt:
            return False
        if self.ctx.state.grad_params is None:  # (the first graph: always built)
            return False
        sized = without_sizes(sig)
        if not any(without_sizes(s) == sized for s, _ in self.graphs.train):
            return False
        if self.deferred is None or self.graphs.cache.holds_train(batch, self.ctx.settings()):
            return False  # (a load away: taken now)
        self._take_aside()
        if self.graphs.has_train(batch):  # (arrived just now)
            return False
        if self._aside is not None:  # one build aside at a time: eager until it arrives
            return True
        # built aside (a forked child on one of the cores, the steps in eager on the
        # others meanwhile), a build costs the steps at most its time over the cores
        cores = _cores()
        aside = cores > 1 and can_fork([*self.ctx.state.params.values()])
        if self.deferred.rents(sig, batch, cores if aside else 1):
            return True
        if not aside:
            return False
        self._aside = BackgroundBuild(self.ctx)
        self._aside.start(batch)
        return True

    def _take_aside(self) -> None:
        """The graph built aside (``_defers``), bound once it has arrived."""
        aside = self._aside
        if aside is None:
            return
        try:
            with self._build_errors():
                arrived = aside.arrived()
        except UpdateInBackwardError:  # built again here, for the engine chosen now
            if self.ctx.engine.in_backward:  # the engine may not change: the refusal stands
                raise
            arrived = None
        if aside.building:
            return
        self._aside = None
        if arrived is not None:
            self._bind(arrived.batch, arrived.rows, arrived.built, arrived.hit)
            if self.deferred is not None:
                self.deferred.arrived(signature(arrived.batch))

    def cancel_builds(self) -> None:
        """Drop the builds running in forked children (the trainer is laid out anew)."""
        for build in (self.background, self._aside):
            if build is not None:
                build.cancel()
        self._aside = None

    def refuse_autocast(self) -> None:
        """A step inside the user's ``torch.autocast`` computes in autocast's dtypes in
        eager; a graph computes in those it was built for. Segments run such a step in
        eager (``segments/calls.py``), so the model trains as segments from here on.
        Asked before the batch is padded, whose proof may build a graph."""
        device = self.ctx.device.type
        if not torch.is_autocast_enabled(device):
            return
        why = (
            f"train_step runs inside torch.autocast({device!r}, "
            f"{torch.get_autocast_dtype(device)}), whose casts a graph does not make: steps "
            "inside it run in eager PyTorch, as without ortrain (for compiled half precision, "
            "call train_step outside autocast with TrainerOptions(mixed_precision=...))"
        )
        if self.ctx.options.fallback == "off":
            raise ExportError(f"{type(self.ctx.module).__name__}: {why}")
        raise NotOneGraph(why, ExportError(why))

    def _graph_step(self, batch: dict[str, Any]) -> torch.Tensor:
        """A micro-step of ``batch`` on its training graph (built or loaded here unless
        it is; its first step checked against eager)."""
        ctx, st = self.ctx, self.ctx.state
        if hooked := ctx.grad_hooked():
            self._runs_grad_hooks(hooked)
        reference = self._references.pop(signature(batch), None) or self._early_reference(batch)
        if ctx.eager.lazily_built:  # a cache the first call sizes: the state takes it
            ctx.eager.lazily_built = False
            st.adopt_rebound()
        # before the first graph: every rank takes the same path (a collective)
        if ctx.options.verify and st.grad_params is None:
            if ctx.eager.any_rank(bool(reference is not None and ctx.eager.stateful)):
                self._keeps_python_state()
        failed: NotOneGraph | VerificationError | None = None
        try:
            compiled, keep = self._checked_graph(batch, reference)
        except (NotOneGraph, VerificationError) as exc:
            failed = exc
        comm = getattr(ctx.reducer, "comm", None)
        # ranks build graphs of their own batches' shapes, at steps of their own: whether a
        # graph failed its build or check is voted every micro-step (one all-reduce), so
        # that every rank leaves the graphs together, as on the first step
        if comm is not None and comm.any(failed is not None) and failed is None:
            failed = self._elsewhere()
        if failed is not None:
            raise failed
        try:
            compiled.session.run()
        except CudaGraphCaptureError:  # its own message; the session restored the state
            raise
        except Exception as exc:
            # A partial run may have written into the gradients: the window starts again
            # (its first micro-step zeroes them); parameters and optimizer state are untouched
            # unless the update runs in the backward and got that far.
            discarded, st.micro_step = st.micro_step, 0
            updated, n = ctx.engine.applied()
            raise run_failed("training", batch, exc, updated, n, discarded) from exc
        del keep
        for new, buffer in compiled.buffer_updates:  # as eager: every micro-step updates
            buffer.copy_(new)
        return ctx.end_micro_step(st.loss.clone())

    def _checked_graph(
        self, batch: dict[str, Any], reference: EagerStep | None
    ) -> tuple[CompiledGraph, object]:
        """``batch``'s training graph, built or loaded unless it is, its batch bound (and
        what keeps the binding), its first step checked against eager."""
        ctx, st = self.ctx, self.ctx.state
        for attempt in range(2):  # a cached graph that disagrees with eager is built anew
            fresh = attempt > 0
            compiled = None if fresh else self.graphs.find_train(batch, borrow=True)
            if compiled is None:
                compiled = self._build(batch, fresh, reference if ctx.options.verify else None)
            keep = compiled.bind_batch(batch, ctx.device)
            if ctx.options.grad_accumulation_steps > 1 and st.micro_step == 0:
                st.zero_grads()
            if st.scaler is not None:
                st.loss_scale.fill_(st.scaler.scale)
            if ctx.engine.in_backward:  # this step's hyperparameters go into the graph
                ctx.engine.before_run(group_values(ctx.optimizer, ctx.spec))
            if compiled.verified or not ctx.options.verify:
                return compiled, keep
            checked = self._checks_out(compiled, batch, reference if attempt == 0 else None)
            # eager's gradients and the check's copies, the model's size each, are freed:
            # the heap hands their pages back rather than holding them for the run
            reference = None
            trim_heap()
            if checked:
                return compiled, keep
            if compiled.graph.specialized:
                warnings.warn(
                    "ortrain: a graph made from the symbolic export of its batch signature's "
                    "sizes disagrees with eager on its first step; exporting it at its own "
                    "sizes (and the signature's later sizes too)",
                    stacklevel=5,
                )
                continue
            if not compiled.cache_hit:
                raise AssertionError("unreachable: _checks_out raises for a built graph")
            warnings.warn(
                "ortrain: a graph from the graph cache disagrees with eager on its first step "
                "(what the forward reads changed since it was stored); building it again",
                stacklevel=5,
            )
        raise AssertionError("unreachable: a graph built anew is checked or raises")

    def _elsewhere(self) -> NotOneGraph | VerificationError:
        """What a rank whose graph is fine raises where another rank's failed."""
        bad = "another rank's training graph failed its build or its first step's check"
        if self.ctx.options.fallback == "off":
            return VerificationError(bad)
        return NotOneGraph(bad, VerificationError(bad))

    def prepare(self, batch: dict[str, Any]) -> CompiledGraph:
        """``batch``'s training graph, built (or loaded) unless it is; bound, not run (its
        first step is checked against eager as any graph's)."""
        return self.graphs.find_train(batch) or self._build(batch)

    def padding_proof(
        self, batch: dict[str, Any], holds: Mapping[str, float | None] | None = None
    ) -> tuple[str, str]:
        """Whether padding reaches the loss of ``batch``'s training graph (built here if
        it is not: the step runs on it next, with eager's reference step taken before the
        build as a step takes it); a graph where it does is dropped. ``holds``: what the
        padding of tensors bucketing learned holds (proven here, on the export kept)."""
        compiled = self.graphs.find_train(batch)
        # a graph built before for a batch of this shape (unpadded at this length, or padded
        # from another): its proof holds for any real length (``padding.prove``)
        lent = compiled is not None
        if compiled is None and self.background is not None:
            if self._in_background(batch):
                return PENDING  # this batch runs unpadded, in eager, until its graph arrives
            compiled = self.graphs.find_train(batch)  # arrived just now
        if compiled is None and self._defers(signature(batch), batch):
            # its steps run unpadded in eager, their time counted to this padded shape
            self._rent_as = (signature(batch), batch)
            return DEFERRED
        if compiled is None:  # (built aside for this padded shape, arrived just now)
            compiled = self.graphs.find_train(batch)
        if compiled is None:
            reference = self._early_reference(batch)
            compiled = self._build(batch, reference=reference)
            if reference is not None:
                self._references[signature(batch)] = reference
        proof = compiled.graph.padding if holds is None else self._learned_proof(batch, holds)
        if proof[0] == "mixes" and not lent:  # (a lent graph still serves its own batches)
            self.graphs.forget_train(compiled, batch)
            self._references.pop(signature(batch), None)
        return proof

    def _learned_proof(self, batch: dict[str, Any], holds: Mapping[str, float | None]) -> tuple:
        from ortrain.bucketing import pad_token_id
        from ortrain.build import padding_proof, training_view
        from ortrain.export import ExportedForward

        forward = self.graphs.forwards.get(signature(batch))
        if forward is None:
            return ("", "")
        ex = training_view(ExportedForward.from_wire(forward.wire))
        return padding_proof(batch, ex, pad_token_id(self.ctx.module), holds)

    def _in_background(self, batch: dict[str, Any]) -> bool:
        """Whether ``batch`` runs in eager while a graph builds: a build that arrived is
        taken first; one is started for ``batch`` where none is running and it has no
        graph."""
        bg = self.background
        if bg is None:
            return False
        try:
            with self._build_errors():
                arrived = bg.arrived()
        except UpdateInBackwardError:  # built again, for the engine chosen now
            if self.ctx.engine.in_backward:  # the engine may not change: the refusal stands
                raise
            arrived = None
        if arrived is not None:
            self._bind(arrived.batch, arrived.rows, arrived.built, arrived.hit)
        if self.graphs.find_train(batch) is not None:
            return False
        if not bg.building:
            if not bg.can_start():
                return False
            bg.start(batch)
        return True

    def _build(
        self, batch: dict[str, Any], fresh: bool = False, reference: EagerStep | None = None
    ) -> CompiledGraph:
        """``batch``'s training graph built (or loaded), given a session, bound by role;
        ``reference``: eager's step on it, whose reached parameters the graph must reach."""
        ctx = self.ctx
        sig = signature(batch)
        fresh = fresh or sig in self._fresh
        self._fresh.discard(sig)
        prebuilt = self._prebuilt.pop(sig, None)
        while True:  # twice at most: the settings change with the engine
            try:
                with self._build_errors():
                    settings = ctx.settings()
                    if prebuilt is not None and not fresh and prebuilt[0] == settings:
                        result, prebuilt = prebuilt[1], None
                        if isinstance(result, Exception):
                            raise result
                        rows, built, hit = result
                    else:
                        rows, built, hit = self.graphs.build_train(batch, settings, fresh)
                break
            except UpdateInBackwardError:
                if ctx.engine.in_backward:  # the engine may not change: the refusal stands
                    raise
        if ctx.options.verify and ctx.state.grad_params is None:
            self._reaches_what_eager_reaches(built, reference)
        return self._bind(batch, rows, built, hit)

    def _reaches_what_eager_reaches(self, built: BuiltGraph, reference: EagerStep | None) -> None:
        """Before the first graph lays out the gradients: a parameter eager's backward
        reaches (a custom autograd.Function's backward may reach one the export saw read
        under no_grad only) that the graph computes no gradient for fails its check, on
        every rank if on one (a collective)."""
        bad = []
        if reference is not None:
            # (a parameter that requires grad in no param group gets eager's gradient and
            # no update: nothing that trains reads it)
            trained = set(self.ctx.state.trainable)
            grads = reference[1]  # (keys first: a value may be read from a file)
            eager = {n: grads[n] for n in grads if n not in built.grad_params and n in trained}
            bad = compare({}, eager, self.ctx.eager.tol.grad)
        if self.ctx.eager.any_rank(bool(bad)):
            what = f"{type(self.ctx.module).__name__}'s training graph"
            mods = {m.name: module_of(m.name) for m in bad}
            self._disagrees(
                report(what, bad, mods, limit=3) if bad else "another rank's graph reaches fewer"
            )

    @contextlib.contextmanager
    def _build_errors(self) -> Iterator[None]:
        """A build's errors as the program takes them: a graph that cannot be made
        (``NotOneGraph``, fallback "auto"), and an update that cannot run in its backward
        (re-raised after choosing the engine that runs it after the session)."""
        ctx = self.ctx
        try:
            yield
        except LossShapeError:
            raise  # eager's backward() refuses that loss too: no segment would train it
        except (ExportError, GradientError, PassError) as exc:
            if ctx.options.fallback == "off":
                raise
            raise NotOneGraph(f"{type(exc).__name__}: {first_line(exc)}", exc) from exc
        except UpdateInBackwardError as exc:
            # "auto" takes the update after the session where the graph cannot run it
            # (choose_engine raises the refusal where the engine may not change)
            ctx.engine = ctx.choose_engine(refused=exc)
            warnings.warn(
                f"ortrain: the optimizer update runs after the session: {exc}", stacklevel=7
            )
            raise

    def _bind(
        self, batch: dict[str, Any], rows: tuple, built: BuiltGraph, hit: bool
    ) -> CompiledGraph:
        """A built training graph given a session and bound to the state by role."""
        ctx = self.ctx
        if ctx.device.type == "cpu":  # sized by this graph, before the update's session
            register_cpu_arena(built.planned_peak_bytes)
        self._reach(built, batch)  # the first graph's lays out the gradients and the update
        try:
            with ctx.graph_cache.session_stage("train"):
                session = ctx.session(built, graph_capture=True)
        except Exception as exc:
            if ctx.options.fallback == "off" or not from_onnxruntime(exc):
                raise
            # a graph ONNX Runtime refuses (a kernel it lacks for these types): segments
            raise NotOneGraph(f"ONNX Runtime refused the graph: {first_line(exc)}", exc) from exc
        try:
            updates = bind_training_graph(session, built, ctx.state, ctx.engine, ctx.dropout_on)
        except UnbindableError as exc:
            if ctx.options.fallback == "off":
                raise
            # a tensor ONNX Runtime cannot take (a complex one the graph does not take as its
            # real view): the modules that read it in eager
            raise NotOneGraph(f"{type(exc).__name__}: {first_line(exc)}", exc) from exc
        static = {} if ctx.options.cuda_graph else None
        compiled = CompiledGraph.of(
            session, built, batch, static_batch=static, buffer_updates=updates, cache_hit=hit
        )
        self.graphs.add_train(batch, rows, compiled)
        return compiled

    def _reach(self, built: BuiltGraph, batch: dict[str, Any]) -> None:
        """The parameters a training graph reaches: the first graph's set lays out the
        gradients and the update (every rank the same set); later graphs reach it too."""
        st, reducer = self.ctx.state, self.ctx.reducer
        grad_params = sorted(built.grad_params, key=st.trainable.index)
        if not grad_params:
            error = BatchError(
                "the loss of this batch depends on no parameter that requires grad (it has "
                "no grad_fn: eager's loss.backward() raises on it; or, with fallback='off', "
                "only its export lost them); nothing was applied"
            )
            if self.ctx.options.fallback != "off" and self.ctx.eager.loss_requires_grad(batch):
                # the export computes the loss from no parameter where eager's autograd
                # reaches some (torch.norm(x, p=0), a fill_ of what they made): eager's
                # own step, which gives them no gradient or zeros as its ops do
                raise NotOneGraph(
                    "its graph computes the loss from no parameter, which eager's autograd reaches",
                    error,
                )
            raise error
        if st.grad_params is None and reducer is not None:  # before any gradient moves
            from ortrain.distributed.fingerprint import agree_on_graph

            agree_on_graph(reducer.comm, built, grad_params)  # type: ignore[attr-defined]
        if st.grad_params is None:
            self.ctx.lay_out(grad_params)
        elif grad_params != st.grad_params:
            error = BatchError(
                "this batch reaches a different set of parameters than the first one "
                f"({sorted(set(grad_params) ^ set(st.grad_params))}); one training graph "
                "lays out one set"
            )
            if self.ctx.options.fallback == "off":
                raise error
            # segments: torch's autograd gives the parameters a step does not reach no
            # gradient, as eager does (a loop over a batch's values, a branch on its shape)
            raise NotOneGraph(str(error), error)

    def _early_reference(self, batch: dict[str, Any]) -> EagerStep | None:
        """Eager's step on ``batch`` for the first-step check where this signature's first
        graph is due (``first_step.EagerSide.early_reference``), with the graph built
        beside it where it is due too (``_build`` takes it); else None."""
        if not self.ctx.options.verify or self.graphs.has_train(batch):
            return None
        gated = self.trial is not None and self.trial.gated
        started = self._started.pop(signature(batch), None)
        if started is not None:
            pending, job, settings = started
            if job is not None:
                self._collect(batch, job, settings)
        else:
            beside = self.background is None and _cores() > 1 and self._room_beside()
            pending = self.ctx.eager.start_reference(batch, timed=gated, beside=beside)
            if pending.forked and beside:
                self._build_beside(batch)
        # "auto"'s gate: eager's step and forward timed warm in the same child
        reference, times = pending.finish() if gated else (pending.finish(), None)
        if times is not None:
            self.trial.measured(signature(batch), times)  # type: ignore[union-attr]
        if pending.lazy and self._prebuilt.pop(signature(batch), None) is not None:
            # built beside from the first call's branch, and stored so: built anew
            self._fresh.add(signature(batch))
        return reference

    def _room_beside(self) -> bool:
        """Whether the machine's free memory holds the build's child beside the check's:
        each may write the model's size a few times over (eager's gradients, the graph's
        initializers), and one after the other never needs both at once."""
        st = self.ctx.state
        model = sum(t.nbytes for t in (*st.params.values(), *st.buffers.values()))
        free = available_bytes()
        return free is None or free > BESIDE_MODEL_COPIES * model + BESIDE_SPARE

    def start_early(self, batch: dict[str, Any]) -> Callable[[], None]:
        """``batch``'s eager reference step and training graph started now, each in a
        forked child, while this process still works out whether the step runs on
        ``batch`` (bucketing's eager check and length trace of a padded batch: Python on
        one core while the build's child takes the other). ``padding_proof`` takes them;
        the function returned drops them where the step does not."""
        sig = signature(batch)
        if (
            not self.ctx.options.verify
            or self.background is not None
            or sig in self._started
            or self.graphs.has_train(batch)
            or _cores() < 2
            or not can_fork([*self.ctx.state.params.values(), *self.ctx.state.buffers.values()])
            or not self._room_beside()
        ):
            return _nothing
        gated = self.trial is not None and self.trial.gated
        pending = self.ctx.eager.start_reference(batch, timed=gated, beside=True)
        job, settings = None, self.ctx.settings()
        if pending.forked:  # (where eager's step cannot fork, neither can the build)
            job = start_build(self.ctx, batch)
            self.started_early += 1
        self._started[sig] = (pending, job, settings)

        def drop() -> None:
            if self._started.get(sig) is not None and self._started[sig][0] is pending:
                del self._started[sig]
                if job is not None:
                    job.cancel()
                    self.dropped_early += 1
                if pending.job is not None:
                    pending.job.cancel()

        return drop

    def _collect(self, batch: dict[str, Any], job: ForkedJob, settings: Any) -> None:
        """A graph ``start_early`` started, waited for: ``_build`` takes it (or raises
        what its build raised) as one built beside."""
        try:
            result: Any = collect_build(self.ctx, batch, job)
        except Exception as exc:
            result = exc
        self._prebuilt[signature(batch)] = (settings, result)

    def _build_beside(self, batch: dict[str, Any]) -> None:
        """``batch``'s training graph built (its own forked child) while eager's reference
        step runs in another: two cores' work at once. Its result, or what the build
        raised, waits for ``_build`` (which raises it where it would have run it)."""
        settings = self.ctx.settings()
        try:
            result: Any = self.graphs.build_train(batch, settings)
        except Exception as exc:
            result = exc
        self._prebuilt[signature(batch)] = (settings, result)

    def _checks_out(
        self, compiled: CompiledGraph, batch: dict[str, Any], reference: EagerStep | None = None
    ) -> bool:
        """The graph's first step against eager (``ortrain/first_step.py``), its batch
        bound. True: it agrees. False: a cached graph disagrees (build it again). A graph
        built here that disagrees raises: ``NotOneGraph`` (fallback "auto") or
        ``VerificationError``."""
        ctx = self.ctx
        compiled.unchecked = ctx.eager.unchecked(compiled.graph)
        try:
            bad = compiled.unchecked or ctx.eager.check(
                compiled.graph,
                compiled.session,
                batch,
                ctx.state,
                ctx.engine,
                ctx.dropout_on,
                reference,
            )
        except Exception as exc:
            # eager ran this step (the check takes its step first) and the graph's run
            # failed (a kernel's limit torch does not have: ConvTranspose's output_padding
            # at or past its stride); the check put back what the run wrote
            if ctx.options.fallback == "off" or not failed_in_onnxruntime(exc):
                raise
            self.graphs.forget_train(compiled, batch)
            raise NotOneGraph(
                f"ONNX Runtime could not run the graph: {first_line(exc)}", exc
            ) from exc
        compiled.unchecked = compiled.unchecked or ctx.eager.trusted
        if compiled.unchecked or not bad:
            compiled.verified = True
            return True
        self.graphs.forget_train(compiled, batch)
        if compiled.cache_hit:
            return False
        if compiled.graph.specialized:  # built anew from an export of its own sizes
            self.graphs.drop_family(batch, first_line(str(bad)))
            return False
        self._disagrees(bad)

    def _runs_grad_hooks(self, hooked: list[str]) -> NoReturn:
        """Parameters with gradient hooks: their gradients must come through torch's
        autograd, where the hooks run (compiled segments inside it)."""
        some = ", ".join(hooked[:4]) + (f" and {len(hooked) - 4} more" if len(hooked) > 4 else "")
        bad = (
            f"parameter(s) {some} carry gradient hooks (register_hook or "
            "register_post_accumulate_grad_hook), which a graph's gradients would bypass"
        )
        if self.ctx.options.fallback == "off":
            raise VerificationError(
                f"{bad}; fallback='auto' trains the model as compiled segments inside torch's "
                "autograd, where the hooks run"
            )
        raise NotOneGraph(bad, VerificationError(bad))

    def _keeps_python_state(self) -> NoReturn:
        """The forward changes Python attributes on every call: a graph would keep the
        values the export saw (``ortrain/python_state.py``)."""
        ctx = self.ctx
        said = describe(ctx.eager.stateful, type(ctx.module).__name__)
        bad = (
            f"its forward changes Python state or a buffer's shape from call to call ({said}), "
            "which a graph would hold at the values its export saw"
        )
        if ctx.options.fallback == "off":
            raise VerificationError(
                f"{bad}; fallback='auto' runs the modules that own them in eager PyTorch"
            )
        raise NotOneGraph(bad, VerificationError(bad))

    def _disagrees(self, bad: str) -> NoReturn:
        """A graph built here disagrees with eager: ``NotOneGraph`` (fallback "auto") or
        ``VerificationError``."""
        hint = (
            "The exporter or a gradient rule changed what the model computes; "
            "fallback='auto' trains such a model as compiled segments and eager PyTorch"
        )
        if self.ctx.options.fallback == "off":
            raise VerificationError(f"{bad}. {hint}")
        cause = f"its first step disagrees with eager: {bad}"
        raise NotOneGraph(cause, VerificationError(f"{bad}. {hint}"))
