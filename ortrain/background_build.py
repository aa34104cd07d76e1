"""Training graphs built in a forked child while the steps run in eager PyTorch.

``TrainerOptions.background_build``: a step whose batch has no training graph yet starts
that graph's build in a forked child (``ortrain/forked.py``, as every build runs, but not
waited for) and runs in eager PyTorch over the trainer's own state
(``ortrain/eager_steps.py``); so do the steps after it whose batch has no graph, until the
build has arrived. One build at a time, on one core at the lowest priority; the eager
steps run on the other cores. The first step after it arrived takes it (its session,
its binding by role), and the steps of its signature run on it from then on, its first one
checked against eager as any graph's. The padding proof of a bucketed layout waits for its
graph the same way: its batches run unpadded in eager until then.

Which steps ran in eager depends on how long a build takes, so two runs agree to float
rounding, not bit for bit.
"""

from __future__ import annotations

import dataclasses
import os
from typing import TYPE_CHECKING, Any

import torch

from ortrain.eager_steps import EagerSteps
from ortrain.forked import IN_PROCESS_ENV, ForkedJob, can_fork

if TYPE_CHECKING:
    from ortrain.build import BuiltGraph, ForwardSource
    from ortrain.program_context import ProgramContext

# The build's child (one thread) runs at the lowest priority on the core the eager steps
# leave it (``eager_step``): it takes nothing from anything else running.
NICE = 19
# what a padding proof says while its graph is still building
PENDING = ("pending", "its training graph is building")


@dataclasses.dataclass
class Arrived:
    """A build that ended: the batch it was started for and what it made."""

    batch: dict[str, Any]
    rows: tuple
    built: BuiltGraph
    hit: bool  # loaded from the graph cache


def start_build(ctx: ProgramContext, batch: dict[str, Any], nice: int = 0) -> ForkedJob:
    """``batch``'s training graph (built, or loaded from the graph cache) started in a
    forked child, not waited for; ``collect_build`` takes its result."""
    job = ctx.graphs.train_job(batch, ctx.settings())
    cache, parent = ctx.graph_cache, os.getpid()

    def in_child() -> tuple[ForwardSource, tuple, BuiltGraph, bool, float | None]:
        forked = os.getpid() != parent  # (run here instead where the child failed)
        if forked:
            os.environ[IN_PROCESS_ENV] = "1"  # the child is the build's process
        hits, saved = cache.hits, cache.saved_seconds
        forward, rows, built = job()
        # a hit's counts, for the parent to add (where it ran here, they are added)
        moved = cache.saved_seconds - saved if forked else None
        return forward, rows, built, cache.hits > hits, moved

    return ForkedJob(in_child, what="building the ONNX graph", nice=nice)


def collect_build(
    ctx: ProgramContext, batch: dict[str, Any], job: ForkedJob
) -> tuple[tuple, BuiltGraph, bool]:
    """What ``start_build`` built (waited for), adopted as ``graphs.build_train`` adopts
    its own: (label rows, graph, whether it came from the graph cache). Raises what the
    build raised."""
    forward, rows, built, hit, saved = job.result()
    if hit and saved is not None:  # counted in the child
        ctx.graph_cache.hits += 1
        ctx.graph_cache.saved_seconds += saved
    return ctx.graphs.adopt_train(batch, forward, rows, built, hit)


class BackgroundBuild:
    """At most one training graph building in a forked child; eager steps meanwhile."""

    def __init__(self, ctx: ProgramContext):
        self.ctx = ctx
        self.eager = EagerSteps(ctx)
        self._job: ForkedJob | None = None
        self._batch: dict[str, Any] | None = None

    @property
    def building(self) -> bool:
        return self._job is not None

    def can_start(self) -> bool:
        """Whether a build may go to a forked child now (not where CUDA started, or
        ``ORTRAIN_BUILD_IN_PROCESS=1``): else the step builds and waits, as without the
        option."""
        st = self.ctx.state
        return can_fork([*st.params.values(), *st.buffers.values()])

    def start(self, batch: dict[str, Any]) -> None:
        self._batch = batch
        self._job = start_build(self.ctx, batch, nice=NICE)

    def arrived(self) -> Arrived | None:
        """The build started before, if it has ended (else None, at once); raises what the
        build raised."""
        job, batch = self._job, self._batch
        if job is None or batch is None or not job.done():
            return None
        self._job = self._batch = None
        rows, built, hit = collect_build(self.ctx, batch, job)
        return Arrived(batch, rows, built, hit)

    def wait(self) -> None:
        """Until the running build (if any) has ended; the next step takes it."""
        if self._job is not None:
            self._job.result_ready()

    def eager_step(self, batch: dict[str, Any]) -> torch.Tensor:
        """A step in eager PyTorch beside the build: on one thread fewer, the build's core
        (OpenMP's team would otherwise wait at every barrier for the thread that lost its
        core to the build: slower than one thread fewer)."""
        threads = torch.get_num_threads()
        torch.set_num_threads(max(1, threads - 1))
        try:
            return self.eager.step(batch)
        finally:
            torch.set_num_threads(threads)

    def cancel(self) -> None:
        if self._job is not None:
            self._job.cancel()
        self._job = self._batch = None

    def __del__(self) -> None:  # a trainer let go mid-build: its child is not wanted
        try:
            self.cancel()
        except Exception:  # (interpreter shutdown: os may be half gone)
            pass
