"""ZeRO-1: each rank keeps and updates only its shard of the optimizer state.

Layout (``ShardConfig``): the trainable parameters live in one flat, padded, aligned
buffer (the module's parameters become views into it); rank r owns one contiguous
shard of it, and of the equally laid out flat gradient buffer. Per optimizer step:

    backward graph  -> flat gradients (views bound to ONNX Runtime)
    reduce-scatter  -> this rank's shard of the flat gradients holds their sum
    partial norm    -> (clipping) sum of squares of the shard's scaled gradients, a norm
                       per tensor's piece as torch's ``clip_grad_norm_`` takes one per tensor
    all-reduce      -> (clipping) the global squared norm: every rank clips alike
    update graph    -> the shard's pieces only (graph_passes/training/zero.py), in place;
                       moments exist for the shard only
    all-gather      -> every rank's updated shard into the flat parameters

Both collectives work in place on the flat buffers: beside the whole parameters and
gradients (as data parallel), a rank holds 1/N of the optimizer state and nothing else.
"""

from __future__ import annotations

import dataclasses
import itertools
import mmap
import os
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import torch

from ortrain import checkpoint
from ortrain.core.optimizer_spec import OptimizerSpec
from ortrain.distributed import sharded_checkpoint
from ortrain.distributed.comm import Comm
from ortrain.distributed.shard_config import ShardConfig
from ortrain.graph_passes.training.optimizer.update_graph import state_key
from ortrain.graph_passes.training.zero import build_shard_update_graph, check_shardable
from ortrain.runtime.buffer_pool import release_kept
from ortrain.runtime.flat_layout import UPDATE_CHAIN_NUMEL, Piece
from ortrain.runtime.heap import trim_heap
from ortrain.runtime.zero_pages import is_lazy, lazy_zeros, populate

if TYPE_CHECKING:
    from ortrain.runtime.training_state import TrainingState
    from ortrain.runtime.update_engines import GraphUpdate


@dataclasses.dataclass(frozen=True)
class ShardPiece:
    """One parameter's piece of this rank's shard, as an update kernel takes it."""

    group: int  # the parameter group
    param: torch.Tensor
    grad: torch.Tensor
    state: dict[str, torch.Tensor]  # optimizer state name -> its piece
    name: str = ""  # the parameter's
    start: int = 0  # its first element in the flat layout


