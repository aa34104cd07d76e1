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
import weakref
from collections.abc import Callable, Collection, Iterable, Iterator, Sequence
from typing import Any, Protocol

import torch

from ortrain.core.names import DROPOUT_SWITCH_INPUT
from ortrain.core.own_hooks import own_hook
from ortrain.core.roles import Role
from ortrain.rank_memory import MemoryTally
from ortrain.runtime.buffer_pool import ReusePool
from ortrain.runtime.session import BoundSession
from ortrain.runtime.zero_pages import populate
from ortrain.segments.build import GraphBytes, SegmentGraphs
from ortrain.segments.twice import second_order_error

# a gradient in two pieces: an embedding's rows [N, 1] and their updates, or a weight's
# product factors (the gradient is ``left^T @ right``)
Parts = tuple[torch.Tensor, torch.Tensor]

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
        self._session = session
        self.dropout_on = torch.ones((), dtype=torch.bool, device=device)
        self.fwd = self._made(graphs.forward)
        # the backward's sessions, made on first use: a segment whose rows go into zeros
        # runs only the accumulating one (``backward``)
        self._bwd: BoundSession | None = None
        self.bwd_acc: BoundSession | None = None
        # ZeRO-2/3 take a tied table's gradient in pieces (``parts_of``): those sessions
        self._parts_sessions: dict[str, BoundSession] = {}
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
        # the module's parameters the backward that runs reads (``backward``): ZeRO-3
        # gathers only those for it (an embedding's rows need none)
        run_bwd = graphs.backward_acc or graphs.backward
        self.backward_params = frozenset(
            r.name for r in run_bwd.inputs if r.role in (Role.PARAMETER, Role.FROZEN_PARAMETER)
        )
        self.runs = 0  # forward runs (a test's and ``explain``'s count)
        self.unchecked = ""  # why its check could not compare it (eager drew unfixed draws)
        self.tally = MemoryTally()  # the model's, shared by its runners (``memory_report``)
        self.seconds = 0.0  # in both graphs' runs (``explain``'s share of the step)
        # the forward graph's runs: their seconds and their inputs' elements (what a new
        # signature's eager calls are weighed against, ``ski_rental.py``)
        self.forward_seconds = 0.0
        self.forward_elements = 0
        # the model's outputs, reused step to step (a fresh large tensor faults in every
        # page again); None: allocated per call
        self.pool: ReusePool | None = None
        # gradients another segment made of parameters this one adds rows to (the model's)
        self.tied: TiedGradients | None = None

    def _made(self, graph: GraphBytes) -> BoundSession:
        session = self._session(graph)
        session.bind_inputs({DROPOUT_SWITCH_INPUT: self.dropout_on})
        return session

    @property
    def bwd(self) -> BoundSession:
        if self._bwd is None:
            self._bwd = self._made(self.graphs.backward)
        return self._bwd

    # ------------------------------------------------------------------ state by role
    @staticmethod
    def _state(module: torch.nn.Module, graph: GraphBytes) -> dict[str, torch.Tensor]:
        params = dict(module.named_parameters())
        buffers = dict(module.named_buffers())
        out = {}
        for r in graph.inputs:
            if r.role in (Role.PARAMETER, Role.FROZEN_PARAMETER):
                p = params[r.name]
                if any(st == 0 and n > 1 for st, n in zip(p.stride(), p.shape)):
                    # ZeRO-3's stand-in for a parameter it has not gathered: never bound
                    raise RuntimeError(f"segment graph reads {r.name}, which is not gathered")
                out[r.name] = p.detach()
            elif r.role is Role.BUFFER:
                out[r.name] = buffers[r.name]
        return out

    def _outputs(
        self, session: BoundSession, graph: GraphBytes, given: dict[str, torch.Tensor] | None = None
    ) -> dict[str, torch.Tensor]:
        outs = dict(given or {})
        for r in graph.outputs:
            if r.name in outs:
                continue
            shape, dtype = graph.output_types[r.name]
            if shape is None or dtype not in _DTYPES:
                raise RuntimeError(f"segment output {r.name} has no static shape ({dtype})")
            if self.pool is not None:
                outs[r.name] = self.pool.empty(shape, _DTYPES[dtype])
            else:
                outs[r.name] = out = torch.empty(shape, dtype=_DTYPES[dtype], device=self.device)
                populate(out)  # the graph writes it whole
        session.bind_outputs(outs)
        return outs

    def _zeros(self, shape: tuple[int, ...] | None, dtype: str) -> torch.Tensor:
        if shape is None or dtype not in _DTYPES:
            raise RuntimeError(f"segment gradient has no static shape ({dtype})")
        if self.pool is not None:
            return self.pool.empty(shape, _DTYPES[dtype]).zero_()
        return torch.zeros(shape, dtype=_DTYPES[dtype], device=self.device)

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
        took = time.perf_counter() - start
        self.seconds += took
        self.forward_seconds += took
        self.forward_elements += sum(t.numel() for t in inputs)
        del keep
        self.runs += 1
        buffers = dict(module.named_buffers())
        with torch.no_grad():
            for r in g.outputs:
                if r.role is Role.UPDATED_BUFFER:
                    buffers[r.of].copy_(outs[r.name])
        results = [outs[r.name] for r in g.outputs if r.role is Role.SEGMENT_OUTPUT]
        for k in self.graphs.result.complex_at:  # the exporter's real view of a complex value
            results[k] = torch.view_as_complex(results[k])
        return results, [outs[name] for name in self.graphs.saved]

    def backward(
        self,
        module: torch.nn.Module,
        n_inputs: int,
        read: dict[int, torch.Tensor],
        saved: list[torch.Tensor],
        grad_outputs: list[torch.Tensor],
        into: dict[str, torch.Tensor] | None = None,
        parts_out: dict[str, Parts | None] | None = None,
        homes: dict[str, torch.Tensor] | None = None,
    ) -> tuple[list[torch.Tensor | None], dict[str, torch.Tensor]]:
        """(gradients of the call's ``n_inputs`` tensors, gradients of the trainable
        parameters) for the output gradients ``grad_outputs``; ``read``: the call's tensors
        the backward graph reads (``backward_reads``), by position. ``into``: gradients
        already made of parameters in ``graphs.accumulators``, which this backward adds
        its rows to in place (and returns as theirs). ``parts_out``: the parameters (its
        keys) whose gradient is wanted in pieces (``parts_of``); the pieces are set there
        and those parameters get no entry in the parameter gradients. ``homes``: where
        parameters' gradients are to be written (views of the reducer's buckets), used
        where the graph's output has their shape and type."""
        if parts_out:
            kind = self._parts_kind(parts_out)
            if kind is not None:
                return self._backward_parts(
                    kind, module, n_inputs, read, saved, grad_outputs, into, parts_out
                )
        given: dict[str, torch.Tensor] = {}
        if self.graphs.backward_acc is None:
            g, session = self.graphs.backward, self.bwd
        else:
            # Always this one where it exists: the plain graph's zeros are a constant that
            # ONNX Runtime folds into an initializer its session keeps (a table's worth,
            # copied into the output on every run); here they are made per run, or the rows
            # go into a gradient another segment made
            g = self.graphs.backward_acc
            if self.bwd_acc is None:
                self.bwd_acc = self._made(g)
            session = self.bwd_acc
            for p, name in self.graphs.accumulators.items():
                out = self.graphs.grads[p]
                t = (into or {}).get(p)
                if t is None:
                    t = self._zeros(*g.output_types[out])
                given[out] = given[name] = t
        for p, t in (homes or {}).items():
            out = self.graphs.grads.get(p)
            if out is None or out in given or out not in g.output_types:
                continue
            shape, dtype = g.output_types[out]
            fits = shape is not None and tuple(t.shape) == tuple(shape)
            if fits and t.dtype == _DTYPES.get(dtype):
                given[out] = t
        outs = self._run_backward(module, g, session, read, saved, grad_outputs, given)
        param_grads = {p: outs[self.graphs.grads[p]] for p in self.grad_params}
        return self._input_grads(outs, n_inputs), param_grads

    def _input_grads(
        self, outs: dict[str, torch.Tensor], n_inputs: int
    ) -> list[torch.Tensor | None]:
        """The call's tensors' gradients among a backward's outputs (a complex tensor's
        from its real view's, as torch's ``view_as_real`` backward gives it)."""
        grads = self.graphs.grads
        in_grads = [outs.get(grads.get(f"in:{k}", "")) for k in range(n_inputs)]
        for k in self.graphs.complex_inputs:
            if k < n_inputs and (g := in_grads[k]) is not None:
                in_grads[k] = torch.view_as_complex(g)
        return in_grads

    def _run_backward(
        self,
        module: torch.nn.Module,
        g: GraphBytes,
        session: BoundSession,
        read: dict[int, torch.Tensor],
        saved: list[torch.Tensor],
        grad_outputs: list[torch.Tensor],
        given: dict[str, torch.Tensor],
    ) -> dict[str, torch.Tensor]:
        """Bind and run one of the backward graphs; its outputs by name (``given``: tensors
        bound as inputs and outputs both, an accumulator and the gradient it becomes)."""
        feed = {**self._state(module, g), **{f"in:{k}": t.detach() for k, t in read.items()}}
        feed.update(zip(self.graphs.saved, saved))
        seeds = {r.of: r.name for r in g.inputs if r.role is Role.OUTPUT_GRADIENT}
        names = [r.name for r in self.graphs.forward.outputs if r.role is Role.SEGMENT_OUTPUT]
        for name, grad in zip(names, grad_outputs, strict=True):
            if name in seeds:
                feed[seeds[name]] = grad
        feed.update({n: t for n, t in given.items() if n in session.input_names})
        keep = self._bind(session, feed)
        outs = self._outputs(session, g, {n: t for n, t in given.items() if n in g.output_types})
        start = time.perf_counter()
        session.run()
        session.release_outputs()
        self.seconds += time.perf_counter() - start
        # made by this run: not the gradients it added rows into (made before, held already)
        self.tally.passing(sum(t.nbytes for n, t in outs.items() if n not in given))
        del keep
        return outs

    def _parts_kind(self, wanted: Iterable[str]) -> str | None:
        """Which variant gives pieces of some of ``wanted``: "rows" or "factors"."""
        wanted = set(wanted)
        if wanted & set(self.graphs.row_outputs) and self.graphs.backward_rows is not None:
            return "rows"
        if wanted & set(self.graphs.factor_outputs) and self.graphs.backward_factored is not None:
            return "factors"
        return None

    def parts_of(self, wanted: Iterable[str], world_size: int) -> set[str]:
        """Of parameters ``wanted`` (whose gradient this segment makes), those whose
        gradient the backward gives in pieces: an embedding's rows; a weight's product
        factors where what a rank holds of them at once (its own and every rank's,
        gathered: ``world_size + 1`` sets) is less than the weight (few tokens against a
        large table)."""
        wanted = set(wanted)
        kind = self._parts_kind(wanted)
        if kind == "rows":
            return wanted & set(self.graphs.row_outputs)
        if kind != "factors":
            return set()
        g = self.graphs.backward_factored
        assert g is not None
        out = set()
        for p, (left, right) in self.graphs.factor_outputs.items():
            (shape_l, _), (shape_r, _) = g.output_types[left], g.output_types[right]
            if p in wanted and shape_l is not None and shape_r is not None:
                tokens, m = shape_l
                n = shape_r[1]
                if (world_size + 1) * tokens * (m + n) < m * n:
                    out.add(p)
        return out

    def _backward_parts(
        self,
        kind: str,
        module: torch.nn.Module,
        n_inputs: int,
        read: dict[int, torch.Tensor],
        saved: list[torch.Tensor],
        grad_outputs: list[torch.Tensor],
        into: dict[str, torch.Tensor] | None,
        parts_out: dict[str, Parts | None],
    ) -> tuple[list[torch.Tensor | None], dict[str, torch.Tensor]]:
        """``backward`` with the graph giving gradients in pieces (``kind``): those of
        ``parts_out`` go there; the others are made whole here (rows added into ``into``
        or zeros, factors multiplied out)."""
        if kind == "rows":
            g, pieces = self.graphs.backward_rows, self.graphs.row_outputs
        else:
            g, pieces = self.graphs.backward_factored, self.graphs.factor_outputs
        assert g is not None
        session = self._parts_sessions.get(kind)
        if session is None:
            session = self._parts_sessions[kind] = self._made(g)
        outs = self._run_backward(module, g, session, read, saved, grad_outputs, {})
        grads = self.graphs.grads
        in_grads = self._input_grads(outs, n_inputs)
        param_grads = {p: outs[grads[p]] for p in self.grad_params if p not in pieces}
        for p, (first, second) in pieces.items():
            a, b = outs[first], outs[second]
            if p in parts_out:
                parts_out[p] = (a, b)
            elif kind == "factors":
                param_grads[p] = a.t() @ b
            else:
                made = (into or {}).get(p)
                if made is None:
                    made = self._zeros(*self.graphs.backward.output_types[grads[p]])
                param_grads[p] = add_rows(made, a, b)
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

    def acquire(self, module: torch.nn.Module, only: Sequence[torch.Tensor] | None = None) -> None:
        """``module``'s parameters whole (``only``: those of them a graph reads)."""
        ...

    def release(self, module: torch.nn.Module) -> None: ...

    def after_backward(self, module: torch.nn.Module) -> None:
        """``module``'s backward graph has run: its parameters may be dropped before
        autograd accumulates their gradients."""
        ...

    def hold(self, module: torch.nn.Module) -> None:
        """After a call of ``module`` that ran in eager instead of ``release``: autograd
        saved what it read."""
        ...

    def keep_whole(self, names: list[str]) -> None:
        """``names`` are read by eager code: never dropped."""
        ...

    def planned(
        self,
        order: Sequence[torch.nn.Module] = (),
        backward_reads: Sequence[Sequence[torch.Tensor]] = (),
    ) -> None:
        """The segments are planned (on whole parameters): from now on they may be
        sharded and gathered per call; ``order``: the compiled modules' calls in the
        recorded forward; ``backward_reads``: per call, the parameters its backward reads."""
        ...


