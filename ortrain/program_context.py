"""What every program of a trainer is compiled and run with: ``ProgramContext``.

A trainer's model runs as one of two programs (``ortrain/program.py``): the whole model as
one training graph per batch signature (``ortrain/whole_program.py``), or compiled segments
inside eager PyTorch (``ortrain/segmented_program.py``); evaluation has its own graphs
(``ortrain/evaluation.py``). All of them share this context:

- the options, the device and the CUDA stream the sessions run on, the build settings
  made from them (``settings``), sessions (``session``) and builds in a forked child
  (``run_build``);
- the ``TrainingState`` (parameters, gradients, optimizer state, counters) and the
  distributed reducer, made here once;
- the update engine, chosen in one place (``choose_engine``: here at construction, and
  again where a gradient graph cannot take the update in its backward or the model becomes
  segments), and the end of a micro-step that runs it (``end_micro_step``);
- the whole model's graphs by signature (``ortrain/whole_graph.py``), which training and
  evaluation share (one export per signature), and eager beside them
  (``ortrain/first_step.py``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import warnings
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import torch

from ortrain.build import StageRecord
from ortrain.build_cache import GraphCache
from ortrain.core.build_config import BuildConfig
from ortrain.core.errors import (
    BatchError,
    CheckpointError,
    NonFiniteLossError,
    TrainableChangedError,
)
from ortrain.core.names import UpdateInBackwardError
from ortrain.core.optimizer_spec import EAGER, OptimizerSpec
from ortrain.core.own_hooks import users_hooks
from ortrain.distributed import join_process_group
from ortrain.export import LossFn
from ortrain.first_step import EagerSide
from ortrain.forked import call_forked, can_fork, run_here
from ortrain.loss_scaler import LossScaler
from ortrain.module_structure import StructureWatch
from ortrain.optim.from_torch import (
    check_groups,
    check_sparse_gradients,
    group_values,
    optimizer_spec,
)
from ortrain.optimizer_resets import StateResets, drop_state
from ortrain.options import TrainerOptions
from ortrain.param_dtypes import eager_for_dtype
from ortrain.python_state import LOSS_FN, READ, ValueWatch
from ortrain.rank_memory import resident_bytes
from ortrain.runtime.cpu_ops import has_sgemm_batch, use_blas_gemm, use_grad_kernels
from ortrain.runtime.outside_steps import OutsideSteps
from ortrain.runtime.session import BoundSession, check_device, make_session
from ortrain.runtime.training_state import TrainingState
from ortrain.runtime.update_engines import (
    EngineEnv,
    EngineFacts,
    Reducer,
    UpdateEngine,
    choose_engine,
    make_engine,
)
from ortrain.step_errors import window_restarts
from ortrain.tensor_slots import TensorSlots
from ortrain.verify import Tolerance, eval_children
from ortrain.whole_graph import WholeGraphs

if TYPE_CHECKING:
    import onnx_ir as ir

    from ortrain.build import BuiltGraph

T = TypeVar("T")


@dataclasses.dataclass(frozen=True)
class ValuesChanged:
    """``ProgramContext.values_changed``'s finding."""

    said: str  # each value, "(old -> new)"
    again: bool  # some changed at a second step: their readers run in eager from now on


# optimizer -> the ProgramContext whose hooks act on it (``_hook_optimizer``)
_OWNERS: weakref.WeakKeyDictionary[torch.optim.Optimizer, weakref.ref] = weakref.WeakKeyDictionary()


def _uneven_steps_held(optimizer: torch.optim.Optimizer) -> tuple[str, int]:
    """The step counts (``checkpoint.uneven_steps``) of the optimizer's own state where the
    parameters that require grad took different numbers of steps (frozen for a while,
    by an earlier trainer or eager steps), and the most of them; ("", 0) where they took
    the same."""
    if not optimizer.state:
        return "", 0
    from ortrain.checkpoint import uneven_steps

    held = optimizer.state_dict()
    flat = [p for g in optimizer.param_groups for p in g["params"]]
    ids = [i for g in held["param_groups"] for i in g["params"]]
    trained = {i for i, p in zip(ids, flat, strict=False) if p.requires_grad}
    entries = {k: v for k, v in held["state"].items() if k in trained}
    counts = uneven_steps({"optimizer": {"state": entries}})
    steps = [float(e["step"]) for e in entries.values() if "step" in e]
    return counts, (int(max(steps)) if counts and steps else 0)


