"""The optimizer update's engines behind one interface, and the one place that picks one.

An engine (``UpdateEngine``) is made over the ``TrainingState`` when the trainer is; after
the first gradient graph is built (the parameters the loss reaches are known) the trainer
calls ``prepare`` once, ``bind_train`` for every gradient graph's session, ``before_run``
before each gradient graph run (engines ``in_backward`` only: the update in the graph reads
this step's hyperparameters) and ``step`` at the end of each accumulation window. The
engines (``TrainerOptions.update_engine``):

1. "backward" (``BackwardUpdate``): each parameter's Adam/AdamW update runs inside the
   gradient graph (``graph_passes/targets/cpu/update_in_backward.py``): no gradient
   buffers; per param group the hyperparameters the graph reads, per parameter whether its
   update ran;
2. "kernels" (``KernelUpdate``): the fused kernels of ``cuda_kernels/`` over flat
   buffers (``fused_update.py``);
3. "torch" (``TorchUpdate``): torch's fused Adam/AdamW kernels over flat gradients and
   moments (``torch_update.py``);
4. "graph" (``GraphUpdate``): the update graph in an ONNX Runtime session; under data
   parallel the reducer all-reduces the gradients around its run;
5. "zero1" (``ShardUpdate``): ZeRO-1's update graph over this rank's shard, laid out and
   bound by ``ortrain/distributed/sharded_state.py``, run between its collectives;
6. "zero-torch" (``ShardTorchUpdate``): torch's fused Adam/AdamW kernels over the pieces
   of this rank's shard (ZeRO-1, -2 and -3 on CPU), between the same collectives: no
   update graph to build, one pass over each piece; "zero-backward"
   (``ShardBackwardUpdate``, ZeRO-2/3 without clipping, scaling or accumulation): the same
   kernels over each gradient bucket's stretch as its reduce lands, in the backward: no
   gradient shard kept;
7. "zero-eager" (``ShardEagerUpdate``): under ZeRO, an elementwise torch optimizer's own
   ``step()`` over this rank's pieces (``ortrain/optim/sharded_eager.py``);
8. "eager" (``EagerUpdate``): any other optimizer's own ``step()`` over whole tensors.

``choose_engine`` decides from the options, the device, the optimizer, the process group
and one build fact (a gradient graph that could not take the update in its backward).
"""

from __future__ import annotations

import bisect
import dataclasses
import os
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

import torch

from ortrain.core.errors import UnsupportedOptimizerError
from ortrain.core.names import (
    HYPER_NAMES,
    IN_BACKWARD_STATES,
    UpdateInBackwardError,
    hyper_name,
    state_key,
)
from ortrain.core.optimizer_spec import EAGER, SHARDED_EAGER
from ortrain.core.roles import Role
from ortrain.optim.sharded_eager import hyperparameters, make_like
from ortrain.runtime import kernels
from ortrain.runtime.flat_update import flatten_update
from ortrain.runtime.fused_update import (
    KERNEL_KINDS,
    FusedUpdate,
    check_supported,
    kernels_available,
)
from ortrain.runtime.outside_steps import own_step
from ortrain.runtime.session import BoundSession
from ortrain.runtime.torch_update import TORCH_KINDS, TorchFusedUpdate
from ortrain.runtime.training_state import TrainingState
from ortrain.runtime.zero_pages import populate, release

if TYPE_CHECKING:
    import onnx_ir as ir

    from ortrain.build import BuiltGraph
    from ortrain.graph_passes.training.optimizer import UpdateGraph

Values = list[dict[str, float]]  # per param group: this step's hyperparameters


class Reducer(Protocol):
    """What the update engines call on a distributed run (``ortrain/distributed``: data
    parallel, ZeRO-1, -2, -3); checkpoints go through it too."""

    world_size: int

    def prepare_update(self, state: TrainingState, engine: GraphUpdate) -> bool:
        """Lay out ``state.grads``; True when it also bound ``engine``'s update session."""
        ...

    def update(self, run_update: Callable[[], None]) -> None:
        """Reduce the gradients across ranks around ``run_update`` (the update graph)."""
        ...

    def state_dict(self, training: TrainingState) -> dict[str, Any]: ...

    def load_state_dict(self, training: TrainingState, state: Mapping[str, Any]) -> None: ...

    def save_checkpoint(self, training: TrainingState, path: str | os.PathLike) -> None: ...

    def load_checkpoint(self, training: TrainingState, path: str | os.PathLike) -> None: ...


@dataclasses.dataclass(frozen=True)
class EngineEnv:
    """What an engine takes from the trainer to build and bind its sessions."""

    # a session on the trainer's device and stream (graph_capture: as a CUDA graph where
    # TrainerOptions.cuda_graph says so)
    session: Callable[..., BoundSession]
    save: Callable[[ir.Model, str], None]  # keeps a graph where save_graphs_dir says
    reducer: Reducer | None = None


