"""Each training graph timed against eager PyTorch on its first steps; the faster runs.

``TrainerOptions.eager_if_faster``: after a signature's first step on its training graph
(its check against eager, the session's warm-up), its next steps alternate between the
graph and eager PyTorch over the same state (``ortrain/eager_steps.py``: nothing is
copied to switch), ``ROUNDS`` of each, every one a real training step. Then the median
step decides: the graph stays unless eager's is faster by more than ``MARGIN`` (the
graph's steps are what the memory plan sized, and the margin keeps a near tie from
flipping between runs), and that signature's steps run on the winner from then on.

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


@dataclasses.dataclass
class Trial:
    """One signature's timed steps and, once they are in, the choice."""

    warm: bool = False  # its first graph step (check, warm-up) ran: not timed
    graph: list[float] = dataclasses.field(default_factory=list)
    eager: list[float] = dataclasses.field(default_factory=list)
    choice: str = ""  # "graph" or "eager" once decided

    def route(self) -> str:
        if self.choice:
            return self.choice
        if not self.warm:
            return "graph"
        return "graph" if len(self.graph) <= len(self.eager) else "eager"

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

    def __init__(self, ctx: ProgramContext):
        self.eager = EagerSteps(ctx)
        self.trials: dict[tuple, Trial] = {}

    def route(self, sig: tuple) -> str:
        return self.trials.setdefault(sig, Trial()).route()

    def run(self, sig: tuple, route: str, step: Any, batch: dict[str, Any]) -> torch.Tensor:
        """``batch``'s step on ``route`` (``step`` runs the graph's), timed into its trial."""
        start = time.perf_counter()
        loss = self.eager.step(batch) if route == "eager" else step(batch)
        self.trials.setdefault(sig, Trial()).record(
            route, self._seconds(route, time.perf_counter() - start)
        )
        return loss

    def _seconds(self, route: str, measured: float) -> float:
        """A step's time as the trial counts it (tests replace this to pin a choice)."""
        return measured

    def summary(self) -> str:
        """One line per signature decided: the two medians and the choice."""
        lines = []
        for sig, t in self.trials.items():
            if not t.choice:
                continue
            g, e = statistics.median(t.graph), statistics.median(t.eager)
            lines.append(
                f"  {_shape_text(sig)}: graph {g * 1e3:.1f} ms, eager {e * 1e3:.1f} ms a step: "
                f"runs {'in eager' if t.choice == 'eager' else 'on the graph'}"
            )
        return "\n".join(lines)


def _shape_text(sig: tuple) -> str:
    """A signature (``whole_graph.signature``) as its tensors' shapes."""
    parts = [f"{k} {list(shape)}" for k, shape, _ in sig if isinstance(shape, tuple)]
    return ", ".join(parts) or "batch"