def add_rows(table: torch.Tensor, rows: torch.Tensor, updates: torch.Tensor) -> torch.Tensor:
    """``table`` with ``updates[i]`` added to its row ``rows[i, 0]`` (negative rows count
    from the end), in place."""
    n = table.shape[0]
    flat = table.view(n, -1)
    flat.index_add_(0, rows.view(-1).remainder(n), updates.reshape(rows.numel(), -1))
    return table


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
        ctx.mark_non_differentiable(
            *[o for o in outs if not (o.is_floating_point() or o.is_complex())]
        )
        # an output without a gradient comes as None (zeros made in the backward): where
        # none has one, eager's autograd gives the module's parameters no gradient (their
        # .grad stays None), which the optimizer skips, weight decay and momentum included
        ctx.set_materialize_grads(False)
        ctx.outs = [(o.shape, o.dtype, o.device) for o in outs]
        ctx.n_flat = len(flat)
        return tuple(outs)

    @staticmethod
    def backward(ctx: Any, *grad_outputs: torch.Tensor) -> Any:
        runner: SegmentRunner = ctx.runner
        if torch.is_grad_enabled():  # create_graph=True: this graph's gradients are first-order
            raise second_order_error(ctx.module)
        home: ParamHome | None = ctx.home
        sink = runner.tied.sink if runner.tied is not None else None
        if all(g is None for g in grad_outputs) and home is None and sink is None:
            # (ZeRO's gathers and sinks follow every backward: they take zeros below)
            runner.tally.drop(ctx.saved_bytes)
            return (None,) * (4 + ctx.n_flat)
        grad_outputs = tuple(
            torch.zeros(shape, dtype=dtype, device=device) if g is None else g
            for g, (shape, dtype, device) in zip(grad_outputs, ctx.outs, strict=True)
        )
        if home is not None:  # dropped after the forward; gathered again if read here
            named_all = dict(ctx.module.named_parameters())
            home.acquire(ctx.module, [named_all[p] for p in runner.backward_params])
        elif (check := getattr(sink, "check_reads", None)) is not None:
            # ZeRO-2: what it reads, for the update in the backward (ZeRO-3's acquire does)
            check([ctx.module.get_parameter(p) for p in runner.backward_params])
        tensors = ctx.saved_tensors
        n = len(runner.backward_reads)
        read = dict(zip(runner.backward_reads, tensors[:n]))
        grads = [g.contiguous() for g in grad_outputs]
        tied, named, into = runner.tied, {}, {}
        # ZeRO-2/3: a routed tied table's gradient goes to the reducer in pieces, outside
        # autograd (which would hold the head's until the embedding's rows came): the
        # embedding's rows, the head's product factors
        routed: dict[str, str] = {}
        if tied is not None and tied.routed:
            named = dict(ctx.module.named_parameters())
            ids = {p: id(named[p]) for p in runner.grad_params}
            routed = {p: tied.routed[k] for p, k in ids.items() if k in tied.routed}
        parts_out: dict[str, Parts | None] = dict.fromkeys(
            runner.parts_of(routed, tied.world_size) if tied is not None and routed else (), None
        )
        if tied is not None and runner.graphs.accumulators:
            named = named or dict(ctx.module.named_parameters())
            for p in runner.graphs.accumulators:
                if p in parts_out:
                    continue
                out_type = runner.graphs.backward.output_types[runner.graphs.grads[p]]
                made = tied.take(named[p], out_type)
                if made is not None:
                    into[p] = made
        # ZeRO-2/3: the gradients written where the reducer reads them, in their bucket
        homes: dict[str, torch.Tensor] = {}
        grad_home = getattr(tied.sink, "grad_home", None) if tied is not None else None
        if grad_home is not None:
            for p in runner.grad_params:
                if p in parts_out or p in into or p in routed:
                    continue
                # (a tied table's too: the other segment's rows are added into it)
                home_t = grad_home(ctx.module.get_parameter(p))
                if home_t is not None:
                    homes[p] = home_t
        in_grads, param_grads = runner.backward(
            ctx.module, ctx.n_inputs, read, list(tensors[n:]), grads, into, parts_out, homes
        )
        del homes
        runner.tally.drop(ctx.saved_bytes)
        if home is not None:  # what no later graph of this micro-step reads goes now
            home.after_backward(ctx.module)
        params: list[torch.Tensor | None] = []
        parts: Parts | None = None
        for p in runner.grad_params:
            grad = param_grads.get(p)
            parts = parts_out.get(p)
            if parts is not None:
                if p in runner.graphs.row_outputs:
                    tied.sink.add_rows(routed[p], *parts)  # type: ignore[union-attr]
                else:
                    tied.sink.take_factors(routed[p], *parts)  # type: ignore[union-attr]
                grad = None
            elif p in routed and grad is not None:  # its pieces' variant could not run
                raise RuntimeError(f"ortrain: the gradient of {routed[p]} came whole")
            elif p in into:  # added in place to the gradient autograd holds for it already
                tied.added(named[p], grad)  # type: ignore[union-attr]
                grad = None
            elif tied is not None and tied.eligible and grad is not None:
                tied.offer(named[p] if p in named else ctx.module.get_parameter(p), grad)
            params.append(grad)
        del into, param_grads, parts_out, parts
        return (None, None, None, None, *in_grads, *params)