class ShardedState:
    """This rank's ZeRO-1 state and the steps around its update graph (a ``Reducer``)."""

    def __init__(self, training: TrainingState, comm: Comm):
        state = training
        check_shardable(state.spec)
        shapes = {n: tuple(state.params[n].shape) for n in self._layout_order(state)}
        self.config = ShardConfig.build(state.spec, shapes, comm.rank, comm.world_size)
        self.comm = comm
        self.world_size = comm.world_size
        layout = self.config.layout
        self.flat_params = self._flat_buffer(layout.numel)
        # The trainable parameters move into the flat buffer; module and state see views.
        state.move_params(layout.views(self.flat_params))
        comm.broadcast_tensors(
            [self.flat_params]
            + [t for n, t in state.params.items() if n not in shapes]
            + list(state.buffers.values())
        )
        n = layout.shard_numel
        self.grad_shard = self._make_grads(training)  # this rank's gradients, reduced
        # first written by the first update: not resident before it (ZeRO-3's planning
        # step holds whole parameters)
        self.state = {s: lazy_zeros(n, comm.device) for s in self.config.state_names}
        self.lazy_state = is_lazy(comm.device)  # state and gradient shards (``memory_report``)
        self._state_untaken = self.lazy_state  # until the first update writes the state
        # the first update takes the state's pages piece by piece itself (ZeRO-3's update
        # in the backward hands the gradient shard back as it goes)
        self.piecewise_state = False
        self.sq_norm = torch.zeros((), device=comm.device)
        self._norm_scale: torch.Tensor | None = None  # set where clipping or overflow needs it
        # Parameters whose optimizer state is live: those with gradients, and those a
        # loaded checkpoint had state for (before the first step says which get gradients).
        self.stateful: set[str] = set()
        # an optimizer's own step on the pieces (``ShardEagerUpdate``): its numbers per
        # parameter besides the step count (NAdam's ``mu_product``), alike on every rank
        self.scalars: dict[str, dict[str, float]] = {}

    def _flat_buffer(self, numel: int) -> torch.Tensor:
        """The flat parameters' buffer (zeros). On CPU an anonymous mapping of its own: its
        pages come zeroed from the system and are first written by the parameters' copy
        (``torch.zeros`` would write the whole buffer once more before it); private, so a
        forked child (builds, checks) sees a copy-on-write view as of plain memory, and
        pages handed back are freed (ZeRO-3 hands back those beyond its stretch)."""
        if self.comm.device.type != "cpu" or numel == 0:
            return torch.zeros(numel, device=self.comm.device)
        self._mapping = mmap.mmap(-1, numel * 4, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        return torch.frombuffer(self._mapping, dtype=torch.float32, count=numel)

    def _param_piece(self, start: int, stop: int) -> torch.Tensor:
        """Flat parameter elements ``[start, stop)`` of this rank's shard, as the update
        graph writes them."""
        return self.flat_params[start:stop]

    def _layout_order(self, state: TrainingState) -> list[str]:
        """The trainable parameters in the order they are laid out: param-group order."""
        return state.trainable

    def _make_grads(self, state: TrainingState) -> torch.Tensor:
        """ZeRO-1: whole flat gradients (the gradient graph writes them all); the shard,
        a view of them, is where the reduce-scatter leaves this rank's sums."""
        self.flat_grads = torch.zeros(self.config.layout.numel, device=self.comm.device)
        return self.flat_grads[self.config.shard]

    def _adopt_grads(self, state: TrainingState) -> None:
        """The gradient buffers the backward writes: views of the flat gradients."""
        assert state.grad_params is not None
        views = self.config.layout.views(self.flat_grads)
        state.adopt_grads({p: views[p] for p in state.grad_params})

    # ------------------------------------------------------------------ building
    def _lay_out(self, state: TrainingState) -> list[Piece]:
        """Lay out the gradients and adopt the shard's optimizer state: this rank's pieces
        of the parameters the loss reaches."""
        assert state.grad_params is not None
        cfg, spec = self.config, state.spec
        reached = set(state.grad_params)
        self.stateful |= reached
        self._adopt_grads(state)
        pieces = [pc for pc in cfg.layout.pieces(cfg.rank) if pc.name in reached]
        group_states = {p: spec.state_names(g) for g in spec.groups for p in g.params}
        shard_state = {
            state_key(s, pc.name): self.state[s][cfg.local(pc)]
            for pc in pieces
            for s in group_states[pc.name]
        }
        state.adopt_opt_state(shard_state, replace=True)
        return pieces

    def shard_pieces(self, state: TrainingState) -> list[ShardPiece]:
        """Lay out the update (as ``prepare_update``) for kernels instead of a graph: per
        piece of this rank's shard, its parameter group and the tensors it updates."""
        pieces = self._lay_out(state)
        lo = self.config.shard.start
        group_of = {p: gi for gi, g in enumerate(state.spec.groups) for p in g.params}
        return [
            ShardPiece(
                group_of[pc.name],
                self._param_piece(pc.start, pc.stop),
                self.grad_shard[pc.start - lo : pc.stop - lo],
                {s: buf[pc.start - lo : pc.stop - lo] for s, buf in self.state.items()},
                pc.name,
                pc.start,
            )
            for pc in pieces
        ]

    def global_sq_norm(self) -> torch.Tensor:
        """The sum over ranks of the squares of the reduced gradient shards (a collective)."""
        self.sq_norm.copy_(shard_sq_norm(self.grad_shard, self.config))
        self.comm.all_reduce(self.sq_norm)
        return self.sq_norm

    def _global_scaled_sq_norm(self) -> None:
        """``sq_norm`` = the squared norm of every rank's scaled gradients (a collective),
        where the update clips or checks them."""
        if self._norm_scale is not None:
            self.sq_norm.copy_(shard_sq_norm(self.grad_shard, self.config))
            self.sq_norm.mul_(self._norm_scale.square())
            self.comm.all_reduce(self.sq_norm)

    def prepare_update(self, state: TrainingState, engine: GraphUpdate) -> bool:
        """Lay out the gradients and bind the shard's update graph as ``engine``'s session."""
        cfg, spec = self.config, state.spec
        pieces = self._lay_out(state)
        group_states = {p: spec.state_names(g) for g in spec.groups for p in g.params}
        clip = state.max_grad_norm is not None
        skip = state.scaler is not None
        chunks = _chunks(pieces)
        ug = build_shard_update_graph(
            _chunked_spec(spec, chunks),
            {c.name: c.stop - c.start for c in chunks},
            clip_grad_norm=clip,
            skip_nonfinite=skip,
        )
        engine.save_graph(ug.model, "update.zero1")
        lo = cfg.shard.start
        params = {c.name: self._param_piece(c.start, c.stop) for c in chunks}
        grads = {f"grad:{c.name}": self.grad_shard[c.start - lo : c.stop - lo] for c in chunks}
        chunk_state = {
            state_key(s, c.name): self.state[s][c.start - lo : c.stop - lo]
            for c in chunks
            for s in group_states[c.param]
        }
        engine.bind(ug, params, grads, chunk_state, {"global_sq_norm": self.sq_norm})

        if clip or skip:  # both read the global sum of squares
            self._norm_scale = state.scalars["grad_scale"]
        return True

    # ------------------------------------------------------------------ running
    def _make_room(self) -> None:
        """Before the first update, which takes the optimizer state's pages: the buffers
        kept for the next step go back, so that the two do not add up at one moment."""
        if self._state_untaken:
            self._state_untaken = False
            release_kept()
            trim_heap()
            for t in () if self.piecewise_state else self.state.values():
                populate(t)  # read before written: each page faulted twice otherwise

    def update(self, run_update: Callable[[], None]) -> None:
        self._make_room()
        self.comm.reduce_scatter(self.flat_grads)  # other ranks' shards: left undefined
        self._global_scaled_sq_norm()  # clipping/overflow check: every rank needs it
        run_update()
        self.comm.all_gather(self.flat_params)

    # ------------------------------------------------------------------ state
    def full_state(self, buffers: Mapping[str, torch.Tensor], training: TrainingState) -> dict:
        """{state_key: tensor} of every parameter with state, from full flat state buffers."""
        out = {}
        for s, flat in buffers.items():
            views = self.config.layout.views(flat)
            for g in training.spec.groups:
                if s in training.spec.state_names(g):
                    out.update({state_key(s, p): views[p] for p in g.params if p in self.stateful})
        for p, numbers in self.scalars.items():
            out.update({state_key(s, p): torch.tensor(v) for s, v in numbers.items()})
        return out

    def state_dict(self, training: TrainingState) -> dict[str, Any]:
        """The full, ordinary state dict on rank 0 (a collective: every rank must call it);
        ``{}`` on the other ranks."""
        gathered = {s: self.comm.gather(buf) for s, buf in self.state.items()}
        if self.comm.rank != 0:
            return {}
        flat = {s: torch.cat(parts) for s, parts in gathered.items() if parts is not None}
        return checkpoint.trainer_state_dict(training, opt_state=self.full_state(flat, training))

    def load_state_dict(self, training: TrainingState, state: Mapping[str, Any]) -> None:
        """Load a full state dict (any world size wrote it): keep this rank's shard of it."""
        full: dict[str, torch.Tensor] = {}
        checkpoint.load_trainer_state_dict(training, state, opt_state=full)
        self.scalars = _scalars_of(full, training.spec.scalars, self.config.layout.names)
        self.stateful = {
            p
            for p in self.config.layout.names
            if any(state_key(s, p) in full for s in self.config.state_names)
        }
        for s, buf in self.state.items():
            buf.zero_()
            for pc in self.config.layout.pieces(self.config.rank):
                t = full.get(state_key(s, pc.name))
                if t is not None:
                    src = t.reshape(-1)[pc.start - pc.entry_offset : pc.stop - pc.entry_offset]
                    buf[self.config.local(pc)].copy_(src)

    def load_shards(
        self,
        training: TrainingState,
        base: Mapping[str, Any],
        shard: Mapping,
        stateful: set[str],
        scalars: Mapping[str, Mapping[str, float]],
    ) -> None:
        """Load a sharded checkpoint written with this layout: this rank's shard as is."""
        checkpoint.load_trainer_state_dict(training, base, opt_state={})
        self.stateful = set(stateful)
        self.scalars = {p: {s: float(v) for s, v in n.items()} for p, n in scalars.items()}
        for s, buf in self.state.items():
            buf.copy_(shard[s])

    def save_checkpoint(self, training: TrainingState, path: str | os.PathLike) -> None:
        sharded_checkpoint.save(training, self, path)

    def load_checkpoint(self, training: TrainingState, path: str | os.PathLike) -> None:
        sharded_checkpoint.load(training, self, path)


@dataclasses.dataclass(frozen=True)
class _Chunk:
    """At most ``UPDATE_CHAIN_NUMEL`` flat elements of a parameter's piece: one chain."""

    name: str
    param: str
    start: int
    stop: int


def _chunks(pieces: list[Piece]) -> list[_Chunk]:
    """The shard's pieces cut into update chains: ONNX Runtime keeps an update
    chain's temporaries in the session's arena for good, so a chain the size of a large
    parameter's piece (an embedding's) would hold several copies of it."""
    out = []
    for pc in pieces:
        cuts = [*range(pc.start, pc.stop, UPDATE_CHAIN_NUMEL), pc.stop]
        many = len(cuts) > 2
        for k, (a, b) in enumerate(itertools.pairwise(cuts)):
            out.append(_Chunk(f"{pc.name}#{k}" if many else pc.name, pc.name, a, b))
    return out


def _chunked_spec(spec: OptimizerSpec, chunks: list[_Chunk]) -> OptimizerSpec:
    """``spec`` with each parameter replaced by its chunks (same groups, same order)."""
    of: dict[str, list[str]] = {}
    for c in chunks:
        of.setdefault(c.param, []).append(c.name)
    groups = tuple(
        dataclasses.replace(g, params=tuple(n for p in g.params for n in of.get(p, ())))
        for g in spec.groups
    )
    return dataclasses.replace(spec, groups=groups)


def _scalars_of(
    full: Mapping[str, torch.Tensor], names: tuple[str, ...], params: list[str]
) -> dict[str, dict[str, float]]:
    """The numbers per parameter ``names`` in a full state (``ShardedState.scalars``)."""
    out: dict[str, dict[str, float]] = {}
    for p in params:
        got = {s: float(full[state_key(s, p)]) for s in names if state_key(s, p) in full}
        if got:
            out[p] = got
    return out


def shard_sq_norm(shard: torch.Tensor, config: ShardConfig) -> torch.Tensor:
    """The squared L2 norm of this rank's gradient shard, summed as torch's
    ``clip_grad_norm_`` sums a model's: a norm per tensor (here this shard's piece of it),
    then the norm of those norms. One reduction over the whole flat shard would not do:
    its float accumulators lose digits with every million elements they add up (a shard
    holds a model's worth of them), where torch's reduce one tensor each."""
    lo = config.shard.start
    views = [shard[pc.start - lo : pc.stop - lo] for pc in config.layout.pieces(config.rank)]
    if not views:
        return torch.zeros((), device=shard.device)
    norms = torch.stack([torch.linalg.vector_norm(v) for v in views])
    return torch.linalg.vector_norm(norms).square()