class UpdateEngine(Protocol):
    name: ClassVar[str]
    in_backward: ClassVar[bool]  # the gradient graph itself runs the update

    @property
    def update_graph(self) -> UpdateGraph | None:
        """The update graph the engine runs (None: kernels, or in the backward)."""
        ...

    def prepare(self) -> bool:
        """After the first gradient graph: lay out gradients and state, build what runs
        the update. True when parameters, gradients or state moved (sessions bound to the
        old tensors must be rebuilt)."""
        ...

    def bind_train(self, session: BoundSession, built: BuiltGraph) -> None:
        """Bind a gradient graph's update-side inputs and outputs."""
        ...

    def before_run(self, values: Values) -> None:
        """Before each gradient graph run; called only where ``in_backward`` (the others
        read the hyperparameters in ``step``)."""
        ...

    def step(self, values: Values, grad_scale: float) -> None:
        """The end of an accumulation window: apply the update (counted in the state's
        step when its gradients were finite)."""
        ...

    def applied(self) -> tuple[int, int]:
        """(parameters updated, parameters) by the last gradient graph run: nonzero only
        where the update runs in the backward."""
        ...


class _AfterBackward:
    """Engines that run after the gradient graph, which writes ``state.grads``."""

    name: ClassVar[str]
    in_backward: ClassVar[bool] = False

    def __init__(self, state: TrainingState, env: EngineEnv):
        self.state = state
        self.env = env

    @property
    def update_graph(self) -> UpdateGraph | None:
        return None

    def bind_train(self, session: BoundSession, built: BuiltGraph) -> None:
        """Each gradient output into its parameter's gradient buffer (two outputs of one
        gradient share it: ``scatter_in_place.py``)."""
        st = self.state
        assert st.grad_params is not None
        session.bind_outputs({r.name: st.grads[r.of] for r in built.roles(Role.GRADIENT)})

    def before_run(self, values: Values) -> None:
        pass

    def applied(self) -> tuple[int, int]:
        return 0, 0


class GraphUpdate(_AfterBackward):
    """The update graph (clipping, overflow check, optimizer) in a session of its own."""

    name = "graph"

    def __init__(self, state: TrainingState, env: EngineEnv):
        super().__init__(state, env)
        self.graph: UpdateGraph | None = None
        self.session: BoundSession | None = None
        self.hyper: dict[str, torch.Tensor] = {}  # hyperparameter inputs: group<i>.<name>

    @property
    def update_graph(self) -> UpdateGraph | None:
        return self.graph

    def prepare(self) -> bool:
        st = self.state
        assert st.grad_params is not None
        # Distributed: gradients become views of one flat buffer; ZeRO-1 also builds and
        # binds the update graph of this rank's shard instead of the one below.
        if self.env.reducer is not None and self.env.reducer.prepare_update(st, self):
            return False
        from ortrain.graph_passes.training.optimizer import (
            build_update_graph,  # the graph libraries: only here
        )

        flat = flatten_update(st)
        if flat is not None:  # one update chain per param group (memory moved)
            spec, shapes = flat.spec, flat.shapes
            params, grads, states = flat.params, flat.grads, flat.states
        else:
            spec = st.spec
            shapes = {p: tuple(st.params[p].shape) for p in st.grad_params}
            for p in st.grad_params:
                st.grads.setdefault(p, torch.zeros_like(st.params[p]))
                for g in spec.groups:
                    if p in g.params:
                        for s in spec.state_names(g):
                            key = state_key(s, p)
                            st.opt_state.setdefault(key, torch.zeros_like(st.params[p]))
            params = {p: st.params[p] for p in st.grad_params}
            grads = {p: st.grads[p] for p in st.grad_params}
            states = st.opt_state
        ug = build_update_graph(
            spec,
            shapes,
            clip_grad_norm=st.max_grad_norm is not None,
            skip_nonfinite=st.scaler is not None,
        )
        self.save_graph(ug.model, "update")
        self.bind(ug, params, {f"grad:{p}": t for p, t in grads.items()}, states)
        return flat is not None

    def new_session(self, model: ir.Model, *, graph_capture: bool = False) -> BoundSession:
        """A session for ``model`` on the trainer's device and stream."""
        return self.env.session(model, graph_capture=graph_capture)

    def save_graph(self, model: ir.Model, name: str) -> None:
        """Keep ``model`` as ``<name>.onnx`` where ``save_graphs_dir`` says (if set)."""
        self.env.save(model, name)

    def bind(
        self,
        ug: UpdateGraph,
        params: Mapping[str, torch.Tensor],
        grads: Mapping[str, torch.Tensor],
        states: Mapping[str, torch.Tensor],
        extra: Mapping[str, torch.Tensor] | None = None,
    ) -> None:
        """The session for ``ug``; every aliased output bound to its input's buffer.

        ``grads`` are keyed by graph input name (``grad:<param>``); ``extra`` holds other
        inputs (ZeRO-1's ``global_sq_norm``).
        """
        st = self.state
        self.graph = ug
        self.hyper = {
            io.name: torch.zeros((), dtype=torch.float32, device=st.device)
            for io in ug.io
            if io.role is Role.HYPERPARAMETER
        }
        sess = self.new_session(ug.model, graph_capture=True)
        sess.bind_inputs({**params, **grads, **states, **self.hyper, **st.scalars})
        sess.bind_inputs({"step": st.step_tensor, **(extra or {})})
        outputs = {"new:step": st.step_tensor}
        if st.max_grad_norm is not None:
            outputs["grad_norm"] = st.grad_norm
        if any(o.role is Role.GRADS_FINITE for o in ug.outputs):
            outputs["grads_finite"] = st.grads_finite
        for out, src in ug.aliases.items():
            if src != "step":
                outputs[out] = params[src] if src in params else states[src]
        sess.bind_outputs(outputs)
        self.session = sess

    def step(self, values: Values, grad_scale: float) -> None:
        st, sess = self.state, self.session
        assert sess is not None
        for gi, group in enumerate(values):
            for h, v in group.items():
                self.hyper[f"group{gi}.{h}"].fill_(v)
        st.scalars["grad_scale"].fill_(grad_scale)
        if st.max_grad_norm is not None:
            st.scalars["max_grad_norm"].fill_(st.max_grad_norm)
        if self.env.reducer is None:
            sess.run()
        else:
            self.env.reducer.update(sess.run)