class RowsSink(Protocol):
    """Takes a parameter's gradient outside autograd (ZeRO-2/3's reducer): ``routed``
    parameters' gradients come here in pieces, each once per backward that makes one."""

    def add_rows(self, name: str, rows: torch.Tensor, updates: torch.Tensor) -> None:
        """Rows of ``name``'s gradient: ``updates[i]`` adds to row ``rows[i, 0]``."""
        ...

    def take_factors(self, name: str, left: torch.Tensor, right: torch.Tensor) -> None:
        """A product's factors of ``name``'s gradient: it adds ``left^T @ right``."""
        ...

    world_size: int

    def grad_home(self, param: torch.Tensor) -> torch.Tensor | None:
        """Where ``param``'s gradient of this micro-step is to be written, if anywhere."""
        ...

    def route(self, rows: Collection[str], factors: Collection[str]) -> None:
        """From now on the gradients of the parameters named come only through the two
        above: rows (of those in ``rows``) and product factors (``factors``)."""
        ...

    def agree_routes(
        self, routed: frozenset[str], rows: frozenset[str], factors: frozenset[str]
    ) -> tuple[frozenset[str], frozenset[str], frozenset[str]]:
        """What every rank routes, given what this one could (``routed``, of them those
        with ``rows`` and with ``factors``): a collective, called alike on every rank."""
        ...


