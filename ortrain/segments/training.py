"""A training step of a model that runs as segments (``partition.SegmentedModel``).

The trainer falls back to this when the whole model cannot be one training graph: its
forward runs in eager PyTorch with the planned sub-modules compiled, its loss's backward
runs through torch autograd (the segments' backward graphs inside), and the parameter
gradients land in ``.grad``, which the trainer points at the state's gradient buffers so
every update engine reads them where it always does.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
import warnings
from collections.abc import Callable, Mapping
from typing import Any

import torch

from ortrain.core.build_config import BuildConfig
from ortrain.core.errors import BatchError, LossShapeError
from ortrain.export import LossFn, call_arguments, step_loss
from ortrain.first_step import copied
from ortrain.segments.blocks import repeated_blocks
from ortrain.segments.calls import Call
from ortrain.segments.param_reads import ParamReads
from ortrain.segments.partition import (
    Plan,
    Recorded,
    SegmentedModel,
    SessionFactory,
    eager_share,
    plan_segments,
    record_calls,
)
from ortrain.segments.pooled_loss import pooled_cross_entropy
from ortrain.segments.runner import ParamHome, RowsSink
from ortrain.verify import Tolerance, in_mode, no_kv_cache

Runner = Callable[[Callable[[], Any], Mapping[str, Any]], Any]  # the trainer's _run_build


class SegmentedTraining:
    """Plan (on the first batch) and run the segmented model's forward and backward."""

    def __init__(
        self,
        module: torch.nn.Module,
        loss_fn: LossFn | None,
        config: BuildConfig,
        session: SessionFactory,
        run_build: Runner,
        device: torch.device,
        tol: Tolerance | None,
        cause: str,
        blocks: bool = False,
        home: ParamHome | None = None,
        stateful: Mapping[str, str] | None = None,
        reuse_outputs: bool = False,
        sink: RowsSink | None = None,
        rent_signatures: bool = False,
    ):
        self.module = module
        self.loss_fn = loss_fn
        self.config = config
        self.session = session
        self.run_build = run_build
        self.device = device
        self.tol = tol
        self.cause = cause  # why the whole model is not one graph
        # cut at the repeated blocks by choice (segments="blocks", ZeRO-2), not a fallback
        self.blocks = repeated_blocks(module) if blocks else None
        self.home = home  # ZeRO-3's sharded parameters (``runner.ParamHome``)
        self.sink = sink  # ZeRO-2/3's reducer: takes a tied table's gradient in pieces
        # the graphs' outputs made over memory earlier ones gave back (``ReusePool``)
        self.reuse_outputs = reuse_outputs
        # modules whose forward changes their Python attributes on every call: eager
        self.stateful = dict(stateful or {})
        self.model: SegmentedModel | None = None
        self.recorded: Recorded | None = None
        self.plan_seconds = 0.0
        self.verify_seconds = 0.0
        self.step_seconds = 0.0  # forward + backward of the steps so far
        self.steps = 0
        # called with the loss before its backward (an update in the backward must not
        # start on a loss the step will refuse)
        self.before_backward: Callable[[torch.Tensor], None] | None = None
        self.pooled_losses = 0  # cross-entropies computed over pooled buffers (``pooled_loss``)
        self.route_losses = True  # until a step's routed losses were too small to gain
        # a compiled module's new call signatures run in eager until a build pays
        # (``SegmentedModel._rents``)
        self.rent_signatures = rent_signatures

    def loss(self, batch: Mapping[str, Any]) -> torch.Tensor:
        """The training step's forward's loss, in the modes the user gave the module (as a
        training graph computes it)."""
        args, kwargs = call_arguments(self.module, batch)
        with no_kv_cache(self.module), in_mode(self.module, True):
            out = self.module(*args, **kwargs)
            return step_loss(out, batch, self.loss_fn)

    def _plan_job(self, only: str | None = None, call: Call | None = None) -> Callable[[], Plan]:
        recorded = self.recorded
        assert recorded is not None
        if only is not None and call is not None:
            recorded = Recorded({only: [call]}, {only: [True]}, {}, 0.0, twice=recorded.twice)
        module, config, session = self.module, self.config, self.session
        device, tol, blocks = self.device, self.tol, self.blocks or frozenset()
        stateful = self.stateful

        def job() -> Plan:
            with no_kv_cache(module):
                return plan_segments(
                    module,
                    recorded,
                    config,
                    session,
                    device,
                    tol,
                    only,
                    blocks=blocks,
                    stateful=stateful,
                )

        return job

    def plan(self, batch: Mapping[str, Any]) -> None:
        start = time.perf_counter()
        # ZeRO-2/3: which parameters eager code reads (ZeRO-3 cannot shard them; autograd
        # makes their gradient, so the reducer takes it from there)
        watch = self.home is not None or self.sink is not None
        reads = ParamReads(self.module) if watch else None
        with reads if reads is not None else contextlib.nullcontext():
            # a look on copies: a forward changing its input in place changes the caller's
            # tensor only in the step itself
            self.recorded = record_calls(self.module, lambda: self.loss(copied(batch)))
        plan = self.run_build(self._plan_job(), batch)
        self.verify_seconds += plan.verify_seconds

        def replan(name: str, call: Call, training: bool) -> Plan:
            new = self.run_build(self._plan_job(name, call), batch)
            self.verify_seconds += new.verify_seconds
            return new

        self.model = SegmentedModel(
            self.module, plan, self.session, self.device, replan, self.home, self.reuse_outputs
        )
        self.model.rent_signatures = self.rent_signatures
        # the planned calls' tensors (every sub-module's inputs) are not needed again
        self.recorded = dataclasses.replace(self.recorded, calls={})
        if self.sink is not None and reads is not None:
            eager = set(self.model.uncompiled_parameters())
            eager |= set(reads.outside(self.model.compiled))
            self.model.route_rows(self.sink, eager)
        if self.home is not None and reads is not None:
            self._keep_whole(self.model, reads)
            # the first step's own forward and backward run sharded, their gathers
            # prefetched along the recorded forward's calls (and the backward's, reversed)
            modules, compiled = dict(self.module.named_modules()), set(self.model.compiled)
            order = [n for n in self.recorded.order if n in compiled]
            self.home.planned([modules[n] for n in order], [self._backward_reads(n) for n in order])
        self.plan_seconds = time.perf_counter() - start
        # a new signature's build is priced at the plan's time per graph until one is timed
        self.model.plan_price = self.plan_seconds / max(1, len(plan.graphs))
        if self.blocks is None or self.model.fallbacks:  # a fallback, or one in the cut
            warnings.warn(self.summary(), stacklevel=6)  # the user's train_step call

    def _backward_reads(self, name: str) -> list[torch.Tensor]:
        """The parameters of module ``name`` its compiled backwards read (any signature)."""
        assert self.model is not None
        module = self.module.get_submodule(name)
        params = dict(module.named_parameters())
        read = set()
        for runner in self.model.runners.get(name, {}).values():
            if runner is not None:
                read |= runner.backward_params
        return [params[p] for p in sorted(read)]

    def _keep_whole(self, model: SegmentedModel, reads: ParamReads) -> None:
        """ZeRO-3: the parameters eager code reads stay whole on every rank (said once)."""
        assert self.home is not None
        params = dict(self.module.named_parameters())
        eager = set(model.uncompiled_parameters()) | set(reads.outside(model.compiled))
        whole = sorted(n for n in eager if params[n].requires_grad)  # frozen: never sharded
        self.home.keep_whole(whole)
        if not whole:
            return
        mib = sum(params[n].numel() * params[n].element_size() for n in whole) / 2**20
        causes = "; ".join(f"{p.name}: {p.cause}" for p in model.fallbacks)
        warnings.warn(
            f"ortrain: ZeRO-3 keeps {len(whole)} parameter(s) whole on every rank "
            f"({mib:.1f} MiB), because eager code reads them: {', '.join(whole[:8])}"
            f"{' ...' if len(whole) > 8 else ''}"
            f"{f' (in eager: {causes})' if causes else ''}",
            stacklevel=7,
        )

    def summary(self) -> str:
        """One line per fallback: the module, the cause, the eager share of the forward."""
        assert self.model is not None and self.recorded is not None
        name = type(self.module).__name__
        share = eager_share(self.model.plans, self.recorded.total)
        why = (
            f"is cut at its repeated blocks ({self.cause})"
            if self.blocks is not None
            else f"does not compile as one graph ({self.cause})"
        )
        lines = [
            f"ortrain: {name} {why}; it trains as "
            f"{len(self.model.compiled)} compiled segment(s) inside eager PyTorch, "
            f"{share:.0%} of its forward's time in eager:"
        ]
        for p in self.model.fallbacks:
            what = "runs in eager" if p.status == "eager" else "split into its children"
            lines.append(f"  {p.name}: {what}: {p.cause}")
        for p in self.model.plans.values():
            if p.unchecked:
                lines.append(f"  {p.name}: compiled, not checked against eager: {p.unchecked}")
        if not self.model.compiled:
            lines.append("  (no sub-module could be compiled: the model trains in eager)")
        return "\n".join(lines)

    def forward_backward(self, batch: Mapping[str, Any], scale: float | None) -> torch.Tensor:
        """The step's loss; its backward has run (gradients in ``.grad``)."""
        if self.model is None:
            self.plan(batch)
        assert self.model is not None
        start = time.perf_counter()
        self.model.tally.held = 0  # what an earlier step saved is gone with its graph
        # a forward that differentiates its outputs again keeps eager's own cross-entropy;
        # after the first step, only a model whose loss gained from the pool keeps it
        pool = self.model.loss_pool if self.route_losses else None
        if self.recorded is None or self.recorded.twice:
            pool = None
        with self.model.active(), pooled_cross_entropy(pool) as route:
            loss = self.loss(batch)
            if route is not None:
                self.pooled_losses += route.calls
                self.route_losses = route.worth_it()
            if loss.dim() != 0:
                raise LossShapeError(
                    "the loss must be a scalar (0-dim or one element) tensor, got "
                    f"{list(loss.shape)} (eager's backward() needs one element too)"
                )
            if not loss.requires_grad:  # eager's backward() raises on it too
                raise BatchError(
                    "the loss of this batch depends on no parameter that requires grad (it "
                    "has no grad_fn: eager's loss.backward() raises on it); no gradient was "
                    "taken and no update applied"
                )
            self.model.settle_routes()  # (a signature built in this forward may change them)
            if self.before_backward is not None:
                self.before_backward(loss)
            try:
                (loss * scale if scale is not None else loss).backward()
            finally:
                self.model.tied.clear()
        self.step_seconds += time.perf_counter() - start
        self.steps += 1
        return loss.detach()

    def explain(self) -> str:
        """The segments with their time: compiled ones (graph runs) and the eager rest."""
        if self.model is None or self.recorded is None:
            return "(segmented: nothing planned yet)"
        rows = [f"segments of {type(self.module).__name__} ({self.cause}):"]
        for name in self.model.compiled:
            p = self.model.plans[name]
            note = f"; not checked: {p.unchecked}" if p.unchecked else ""
            if rented := self.model.eager_calls(name):
                note += f"; {rented} call(s) of new signatures in eager"
            rows.append(f"  compiled  {name} ({len(p.graphs)} graph(s), {p.calls} call(s){note})")
        for p in self.model.fallbacks:
            rows.append(f"  {p.status:<9} {name_or_root(p.name)}: {p.cause}")
        compiled = self.model.compiled_seconds()
        total = self.step_seconds or 1e-9
        rows.append(
            f"  steps {self.steps}: {self.step_seconds:.3f} s forward+backward, "
            f"{compiled:.3f} s in compiled graphs ({compiled / total:.0%}), the rest in eager; "
            f"planning {self.plan_seconds:.2f} s (checks against eager {self.verify_seconds:.2f} s)"
        )
        return "\n".join(rows)


def name_or_root(name: str) -> str:
    return name or "(the model)"
