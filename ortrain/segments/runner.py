"""Run a compiled segment inside torch autograd.

``SegmentRunner`` holds a segment call's two ONNX Runtime sessions and binds them by
role on every call: parameters and buffers are read where the module keeps them now
(an update engine may have moved them into flat buffers), the call's tensors by
position, outputs into tensors allocated per call. ``SegmentFunction`` is the
``torch.autograd.Function`` around it: its forward runs the forward graph and keeps the
saved values for the backward graph, which turns the output gradients torch hands it into
the gradients of the call's tensors and of the module's trainable parameters. Eager code
around the segment (glue, losses, modules that run in eager) differentiates through it
like through any torch op, and parameter gradients accumulate into ``.grad`` as eager's do.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Protocol

import torch

from ortrain.core.names import DROPOUT_SWITCH_INPUT
from ortrain.core.roles import Role
from ortrain.rank_memory import MemoryTally
from ortrain.runtime.buffer_pool import ReusePool
from ortrain.runtime.session import BoundSession
from ortrain.segments.build import GraphBytes, SegmentGraphs

_DTYPES = {
    "FLOAT": torch.float32,
    "FLOAT16": torch.float16,
    "DOUBLE": torch.float64,
    "INT64": torch.int64,
    "INT32": torch.int32,
    "BOOL": torch.bool,
    "UINT8": torch.uint8,
    "INT8": torch.int8,
}


class SegmentRunner:
    """The sessions of one compiled segment call, bound by role on each run."""

    def __init__(
        self,
        graphs: SegmentGraphs,
        session: Callable[[GraphBytes], BoundSession],
        device: torch.device,
    ):
        self.graphs = graphs
        self.device = device
        self.fwd = session(graphs.forward)
        self.bwd = session(graphs.backward)
        self.dropout_on = torch.ones((), dtype=torch.bool, device=device)
        for s in (self.fwd, self.bwd):
            s.bind_inputs({DROPOUT_SWITCH_INPUT: self.dropout_on})
        self.trainable = [
            r.name
            for r in graphs.forward.inputs + graphs.backward.inputs
            if r.role is Role.PARAMETER
        ]
        self.trainable = list(dict.fromkeys(self.trainable))
        self.grad_params = [p for p in self.trainable if p in graphs.grads]
        # the call's tensors the backward graph reads (only those are kept for it)
        bwd_inputs = {r.name for r in graphs.backward.inputs if r.role is Role.SEGMENT_INPUT}
        self.backward_reads = sorted(int(n[3:]) for n in bwd_inputs)
        self.runs = 0  # forward runs (a test's and ``explain``'s count)
        self.tally = MemoryTally()  # the model's, shared by its runners (``memory_report``)
        self.seconds = 0.0  # in both graphs' runs (``explain``'s share of the step)
        # the model's outputs, reused step to step (a fresh large tensor faults in every
        # page again); None: allocated per call
        self.pool: ReusePool | None = None

    # ------------------------------------------------------------------ state by role
    @staticmethod
    def _state(module: torch.nn.Module, graph: GraphBytes) -> dict[str, torch.Tensor]:
        params = dict(module.named_parameters())
        buffers = dict(module.named_buffers())
        out = {}
        for r in graph.inputs:
            if r.role in (Role.PARAMETER, Role.FROZEN_PARAMETER):
                out[r.name] = params[r.name].detach()
            elif r.role is Role.BUFFER:
                out[r.name] = buffers[r.name]
        return out

    def _outputs(self, session: BoundSession, graph: GraphBytes) -> dict[str, torch.Tensor]:
        outs = {}
        for r in graph.outputs:
            shape, dtype = graph.output_types[r.name]
            if shape is None or dtype not in _DTYPES:
                raise RuntimeError(f"segment output {r.name} has no static shape ({dtype})")
            if self.pool is not None:
                outs[r.name] = self.pool.empty(shape, _DTYPES[dtype])
            else:
                outs[r.name] = torch.empty(shape, dtype=_DTYPES[dtype], device=self.device)
        session.bind_outputs(outs)
        return outs

    @staticmethod
    def _bind(session: BoundSession, tensors: dict[str, torch.Tensor]) -> list[torch.Tensor]:
        keep = []
        for name, t in tensors.items():
            if name in session.input_names:
                t = t.contiguous()
                keep.append(t)
                session.bind_batch(name, t)
        return keep

    # ------------------------------------------------------------------ runs
    def forward(
        self, module: torch.nn.Module, inputs: list[torch.Tensor]
    ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """(the call's output tensors, the saved values) for ``module`` called with the
        call's tensors ``inputs``."""
        g = self.graphs.forward
        feed = {**self._state(module, g), **{f"in:{k}": t.detach() for k, t in enumerate(inputs)}}
        keep = self._bind(self.fwd, feed)
        outs = self._outputs(self.fwd, g)
        start = time.perf_counter()
        self.fwd.run()
        self.fwd.release_outputs()
        self.seconds += time.perf_counter() - start
        del keep
        self.runs += 1
        buffers = dict(module.named_buffers())
        with torch.no_grad():
            for r in g.outputs:
                if r.role is Role.UPDATED_BUFFER:
                    buffers[r.of].copy_(outs[r.name])
        results = [outs[r.name] for r in g.outputs if r.role is Role.SEGMENT_OUTPUT]
        return results, [outs[name] for name in self.graphs.saved]

    def backward(
        self,
        module: torch.nn.Module,
        n_inputs: int,
        read: dict[int, torch.Tensor],
        saved: list[torch.Tensor],
        grad_outputs: list[torch.Tensor],
    ) -> tuple[list[torch.Tensor | None], dict[str, torch.Tensor]]:
        """(gradients of the call's ``n_inputs`` tensors, gradients of the trainable
        parameters) for the output gradients ``grad_outputs``; ``read``: the call's tensors
        the backward graph reads (``backward_reads``), by position."""
        g = self.graphs.backward
        feed = {**self._state(module, g), **{f"in:{k}": t.detach() for k, t in read.items()}}
        feed.update(zip(self.graphs.saved, saved))
        seeds = {r.of: r.name for r in g.inputs if r.role is Role.OUTPUT_GRADIENT}
        names = [r.name for r in self.graphs.forward.outputs if r.role is Role.SEGMENT_OUTPUT]
        for name, grad in zip(names, grad_outputs, strict=True):
            if name in seeds:
                feed[seeds[name]] = grad
        keep = self._bind(self.bwd, feed)
        outs = self._outputs(self.bwd, g)
        start = time.perf_counter()
        self.bwd.run()
        self.bwd.release_outputs()
        self.seconds += time.perf_counter() - start
        del keep
        grads = self.graphs.grads
        self.tally.passing(sum(t.nbytes for t in outs.values()))
        in_grads = [outs.get(grads.get(f"in:{k}", "")) for k in range(n_inputs)]
        param_grads = {p: outs[grads[p]] for p in self.grad_params}
        return in_grads, param_grads

    @contextlib.contextmanager
    def dropout(self, on: bool) -> Iterator[None]:
        """Dropout drawn (the default) or off (a verification run)."""
        before = bool(self.dropout_on)
        self.dropout_on.fill_(on)
        try:
            yield
        finally:
            self.dropout_on.fill_(before)


class ParamHome(Protocol):
    """Where a module's parameters live when they are not whole (ZeRO-3's shards):
    ``acquire`` makes them whole before a graph reads them, ``release`` drops them."""

    def acquire(self, module: torch.nn.Module) -> None: ...

    def release(self, module: torch.nn.Module) -> None: ...

    def hold(self, module: torch.nn.Module) -> None:
        """After a call of ``module`` that ran in eager instead of ``release``: autograd
        saved what it read."""
        ...

    def keep_whole(self, names: list[str]) -> None:
        """``names`` are read by eager code: never dropped."""
        ...

    def planned(self, order: Sequence[torch.nn.Module] = ()) -> None:
        """The segments are planned (on whole parameters): from now on they may be
        sharded and gathered per call; ``order``: the compiled modules' calls in the
        recorded forward."""
        ...


class SegmentFunction(torch.autograd.Function):
    """``apply(runner, module, home, n_inputs, *inputs, *params)``: the call's outputs,
    differentiable with respect to its tensors and ``module``'s trainable parameters
    (``runner.grad_params``, in that order); ``home`` (or None) gathers the parameters
    again for the backward."""

    @staticmethod
    def forward(
        ctx: Any,
        runner: SegmentRunner,
        module: torch.nn.Module,
        home: ParamHome | None,
        n_inputs: int,
        *flat: torch.Tensor,
    ) -> Any:
        inputs = list(flat[:n_inputs])
        outs, saved = runner.forward(module, inputs)
        ctx.runner = runner
        ctx.module = module
        ctx.home = home
        ctx.n_inputs = n_inputs
        # only what the backward graph reads: eager may change the rest in place, as it may
        # where its own backward does not read it
        read = [inputs[k] for k in runner.backward_reads]
        ctx.save_for_backward(*read, *saved)
        ctx.saved_bytes = sum(t.nbytes for t in saved)
        runner.tally.hold(ctx.saved_bytes)
        ctx.mark_non_differentiable(*[o for o in outs if not o.is_floating_point()])
        return tuple(outs)

    @staticmethod
    def backward(ctx: Any, *grad_outputs: torch.Tensor) -> Any:
        runner: SegmentRunner = ctx.runner
        if ctx.home is not None:  # dropped after the forward; the home drops them again
            ctx.home.acquire(ctx.module)
        tensors = ctx.saved_tensors
        n = len(runner.backward_reads)
        read = dict(zip(runner.backward_reads, tensors[:n]))
        grads = [g.contiguous() for g in grad_outputs]  # torch gives zeros for unused ones
        in_grads, param_grads = runner.backward(
            ctx.module, ctx.n_inputs, read, list(tensors[n:]), grads
        )
        runner.tally.drop(ctx.saved_bytes)
        params = [param_grads.get(p) for p in runner.grad_params]
        return (None, None, None, None, *in_grads, *params)