class ShardUpdate(GraphUpdate):
    """ZeRO-1: the update graph of this rank's shard, which the reducer lays out and binds
    (``bind``), run between its reduce-scatter and all-gather."""

    name = "zero1"

    def prepare(self) -> bool:
        assert self.env.reducer is not None
        if not self.env.reducer.prepare_update(self.state, self):
            raise AssertionError("ZeRO-1's reducer did not bind its shard's update graph")
        return False


class ShardReducer(Protocol):
    """What ``ShardTorchUpdate`` needs of ZeRO's reducer (``ShardedState``)."""

    def shard_pieces(self, state: TrainingState) -> list[Any]: ...

    def global_sq_norm(self) -> torch.Tensor: ...

    scalars: dict[str, dict[str, float]]  # (an optimizer's own numbers per parameter)

    def update(self, run_update: Callable[[], None]) -> None: ...


class ShardTorchUpdate(_AfterBackward):
    """torch's fused Adam/AdamW over this rank's shard, piece by piece, run by the reducer
    between its collectives (where ZeRO-1's update graph runs)."""

    name = "zero-torch"

    def __init__(self, state: TrainingState, env: EngineEnv):
        super().__init__(state, env)
        if state.spec.kind not in TORCH_KINDS:
            raise ValueError(f"torch's fused kernels run {TORCH_KINDS}, not {state.spec.kind}")
        self.kernel = torch._fused_adamw_ if state.spec.kind == "adamw" else torch._fused_adam_
        self.step_t = torch.zeros((), dtype=torch.float32, device=state.device)
        self.found_inf = torch.zeros((), dtype=torch.float32, device=state.device)
        self.groups: list[tuple[list[torch.Tensor], ...]] = []

    @property
    def _reducer(self) -> ShardReducer:
        reducer = self.env.reducer
        assert reducer is not None and hasattr(reducer, "shard_pieces")
        return reducer  # type: ignore[return-value]

    def prepare(self) -> bool:
        groups: list[tuple[list[torch.Tensor], ...]] = [
            ([], [], [], []) for _ in self.state.spec.groups
        ]
        for pc in self._reducer.shard_pieces(self.state):
            params, grads, avg, avg_sq = groups[pc.group]
            params.append(pc.param)
            grads.append(pc.grad)
            avg.append(pc.state["exp_avg"])
            avg_sq.append(pc.state["exp_avg_sq"])
        self.groups = groups
        return False

    def step(self, values: Values, grad_scale: float) -> None:
        self._reducer.update(lambda: self._run(values, grad_scale))

    def _run(self, values: Values, grad_scale: float) -> None:
        st = self.state
        # torch's kernels divide by their grad_scale: pass 1 / ours (None when it is 1)
        divisor: torch.Tensor | None = None
        if grad_scale != 1.0:
            divisor = torch.full((), 1.0 / grad_scale, dtype=torch.float32, device=st.device)
        self.found_inf.zero_()
        if st.checks_gradients:  # every rank reads the same global norm: all decide alike
            norm = self._reducer.global_sq_norm().sqrt() * grad_scale
            self.found_inf.copy_((~torch.isfinite(norm)).to(torch.float32))
            if st.max_grad_norm is not None:
                st.record_grad_norm(norm)
                coef = torch.clamp(st.max_grad_norm / (norm + 1e-6), max=1.0)
                divisor = 1.0 / (coef * grad_scale)
        self.step_t.fill_(float(st.step_tensor) + 1.0)  # the 1-based t of this update
        for (params, grads, avg, avg_sq), hp in zip(self.groups, values, strict=True):
            if not params:
                continue
            self.kernel(
                params,
                grads,
                avg,
                avg_sq,
                [],
                [self.step_t] * len(params),
                lr=hp["lr"],
                beta1=hp["beta1"],
                beta2=hp["beta2"],
                weight_decay=hp["weight_decay"],
                eps=hp["eps"],
                amsgrad=False,
                maximize=False,
                grad_scale=divisor,
                found_inf=self.found_inf if st.checks_gradients else None,
            )
        st.record_update(self.found_inf == 0)