class TiedGradients:
    """Parameters whose gradient two compiled segments make, one of them by adding
    embedding rows into zeros (a tied embedding and LM head): the first gradient made in a
    backward is remembered (weakly: autograd holds it until the last one is added), and the
    rows segment adds into it in place (``accumulate.py``) instead of making a table-sized
    tensor of its own for autograd to add. A parameter's pre-hook checks that the tensor
    autograd accumulates is the one the rows went into, or that a third segment's
    gradient came after the rows (encoder, decoder and head of a T5 share one table):
    autograd added it to the one holding the rows, in place or (a bucket's view under
    ZeRO-2/3) into a new tensor.

    With a ``sink`` (ZeRO-2/3's reducer) a tied parameter that no eager code reads and
    whose every gradient comes in pieces (the embedding's rows, the head's product factors
    where they are smaller than the table: ``parts_of``) is ``routed`` instead: both
    segments hand the sink their pieces and autograd gets none, so no table-sized
    gradient is made."""

    def __init__(self) -> None:
        self.eligible: set[int] = set()  # id of each parameter it handles
        self.sink: RowsSink | None = None
        self.world_size = 1  # the sink's (whether factors are smaller than the product)
        self.routed: dict[int, str] = {}  # id -> the model's name, for the sink
        self._made: dict[int, weakref.ref[torch.Tensor]] = {}
        self._into: dict[int, int] = {}  # id -> data_ptr of the tensor the rows went into
        self._added_to: set[int] = set()  # ids whose gradient with the rows got another
        self._hooked: set[int] = set()
        self.added_count = 0  # rows added in place so far (a test's figure)

    def watch(self, param: torch.nn.Parameter) -> None:
        self.eligible.add(id(param))
        if id(param) not in self._hooked:
            self._hooked.add(id(param))
            param.register_hook(own_hook(self._checker(id(param))))

    def _checker(self, key: int) -> Callable[[torch.Tensor], None]:
        def check(grad: torch.Tensor) -> None:
            ptr = self._into.pop(key, None)
            summed = key in self._added_to
            self._added_to.discard(key)
            if ptr is not None and grad.data_ptr() != ptr and not summed:
                raise RuntimeError(
                    "ortrain: a tied parameter's gradient was replaced after a segment added "
                    "its embedding rows into it (the rows would be lost); train with "
                    'TrainerOptions(segments="auto") or report this'
                )

        return check

    def offer(self, param: torch.Tensor, grad: torch.Tensor) -> None:
        key = id(param)
        if key in self._into:  # autograd adds it to the gradient holding the rows
            self._added_to.add(key)
        if key in self.eligible and key not in self._made and grad.is_contiguous():
            self._made[key] = weakref.ref(grad)

    def take(self, param: torch.Tensor, out_type: tuple[Any, str]) -> torch.Tensor | None:
        """The gradient of ``param`` another segment made in this backward, if autograd
        still holds it and it has the rows output's shape and type."""
        ref = self._made.pop(id(param), None)
        grad = ref() if ref is not None else None
        shape, dtype = out_type
        if grad is None or tuple(grad.shape) != shape or grad.dtype != _DTYPES.get(dtype):
            return None
        return grad

    def added(self, param: torch.Tensor, grad: torch.Tensor) -> None:
        self._into[id(param)] = grad.data_ptr()
        self.added_count += 1

    def clear(self) -> None:
        """After a backward: what it made is autograd's no more."""
        self._made.clear()
        self._into.clear()
        self._added_to.clear()
