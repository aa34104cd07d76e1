"""Which sub-modules run compiled, and the model that runs them so.

``record_calls`` runs the model's forward once in eager with hooks on every sub-module
and keeps each call (``calls.Call``) and its time. ``plan_segments`` (one build job,
forked where the trainer forks its builds) walks the module tree from the top:

1. a module that was called and holds parameters is compiled for each of its call
   signatures, and every call is checked against eager (its outputs and the gradients of
   its inputs and parameters for random output gradients, ``verify_call``);
2. where that fails (the export, a gradient rule, the check), its children are tried the
   same way and the module's own code runs in eager around them; a module without
   children runs in eager, with the cause kept for the report;
3. modules with the same structure and the same call signature (a transformer's layers)
   share one built graph; each is still checked on its own calls, and one that disagrees
   gets a graph of its own;
4. a module without parameters runs in eager (it is glue: activations, dropout, pooling);
5. cut at repeated blocks (``segments="blocks"``, ZeRO-2): a module that holds repeated
   blocks (``repeated_blocks``) is not compiled whole but cut ("cut"): its own code runs
   in eager and its children are planned, so each block is a segment of its own and
   the blocks share one graph (case 3);
6. a module whose output the forward itself differentiates with ``create_graph=True``
   (``twice.py``), or that holds one, runs in eager: compiled backwards are first-order.

``SegmentedModel`` holds the plan's sessions and, while ``active``, replaces each compiled
module's ``forward`` by a call of its graphs through ``SegmentFunction``. A call whose
signature the plan did not see (another batch shape) is compiled and checked then, or, in
one process at full precision, runs in eager until such calls have lost a build's time
(``_rents``: a size that depends on the data, as the rows a mask selects, rarely comes
back and would otherwise cost a build on every step).
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import time
from collections.abc import Callable, Collection, Iterator, Mapping
from typing import Any

import torch

from ortrain.core.build_config import BuildConfig
from ortrain.core.errors import ExportError, OrtrainError, first_line
from ortrain.core.names import GradientError
from ortrain.distributed.embedding_rows import takes_rows
from ortrain.eager_grads import grads_of
from ortrain.param_dtypes import other_dtype
from ortrain.python_state import kept
from ortrain.rank_memory import MemoryTally
from ortrain.runtime.buffer_pool import ReusePool
from ortrain.runtime.session import BoundSession
from ortrain.segments.build import GraphBytes, SegmentGraphs, build_segment
from ortrain.segments.calls import Call, Uncompilable
from ortrain.segments.runner import (
    ParamHome,
    RowsSink,
    SegmentFunction,
    SegmentRunner,
    TiedGradients,
)
from ortrain.segments.twice import TwiceWatch, refuse_twice
from ortrain.ski_rental import Rented, keeps_renting
from ortrain.verify import (
    Draws,
    Mismatch,
    Tolerance,
    compare,
    confirm,
    eager_run,
    in_float64,
    in_float64_run,
    in_mode,
    lost_dropout,
    no_dropout,
    restoring,
    with_written,
    written_grads,
)

SessionFactory = Callable[[GraphBytes], BoundSession]
Key = tuple  # (call signature, module.training)


@dataclasses.dataclass
class Recorded:
    """One eager forward's calls of every sub-module."""

    calls: dict[str, list[Call | Uncompilable]]
    training: dict[str, list[bool]]
    seconds: dict[str, float]  # per module, its calls' time (inclusive)
    total: float  # the whole forward
    order: list[str] = dataclasses.field(default_factory=list)  # every call, as they began
    # modules whose outputs the forward differentiates with create_graph=True (``twice``)
    twice: frozenset[str] = frozenset()