class ShardBackwardUpdate(ShardTorchUpdate):
    """ZeRO-2 and -3: torch's fused Adam/AdamW over each bucket's stretch of this rank's shard as
    soon as the bucket's reduce lands, inside the backward (``ShardedGradients
    .on_landing``): the summed gradient is used where it lands and never kept. The first
    update runs after its backward (the pieces are laid out then), piece by piece, handing
    the gradient shard's pages back as it goes; they are not taken again. Needs what
    makes a stretch's update independent of every other gradient: no clipping, no loss
    scaling, no accumulation (``_zero_backward_needs``). A backward graph that reads a
    parameter after its gradient arrived (``ShardedGradients.late_reads``, seen at the
    first step) keeps the update after the backward. Under ZeRO-2 the parameters are whole
    on every rank: this rank's stretch of them changes in the backward, the others' after
    the step's all-gather."""

    name = "zero-backward"

    def __init__(self, state: TrainingState, env: EngineEnv):
        super().__init__(state, env)
        # per piece of this rank's shard, by flat start: (start, stop, group, parameter
        # (its storage's own version counter: gathered views of the shard that autograd
        # holds are not "modified in place" by a stretch they do not read), exp_avg,
        # exp_avg_sq)
        self._pieces: list[tuple[int, int, int, torch.Tensor, torch.Tensor, torch.Tensor]] = []
        self._starts: list[int] = []  # their flat starts
        self._values: Values = []
        self._divisor: torch.Tensor | None = None
        self.landing = False  # this micro-step updates in its backward
        self.updated_numel = 0  # elements updated so far in this micro-step
        self.released = False  # the gradient shard's pages handed back

    def prepare(self) -> bool:
        super().prepare()
        # the first update takes the state's pages piece by piece (``_update_handing_back``)
        self._reducer.piecewise_state = True  # type: ignore[attr-defined]
        pieces = self._reducer.shard_pieces(self.state)
        self._pieces = sorted(
            (pc.start, pc.start + pc.param.numel(), pc.group, pc.param.data, *moments)
            for pc in pieces
            for moments in [(pc.state["exp_avg"], pc.state["exp_avg_sq"])]
        )
        self._starts = [piece[0] for piece in self._pieces]
        return False

    @property
    def _active(self) -> bool:
        """Laid out, and no backward read a parameter after its gradient arrived."""
        reducer = self.env.reducer
        return bool(self._pieces) and not getattr(reducer, "late_reads", True)

    def begin_micro_step(self, values: Values, grad_scale: float) -> None:
        """Before a micro-step's forward (and its window's zeroing of the gradients): its
        buckets update their stretch as they land (from the second step on, the first
        having laid the pieces out)."""
        st = self.state
        if self.released:  # it reads zeros until written again: nothing to zero
            st.pristine_grads.add(id(self._reducer.grad_shard))  # type: ignore[attr-defined]
        self.landing = self._active and int(st.step_tensor) > 0
        self.released = self.released and self.landing
        self._reducer.grads_released = self.released  # type: ignore[attr-defined]
        self._reducer.on_landing = self._update_stretch if self.landing else None  # type: ignore[attr-defined]
        if not self.landing:
            return
        self._set_step(values, grad_scale)
        self.updated_numel = 0

    def _update_stretch(self, first: int, grad: torch.Tensor) -> None:
        """Flat elements [first, first + len(grad)) of this rank's shard: their summed
        gradients landed. The pieces there (whole ones for a bucket, parts of one for a
        routed table summed a stretch at a time) take their update, group by group."""
        stop = first + grad.numel()
        lists: dict[int, tuple[list[torch.Tensor], ...]] = {}
        k = max(0, bisect.bisect_right(self._starts, first) - 1)  # the piece holding first
        for start, end, group, param, avg, avg_sq in self._pieces[k:]:
            if start >= stop:
                break
            a, b = max(start, first), min(end, stop)
            if a >= b:
                continue
            ps, gs, avgs, sqs = lists.setdefault(group, ([], [], [], []))
            ps.append(param[a - start : b - start])
            gs.append(grad[a - first : b - first])
            avgs.append(avg[a - start : b - start])
            sqs.append(avg_sq[a - start : b - start])
            self.updated_numel += b - a
        for group, (ps, gs, avgs, sqs) in lists.items():
            self._run_kernel(group, ps, gs, avgs, sqs)

    def _run_kernel(self, group: int, *tensors: list[torch.Tensor]) -> None:
        """One fused call over lists (parameters, gradients, exp_avg, exp_avg_sq)."""
        hp = self._values[group]
        self.kernel(
            *tensors,
            [],
            [self.step_t] * len(tensors[0]),
            lr=hp["lr"],
            beta1=hp["beta1"],
            beta2=hp["beta2"],
            weight_decay=hp["weight_decay"],
            eps=hp["eps"],
            amsgrad=False,
            maximize=False,
            grad_scale=self._divisor,
            found_inf=None,
        )

    def _set_step(self, values: Values, grad_scale: float) -> None:
        """This update's hyperparameters, divisor and 1-based step."""
        st = self.state
        self._values = values
        self._divisor = None
        if grad_scale != 1.0:  # torch's kernels divide by theirs
            self._divisor = torch.full((), 1.0 / grad_scale, device=st.device)
        self.step_t.fill_(float(st.step_tensor) + 1.0)

    def _update_handing_back(self) -> None:
        """The update after a backward (the first step's), piece by piece: each piece's
        optimizer-state pages are taken as it is updated and its gradient's pages handed
        back after it, so that the gradient shard and the whole state are never resident
        together (with the update in the backward after it, that moment was a run's
        peak)."""
        grad = self._reducer.grad_shard  # type: ignore[attr-defined]
        lo = self._reducer.config.shard.start  # type: ignore[attr-defined]
        for start, end, group, param, avg, avg_sq in self._pieces:
            populate(avg)  # read before written: each page faulted twice otherwise
            populate(avg_sq)
            piece = grad[start - lo : end - lo]
            self._run_kernel(group, [param], [piece], [avg], [avg_sq])
            release(piece, zero_rest=False)  # (its neighbours' gradients share its edges)
        release(grad)
        self.state.record_update(torch.ones((), dtype=torch.bool))

    def step(self, values: Values, grad_scale: float) -> None:
        reducer = self._reducer
        if not self.landing:
            if not self._active:
                super().step(values, grad_scale)
                return
            # the next micro-steps update as they land: the gradient shard is not written
            # again, and goes piece by piece as this update passes it
            self._set_step(values, grad_scale)
            reducer.update(self._update_handing_back)
            self.released = reducer.grads_released = True  # type: ignore[attr-defined]
            return
        self.landing = False
        reducer.on_landing = None  # type: ignore[attr-defined]
        total = sum(end - start for start, end, *_ in self._pieces)
        if self.updated_numel != total:  # every piece once, or the step is not a step
            raise AssertionError(
                f"ZeRO's update in the backward updated {self.updated_numel} of this "
                f"rank's {total} elements"
            )
        st = self.state
        reducer.update(lambda: st.record_update(torch.ones((), dtype=torch.bool)))


