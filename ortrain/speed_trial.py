"""Each training graph timed against eager PyTorch on its first steps; the faster runs.

``TrainerOptions.eager_if_faster``: after a signature's first step on its training graph
(its check against eager, the session's warm-up), its next steps alternate between the
graph and eager PyTorch over the same state (``ortrain/eager_steps.py``: nothing is
copied to switch), ``ROUNDS`` of each after an untimed first eager step (it lends the
optimizer's state to torch's and makes autograd's first buffers, as the graph's first
step pays for its check and warm-up), every one a real training step. Then the median
step decides: eager's where the graph's is over ``MARGIN`` times it, else the graph's
(a tie keeps the graph, whose steps are what the memory plan sized), and that
signature's steps run on the winner from then on.

``eager_if_faster="auto"`` (the default) first asks whether a trial is worth its eager
steps, whose activations can set the process's peak memory where the graph's are
smaller: after ``GATE_STEPS`` timed graph steps it times eager's forward of the same
batch (without gradients, nothing it changes kept: buffers, Python attributes, the
random generator) and estimates eager's step as that forward times the model's own
step-to-forward ratio, measured where the first-step check's forked child timed a warm
eager forward and backward and then a forward without gradients (one thread), or
``FORWARD_SHARE`` without that child (a backward costs about two forwards: the products
of each layer are computed once for the output and twice for the gradients). The ratio
is often well under three (a frozen backbone's backward stops at the head, a small
model's is mostly autograd's own overhead), where three forwards would keep a slower
graph from its trial; it is taken at most three (``SpeedTrial.measured``). The estimate
is never below the child's step over this process's thread count (a floor: no step runs
faster on more threads than perfect scaling); a graph step already faster than ``GATE``
times that floor keeps the graph without timing eager's forward at all. It is not exact
(the forward is timed in the trainer's process, the ratio on one thread), so only a
graph step faster than ``GATE`` times it skips the trial, and never runs an eager step;
a near tie goes to the trial, whose real steps decide. Where eager's step costs more
than the estimate the gate can send a faster graph to a trial it did not need: that
costs the trial's eager steps, their time and activation memory, and the graph stays.

Which steps ran where is fixed (the trial's schedule does not depend on time); what runs
after it does, so two runs agree to float rounding, not bit for bit, where the choice
falls differently.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from typing import TYPE_CHECKING, Any

import torch

from ortrain.eager_steps import EagerSteps
from ortrain.runtime.heap import trim_heap

if TYPE_CHECKING:
    from ortrain.first_step import EagerTimes
    from ortrain.program_context import ProgramContext

ROUNDS = 3  # timed steps of each kind per signature
# eager wins where the graph's median step is slower: a graph slower than eager is what
# the choice is for, and at a tie either route costs the same time
MARGIN = 1.0
GATE_STEPS = 2  # "auto": timed graph steps before it weighs a trial
FORWARD_SHARE = 3.0  # without a measured ratio: a forward, and a backward of about two
# "auto"'s trial: a graph step slower than this times eager's estimate. Under 1 by about
# the estimate's own error (a forward timed in the trainer's process, a ratio timed on one
# thread): a graph within that of eager goes to the trial, whose steps decide
GATE = 0.85


@dataclasses.dataclass
class Trial:
    """One signature's timed steps and, once they are in, the choice."""

    gated: bool = False  # "auto": a trial only where the gate finds the graph slow
    warm: bool = False  # its first graph step (check, warm-up) ran: not timed
    eager_warm: bool = False  # its first eager step ran: not timed either
    graph: list[float] = dataclasses.field(default_factory=list)
    eager: list[float] = dataclasses.field(default_factory=list)
    choice: str = ""  # "graph" or "eager" once decided
    estimate: float | None = None  # gated: eager's step estimated from its forward
    floor: float = 0.0  # gated: what eager's step cannot undercut (``SpeedTrial.measured``)
    share: float = FORWARD_SHARE  # gated: eager's step over its no-grad forward
    floored: bool = False  # gated: kept the graph on the floor alone (``beats_floor``)

    def route(self) -> str:
        if self.choice:
            return self.choice
        if not self.warm or (self.gated and self.estimate is None):
            return "graph"
        return "graph" if len(self.graph) <= len(self.eager) else "eager"

    def weighing(self) -> bool:
        """Gated, with its graph steps in: the gate's estimate is due."""
        due = self.gated and self.estimate is None and not self.choice
        return due and len(self.graph) >= GATE_STEPS

    def gate(self, forward: float) -> None:
        """Eager's forward took ``forward`` seconds: a trial, or the graph for good."""
        self.estimate = max(self.share * forward, self.floor)
        if min(self.graph) <= GATE * self.estimate:
            self.choice = "graph"

    def beats_floor(self) -> bool:
        """Whether the graph is faster than the floor alone says eager can be: the
        estimate is never below the floor, so ``gate`` would keep the graph whatever the
        forward took; it keeps it without timing one (an eager forward's activations
        would set the process's peak memory for nothing)."""
        if self.floor > 0 and min(self.graph) <= GATE * self.floor:
            self.estimate, self.choice, self.floored = self.floor, "graph", True
            return True
        return False

    def record(self, route: str, seconds: float) -> None:
        if self.choice:
            return
        if route == "graph" and not self.warm:
            self.warm = True
            return
        if route == "eager" and not self.eager_warm:
            self.eager_warm = True
            return
        (self.graph if route == "graph" else self.eager).append(seconds)
        if len(self.graph) >= ROUNDS and len(self.eager) >= ROUNDS:
            self.choice = faster(self.graph, self.eager)