def record_calls(module: torch.nn.Module, run: Callable[[], Any]) -> Recorded:
    """Run ``run()`` (an eager forward of ``module``) with hooks on every sub-module but
    TorchScript ones (which take no hooks, and run in eager as they are)."""
    calls: dict[str, list[Call | Uncompilable]] = collections.defaultdict(list)
    training: dict[str, list[bool]] = collections.defaultdict(list)
    seconds: dict[str, float] = collections.defaultdict(float)
    started: dict[str, list[float]] = collections.defaultdict(list)
    order: list[str] = []
    twice = TwiceWatch()
    handles = []
    for name, m in module.named_modules():
        if not name or isinstance(m, torch.jit.ScriptModule):
            continue

        def pre(mod: torch.nn.Module, args: tuple, kwargs: dict, name: str = name) -> None:
            try:
                calls[name].append(Call.of(args, kwargs).detached())
            except Uncompilable as exc:
                calls[name].append(exc)
            training[name].append(mod.training)
            order.append(name)
            started[name].append(time.perf_counter())

        def post(
            mod: torch.nn.Module, args: tuple, kwargs: dict, out: Any, name: str = name
        ) -> None:
            seconds[name] += time.perf_counter() - started[name].pop()
            twice.watch(name, out)

        handles.append(m.register_forward_pre_hook(pre, with_kwargs=True))
        handles.append(m.register_forward_hook(post, with_kwargs=True))
    start = time.perf_counter()
    try:
        # a look, not a step: no statistics update, no Python attribute advanced; a
        # torch.compile'd sub-module runs as its eager self (under dynamo its modules' hooks
        # would see fake tensors, or none)
        with restoring(list(module.buffers())), kept(module), _dynamo_off(module):
            run()
    finally:
        for h in handles:
            h.remove()
    total = time.perf_counter() - start
    return Recorded(
        dict(calls), dict(training), dict(seconds), total, order, frozenset(twice.names)
    )


def _is_compiled_wrapper(m: torch.nn.Module) -> bool:
    """A ``torch.compile``'d module (dynamo's wrapper around ``m._orig_mod``)."""
    inner = getattr(m, "_orig_mod", None)
    return type(m).__name__ == "OptimizedModule" and isinstance(inner, torch.nn.Module)


@contextlib.contextmanager
def _dynamo_off(module: torch.nn.Module) -> Iterator[None]:
    """Each ``torch.compile``'d sub-module calls its module as it is for the duration
    (its compiled code, once made, runs whatever dynamo's config says)."""
    held = []
    for m in module.modules():
        if _is_compiled_wrapper(m):
            held.append((m, m.__dict__.get("forward")))
            m.forward = m._orig_mod.__call__
    try:
        yield
    finally:
        for m, forward in held:
            if forward is None:
                del m.forward
            else:
                m.forward = forward


def _original_forward(module: torch.nn.Module) -> Callable[..., Any]:
    return type(module).forward.__get__(module)


def _structure(module: torch.nn.Module, key: Key) -> tuple:
    """What two modules sharing a graph must have in common (their Python attributes are
    not in it: each module's own check catches one that differs)."""
    params = tuple(
        (n, tuple(p.shape), p.dtype, p.requires_grad) for n, p in module.named_parameters()
    )
    buffers = tuple((n, tuple(b.shape), b.dtype) for n, b in module.named_buffers())
    return (type(module).__module__, type(module).__qualname__, repr(module), params, buffers, key)


_EagerCall = tuple[list[torch.Tensor], list[torch.Tensor | None], list[torch.Tensor], list, Draws]


def _eager_call(
    module: torch.nn.Module, call: Call, runner: SegmentRunner, seeds: list | None
) -> _EagerCall:
    """Eager ``module(*call)`` without dropout, in the module's dtype: (its tensors with
    grad as they require it, the gradients of those and of ``runner.grad_params`` for
    output gradients ``seeds`` (drawn when None), the outputs, the seeds, what it drew);
    its draws at their fixed values (``verify.eager_run``)."""
    return eager_run(
        lambda fixed: _eager_call_once(module, call, runner, seeds, fixed), lambda r: r[4]
    )