class ShardEagerUpdate(_AfterBackward):
    """ZeRO's update by an elementwise torch optimizer's own ``step()`` over this rank's pieces
    (kind ``SHARDED_EAGER``: ``ortrain/optim/sharded_eager.py``).

    A second optimizer of the user's class holds this rank's pieces of the parameters as leaf
    tensors that share the flat buffer's storage, each piece's gradient a view of the reduced
    gradient shard; its per-element state is made views of ZeRO's flat state buffers once it
    exists (the first update makes it as torch would, e.g. Rprop's step sizes at ``lr``), and
    its ``step`` counters are the trainer's, its other numbers per parameter (NAdam's
    ``mu_product``) the reducer's ``scalars``: for those every rank steps a piece of every
    parameter, empty where its shard holds none. Before each update the user's param
    groups' hyperparameters are copied over (schedulers change those).
    """

    name: ClassVar[str] = "zero-eager"

    def __init__(self, state: TrainingState, env: EngineEnv):
        super().__init__(state, env)
        self.optimizer: torch.optim.Optimizer | None = None
        # per piece: (its parameter, the leaf, its flat state views)
        self.pieces: list[tuple[str, torch.Tensor, dict[str, torch.Tensor]]] = []

    @property
    def _reducer(self) -> ShardReducer:
        reducer = self.env.reducer
        assert reducer is not None and hasattr(reducer, "shard_pieces")
        return reducer  # type: ignore[return-value]

    def prepare(self) -> bool:
        st = self.state
        assert st.optimizer is not None
        assert st.optimizer is not None and st.grad_params is not None
        groups: list[list[torch.Tensor]] = [[] for _ in st.optimizer.param_groups]
        self.pieces = []
        for pc in self._reducer.shard_pieces(st):
            leaf = pc.param.detach().requires_grad_(True)  # the flat buffer's storage
            leaf.grad = pc.grad
            groups[pc.group].append(leaf)
            self.pieces.append((pc.name, leaf, pc.state))
        if st.spec.scalars:  # every parameter's numbers on every rank: an empty piece
            held = {name for name, _, _ in self.pieces}
            group_of = {p: gi for gi, g in enumerate(st.spec.groups) for p in g.params}
            for name in st.grad_params:
                if name not in held and name in group_of:
                    leaf = torch.zeros(0, device=st.device).requires_grad_(True)
                    leaf.grad = torch.zeros(0, device=st.device)
                    groups[group_of[name]].append(leaf)
                    empty = {s: torch.zeros(0, device=st.device) for s in st.spec.state}
                    self.pieces.append((name, leaf, empty))
        self.optimizer = make_like(st.optimizer, groups)
        return False

    def step(self, values: Any, grad_scale: float) -> None:
        self._reducer.update(lambda: self._run(grad_scale))

    def _run(self, grad_scale: float) -> None:
        st, opt = self.state, self.optimizer
        assert opt is not None and st.optimizer is not None
        grads = [leaf.grad for _, leaf, _ in self.pieces if leaf.grad is not None]
        with torch.no_grad():
            if grad_scale != 1.0 and grads:
                torch._foreach_mul_(grads, grad_scale)
            finite = torch.ones((), dtype=torch.bool, device=st.device)
            if st.checks_gradients:  # every rank reads the same global norm: all decide alike
                norm = self._reducer.global_sq_norm().sqrt()
                finite = torch.isfinite(norm)
                if st.max_grad_norm is not None:
                    st.record_grad_norm(norm)
                    coef = torch.clamp(st.max_grad_norm / (norm + 1e-6), max=1.0)
                    if grads:
                        torch._foreach_mul_(grads, coef)
            if not bool(finite):  # nothing changes; the loss scale backs off
                st.record_update(finite)
                return
        for mine, theirs in zip(opt.param_groups, st.optimizer.param_groups, strict=True):
            mine.update(hyperparameters(theirs))
        self._lend_state()
        opt.step()
        self._take_state()
        st.record_update(finite)

    def _lend_state(self) -> None:
        """Once the trainer has taken a step (or loaded one), each piece's state is the flat
        buffers' views and the trainer's step count; before, torch makes its own."""
        st, opt = self.state, self.optimizer
        assert opt is not None
        if st.step == 0:
            return
        step = float(st.step)
        scalars = self._reducer.scalars
        for name, leaf, views in self.pieces:
            state = opt.state[leaf]
            state.update(views)
            if st.spec.counts_steps:
                state["step"] = torch.tensor(step, dtype=torch.float32)
            for s, v in scalars.get(name, {}).items():
                state[s] = torch.tensor(v, dtype=torch.float32)

    def _take_state(self) -> None:
        """What the step made or wrote anew goes into (and becomes a view of) the flat
        buffers, so checkpoints and the memory report see it."""
        opt, names = self.optimizer, self.state.spec.scalars
        assert opt is not None
        for name, leaf, views in self.pieces:
            state = opt.state[leaf]
            for s, view in views.items():
                new = state.get(s)
                if new is not None and new is not view:
                    view.copy_(new)
                    state[s] = view
            if names:
                self._reducer.scalars[name] = {s: float(state[s]) for s in names if s in state}


