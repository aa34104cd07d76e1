"""A new batch shape's graph built once its eager steps have lost a build's time.

A graph pays for its build only over the steps that run on it: a build costs tens of a
small model's steps, and variable-length data keeps bringing shapes (bucket lengths) no
graph has yet, most of them rare. So once a model has a graph (its first shape is always
built: nothing is known before), a step whose batch shape has none runs in eager PyTorch
over the trainer's own state (``ortrain/eager_steps.py``: nothing is copied to switch, the
step is eager's own), and the time those steps lose is counted per shape: each eager
step's measured time less what the shape's graph would take, estimated from the graphs'
own steps per batch element. The shape's graph is built at the step whose loss would
bring the count to what a build costs the steps: the time the model's last build took,
or, where the build can run in a forked child on one of the cores while the steps go on
in eager on the others (one thread fewer, until it arrives), that time over the cores
(the share of the machine the child takes from them). From then on the shape runs on its
graph as any.

This is the ski-rental rule (``ski_rental.py``, which compiled segments' new call
signatures follow too): a shape that comes back often gets its graph after at most one
build's cost lost, and a rare one never costs a build. Every number is measured on this
machine, in this run (no threshold is picked for one). A shape eager steps as fast as
the graph never builds, as ``eager_if_faster`` would decide after building it.

Where the update or the batch needs what eager steps cannot do (``eager_steps.unsupported``:
several processes, accumulation, half precision, a device) every shape builds at once.
"""

from __future__ import annotations

import collections
import statistics
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch

from ortrain.eager_steps import EagerSteps
from ortrain.ski_rental import Rented, keeps_renting

if TYPE_CHECKING:
    from ortrain.program_context import ProgramContext

# graph steps per element kept for the estimate: the latest few (the machine's load moves)
RECENT = 8
# what a padding proof says while its shape's graph is deferred (bucketing: unpadded then)
DEFERRED = ("pending", "its shape's steps run in eager until a build pays")


def elements(batch: Mapping[str, Any]) -> int:
    """The batch's tensor elements: what a graph's step time scales with across the
    shapes of one layout (the sequence length of every batch tensor)."""
    return sum(v.numel() for v in batch.values() if isinstance(v, torch.Tensor)) or 1


class DeferredBuilds:
    """Per batch signature without a graph: eager steps until a build pays."""

    def __init__(self, ctx: ProgramContext):
        self.eager = EagerSteps(ctx)
        self.build_seconds: float | None = None  # the latest step that built or loaded
        self._per_element: collections.deque[float] = collections.deque(maxlen=RECENT)
        self.rented: dict[tuple, Rented] = {}
        self.built: dict[tuple, Rented] = {}  # shapes built after eager steps
        self._stepped: set[tuple] = set()  # shapes whose graph has taken a step

    def per_element(self) -> float:
        """A graph step's seconds per batch element, the median of the latest (0 before
        any was timed: a build then comes sooner, as before this rule)."""
        return statistics.median(self._per_element) if self._per_element else 0.0

    def graph_step_estimate(self, batch: Mapping[str, Any]) -> float:
        """The seconds a graph of ``batch``'s shape would take a step."""
        return self.per_element() * elements(batch)

    def lost(self, sig: tuple) -> float:
        """What ``sig``'s eager steps cost beyond its graph's estimate so far."""
        r = self.rented.get(sig)
        return 0.0 if r is None else r.lost(self.per_element())

    def rents(self, sig: tuple, batch: Mapping[str, Any], cores: int = 1) -> bool:
        """Whether ``batch`` (whose shape has no graph) steps in eager rather than build.
        ``cores``: the build runs in a forked child on one of that many cores while the
        steps go on in eager on the others, which lose at most that share of the time it
        takes (perfect scaling over threads; less where they scale worse)."""
        if self.build_seconds is None:  # no graph built yet: nothing to weigh
            return False
        price = self.build_seconds / max(cores, 1)
        return keeps_renting(self.rented.get(sig), self.per_element(), elements(batch), price)

    def step(
        self, sig: tuple, padded: Mapping[str, Any], batch: dict[str, Any], beside: bool = False
    ) -> torch.Tensor:
        """``batch``'s step in eager (``padded``: what its graph would take), timed;
        ``beside``: a graph builds in a forked child meanwhile, on a core of its own (one
        thread fewer here: OpenMP's team would wait at every barrier for the thread that
        lost its core)."""
        start = time.perf_counter()
        threads = torch.get_num_threads()
        if beside:
            torch.set_num_threads(max(1, threads - 1))
        try:
            loss = self.eager.step(batch)
        finally:
            torch.set_num_threads(threads)
        self.rented.setdefault(sig, Rented()).add(time.perf_counter() - start, elements(padded))
        return loss

    def arrived(self, sig: tuple) -> None:
        """``sig``'s graph came from a forked child that built it while its steps ran in
        eager: its first step is not a build's time (the price stays the last one's)."""
        self._stepped.add(sig)
        if sig in self.rented:
            self.built[sig] = self.rented.pop(sig)

    def stepped(self, sig: tuple) -> bool:
        return sig in self._stepped

    def graph_step(self, sig: tuple, batch: Mapping[str, Any], seconds: float, built: bool) -> None:
        """A step on a graph took ``seconds`` (``built``: it built or loaded the graph, or
        was its first: a build's time is the whole step's, its check's and bucketing's
        included, which may run beside it)."""
        self._stepped.add(sig)
        if built:
            self.build_seconds = seconds
            if sig in self.rented:
                self.built[sig] = self.rented.pop(sig)
            return
        self._per_element.append(seconds / elements(batch))

    def summary(self) -> str:
        """Shapes that stepped in eager: how many steps, and whether their graph came."""
        lines = []
        for sig, r in [*self.built.items(), *self.rented.items()]:
            shape = ", ".join(f"{k} {list(s)}" for k, s, _ in sig if isinstance(s, tuple))
            then = "then built" if sig in self.built else "no graph yet"
            lines.append(f"  {shape or 'batch'}: {r.steps} step(s) in eager, {then}")
        return "\n".join(lines)