def _eager_call_once(
    module: torch.nn.Module, call: Call, runner: SegmentRunner, seeds: list | None, fixed: bool
) -> _EagerCall:
    dtype = next((p.dtype for p in module.parameters()), torch.float32)
    tensors = [
        (t.detach().to(dtype) if t.is_floating_point() else t.detach())
        .clone()
        .requires_grad_(t.requires_grad and t.is_floating_point())
        for t in call.tensors
    ]
    args, kwargs = call.with_tensors(tensors)
    params = dict(module.named_parameters())
    inputs = [t for t in tensors if t.requires_grad]
    wrt = inputs + [params[p] for p in trainable(module)]
    # the buffers (BatchNorm statistics) are put back after the backward, which checks
    # that nothing it saved was changed in place
    with (
        written_grads(list(params.values())) as written,
        kept(module),
        restoring(list(module.buffers())),
        no_dropout(fixed) as skipped,
        torch.enable_grad(),
    ):
        out = _original_forward(module)(*args, **kwargs)
        outs = runner.graphs.result.tensors(out)
        if seeds is None:
            gen = torch.Generator().manual_seed(0)
            seeds = [
                torch.randn(o.shape, generator=gen, dtype=o.dtype).to(o.device)
                if o.is_floating_point()
                else None
                for o in outs
            ]
        pairs = [
            (o, s.to(o.dtype)) for o, s in zip(outs, seeds) if s is not None and o.requires_grad
        ]
        grads = (
            grads_of([o for o, _ in pairs], wrt, [s for _, s in pairs])
            if pairs and wrt
            else [None] * len(wrt)
        )
    by_name = dict(zip(params, written, strict=True))
    grads = [
        *grads[: len(inputs)],
        *with_written(grads[len(inputs) :], [by_name[n] for n in trainable(module)]),
    ]
    return tensors, grads, [o.detach() for o in outs], seeds, skipped.draws


def trainable(module: torch.nn.Module) -> list[str]:
    """The parameters a check compares: every one that requires grad (one the graph
    computes no gradient for must get none in eager either)."""
    return [n for n, p in module.named_parameters() if p.requires_grad]


def _named(module: torch.nn.Module, tensors: list[torch.Tensor], grads: list, outs: list):
    """(outputs by name, gradients by name) of one side of a check."""
    outputs = {f"output {k}": o for k, o in enumerate(outs)}
    grad_inputs = [k for k, t in enumerate(tensors) if t.requires_grad]
    named = {f"gradient of input {k}": g for k, g in zip(grad_inputs, grads)}
    named.update(zip(trainable(module), grads[len(grad_inputs) :]))
    return outputs, named


def verify_call(
    module: torch.nn.Module,
    call: Call,
    runner: SegmentRunner,
    tol: Tolerance,
    training: bool = True,
) -> list[Mismatch]:
    """The compiled call against eager on the same inputs and weights, without dropout:
    outputs, and the gradients of the inputs and parameters for random output gradients;
    a mismatch stands only if a float64 eager run confirms it (``verify.confirm``). A
    graph that draws random numbers no switch fixes is not compared (eager draws others),
    nor one whose eager call draws what has no fixed value (``fixed_draws.py``): it
    passes, and ``ModulePlan.unchecked`` says so (``runner.unchecked``)."""
    if runner.graphs.forward.draws:
        return []
    with in_mode(module, training):  # the mode the call was made (and compiled) in
        return _verify_call(module, call, runner, tol)


