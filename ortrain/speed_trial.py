"""Each training graph timed against eager PyTorch on its first steps; the faster runs.

``TrainerOptions.eager_if_faster``: after a signature's first step on its training graph
(its check against eager, the session's warm-up), its next steps alternate between the
graph and eager PyTorch over the same state (``ortrain/eager_steps.py``: nothing is
copied to switch), ``ROUNDS`` of each, every one a real training step. Then the median
step decides: the graph stays unless eager's is faster by more than ``MARGIN`` (the
graph's steps are what the memory plan sized, and the margin keeps a near tie from
flipping between runs), and that signature's steps run on the winner from then on.

``eager_if_faster="auto"`` (the default) first asks whether a trial is worth its eager
steps, whose activations can set the process's peak memory where the graph's are
smaller: after ``GATE_STEPS`` timed graph steps it times eager's forward of the same
batch (without gradients, nothing it changes kept: buffers, Python attributes, the
random generator) and estimates eager's step as ``FORWARD_SHARE`` forwards (a backward
costs about two forwards: the products of each layer are computed once for the output
and twice for the gradients), or as a warm eager forward and backward of the batch in
the first-step check's child (one thread) over the thread count where that is more
(``SpeedTrial.floor``). Only a
graph step slower than ``GATE`` times that estimate goes on to the trial; the trial's own
eager steps decide. A graph that is clearly faster never runs an eager step. Where
eager's step still costs more than the estimate the gate can send a faster graph to a
trial it did not need (three forwards alone sent BERT-tiny's MLM to one in three runs of
five on one machine): that costs the trial's eager steps, their time and activation
memory, and the graph stays.

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

if TYPE_CHECKING:
    from ortrain.program_context import ProgramContext

ROUNDS = 3  # timed steps of each kind per signature
MARGIN = 1.1  # eager wins only when the graph's median step is this much slower
GATE_STEPS = 2  # "auto": timed graph steps before it weighs a trial
FORWARD_SHARE = 3.0  # an eager step as forwards: one forward, a backward of about two
# "auto"'s trial: a graph step slower than this times eager's estimate. No margin here: a
# CNN's eager step is about its three forwards, so a graph 1.1-1.2x slower than eager
# passed a gate of 1.2; the trial's own MARGIN keeps a near tie on the graph
GATE = 1.0


@dataclasses.dataclass
class Trial:
    """One signature's timed steps and, once they are in, the choice."""

    gated: bool = False  # "auto": a trial only where the gate finds the graph slow
    warm: bool = False  # its first graph step (check, warm-up) ran: not timed
    graph: list[float] = dataclasses.field(default_factory=list)
    eager: list[float] = dataclasses.field(default_factory=list)
    choice: str = ""  # "graph" or "eager" once decided
    estimate: float | None = None  # gated: eager's step estimated from its forward
    floor: float = 0.0  # gated: what eager's step cannot undercut (``SpeedTrial.floor``)

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
        self.estimate = max(FORWARD_SHARE * forward, self.floor)
        if min(self.graph) <= GATE * self.estimate:
            self.choice = "graph"

    def record(self, route: str, seconds: float) -> None:
        if self.choice:
            return
        if route == "graph" and not self.warm:
            self.warm = True
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

    def floor(self, sig: tuple, seconds: float) -> None:
        """A warm eager forward and backward of ``sig``'s first batch took ``seconds`` in
        the first-step check's forked child, on one thread
        (``first_step.EagerSide.early_reference``). Over this process's thread count it
        is less than eager's step takes here, and the gate's estimate is never below it:
        an eager step of far more than three forwards (a slow backward, a large optimizer
        step) then does not send a faster graph to a trial."""
        self._trial(sig).floor = seconds / max(torch.get_num_threads(), 1)

    def run(self, sig: tuple, route: str, step: Any, batch: dict[str, Any]) -> torch.Tensor:
        """``batch``'s step on ``route`` (``step`` runs the graph's), timed into its trial."""
        start = time.perf_counter()
        loss = self.eager.step(batch) if route == "eager" else step(batch)
        trial = self._trial(sig)
        trial.record(route, self._seconds(route, time.perf_counter() - start))
        if trial.weighing():
            trial.gate(self._forward_seconds(batch))
        return loss

    def _forward_seconds(self, batch: dict[str, Any]) -> float:
        """Eager's forward of ``batch``, the faster of two (the first warms its caches)."""
        times = []
        for _ in range(2):
            start = time.perf_counter()
            self.eager.look(batch)
            times.append(time.perf_counter() - start)
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
            if not t.eager:  # the gate kept the graph without a trial (on its fastest step)
                assert t.estimate is not None
                lines.append(
                    f"  {_shape_text(sig)}: graph {min(t.graph) * 1e3:.1f} ms a step, eager's "
                    f"estimated at {t.estimate * 1e3:.1f} ms: runs on the graph (no trial)"
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