class ProgramContext:
    """``module`` trained with ``optimizer`` under ``options``: the state, the engine and
    the means to build and run its graphs."""

    def __init__(
        self,
        module: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        options: TrainerOptions,
        loss_fn: LossFn | None,
    ):
        self.module = module
        self.optimizer = optimizer
        self.options = options
        self.loss_fn = loss_fn
        self.device = torch.device(options.device)
        check_device(self.device)
        if self.device.type == "cuda" and self.device.index is None:
            # the current device (torchrun: the rank's, after torch.cuda.set_device), so that
            # ONNX Runtime's sessions, the stream and the collectives all use the same GPU
            self.device = torch.device("cuda", torch.cuda.current_device())
        # fp32 products on the BLAS custom op (graph_passes/targets/cpu/blas_gemm.py): decided
        # (and the op built) once, before any build
        self.blas_gemm = use_blas_gemm(options.cpu_gemm, self.device.type)
        self.blas_batch = self.blas_gemm and has_sgemm_batch()
        self.cpu_kernels = use_grad_kernels(options.cpu_kernels, self.device.type)
        # CUDA: the module lives on the device; ONNX Runtime runs on a stream of ours
        # (torch's default stream cannot be handed to it) that a step makes current.
        self.stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        if self.device.type == "cuda":
            module.to(self.device)
        named = dict(module.named_parameters())
        # parameters other than float32: the model trains in eager, the update the
        # optimizer's own (``param_dtypes.py``)
        self.dtype_cause = eager_for_dtype(module, options)
        self.spec: OptimizerSpec = optimizer_spec(
            optimizer, {id(p): n for n, p in named.items()}, eager_because=self.dtype_cause
        )
        check_sparse_gradients(optimizer, module)
        counts, stepped = _uneven_steps_held(optimizer)
        if not (counts and self.spec.kind != EAGER and options.zero_stage == 0):
            stepped = 0
        elif options.update_engine != "auto":
            raise CheckpointError(
                f"the optimizer's state holds parameters that took {counts} steps (layers "
                f"frozen for a while); update_engine={options.update_engine!r} counts one "
                "step for all: leave it 'auto' (the optimizer's own step)"
            )
        else:  # a compiled update counts one step for all; torch's counts each parameter's
            self.spec = dataclasses.replace(
                self.spec,
                kind=EAGER,
                source=type(optimizer).__name__,
                why_eager=f"the optimizer's state holds parameters that took {counts} steps "
                "(layers frozen for a while)",
            )
        # (ortrain/runtime/update_engines.py: EagerUpdate; for a dtype: the program warns)
        if self.spec.kind == EAGER and not self.dtype_cause:
            warnings.warn(
                f"ortrain: {self.spec.source}'s update runs as its own step() in eager PyTorch "
                f"over the gradients of the compiled graphs ({self.spec.why_eager})",
                stacklevel=3,
            )
        # the optimizer's parameters and whether each required grad when the trainer was
        # made: gradients and optimizer state are laid out for that set
        name_of = {id(p): n for n, p in named.items()}
        self._trained_ids: set[int] | None = None  # (``_trains``)
        self._requires = [
            (name_of[id(p)], p, p.requires_grad)
            for group in optimizer.param_groups
            for p in group["params"]
        ]
        # Loss scaling: the backward is seeded with the scale; the update reports whether
        # the gradients were finite (and skips the update if not). Parameters share memory
        # with the module on CPU: updates are visible in place.
        ls = options.resolved_loss_scale
        self.state = TrainingState.of_module(
            module,
            self.spec,
            self.device,
            optimizer=optimizer,
            scaler=None if ls is None else LossScaler.from_option(ls),
            max_grad_norm=options.max_grad_norm,
            accumulation=options.grad_accumulation_steps,
            any_dtype=bool(self.dtype_cause),
        )
        self.state.update_in_eager = self.update_in_eager
        if stepped:  # the optimizer's own steps go on from the most any parameter took
            self.state.set_counters(stepped, 0)
        # built graphs kept on disk (ortrain/build_cache.py); its hits count in build_count
        self.graph_cache = GraphCache(options, module, loss_fn)
        # where the module held the state's tensors at the last step's check that passed
        self._slots = TensorSlots(module, self._held)
        self._modes: tuple[str, ...] | None = None  # eval_children at the last step
        # each watched module's ``training`` flag when ``_modes`` was taken (``_mode_flags``)
        self._mode_flags: tuple[bool, ...] | None = None
        self._structure: StructureWatch | None = None  # sub-modules and hooks, last step
        self._values: ValueWatch | None = None  # the Python values at the last step
        self._value_changes: dict[tuple[str, str], int] = {}  # steps each one changed at
        self.build_log: list[StageRecord] = []
        self.graphs = WholeGraphs(module, loss_fn, self.graph_cache, self.run_build, self.build_log)
        self.graph_dir = Path(options.save_graphs_dir) if options.save_graphs_dir else None
        if self.graph_dir is not None:
            self.graph_dir.mkdir(parents=True, exist_ok=True)
        # torch.distributed (torchrun): data parallel or ZeRO-1/2/3 (ortrain.distributed);
        # None single-process. ZeRO-1 moves the trainable parameters into a flat buffer.
        self.reducer: Reducer | None = join_process_group(self.state, options)
        self.spec = self.state.spec  # (ZeRO runs an elementwise optimizer's step on pieces)
        # every training Dropout's training_mode (prepare/dropout_switch.py): off only while
        # a first step is checked against eager; on the host, where ONNX Runtime reads it
        self.dropout_on = torch.ones((), dtype=torch.bool)
        mp = options.mixed_precision
        comm = getattr(self.reducer, "comm", None)  # every rank takes the same way
        self.eager = EagerSide(
            module,
            loss_fn,
            self.device,
            Tolerance.of(mp),
            exact=mp is None,
            half={"fp16": torch.float16, "bf16": torch.bfloat16}.get(mp or ""),
            any_rank=bool if comm is None else comm.any,
        )
        # a state the optimizer already has (eager steps before the trainer, a checkpoint
        # loaded into it) is the state the compiled update starts from, as eager's would
        # (not one that took no step: Adagrad's, made with it, which the update makes too)
        prior = self.optimizer.state_dict() if _stepped(self.optimizer.state.values()) else None
        self._to_torch = False  # ``hand_state_to_torch``: a load that goes to torch's state
        self._handed: int | None = None  # the step the state was handed to torch at
        self._handed_versions: list[tuple[torch.Tensor, int]] = []
        # the loop calling ``optimizer.step()`` for nothing (``runtime/outside_steps.py``)
        self.outside_steps = OutsideSteps(optimizer)
        # ``optimizer.state`` emptied by the loop (``optimizer_resets.py``)
        self._resets: StateResets | None = None
        self._optimizer_hooks = self._hook_optimizer()
        if prior is not None and self._optimizer_hooks:
            self.optimizer.load_state_dict(prior)
        self.session_bytes = 0  # resident bytes creating sessions added
        self.segmented = False  # the model runs as segments (the update after torch's backward)
        # What runs the optimizer update (runtime/update_engines.py): an engine the options
        # ask for and these facts cannot run fails now.
        self.engine: UpdateEngine = self.choose_engine()

    @property
    def world_size(self) -> int:
        return self.reducer.world_size if self.reducer is not None else 1

    def choose_engine(self, refused: UpdateInBackwardError | None = None) -> UpdateEngine:
        facts = EngineFacts(
            requested=self.options.update_engine,
            device=self.device,
            kind=self.spec.kind,
            zero_stage=None if self.reducer is None else self.options.zero_stage,
            cpu_kernels=self.cpu_kernels,
            accumulation=self.options.grad_accumulation_steps,
            clipping=self.options.max_grad_norm is not None,
            fp32=self.options.mixed_precision is None and self.state.scaler is None,
            refused=refused,
            first_build=self.state.grad_params is None,
            segmented=self.segmented,
        )
        env = EngineEnv(session=self.session, save=self.save, reducer=self.reducer)
        return make_engine(choose_engine(facts), self.state, env)

    def _hook_optimizer(self) -> list[Any]:
        """A compiled update keeps the optimizer's state in ortrain's (``optimizer.state``
        stays empty): ``optimizer.state_dict()`` gives that state in torch's format, and
        ``optimizer.load_state_dict()`` loads into it, as a training loop written for
        eager expects (a checkpoint of ``optimizer.state_dict()``, a state loaded or reset
        mid-run). Under ZeRO the state is sharded across the ranks: a state dict taken
        after a step warns that it holds none, and loading one with state raises, both
        naming ``trainer.state_dict()`` / ``save_checkpoint``, which gather it (on every
        rank); empty ones pass (accelerate's wrapping reads one and loads it back)."""
        # the newest trainer over this optimizer owns its state_dict: an older one's hooks
        # (a trainer made anew after a freeze, as TrainableChangedError says) pass through,
        # or the older one's load would take the state the new one starts from
        _OWNERS[self.optimizer] = weakref.ref(self)
        if self.spec.kind == EAGER:  # its own step keeps its own state
            return []
        from ortrain import checkpoint
        from ortrain.distributed.data_parallel import DataParallel

        sharded = self.reducer is not None and not isinstance(self.reducer, DataParallel)

        def owns() -> bool:
            owner = _OWNERS.get(self.optimizer)
            return owner is not None and owner() is self

        # by position over the param groups, as torch numbers them in a state dict
        trained = [was for _, _, was in self._requires]
        where = (
            f"under ZeRO-{self.options.zero_stage} the optimizer state is sharded across the "
            "ranks: trainer.state_dict() / load_state_dict() or save_checkpoint() / "
            "load_checkpoint() (on every rank) take it"
        )

        def saved(optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> dict[str, Any]:
            if self._to_torch or not owns():
                return state
            if not sharded:
                out = checkpoint.optimizer_state_dict(self.state)
                # parameters frozen since an earlier trainer: their state is torch's own
                kept = {k: v for k, v in state["state"].items() if not trained[k]}
                out["state"] = {**kept, **out["state"]}
                return out
            if self.state.step > 0:  # (accelerate's wrapping reads it before any step)
                warnings.warn(
                    f"ortrain: optimizer.state_dict() holds no state: {where}", stacklevel=3
                )
            return state

        def loading(optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> dict[str, Any]:
            if self._to_torch or not owns():
                return state
            if not sharded:
                # torch's own load takes the param groups' values (lr, betas...) and the
                # state of parameters this trainer does not train (frozen: eager keeps it
                # for when they thaw, and its step count is theirs); the rest is ortrain's
                at = [i for g in state.get("param_groups", ()) for i in g.get("params", ())]
                kept = {
                    k: v
                    for k, v in state.get("state", {}).items()
                    if k in at and at.index(k) < len(trained) and not trained[at.index(k)]
                }
                ours = {k: v for k, v in state.get("state", {}).items() if k not in kept}
                checkpoint.load_optimizer_state_dict(self.state, {**state, "state": ours})
                return {**state, "state": kept}
            # (one that took no step passes: Adagrad's own, which accelerate loads back)
            if _stepped(state.get("state", {}).values()):
                raise CheckpointError(f"optimizer.load_state_dict() of a state: {where}")
            return state

        self._resets = resets = StateResets(self.optimizer)

        def watch(_: torch.optim.Optimizer) -> None:
            if owns():
                resets.watch()

        return [
            self.optimizer.register_state_dict_post_hook(saved),
            self.optimizer.register_load_state_dict_pre_hook(loading),
            # a load puts a new ``state`` in place: not the loop emptying it
            self.optimizer.register_load_state_dict_post_hook(watch),
        ]

    def release_optimizer(self) -> None:
        """The optimizer's hooks of this context removed (a trainer made anew over it,
        ``ORTTrainer._lay_out_anew``, hooks it itself)."""
        for hook in self._optimizer_hooks:
            hook.remove()
        self._optimizer_hooks = []
        self._resets = None
        if _OWNERS.get(self.optimizer) is not None and _OWNERS[self.optimizer]() is self:
            del _OWNERS[self.optimizer]

    def hand_state_to_torch(self) -> None:
        """The compiled update's state into the torch optimizer's own ``state`` (after
        ``sync_to_module``: eager steps that follow go on from it, as they would after
        eager steps). Nothing where the optimizer's own step keeps its state, or under ZeRO
        (sharded: ``trainer.state_dict()`` gathers it)."""
        if not self._optimizer_hooks or self.state.step in (0, self._handed):
            return  # (handed since the last compiled step: torch's may have gone on)
        from ortrain import checkpoint

        if self._sharded():
            return
        # the state of parameters this trainer does not train (frozen since an earlier
        # trainer handed theirs over) stays: eager keeps it for when they thaw
        untrained = {p: st for p, st in self.optimizer.state.items() if not self._trains(p) and st}
        self._to_torch = True
        try:
            self.optimizer.load_state_dict(checkpoint.optimizer_state_dict(self.state))
        finally:
            self._to_torch = False
        for p, st in untrained.items():
            self.optimizer.state.setdefault(p, st)
        self._handed = self.state.step
        # what says that eager steps followed: torch's step() changes its state in place
        self._handed_versions = [
            (t, t._version)
            for per_param in self.optimizer.state.values()
            for t in per_param.values()
            if isinstance(t, torch.Tensor)
        ]

    def _trains(self, p: torch.Tensor) -> bool:
        """Whether ``p`` is one of the parameters this trainer's state lays out."""
        if self._trained_ids is None:
            self._trained_ids = {id(q) for _, q, was in self._requires if was}
        return id(p) in self._trained_ids

    def _sharded(self) -> bool:
        """Whether the optimizer state is sharded across ranks (ZeRO)."""
        from ortrain.distributed.data_parallel import DataParallel

        return self.reducer is not None and not isinstance(self.reducer, DataParallel)

    def take_state_from_torch(self) -> None:
        """Before a compiled step after ``hand_state_to_torch``: the torch optimizer's
        state as eager steps left it becomes the compiled update's again (and torch's own
        is emptied, as while the trainer steps). Also where eager steps came without a
        handing (a trainer made, then eager steps before its first): torch's state is empty
        while the trainer steps, so any it has is theirs. Before either: the loop emptied
        ``optimizer.state`` (``optimizer_resets.py``): the moments start again."""
        if self._handed is None and self._resets is not None:
            reset = self._resets.reset_params()
            if self._resets.emptied():
                self._restart_state()
            elif reset:
                self._restart_params(reset)
                return
            for p in [p for p, v in self.optimizer.state.items() if not v]:
                drop_state(self.optimizer, p)  # an entry a read made (a defaultdict's)
        if self._handed is None:
            if not self.optimizer.state or not self._optimizer_hooks or self._sharded():
                return
            # (the state of parameters it does not train stays torch's: frozen ones')
            if not any(v and self._trains(p) for p, v in self.optimizer.state.items()):
                return
        else:
            self._handed = None
            stepped = any(t._version != v for t, v in self._handed_versions)
            self._handed_versions = []
            if not stepped:  # no eager step since: the compiled update's state is current
                # (torch's copy: not taken for theirs later; frozen parameters' stays)
                for p in [p for p in self.optimizer.state if self._trains(p)]:
                    del self.optimizer.state[p]
                if self._resets is not None:
                    self._resets.watch()  # (our own clearing)
                return
        self._to_torch = True
        try:
            state = self.optimizer.state_dict()
        finally:
            self._to_torch = False
        self.optimizer.load_state_dict(state)

    def _restart_params(self, reset: list[Any]) -> None:
        """The loop reset some parameters' own state (``optimizer_resets.py``): torch's
        optimizer starts their moments and step counts again while the others go on, which
        one step count for all cannot; so its own ``step()`` runs the update from here, on
        the state kept so far, without theirs."""
        ids = {id(p) for p in reset}
        names = [n for n, p in self.module.named_parameters() if id(p) in ids]
        trained = {id(p) for g in self.optimizer.param_groups for p in g["params"]}
        for p in [p for p, v in self.optimizer.state.items() if not v]:
            drop_state(self.optimizer, p)  # the loop's empty entries: not state to load
        if ids >= trained:  # every parameter's: the whole state starts again
            self._restart_state()
            return
        self.update_in_eager(f"the training loop reset the optimizer state of {', '.join(names)}")
        for p in reset:  # torch's next step() starts theirs again (the loop's intent)
            self.optimizer.state.pop(p, None)

    def _restart_state(self) -> None:
        """The loop cleared ``optimizer.state``: torch's optimizer would start each
        parameter's state again (moments from zero, its step count from 0, so the bias
        correction too); so does the compiled update's, on every rank alike."""
        st = self.state
        for t in st.opt_state.values():
            t.zero_()
        st.set_counters(0, st.micro_step)

    def check_trainable(self) -> None:
        """Raises where a parameter's ``requires_grad`` changed since the trainer was made
        (layers frozen or unfrozen): its graphs, gradients and optimizer state are laid out
        for the set it had then, and training on would leave newly trainable parameters
        unchanged, or keep updating frozen ones, with no error."""
        check_groups(self.optimizer, self.spec)
        changed = [(n, now) for n, p, was in self._requires if (now := p.requires_grad) != was]
        if not changed and self._slots.unchanged():  # (what the walks below would find)
            return
        self._check_same_parameters()
        if not changed:
            self.state.adopt_rebound()  # ``p.data = ...`` since the last step
            self._slots.take()
            return
        thawed = [n for n, now in changed if now]
        frozen = [n for n, now in changed if not now]
        said = "; ".join(
            f"{what}: {', '.join(names[:6])}{' ...' if len(names) > 6 else ''}"
            for what, names in (("now require grad", thawed), ("no longer", frozen))
            if names
        )
        error = TrainableChangedError(
            f"parameters changed requires_grad after the ORTTrainer was made ({said}); its "
            "gradients and optimizer state are laid out for the parameters that required "
            "grad then. The trainer lays them out anew at an accumulation window's start "
            "(in one process or under data parallel): change them there; under ZeRO call "
            "trainer.sync_to_module() and make a new ORTTrainer on every rank (nothing of "
            "this step ran)"
        )
        error.requires_grad_only = True  # (ORTTrainer lays the state out anew where it can)
        error.changed = said
        raise error

    def _held(self, kind: str, name: str) -> torch.Tensor | None:
        """The state's tensor of a parameter or buffer (``TensorSlots``)."""
        return (self.state.params if kind == "parameter" else self.state.buffers).get(name)

    def _check_same_parameters(self) -> None:
        """Raises where the module no longer holds the optimizer's parameter objects under
        their names (a sub-module assigned anew, ``load_state_dict(assign=True)``), or holds
        parameters the trainer never saw: the optimizer steps the old objects, so eager would
        leave the module's new ones untrained, while the state would adopt their values and
        train them."""
        now = dict(self.module.named_parameters())
        replaced = [n for n, p, _ in self._requires if now.get(n) is not p]
        new = [n for n in now if n not in self.state.params]
        if not replaced and not new:
            return
        said = "; ".join(
            f"{what}: {', '.join(names[:6])}{' ...' if len(names) > 6 else ''}"
            for what, names in (("replaced or removed", replaced), ("new", new))
            if names
        )
        raise TrainableChangedError(
            f"the module's parameters changed after the ORTTrainer was made ({said}): a "
            "sub-module assigned anew or load_state_dict(assign=True) puts new Parameter "
            "objects in the module, and the optimizer still holds the old ones. Load values "
            "in place (load_state_dict without assign), or call trainer.sync_to_module() "
            "before the change and make a new optimizer and ORTTrainer after it (nothing of "
            "this step ran)"
        )

    def grad_hooked(self) -> list[str]:
        """The optimizer's parameters that carry gradient hooks of the user's
        (``p.register_hook``, ``p.register_post_accumulate_grad_hook``: a clip by value, an
        update in the backward): a graph's gradients never pass through torch's autograd,
        so it could not run them."""
        return [n for n, p, _ in self._requires if p.requires_grad and users_hooks(p)]

    def modes_changed(self) -> bool:
        """Whether a sub-module went into or out of evaluation mode since the last training
        step (a BatchNorm frozen or thawed): the graphs were exported with the old modes,
        so the training graphs are dropped (built again, and checked) and the graph cache
        keys the new modes. Says when the model itself is in evaluation mode at the first
        step or goes into it later: it trains in that mode as eager does, which is easy to
        miss after ``from_pretrained`` or an evaluation."""
        flags = self._flags()
        if flags is not None and flags == self._mode_flags:
            return False  # every module's flag as it was: no names made
        modes = eval_children(self.module)
        self._mode_flags = flags
        if self._modes is None and not self.module.training:
            warnings.warn(
                f"ortrain: {type(self.module).__name__} is in evaluation mode; train_step "
                "trains it in that mode, as eager PyTorch would (dropout off, BatchNorm on "
                "its running statistics, which stay as they are). Call model.train() before "
                "training for training mode",
                stacklevel=4,
            )
        changed = self._modes is not None and modes != self._modes
        if changed and "" in modes and "" not in self._modes:
            # eager would train on in that mode without a word; after an evaluation it is
            # most often a model.train() forgotten
            warnings.warn(
                f"ortrain: {type(self.module).__name__} went into evaluation mode since the "
                "last training step; train_step trains it in that mode, as eager PyTorch "
                "would (dropout off, BatchNorm on its running statistics). Call model.train() "
                "after evaluating to train in training mode",
                stacklevel=4,
            )
        self._modes = modes
        if changed:
            self.graphs.clear_train()
            self.graph_cache.forget_model_key()
        return changed

    def _flags(self) -> tuple[bool, ...] | None:
        """The ``training`` flags of the modules the structure watch holds (None before
        it holds any)."""
        if self._structure is None:
            return None
        return tuple(m.training for m in self._structure.modules)

    def forward_ran(self) -> None:
        """An eager forward of ortrain's own ran inside a step (an eager step, the speed
        trial's look): hooks the module's own forward adds as it runs (transformers'
        output recording for router logits) are no change of the user's, so the watch
        takes the modules as they are now; else the next step would build every graph
        again."""
        if self._structure is not None:
            self._structure.changes()

    def structure_changed(self) -> bool:
        """Whether a sub-module was assigned anew, or a module hook (a module's or torch's
        global ones) added or removed, since the last step (``ortrain/module_structure.py``):
        the graphs hold the forward their export saw, so they are dropped (built again, and
        checked), the graph cache keys the model again, and the Python values are watched
        on the modules it has now."""
        if self._structure is None:
            self._structure = StructureWatch(self.module)
        said = self._structure.changes()
        if said:  # the graphs are built with the modules' modes as they are now
            self._modes, self._mode_flags = eval_children(self.module), self._flags()
        comm = getattr(self.reducer, "comm", None)
        if comm is not None and not comm.any(bool(said)):
            return False  # (every rank decides alike: what follows builds collectively)
        if not said and comm is None:
            return False
        warnings.warn(
            f"ortrain: {type(self.module).__name__}'s modules or hooks changed since the last "
            f"step ({'; '.join(said[:4]) or 'on another rank'}{' ...' if len(said) > 4 else ''}); "
            "its graphs are built again, and checked against eager",
            stacklevel=4,
        )
        self.graphs.clear_train()
        self.graphs.eval.clear()
        self.graph_cache.forget_model_key()
        self._values = None
        return True

    def values_changed(self, compiled: Callable[[str], bool]) -> ValuesChanged | None:
        """The Python values the forward reads that changed since the last training step
        (``ortrain/python_state.py``): set between steps by the training loop (a
        temperature annealed, a global schedule), where the graphs hold what their export
        saw. Evaluation graphs (the whole model's) are built again after any change. For
        training, values read by a module that ``compiled`` says runs in a graph count:
        the first change of one builds the graphs again (and checks them); one that
        changes at a second step makes the modules whose code reads it run in eager
        PyTorch (``eager.stateful``), the rest compiled around them."""
        if self._values is None:
            self._values = ValueWatch(self.module, self.loss_fn)
            return None
        seen = {
            key: (repr(old), repr(new))
            for key, (old, new) in self._values.changes().items()
            # an attribute of a config filled in later (save_pretrained sets
            # config.architectures on the saving rank): nothing a forward read before
            if not (key[0] != READ and "." in key[1] and old is None)
        }
        comm = getattr(self.reducer, "comm", None)
        if comm is not None:  # every rank decides alike (the checks are collectives)
            if not comm.any(bool(seen)):
                return None
            for theirs in comm.all_gather_object(seen):
                seen.update(theirs)
        if not seen:
            return None
        self.graphs.eval.clear()
        self.graph_cache.forget_model_key()
        said: list[str] = []
        again: dict[str, list[str]] = {}
        for key, (old, new) in sorted(seen.items()):
            owners = [
                o
                for o in self._values.owners_of(key)
                if o not in self.eager.stateful and compiled(o)
            ]
            if not owners:
                continue
            what = f"global {key[1]}" if key[0] == READ else f"{key[0] or '<root>'}.{key[1]}"
            said.append(f"{what} ({old} -> {new})")
            n = self._value_changes[key] = self._value_changes.get(key, 0) + 1
            if n >= 2:
                for owner in owners:
                    again.setdefault(owner, []).append(f"{what} set between steps")
        if not said:
            return None
        for owner, whats in again.items():
            if owner != LOSS_FN:
                self.eager.stateful[owner] = ", ".join(whats)
        self.graphs.clear_train()
        return ValuesChanged("; ".join(said), bool(again))

    def blocks_cause(self) -> str:
        """Why the model is cut at its repeated blocks from the first step ("": it is not)."""
        if self.reducer is not None and self.options.zero_stage >= 2:
            return f"ZeRO-{self.options.zero_stage}"  # gradients reduced block by block
        return "segments='blocks'" if self.options.segments == "blocks" else ""

    @contextlib.contextmanager
    def on_stream(self) -> Iterator[None]:
        """Run on the sessions' CUDA stream, ordered after the caller's stream's work (the
        batch) and before its later work (reading the loss); a no-op on CPU."""
        if self.stream is None:
            yield
            return
        caller = torch.cuda.current_stream(self.device)
        self.stream.wait_stream(caller)
        with torch.cuda.stream(self.stream):
            yield
        caller.wait_stream(self.stream)

    def session(self, model: ir.Model | BuiltGraph, *, graph_capture: bool = False) -> BoundSession:
        before = resident_bytes()
        session = make_session(
            model,
            threads=self.options.intra_op_threads,
            device=self.device,
            stream=self.stream,
            cuda_graph=graph_capture and self.options.cuda_graph,
        )
        self.session_bytes += max(0, resident_bytes() - before)
        return BoundSession(session)

    def save(self, model: ir.Model, name: str) -> None:
        if self.graph_dir is not None:
            import onnx_ir as ir

            ir.save(model, self.graph_dir / f"{name}.onnx")

    def settings(self) -> BuildConfig:
        """The whole model's build settings under the current engine."""
        spec = self.spec
        return BuildConfig(
            trainable=tuple(self.state.trainable),
            target="cuda" if self.device.type == "cuda" else "cpu",
            seed=self.options.seed,
            accumulate=self.options.grad_accumulation_steps > 1,
            mixed_precision=self.options.mixed_precision,
            loss_scaling=self.state.scaler is not None,
            optimize=self.options.optimize_graph,
            recompute="CHEAP_OPS" if self.options.memory_plan else "NOTHING",
            graph_dir=str(self.graph_dir) if self.graph_dir is not None else None,
            blas_gemm=self.blas_gemm,
            blas_batch=self.blas_batch,
            cpu_kernels=self.cpu_kernels,
            update_groups=tuple((p, gi) for gi, g in enumerate(spec.groups) for p in g.params)
            if self.engine.in_backward
            else (),
            dropout_switch=self.options.verify,
        )

    def segment_settings(self) -> BuildConfig:
        """A segment's graphs: fp32 inputs, outputs and gradients (the mixed precision
        pass computes in half inside and casts its outputs back; torch scales the seeds
        and accumulates the gradients), the update after the backward."""
        return dataclasses.replace(
            self.settings(),
            trainable=(),
            accumulate=False,
            loss_scaling=False,
            update_groups=(),
            dropout_switch=True,
        )

    def run_build(self, job: Callable[[], T], batch: Mapping[str, Any]) -> T:
        """``job`` in a forked child where possible (``ortrain/build.py``)."""
        tensors = [*self.state.params.values(), *self.state.buffers.values()]
        tensors += [v for v in batch.values() if isinstance(v, torch.Tensor)]
        if can_fork(tensors):
            return call_forked(job, what="building the ONNX graph")
        return run_here(job)

    def lay_out(self, grad_params: list[str]) -> None:
        """The first step's reached parameters: their gradients and the update laid out."""
        self.state.grad_params = grad_params
        if self.engine.prepare():  # parameters or gradients moved: evals bind anew
            self.graphs.eval.clear()

    def update_in_eager(self, why: str) -> None:
        """From now on the update is the optimizer's own ``step()`` in eager PyTorch
        (``EagerUpdate``), starting from the state the engine kept so far: the steps of
        this model reach different parameters (``why``), and the compiled updates lay out
        one set and count one step for all, where torch's skips a parameter without a
        gradient and counts each parameter's steps (Adam's bias correction). ZeRO and an
        engine the options name keep one set: refused there."""
        if self.engine.name == "eager":
            return
        # a training graph that runs the update inside its backward is built again, as a
        # gradient graph for the optimizer's step
        rebuild = self.engine.in_backward and self.state.grad_params is not None
        from ortrain.distributed.data_parallel import DataParallel

        sharded = self.reducer is not None and not isinstance(self.reducer, DataParallel)
        if sharded or self.options.update_engine != "auto":
            where = (
                f"ZeRO-{self.options.zero_stage}"
                if sharded
                else f"update_engine={self.options.update_engine!r}"
            )
            raise BatchError(
                f"{why}: {where} lays out the gradients and the update for the first step's "
                "parameters only (the optimizer's own step, which skips the parameters a step "
                "does not reach, runs in one process or under data parallel with "
                "update_engine='auto'); if the model "
                "skips layers at random in training (LayerDrop: config.layerdrop, "
                "encoder_layerdrop, decoder_layerdrop), set that probability to 0.0"
            )
        from ortrain.checkpoint import trainer_state_dict

        st = self.state
        for hook in self._optimizer_hooks:  # the optimizer keeps its own state from now on
            hook.remove()
        self._optimizer_hooks = []
        self._resets = None
        self.optimizer.load_state_dict(trainer_state_dict(st, saved=False)["optimizer"])
        self.spec = dataclasses.replace(
            self.spec, kind=EAGER, source=type(self.optimizer).__name__, why_eager=why
        )
        st.spec = self.spec
        st.opt_state.clear()
        held = dict(st.grads)  # data parallel lays its flat buffer out anew: sums carried
        self.engine = self.choose_engine()
        if rebuild:
            self.graphs.clear_train()
        if st.grad_params is not None:  # else laid out at the first step
            self.engine.prepare()
        for name, old in held.items():
            new = st.grads.get(name)
            if new is not None and new is not old:
                new.copy_(old)
        warnings.warn(
            f"ortrain: {type(self.module).__name__}: {why}; from optimizer step {st.step} on, "
            f"{self.spec.source}'s update runs as its own step() in eager PyTorch, which "
            "counts each parameter's steps and skips the parameters a step does not reach, as "
            "eager training does",
            stacklevel=4,
        )

    def refuse_nonfinite(self, loss: torch.Tensor) -> None:
        """Raise where ``check_finite`` and the loss is NaN or infinite: the window starts
        over, nothing updated."""
        st = self.state
        if self.options.check_finite and not math.isfinite(float(loss)):
            st.window_grads = None  # the window starts over: a loaded one's sums too
            discarded, st.micro_step = st.micro_step, 0  # its gradients are in the sums
            raise NonFiniteLossError(
                f"loss is {float(loss)} at optimizer step {int(st.step_tensor)}; the update "
                "was not applied and parameters/optimizer state are unchanged"
                f"{window_restarts(discarded)}"
            )

    def end_micro_step(self, loss: torch.Tensor) -> torch.Tensor:
        """A micro-step's loss counted (whichever program ran it); the update at the end
        of its accumulation window."""
        st = self.state
        self.refuse_nonfinite(loss)
        st.take_window_grads()
        st.micro_step += 1
        if st.micro_step == self.options.grad_accumulation_steps:
            st.micro_step = 0
            self.apply_update()
        return loss

    def apply_update(self) -> None:
        values = group_values(self.optimizer, self.spec)
        self.engine.step(values, self.state.grad_scale(self.world_size))
        self.state.finish_update()
        if self.reducer is not None and self.options.broadcast_buffers:
            self._broadcast_buffers()
        # torch LR schedulers warn unless they see the optimizer step; ours runs in the graph.
        self.optimizer._opt_called = True  # type: ignore[attr-defined]

    def _broadcast_buffers(self) -> None:
        """Rank 0's buffers to every rank (``TrainerOptions.broadcast_buffers``). DDP
        broadcasts them before each forward that follows a synchronised backward; after
        the update is the same point for the next step's forward, and leaves no rank's
        own statistics behind for an evaluation or a checkpoint between steps."""
        self.state.adopt_rebound()  # a buffer the forward assigned anew: its value is newer
        buffers = list(self.state.buffers.values())
        if buffers:  # every rank alike: the ranks' modules were checked to match
            self.reducer.comm.broadcast_tensors(buffers)  # type: ignore[union-attr]


def _stepped(entries: Iterable[Mapping[str, Any]]) -> bool:
    """Whether an optimizer's state entries hold what a step made: one without a ``step``
    count (SGD's momentum) or with one above zero."""
    for entry in entries:
        step = entry.get("step") if isinstance(entry, Mapping) else None
        if step is None or float(step) > 0:
            return True
    return False