def _verify_call(
    module: torch.nn.Module, call: Call, runner: SegmentRunner, tol: Tolerance
) -> list[Mismatch]:
    tensors, grads, outs, seeds, draws = _eager_call(module, call, runner, None)
    if draws.unverified:
        runner.unchecked = f"it draws random numbers ({', '.join(draws.unverified)})"
        return []
    with restoring(list(module.buffers())), runner.dropout(False), torch.no_grad():
        couts, saved = runner.forward(module, tensors)
        zeros = [torch.zeros_like(o) if s is None else s for o, s in zip(couts, seeds)]
        read = {k: tensors[k] for k in runner.backward_reads}
        in_grads, param_grads = runner.backward(module, len(tensors), read, saved, zeros)
    want_out, want = _named(module, tensors, grads, outs)
    got_out = {f"output {k}": o for k, o in enumerate(couts)}
    got = {f"gradient of input {k}": in_grads[k] for k, t in enumerate(tensors) if t.requires_grad}
    got.update(param_grads)
    bad_out = compare(got_out, want_out, tol.loss)
    bad = compare(got, want, tol.grad, tol.floor)
    if bad_out or bad:
        module64 = in_float64(module)  # a copy: the modes it runs in, each sub-module's
        exact_call = in_float64_run(lambda: _eager_call(module64, call, runner, seeds))
        if exact_call is not None:
            t64, g64, o64, _, _ = exact_call
            exact_out, exact = _named(module64, t64, g64, o64)
            bad_out = confirm(bad_out, got_out, want_out, exact_out, tol.loss)
            bad = confirm(bad, got, want, exact, tol.grad)
    lost = lost_dropout(draws.dropouts, runner.graphs.forward.dropouts)
    return bad_out + bad + ([lost] if lost is not None else [])


@dataclasses.dataclass
class ModulePlan:
    """One module's outcome."""

    name: str
    status: str  # "compiled" | "eager" | "split" (its children were tried) | "cut" (case 5)
    cause: str = ""  # why not compiled (eager / split)
    graphs: dict[Key, int] = dataclasses.field(default_factory=dict)  # -> index in Plan.graphs
    seconds: float = 0.0  # eager time of its calls in the recording forward
    calls: int = 0
    unchecked: str = ""  # why a compiled call could not be checked against eager


@dataclasses.dataclass
class Plan:
    modules: list[ModulePlan]
    graphs: list[SegmentGraphs]
    verify_seconds: float = 0.0


CUT = "cut at its repeated blocks"


def _holds_blocks(name: str, blocks: frozenset[str]) -> bool:
    """``name`` holds a repeated block and is not one, nor inside one."""
    if any(name == b or name.startswith(b + ".") for b in blocks):
        return False
    return any(b.startswith(name + ".") for b in blocks)


def _cause(exc: BaseException) -> str:
    kind = type(exc).__name__
    return f"{kind}: {first_line(exc)}"