class _FlatKernels(_AfterBackward):
    """Kernels over the state's flat gradient (and moment) buffers: no update graph."""

    def __init__(self, state: TrainingState, env: EngineEnv):
        super().__init__(state, env)
        self.runner: FusedUpdate | TorchFusedUpdate | None = None

    def _make(self) -> FusedUpdate | TorchFusedUpdate:
        raise NotImplementedError

    def prepare(self) -> bool:
        self.runner = self._make()
        return True

    def step(self, values: Values, grad_scale: float) -> None:
        assert self.runner is not None
        self.runner.run(values, grad_scale)


class KernelUpdate(_FlatKernels):
    """The fused kernels of ``cuda_kernels/`` (on CPU: their single-threaded reference)."""

    name = "kernels"

    def _make(self) -> FusedUpdate:
        flat = flatten_update(self.state, KERNEL_KINDS, whole_groups=True)
        assert flat is not None
        return FusedUpdate(self.state, flat, flat.segments)


class TorchUpdate(_FlatKernels):
    """torch's fused Adam/AdamW kernels; the parameters stay the module's tensors."""

    name = "torch"

    def _make(self) -> TorchFusedUpdate:
        flat = flatten_update(self.state, TORCH_KINDS, whole_groups=True, move_params=False)
        assert flat is not None
        return TorchFusedUpdate(self.state, flat)


class BackwardUpdate:
    """Each parameter's Adam/AdamW update inside the gradient graph."""

    name: ClassVar[str] = "backward"
    in_backward: ClassVar[bool] = True

    def __init__(self, state: TrainingState, env: EngineEnv):
        self.state = state
        self.env = env
        self.hyper: list[torch.Tensor] = []  # per param group: HYPER_NAMES values
        self.done = torch.zeros(0, dtype=torch.float32, device=state.device)  # per parameter

    @property
    def update_graph(self) -> UpdateGraph | None:
        return None

    def prepare(self) -> bool:
        """The moments the graphs update in place, and the tensors they read and write."""
        st = self.state
        assert st.grad_params is not None
        for p in st.grad_params:
            for s in IN_BACKWARD_STATES:
                st.opt_state.setdefault(state_key(s, p), torch.zeros_like(st.params[p]))
        self.hyper = [
            torch.zeros(len(HYPER_NAMES), dtype=torch.float32, device=st.device)
            for _ in st.spec.groups
        ]
        self.done = torch.zeros(len(st.grad_params), dtype=torch.float32, device=st.device)
        return False

    def bind_train(self, session: BoundSession, built: BuiltGraph) -> None:
        st = self.state
        assert st.grad_params is not None
        index = {p: i for i, p in enumerate(st.grad_params)}
        states = {r.name: st.opt_state[r.name] for r in built.roles(Role.OPTIMIZER_STATE)}
        session.bind_inputs(states)
        session.bind_inputs({hyper_name(gi): t for gi, t in enumerate(self.hyper)})
        done = built.roles(Role.UPDATE_APPLIED)
        session.bind_outputs({r.name: self.done[index[r.of]] for r in done})

    def before_run(self, values: Values) -> None:
        """This step's values of what ``hyper:group<i>`` holds (``HYPER_NAMES``)."""
        step = float(self.state.step_tensor) + 1.0  # the 1-based t of this update
        decoupled = 1.0 if self.state.spec.kind == "adamw" else 0.0
        for t, hp in zip(self.hyper, values, strict=True):
            values_t = [hp[h] for h in HYPER_NAMES[:5]] + [step, decoupled]
            t.copy_(torch.tensor(values_t, dtype=torch.float32))
        self.done.zero_()

    def step(self, values: Values, grad_scale: float) -> None:
        # The graph ran the update (unless the loss was not finite): count it.
        if bool(self.done.all()):
            self.state.step_tensor.add_(1.0)

    def applied(self) -> tuple[int, int]:
        return int(self.done.sum()), len(self.done)