def faster(graph: list[float], eager: list[float]) -> str:
    """ "eager" where its median step beats the graph's by more than ``MARGIN``."""
    return "eager" if statistics.median(graph) > MARGIN * statistics.median(eager) else "graph"


class SpeedTrial:
    """Per batch signature: which route its steps take, and the steps' times."""

    def __init__(self, ctx: ProgramContext, gated: bool = False):
        self.eager = EagerSteps(ctx)
        self.gated = gated  # eager_if_faster="auto": the gate first
        self.trials: dict[tuple, Trial] = {}

    def _trial(self, sig: tuple) -> Trial:
        return self.trials.setdefault(sig, Trial(gated=self.gated))

    def route(self, sig: tuple) -> str:
        return self._trial(sig).route()

    def measured(self, sig: tuple, times: EagerTimes) -> None:
        """The first-step check's forked child timed a warm eager forward and backward of
        ``sig``'s first batch and then its forward without gradients, on one thread
        (``first_step.EagerSide.early_reference``): their ratio replaces
        ``FORWARD_SHARE``, and the step over this process's thread count, less than
        eager's step takes here, is the estimate's floor."""
        trial = self._trial(sig)
        trial.floor = times.step / max(torch.get_num_threads(), 1)
        if times.step > 0 and times.forward > 0:
            # at least 1: a step's forward does what the no-grad one does, and more; at
            # most FORWARD_SHARE: a ratio timed on one thread can exceed the one on this
            # process's threads (a convolution's backward gains more from threads than
            # its forward), and an estimate too high keeps a slower graph from its trial,
            # where one too low costs only the trial's steps
            trial.share = min(max(times.step / times.forward, 1.0), FORWARD_SHARE)

    def run(self, sig: tuple, route: str, step: Any, batch: dict[str, Any]) -> torch.Tensor:
        """``batch``'s step on ``route`` (``step`` runs the graph's), timed into its trial."""
        start = time.perf_counter()
        loss = self.eager.step(batch) if route == "eager" else step(batch)
        trial = self._trial(sig)
        trial.record(route, self._seconds(route, time.perf_counter() - start))
        if trial.weighing() and not trial.beats_floor():
            try:
                forward = self._forward_seconds(batch)
            except Exception:  # a forward that needs gradients: nothing to weigh, no trial
                trial.choice = "graph"
            else:
                trial.gate(forward)
        return loss

    def _forward_seconds(self, batch: dict[str, Any]) -> float:
        """Eager's forward of ``batch``, the faster of two (the first warms its caches)."""
        times = []
        for _ in range(2):
            start = time.perf_counter()
            self.eager.look(batch)
            times.append(time.perf_counter() - start)
        trim_heap()  # what the looks allocated is free: not kept resident beside the graph's
        return min(times)

    def _seconds(self, route: str, measured: float) -> float:
        """A step's time as the trial counts it (tests replace this to pin a choice)."""
        return measured

    def summary(self) -> str:
        """One line per signature decided: the two medians and the choice."""
        lines = []
        for sig, t in self.trials.items():
            if not t.choice:
                continue
            if not t.eager and t.estimate is None:  # the gate's forward failed
                lines.append(
                    f"  {_shape_text(sig)}: graph {min(t.graph) * 1e3:.1f} ms a step; eager's "
                    "forward does not run without gradients: runs on the graph (no trial)"
                )
                continue
            if not t.eager:  # the gate kept the graph without a trial (on its fastest step)
                lines.append(
                    f"  {_shape_text(sig)}: graph {min(t.graph) * 1e3:.1f} ms a step, eager's "
                    f"estimated at {t.estimate * 1e3:.1f} ms"
                    f"{' or more (its step on one thread over the threads)' if t.floored else ''}"
                    ": runs on the graph (no trial)"
                )
                continue
            g = statistics.median(t.graph)
            e = statistics.median(t.eager)
            lines.append(
                f"  {_shape_text(sig)}: graph {g * 1e3:.1f} ms, eager {e * 1e3:.1f} ms a step: "
                f"runs {'in eager' if t.choice == 'eager' else 'on the graph'}"
            )
        return "\n".join(lines)


def _shape_text(sig: tuple) -> str:
    """A signature (``whole_graph.signature``) as its tensors' shapes."""
    parts = [f"{k} {list(shape)}" for k, shape, _ in sig if isinstance(shape, tuple)]
    return ", ".join(parts) or "batch"