def plan_segments(
    module: torch.nn.Module,
    recorded: Recorded,
    config: BuildConfig,
    session: SessionFactory,
    device: torch.device,
    tol: Tolerance | None,
    only: str | None = None,
    blocks: frozenset[str] = frozenset(),
    stateful: Mapping[str, str] | None = None,
) -> Plan:
    """Cases 1-4 of the module docstring (``only``: plan that one module alone;
    ``blocks``: the repeated blocks to cut at, case 5; ``stateful``: the modules whose
    forward changes their Python attributes on every call, which run in eager)."""
    stateful = stateful or {}
    plans: list[ModulePlan] = []
    graphs: list[SegmentGraphs] = []
    shared: dict[tuple, int] = {}  # structure -> graph index
    # parameters held by more than one module (a tied table): their gradients' pieces
    owners = collections.Counter(
        id(p) for _, sub in module.named_modules() for p in sub.parameters(recurse=False)
    )
    runners: dict[int, SegmentRunner] = {}
    spent = [0.0]

    def runner(i: int) -> SegmentRunner:
        if i not in runners:
            runners[i] = SegmentRunner(graphs[i], session, device)
        return runners[i]

    def compile_module(name: str, m: torch.nn.Module) -> ModulePlan:
        mp = ModulePlan(name, "compiled", seconds=recorded.seconds.get(name, 0.0))
        entries = recorded.calls[name]
        mp.calls = len(entries)
        for call, training in zip(entries, recorded.training[name]):
            if isinstance(call, Uncompilable):
                raise call
            key = (call.signature, training)
            if key in mp.graphs:
                continue
            struct = _structure(m, key)
            index = shared.get(struct)
            if index is not None and tol is not None:
                start = time.perf_counter()
                bad = verify_call(m, call, runner(index), tol, training)
                spent[0] += time.perf_counter() - start
                if bad:
                    index = None  # another module's graph does not fit this one: its own
            if index is None:
                with in_mode(m, training):
                    tied = [n for n, p in m.named_parameters() if owners[id(p)] > 1]
                    built = build_segment(m, call, training, config, tied)
                graphs.append(built)
                index = len(graphs) - 1
                shared.setdefault(struct, index)
                if tol is not None:
                    start = time.perf_counter()
                    bad = verify_call(m, call, runner(index), tol, training)
                    spent[0] += time.perf_counter() - start
                    if bad:
                        worst = bad[0].describe()
                        raise _Mismatched(f"its first step disagrees with eager ({worst})")
            mp.graphs[key] = index
            draws = graphs[index].forward.draws
            if draws:
                mp.unchecked = f"it draws random numbers ({', '.join(draws)})"
            elif runner(index).unchecked:
                mp.unchecked = runner(index).unchecked
        return mp

    def visit(name: str, m: torch.nn.Module) -> None:
        if blocks and _holds_blocks(name, blocks):
            if name in recorded.calls:  # (a ModuleList is never called: nothing to say)
                calls, seconds = len(recorded.calls[name]), recorded.seconds.get(name, 0.0)
                plans.append(ModulePlan(name, "cut", CUT, seconds=seconds, calls=calls))
            for child, cm in m.named_children():
                visit(f"{name}.{child}", cm)
            return
        if name in recorded.calls and any(p.requires_grad for p in m.parameters()):
            try:
                _keeps_no_python_state(name, stateful)
                if (why := other_dtype(m)) != "":
                    raise _Mismatched(why)
                if (why := refuse_twice(name, recorded.twice)) is not None:
                    raise _Mismatched(why)
                if _is_compiled_wrapper(m):  # its module, a child, compiles in its place
                    raise _Mismatched("a torch.compile'd module: its own module is tried")
                plans.append(compile_module(name, m))
                return
            except (ExportError, GradientError, Uncompilable, _Mismatched, OrtrainError) as exc:
                cause = _cause(exc) if not isinstance(exc, _Mismatched) else str(exc)
            except Exception as exc:
                cause = _cause(exc)
            children = list(m.named_children())
            status = "split" if children else "eager"
            seconds = recorded.seconds.get(name, 0.0)
            plans.append(
                ModulePlan(name, status, cause, seconds=seconds, calls=len(recorded.calls[name]))
            )
            for child, cm in children:
                visit(f"{name}.{child}", cm)
            return
        if name in recorded.calls:  # glue without parameters: eager, not a fallback
            return
        for child, cm in m.named_children():  # never called itself (a ModuleList)
            visit(f"{name}.{child}" if name else child, cm)

    if only is not None:
        visit(only, module.get_submodule(only))
    else:
        for child, cm in module.named_children():
            visit(child, cm)
    return Plan(plans, graphs, spent[0])


class _Mismatched(Exception):
    """A compiled call disagreed with eager."""


def _keeps_no_python_state(name: str, stateful: Mapping[str, str]) -> None:
    """Raises where ``name`` or a module inside it changes Python attributes on every
    call (``ortrain/python_state.py``): a graph would hold them at one value."""
    for owner, attrs in sorted(stateful.items()):
        if owner == name or owner.startswith(name + "."):
            whose = "its" if owner == name else f"{owner[len(name) + 1 :]}'s"
            raise _Mismatched(
                f"{whose} forward changes Python state or a buffer's shape from call to "
                f"call ({attrs}), which a graph would hold at one value"
            )