class EagerUpdate(_AfterBackward):
    """The update of an optimizer ortrain does not compile: its own ``step()``, in eager
    PyTorch over the state's parameters and gradients.

    For an optimizer of kind ``EAGER`` (another class than AdamW, Adam, SGD and Lamb, a
    subclass with its own ``step()``, a flag the compiled update lacks: ``ortrain.optim.
    from_torch``) the gradient graph (or the segments) still computes the gradients into the
    state's buffers, and the reducer still reduces them; then, per optimizer step:

        scale      the gradient sums times ``grad_scale`` (1 / (accumulation * world * loss
                   scale)), in place: after the update the buffers hold what it read
        clip       global-norm clipping as ``clip_grad_norm_`` (the norm recorded before it)
        check      gradients not all finite (loss scaling, clipping): nothing changes, the
                   step is not counted, as the compiled updates do
        step       each trained parameter's ``.data`` and ``.grad`` become the state's
                   tensors for the call, and the optimizer's own ``step()`` runs; it keeps its
                   state in ``optimizer.state`` (checkpoints store its ``state_dict()``); a
                   parameter the window did not reach (``state.unreached``) has no
                   ``.grad``, so the optimizer skips it as in eager

    It is also where a model whose steps reach different parameters (a LayerDrop) moves
    its update to (``ProgramContext.update_in_eager``).

    The parameters are updated in place where the training graphs read them, so nothing is
    copied either way.
    """

    name: ClassVar[str] = "eager"

    def prepare(self) -> bool:
        st = self.state
        assert st.grad_params is not None
        reducer = self.env.reducer
        if reducer is not None:  # data parallel: the gradients become its flat buffer's views
            reducer.prepare_update(st, self)  # type: ignore[arg-type]
        for p in st.grad_params:
            st.grads.setdefault(p, torch.zeros_like(st.params[p]))
        return False

    def step(self, values: Any, grad_scale: float) -> None:
        if self.env.reducer is None:
            self._run(grad_scale)
        else:
            self.env.reducer.update(lambda: self._run(grad_scale))

    def _run(self, grad_scale: float) -> None:
        st = self.state
        assert st.grad_params is not None and st.optimizer is not None
        grads = [st.grads[p] for p in st.grad_params]
        with torch.no_grad():
            if grad_scale != 1.0:
                torch._foreach_mul_(grads, grad_scale)
            finite = torch.ones((), dtype=torch.bool, device=st.device)
            if st.checks_gradients:
                norm = torch.linalg.vector_norm(
                    torch.stack([torch.linalg.vector_norm(g) for g in grads])
                    if grads
                    else torch.zeros(1, device=st.device)
                )
                finite = torch.isfinite(norm)
                if st.max_grad_norm is not None:
                    st.record_grad_norm(norm)
                    coef = torch.clamp(st.max_grad_norm / (norm + 1e-6), max=1.0)
                    torch._foreach_mul_(grads, coef)
            if not bool(finite):  # nothing changes; the loss scale backs off
                st.record_update(finite)
                return
        taken = zip(st.grad_params, grads, strict=True)
        _optimizer_step(st, {p: g for p, g in taken if p not in st.unreached})
        st.record_update(finite)


def _optimizer_step(st: TrainingState, grads: dict[str, torch.Tensor]) -> None:
    """``st.optimizer.step()`` with each trained parameter's data and gradient the state's
    tensors for the call (what the module had is put back after)."""
    optimizer = st.optimizer
    assert optimizer is not None
    held = []
    for name, p in st.module.named_parameters():
        moved = name in st.params and p.data.data_ptr() != st.params[name].data_ptr()
        held.append((p, p.data if moved else None, p.grad))
        p.grad = grads.get(name)  # None: not reached this window, the optimizer skips it
        if moved:  # (a device copy: the optimizer steps the state's tensor)
            p.data = st.params[name]
    try:
        with own_step():
            optimizer.step()
    finally:
        for p, data, grad in held:
            if data is not None:
                p.data = data
            p.grad = grad


ENGINES: dict[str, type[UpdateEngine]] = {
    e.name: e
    for e in (
        GraphUpdate,
        ShardUpdate,
        ShardTorchUpdate,
        ShardBackwardUpdate,
        ShardEagerUpdate,
        KernelUpdate,
        TorchUpdate,
        BackwardUpdate,
        EagerUpdate,
    )
}


@dataclasses.dataclass(frozen=True)
class EngineFacts:
    """What the choice of engine depends on."""

    requested: str  # TrainerOptions.update_engine
    device: torch.device
    kind: str  # the optimizer's (OptimizerSpec.kind)
    zero_stage: int | None  # None in a single process
    cpu_kernels: bool  # ortrain's CPU kernels are on (the update in the backward needs them)
    accumulation: int
    clipping: bool
    fp32: bool  # no mixed precision, no loss scaling
    # a gradient graph could not take the update in its backward, and whether that graph
    # was the first (no update laid out yet: the engine may still change)
    refused: UpdateInBackwardError | None = None
    first_build: bool = True
    # the model trains as compiled segments inside torch autograd (ortrain/segments): the
    # gradients come from torch's backward, after which the update runs
    segmented: bool = False


def _backward_needs(f: EngineFacts) -> list[str]:
    """What the update in the backward needs and these facts lack (it reads no global
    gradient statistic, so it needs no look at all the gradients)."""
    why = []
    if f.device.type != "cpu" or not f.cpu_kernels:
        why.append("ortrain's CPU kernels (device='cpu', cpu_kernels)")
    if f.kind not in TORCH_KINDS:
        why.append(f"Adam or AdamW (not {f.kind})")
    if f.zero_stage is not None:
        why.append("a single process")
    if f.accumulation != 1:
        why.append("grad_accumulation_steps=1")
    if f.clipping:
        why.append("no clipping (max_grad_norm=None)")
    if not f.fp32:
        why.append("fp32 training without loss scaling")
    if f.segmented:
        why.append("a model that compiles as one graph (not as segments)")
    return why


