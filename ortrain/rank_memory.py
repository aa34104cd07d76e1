"""What one rank's memory is made of, by class, against what the process measured.

``ORTTrainer.memory_report()`` returns a ``RankMemory``: the model states this rank
holds (``memory_estimate.StateBytes``), the peaks of what a step holds on top of them,
the process's own bytes, and the measured resident peak they should add up to:

    runtime          the process before the trainer existed, less the module's tensors:
                     the interpreter, torch, ONNX Runtime and the other libraries
    parameters / gradients / optimizer state
                     what ``state_bytes()`` measures from the storages
    buckets          ZeRO-2/3: the most gradient-bucket bytes held at once
    gathered         ZeRO-3: the most parameter bytes gathered at once (the largest
                     gathered segment and the tied parameters read across segments)
    first step       ZeRO-3: the parameters beyond this rank's shard, whole while the
                     first step plans the segments on them (sharded before it runs them)
    activations      what a step keeps for its backward: the saved tensors of the
                     compiled segments (their peak, with a backward's gradient outputs),
                     or for a whole-model graph its planned arena (activations and
                     gradient temporaries)
    sessions         resident bytes that creating the ONNX Runtime sessions added

``total`` is their sum, except that the first step's whole parameters and a later step's
buckets and gathers never coexist: the larger of the two is counted. Where ZeRO-2/3 update
each bucket's stretch as it lands (update engine "zero-backward"), the gradient shard is
held only up to the first update, which runs after its backward and hands it back as it
takes the optimizer state's pages: the later steps count none. On CPU a ZeRO rank's
optimizer-state and gradient shards take memory only when first written (the first
update, the first backward: ``runtime/zero_pages.py``), so the first step's whole
parameters are counted without them. A class the trainer
cannot see (eager code's own activations, a caller's tensors) is the difference between
``total`` and ``measured_peak``, shown as ``unaccounted``.
"""

from __future__ import annotations

import dataclasses
import os
import resource
import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ortrain.graph_passes.memory.memory_plan import MemoryReport
    from ortrain.memory_estimate import StateBytes

MIB = 2**20

_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def resident_bytes() -> int:
    """This process's resident set size now."""
    try:
        with open("/proc/self/statm", "rb") as f:
            return int(f.read().split()[1]) * _PAGE
    except OSError:  # not Linux
        import psutil

        return int(psutil.Process().memory_info().rss)


def peak_resident_bytes() -> int:
    """The most this process has held resident so far (``ru_maxrss``)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak) if sys.platform == "darwin" else int(peak) * 1024


@dataclasses.dataclass
class MemoryTally:
    """Bytes a segmented step holds besides the model states: the tensors the compiled
    segments saved for their backward, and a running backward's gradient outputs."""

    held: int = 0
    peak: int = 0

    def hold(self, nbytes: int) -> None:
        self.held += nbytes
        self.peak = max(self.peak, self.held)

    def drop(self, nbytes: int) -> None:
        self.held -= nbytes

    def passing(self, nbytes: int) -> None:
        """Bytes alive only for a moment on top of what is held (a backward's outputs)."""
        self.peak = max(self.peak, self.held + nbytes)


@dataclasses.dataclass(frozen=True)
class RankMemory:
    states: StateBytes
    runtime: int
    buckets: int
    gathered: int
    first_step: int
    activations: int
    sessions: int
    measured_peak: int
    measured_now: int
    graph: MemoryReport | None  # the whole-model gradient graph's plan, where there is one
    lazy_state: bool = False  # gradient and optimizer-state shards untaken at the first step
    grads_released: bool = False  # the gradient shard went after the first update

    @classmethod
    def measure(
        cls,
        states: StateBytes,
        reducer: object,
        *,
        runtime: int,
        sessions: int,
        activations: int,
        graph: MemoryReport | None = None,
    ) -> RankMemory:
        """Now, with ``reducer``'s peaks (ZeRO-2/3; None in a single process)."""
        return cls(
            states=states,
            runtime=runtime,
            buckets=4 * getattr(reducer, "peak_open_numel", 0),
            gathered=4 * getattr(reducer, "peak_gathered_numel", 0),
            first_step=4 * getattr(reducer, "first_step_numel", 0),
            lazy_state=getattr(reducer, "lazy_state", False),
            grads_released=getattr(reducer, "grads_released", False),
            activations=activations,
            sessions=sessions,
            measured_peak=peak_resident_bytes(),
            measured_now=resident_bytes(),
            graph=graph,
        )

    @property
    def total(self) -> int:
        # the states' in-flight bytes are ``buckets + gathered``, listed on their own; the
        # first step's whole parameters are gone before any bucket or gather exists (the
        # plan is made on them, then they are sharded), so the larger of the two counts
        # (on CPU with the shards of gradients and state not yet taken)
        # (and where the gradient shard goes after the first update, that update hands
        # it back piece by piece as it takes the optimizer state's pages, and the later
        # steps hold no gradients)
        s = self.states
        grads = 0 if self.grads_released else s.gradients
        steps = grads + s.optimizer_state + self.buckets + self.gathered
        first = self.first_step + (0 if self.lazy_state else s.gradients + s.optimizer_state)
        update = max(s.gradients, s.optimizer_state)
        held = max(steps, first, update)
        return self.runtime + s.parameters + held + self.activations + self.sessions

    @property
    def unaccounted(self) -> int:
        return self.measured_peak - self.total

    def rows(self) -> list[tuple[str, int]]:
        s = self.states
        return [
            ("runtime", self.runtime),
            ("parameters", s.parameters),
            ("gradients", s.gradients),
            ("optimizer state", s.optimizer_state),
            ("gradient buckets", self.buckets),
            ("gathered parameters", self.gathered),
            ("whole parameters (first step)", self.first_step),
            ("activations", self.activations),
            ("sessions", self.sessions),
            ("total", self.total),
            ("measured peak", self.measured_peak),
            ("unaccounted", self.unaccounted),
        ]

    def format(self) -> str:
        s = self.states
        head = f"memory of this rank (world size {s.world_size}, ZeRO stage {s.zero_stage}):"
        lines = [head, *(f"  {k:<30} {v / MIB:10.1f} MiB" for k, v in self.rows())]
        if self.graph is not None:
            lines.append(self.graph.format())
        return "\n".join(lines)