class SegmentedModel:
    """A module run in eager PyTorch with its planned sub-modules compiled (``active``)."""

    def __init__(
        self,
        module: torch.nn.Module,
        plan: Plan,
        session: SessionFactory,
        device: torch.device,
        replan: Callable[[str, Call, bool], Plan],
        home: ParamHome | None = None,
        reuse_outputs: bool = False,
    ):
        self.module = module
        self.home = home  # ZeRO-3: gathers a compiled module's parameters around its calls
        self.device = device
        self.session = session
        self.replan = replan  # plan one module for a call signature the plan has not seen
        self.plans: dict[str, ModulePlan] = {}
        self.runners: dict[str, dict[Key, SegmentRunner | None]] = {}
        self.builds = 0
        self.tally = MemoryTally()  # what every runner's calls hold (``memory_report``)
        # every runner's output tensors, reused step to step (``reuse_outputs``; on CUDA
        # torch's allocator caches them)
        self.outputs = ReusePool() if reuse_outputs and device.type == "cpu" else None
        # the eager cross-entropy's buffers (``pooled_loss.py``; on CUDA torch caches them):
        # a pool of their own, whose peak is theirs (in the outputs' pool they would
        # count against the segments' peak and push out the tied table's gradient)
        self.loss_pool = ReusePool() if device.type == "cpu" else None
        self.tied = TiedGradients()
        self._read_in_eager: frozenset[str] = frozenset()
        # what this rank would route (``_watch_tied``), until the ranks agree on it
        self._proposed: tuple[dict[int, str], frozenset[str], frozenset[str]] | None = None
        # a compiled module's new call signatures run in eager until a build pays
        # (``ski_rental.py``): their eager calls, the module's last build's seconds, and
        # before any, the plan's seconds per graph (``plan_price``, set after the plan)
        # (``SegmentedTraining`` turns it on where eager calls may stand in)
        self.rent_signatures = False
        self.rented: dict[tuple[str, Key], Rented] = {}
        self.build_seconds: dict[str, float] = {}
        self.plan_price: float | None = None
        self.adopt(plan)

    def _runner(self, graphs: SegmentGraphs) -> SegmentRunner:
        runner = SegmentRunner(graphs, self.session, self.device)
        runner.tally = self.tally
        runner.pool = self.outputs
        runner.tied = self.tied
        self.builds += 1
        return runner

    def _watch_tied(self) -> None:
        """Parameters whose gradient two runners make, one of which can add its rows into
        the other's (``TiedGradients``)."""
        modules = dict(self.module.named_modules())
        makers: dict[int, set[int]] = {}
        adders: dict[int, torch.nn.Parameter] = {}
        for name, table in self.runners.items():
            m = modules[name]
            for runner in table.values():
                if runner is None:
                    continue
                for p in runner.grad_params:
                    makers.setdefault(id(m.get_parameter(p)), set()).add(id(runner))
                for p in runner.graphs.accumulators:
                    param = m.get_parameter(p)
                    adders[id(param)] = param
        for key, param in adders.items():
            if len(makers.get(key, ())) >= 2:
                self.tied.watch(param)
        if self.tied.sink is None:
            return
        names = {id(p): n for n, p in self.module.named_parameters()}
        routed = {
            key: names[key]
            for key in self.tied.eligible
            if key in names and names[key] not in self._read_in_eager
        }
        # routed: those whose every gradient a micro-step makes comes in pieces (the
        # embedding's rows, the head's factors where smaller than the table)
        rows: set[str] = set()
        factors: set[str] = set()
        whole: set[str] = set()
        world = self.tied.world_size
        for name, table in self.runners.items():
            m = modules[name]
            for runner in {id(r): r for r in table.values() if r is not None}.values():
                ids = {p: id(m.get_parameter(p)) for p in runner.grad_params}
                mine = {p: routed[k] for p, k in ids.items() if k in routed}
                pieces = runner.parts_of(mine, world)
                for p, full in mine.items():
                    if p not in pieces:
                        whole.add(full)
                    elif p in runner.graphs.row_outputs:
                        rows.add(full)
                    else:
                        factors.add(full)
        routed = {k: n for k, n in routed.items() if n not in whole}
        self._proposed = (routed, frozenset(rows - whole), frozenset(factors - whole))

    def settle_routes(self) -> None:
        """Before a backward: the tied parameters routed to the sink from now on, as
        every rank agrees (``RowsSink.agree_routes``). What a rank could route depends on
        the call signatures its own batches built (a head's factors are smaller than its
        table only for few tokens; a second signature of an embedding makes it a maker
        twice), while the collectives that land the pieces must be every rank's alike."""
        sink = self.tied.sink
        if sink is None or self._proposed is None:
            return
        routed, rows, factors = self._proposed
        names, rows, factors = sink.agree_routes(frozenset(routed.values()), rows, factors)
        agreed = {k: n for k, n in routed.items() if n in names}
        if agreed == self.tied.routed:
            return
        self.tied.routed = agreed
        sink.route(rows, factors)

    def route_rows(self, sink: RowsSink, read_in_eager: Collection[str]) -> None:
        """ZeRO-2/3: tied parameters that only compiled segments read take their gradient
        to ``sink`` outside autograd (``TiedGradients``); ``read_in_eager``: the
        parameters eager code reads (autograd would make a gradient of them the sink
        does not see). Every rank calls it alike (the plan of the first micro-step)."""
        self._read_in_eager = frozenset(read_in_eager)
        self.tied.sink = sink
        self.tied.world_size = sink.world_size
        self._watch_tied()
        self.settle_routes()

    def adopt(self, plan: Plan) -> None:
        made: dict[int, SegmentRunner] = {}
        for mp in plan.modules:
            self.plans[mp.name] = mp
            if mp.status != "compiled":
                continue
            table = self.runners.setdefault(mp.name, {})
            for key, index in mp.graphs.items():
                if index not in made:
                    made[index] = self._runner(plan.graphs[index])
                table[key] = made[index]
        self._watch_tied()

    @property
    def compiled(self) -> list[str]:
        return [n for n, p in self.plans.items() if p.status == "compiled"]

    def uncompiled_parameters(self) -> list[str]:
        """Parameters no compiled module holds (eager code reads them)."""
        modules = dict(self.module.named_modules())
        covered = {id(p) for n in self.compiled for p in modules[n].parameters()}
        return [n for n, p in self.module.named_parameters() if id(p) not in covered]

    @property
    def fallbacks(self) -> list[ModulePlan]:
        return [p for p in self.plans.values() if p.status not in ("compiled", "cut")]

    def compiled_seconds(self) -> float:
        seen: dict[int, SegmentRunner] = {}
        for table in self.runners.values():
            for r in table.values():
                if r is not None:
                    seen[id(r)] = r
        return sum(r.seconds for r in seen.values())

    def _forward_of(self, name: str, m: torch.nn.Module) -> Callable[..., Any]:
        original = _original_forward(m)
        table = self.runners[name]

        def forward(*args: Any, **kwargs: Any) -> Any:
            if self.home is None:
                return run(args, kwargs)[0]
            if not self._acquire_rows(m, args, kwargs):
                self.home.acquire(m)
            in_eager = False
            try:
                out, in_eager = run(args, kwargs)
                return out
            finally:
                if in_eager and torch.is_grad_enabled():
                    self.home.hold(m)  # autograd saved what eager read
                else:
                    self.home.release(m)

        def run(args: tuple, kwargs: dict) -> tuple[Any, bool]:
            """The call's output, and whether it ran in eager."""
            try:
                call = Call.of(args, kwargs)
            except Uncompilable:
                return original(*args, **kwargs), True
            key = (call.signature, m.training)
            if key not in table:
                if self._rents(name, key, call, table):
                    start = time.perf_counter()
                    out = original(*args, **kwargs)
                    took = time.perf_counter() - start
                    self.rented.setdefault((name, key), Rented()).add(took, _elements(call))
                    return out, True
                start = time.perf_counter()
                table[key] = self._build(name, call, m.training)
                if m.training:
                    self.build_seconds[name] = time.perf_counter() - start
                self._watch_tied()
            runner = table[key]
            if runner is None:
                return original(*args, **kwargs), True
            params = dict(m.named_parameters())
            outs = SegmentFunction.apply(
                runner,
                m,
                self.home,
                len(call.tensors),
                *call.tensors,
                *[params[p] for p in runner.grad_params],
            )
            return runner.graphs.result.build(list(outs)), False

        # a module inside a torch.compile'd one: dynamo would trace the runner's sessions
        # with fake tensors; it calls the segment as it is instead (a graph break)
        return torch._dynamo.disable(forward)

    def _rents(self, name: str, key: Key, call: Call, table: dict) -> bool:
        """Whether ``name``'s call of a signature without a graph runs in eager rather
        than build one now: weighed (``ski_rental.py``) against the module's compiled
        forward time per input element and the time its last build took. A signature that
        depends on the data (the rows a mask selects, the tokens routed to an expert) comes
        back rarely and is not built each step. Not before the module's graphs have run."""
        if not self.rent_signatures or not key[1]:
            return False  # (evaluation calls run in eager: ``_build``)
        runners = {id(r): r for r in table.values() if r is not None and r.forward_elements}
        price = self.build_seconds.get(name, self.plan_price)
        if not runners or price is None:
            return False
        seconds = sum(r.forward_seconds for r in runners.values())
        per_element = seconds / sum(r.forward_elements for r in runners.values())
        return keeps_renting(self.rented.get((name, key)), per_element, _elements(call), price)

    def eager_calls(self, name: str) -> int:
        """``name``'s calls that ran in eager for a signature without a graph (so far)."""
        return sum(r.steps for (n, _), r in self.rented.items() if n == name)

    def _acquire_rows(self, m: torch.nn.Module, args: tuple, kwargs: dict) -> bool:
        """ZeRO-3: an embedding's call takes only the rows its ids read
        (``ShardedParams.acquire_rows``, a collective: decided on what every rank's call
        has alike, not on which signatures this rank has built); False where the module
        is acquired whole."""
        acquire_rows = getattr(self.home, "acquire_rows", None)
        if acquire_rows is None or not takes_rows(m) or kwargs or len(args) != 1:
            return False
        if not isinstance(args[0], torch.Tensor):
            return False
        return bool(acquire_rows(m, args[0]))

    def _build(self, name: str, call: Call, training: bool) -> SegmentRunner | None:
        """A signature first seen now: plan that module alone for it (eager if it fails)."""
        if not training:
            return None  # evaluation-mode calls run in eager
        with self._own_forwards():
            plan = self.replan(name, call, training)
        mine = [p for p in plan.modules if p.name == name and p.status == "compiled"]
        if not mine:
            return None
        index = next(iter(mine[0].graphs.values()))
        return self._runner(plan.graphs[index])

    @contextlib.contextmanager
    def _own_forwards(self) -> Iterator[None]:
        """Inside ``active``: the modules' own forwards back, for a plan that exports and
        checks a module as it is. Its patched forward would gather ZeRO-3's parameters
        inside the exporter's trace (fake buffers assigned to the real parameters) and
        run collectives in a forked build's child."""
        patched = {}
        for name in self.runners:
            m = self.module.get_submodule(name)
            forward = m.__dict__.pop("forward", None)
            if forward is not None:
                patched[name] = (m, forward)
        try:
            yield
        finally:
            for m, forward in patched.values():
                m.forward = forward  # type: ignore[method-assign]

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        """Compiled modules run their graphs inside (their ``forward`` is replaced)."""
        patched = []
        modules = dict(self.module.named_modules())
        try:
            for name in self.runners:
                m = modules[name]
                m.forward = self._forward_of(name, m)  # type: ignore[method-assign]
                patched.append(m)
            yield
        finally:
            for m in patched:
                del m.forward


def _elements(call: Call) -> int:
    """The call's tensor elements: what a graph's forward time scales with."""
    return sum(t.numel() for t in call.tensors) or 1


def eager_share(plan_modules: Mapping[str, ModulePlan], recorded_total: float) -> float:
    """The share of the recording forward's time outside compiled modules."""
    compiled = sum(p.seconds for p in plan_modules.values() if p.status == "compiled")
    if recorded_total <= 0:
        return 0.0
    return max(0.0, 1.0 - compiled / recorded_total)
