"""What a trainer saves, loads and measures: its state as torch's dicts and checkpoints,
the module with whole parameters, and its memory (``TrainerState``, a base of the
trainer). Each delegates to the state (``runtime/training_state.py``, ``checkpoint.py``)
or, under torch.distributed, to the reducer, which every rank calls together."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

import torch

from ortrain import checkpoint
from ortrain.distributed import sharded_checkpoint
from ortrain.rank_memory import RankMemory

if TYPE_CHECKING:
    from ortrain.memory_estimate import StateBytes
    from ortrain.program_context import ProgramContext
    from ortrain.runtime.training_state import TrainingState
    from ortrain.runtime.update_engines import Reducer
    from ortrain.segmented_program import SegmentedProgram
    from ortrain.whole_program import WholeProgram


class TrainerState:
    _ctx: ProgramContext
    _program: WholeProgram | SegmentedProgram
    _runtime_bytes: int
    module: torch.nn.Module
    state: TrainingState
    reducer: Reducer | None
    state_bytes: Callable[[], StateBytes]  # TrainerViews'

    def memory_report(self, top: int = 10) -> RankMemory:
        """This rank's bytes by class (``ortrain/rank_memory.py``) against its measured
        peak; with a whole-model gradient graph, also its plan (``.graph``: planned
        activation bytes and what the backward keeps, the ``top`` largest). Needs one
        ``train_step`` first."""
        graph, activations = self._program.memory_plan(top)
        return RankMemory.measure(
            self.state_bytes(),
            self._ctx.reducer,
            runtime=self._runtime_bytes,
            sessions=self._ctx.session_bytes,
            activations=activations,
            graph=graph,
        )

    @torch.no_grad()
    @contextlib.contextmanager
    def whole_parameters(self) -> Iterator[torch.nn.Module]:
        """The module with its trained weights, every parameter whole, for the duration
        (under ZeRO-3 a gather, so every rank enters it together; ``save_model`` of the
        Hugging Face trainer saves inside it)."""
        self.sync_to_module()
        materialized = getattr(self._ctx.reducer, "materialized", None)
        with materialized() if materialized is not None else contextlib.nullcontext():
            yield self.module

    def sync_to_module(self) -> torch.nn.Module:
        """Copy trained weights into the module (a no-op where memory is shared), and a
        compiled update's state (moments, step count) into the torch optimizer's own
        ``state``, so that eager steps can go on from both."""
        module = self.state.sync_to_module()
        self._ctx.hand_state_to_torch()
        return module

    # Distributed: collectives (every rank calls them). ZeRO-1's state_dict() is the full
    # one on rank 0 and {} elsewhere; its checkpoints are directories of shards.
    def state_dict(self) -> dict[str, Any]:
        self.state.adopt_rebound()
        if self.reducer is not None:
            return self.reducer.state_dict(self.state)
        return checkpoint.trainer_state_dict(self.state, window=True)

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if self.reducer is not None:
            return self.reducer.load_state_dict(self.state, state)
        checkpoint.load_trainer_state_dict(self.state, state, window=True)

    def save_checkpoint(self, path: str | os.PathLike) -> None:
        self.state.adopt_rebound()
        if self.reducer is not None:
            return self.reducer.save_checkpoint(self.state, path)
        checkpoint.save(self.state, path, window=True)

    def load_checkpoint(self, path: str | os.PathLike) -> None:
        if self.reducer is not None:
            return self.reducer.load_checkpoint(self.state, path)
        sharded_checkpoint.load_any(self.state, path, window=True)