def _zero_backward_needs(f: EngineFacts) -> list[str]:
    """What ZeRO's update in the backward (``ShardBackwardUpdate``) needs and these facts
    lack: each stretch's update must depend on its own gradients only."""
    why = []
    if f.zero_stage not in (2, 3):
        why.append("ZeRO-2 or ZeRO-3 (zero_stage=2 or 3)")
    if f.device.type != "cpu":
        why.append("device='cpu'")
    if f.kind not in TORCH_KINDS:
        why.append(f"Adam or AdamW (not {f.kind})")
    if f.accumulation != 1:
        why.append("grad_accumulation_steps=1")
    if f.clipping:
        why.append("no clipping (max_grad_norm=None)")
    if not f.fp32:
        why.append("fp32 training without loss scaling")
    return why


def choose_engine(f: EngineFacts) -> str:
    """The engine's name; raises where the requested engine cannot run these facts.

    1. "kernels" / "torch" requested: the optimizer must be theirs, in a single process
       (the kernels' library must be built);
    2. "backward" requested: everything ``_backward_needs`` lists (under ZeRO:
       ``_zero_backward_needs``, each bucket's stretch updated as it lands);
    3. "auto": the update in the backward where it can run (one process, or ZeRO-2/3's
       "zero-backward"); where a graph refused it
       (``refused``), the choice below, if no update was laid out yet (otherwise, and for
       "backward" requested, the refusal is raised);
    4. ZeRO-1, -2 and -3: "auto" on CPU with Adam/AdamW: torch's kernels over the shard;
       otherwise the shard's update graph; "auto" on CUDA in a single process: the kernels
       when built and they cover the optimizer; "auto" on CPU in a single process: torch's
       kernels for Adam/AdamW; otherwise the update graph. An elementwise optimizer ortrain
       does not compile, under ZeRO: its own step over the shard ("zero-eager").
    """
    req, single = f.requested, f.zero_stage is None
    if f.kind == EAGER:  # the optimizer's own step() (EagerUpdate)
        if req != "auto":
            raise UnsupportedOptimizerError(
                f"TrainerOptions.update_engine={req!r} runs the updates ortrain compiles "
                "(AdamW, Adam, SGD, Lamb); this optimizer's own step() runs in eager PyTorch: "
                "use update_engine='auto'"
            )
        return "eager"
    if f.kind == SHARDED_EAGER:  # ZeRO: its own step() over the shard's pieces
        if req not in ("auto", "graph"):
            raise UnsupportedOptimizerError(
                f"TrainerOptions.update_engine={req!r}: under ZeRO this optimizer's own "
                "step() runs over the shard's pieces in eager PyTorch: use 'auto'"
            )
        return "zero-eager"
    if req == "kernels":
        check_supported(f.kind)
        if not single:
            raise ValueError(
                "TrainerOptions.update_engine='kernels' is single-process only; distributed "
                "training updates through the update graph (use 'graph' or 'auto')"
            )
        kernels.library(f.device.type)  # fail now, not at the first step
        return "kernels"
    if req == "torch":
        if f.kind not in TORCH_KINDS:
            raise UnsupportedOptimizerError(
                f"update_engine='torch' supports {', '.join(TORCH_KINDS)}, not {f.kind}; use "
                "update_engine='graph'"
            )
        if not single:
            raise ValueError(
                "TrainerOptions.update_engine='torch' is single-process only; distributed "
                "training updates through the update graph (use 'graph' or 'auto')"
            )
        return "torch"
    if f.zero_stage is not None and req in ("auto", "backward"):
        zwhy = _zero_backward_needs(f)
        if not zwhy:
            return "zero-backward"
        if req == "backward":
            raise ValueError(
                f"TrainerOptions.update_engine='backward' under ZeRO-{f.zero_stage} needs "
                + ", ".join(zwhy)
            )
    why = _backward_needs(f)
    if req == "backward" and why:
        raise ValueError("TrainerOptions.update_engine='backward' needs " + ", ".join(why))
    if f.refused is not None:
        if req != "auto" or not f.first_build:
            raise f.refused
    elif req in ("auto", "backward") and not why:
        return "backward"
    if f.zero_stage in (1, 2, 3):  # ZeRO-2 and -3 update their shard as ZeRO-1 does
        cpu_torch = f.device.type == "cpu" and f.kind in TORCH_KINDS
        return "zero-torch" if req == "auto" and cpu_torch else "zero1"
    if req == "auto":
        # (single process: the kernels' engine runs no reducer, whose all-reduce would be lost)
        cuda = f.device.type == "cuda" and single
        if cuda and f.kind in KERNEL_KINDS and kernels_available(f.device):
            return "kernels"
        if f.device.type == "cpu" and f.kind in TORCH_KINDS and single:
            return "torch"
    return "graph"


def make_engine(name: str, state: TrainingState, env: EngineEnv) -> UpdateEngine:
    return ENGINES[name](state, env)
