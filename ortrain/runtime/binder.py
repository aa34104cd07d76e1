"""Bind a compiled graph's session to the training state by the roles of its manifest.

Every input and output of a built graph carries its role (``BuiltGraph.io``: the export
wrote the model's, each pass the ones it created), so binding never reads a name or a
position:

1. parameters, frozen parameters and buffers: the state's tensors of that name;
2. the loss scale, the dropout switch: the state's device scalar, the trainer's switch;
3. an accumulator (the gradient sum an accumulating graph adds to): its parameter's
   gradient buffer, which the gradient output of that parameter is bound to as well;
4. the loss: the state's loss scalar;
5. an updated buffer (BatchNorm statistics): a tensor of its own, copied into the buffer
   after the run (bound to the buffer, a later node could read the new value too early);
6. what the update engine owns (gradient outputs, the in-backward update's moments,
   hyperparameters and ``done`` flags): the engine's ``bind_train``, by the same roles;
7. batch inputs are bound per step (``BoundSession.bind_batch``).

An evaluation graph (``bind_eval_graph``) takes cases 1 and 7; its outputs go to the host.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ortrain.core.roles import Role
from ortrain.runtime.session import BoundSession
from ortrain.runtime.training_state import TrainingState

if TYPE_CHECKING:
    from ortrain.build import BuiltGraph
    from ortrain.runtime.update_engines import UpdateEngine


def bind_training_graph(
    session: BoundSession,
    built: BuiltGraph,
    state: TrainingState,
    engine: UpdateEngine,
    dropout_on: torch.Tensor,
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Cases 1-6; returns (the graph's new value, the buffer) per updated buffer."""
    inputs: dict[str, torch.Tensor] = {}
    outputs: dict[str, torch.Tensor] = {}
    updates = []
    for r in built.io:
        if r.role in (Role.PARAMETER, Role.FROZEN_PARAMETER):
            inputs[r.name] = state.params[r.name]
        elif r.role is Role.BUFFER:
            inputs[r.name] = state.buffers[r.name]
            state.graph_buffers.add(r.name)
        elif r.role is Role.LOSS_SCALE:
            inputs[r.name] = state.loss_scale
        elif r.role is Role.DROPOUT_SWITCH:
            inputs[r.name] = dropout_on
        elif r.role is Role.ACCUMULATOR:
            assert r.of is not None
            inputs[r.name] = state.grads[r.of]
        elif r.role is Role.LOSS:
            outputs[r.name] = state.loss
        elif r.role is Role.UPDATED_BUFFER:
            assert r.of is not None
            new = torch.empty_like(state.buffers[r.of])
            outputs[r.name] = new
            state.graph_buffers.add(r.of)
            updates.append((new, state.buffers[r.of]))
    session.bind_inputs(inputs)
    session.bind_outputs(outputs)
    engine.bind_train(session, built)
    return updates


def bind_eval_graph(session: BoundSession, built: BuiltGraph, state: TrainingState) -> None:
    """An evaluation graph: parameters and buffers as in case 1; every output (the loss
    and the model's outputs) to host memory, copied out after each run."""
    inputs: dict[str, torch.Tensor] = {}
    for r in built.io:
        if r.role in (Role.PARAMETER, Role.FROZEN_PARAMETER):
            inputs[r.name] = state.params[r.name]
        elif r.role is Role.BUFFER:
            inputs[r.name] = state.buffers[r.name]
            state.graph_buffers.add(r.name)
    session.bind_inputs(inputs)
    for name in built.output_names:
        session.bind_output_to_cpu(name)
