"""Element-wise optimizers update each param group as one flat tensor.

Adam, AdamW and SGD are element-wise, so the update graph does not need one chain of
nodes per parameter tensor (hundreds of small kernels): the trained parameters, their
gradients and the optimizer state are laid out group by group in flat buffers, and the
update graph sees one pseudo-parameter per group. Parameters stay views of the flat
buffer (the module's ``.data`` is re-homed there), so the gradient graph, checkpoints
and ``state_dict`` keep working per tensor; torch's fused kernels take lists of tensors,
so for them the parameters are not moved (``move_params=False``). LAMB needs per-tensor
norms: not flattened.

For the update graph a group is cut into pieces of at most ``PIECE`` elements, one
chain each: ONNX Runtime runs the chains one after the other, so the temporaries of an
element-wise chain (several of them per step) are the size of a piece, not of the model.
One chain over GPT-2 small's 124M parameters held ~1.5 GB of temporaries in the
session's arena for good.
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import TYPE_CHECKING

import torch

from ortrain.core.names import state_key
from ortrain.core.optimizer_spec import GroupSpec, OptimizerSpec
from ortrain.runtime.flat_layout import UPDATE_CHAIN_NUMEL, FlatLayout

if TYPE_CHECKING:
    from ortrain.runtime.training_state import TrainingState

FLAT_KINDS = ("adam", "adamw", "sgd")
ALIGN = 16  # elements: every tensor starts on a 64-byte boundary
PIECE = UPDATE_CHAIN_NUMEL  # elements per update chain


@dataclasses.dataclass
class FlatUpdate:
    spec: OptimizerSpec  # one pseudo-parameter per group with trained tensors
    shapes: dict[str, tuple[int, ...]]
    params: dict[str, torch.Tensor]  # pseudo-parameter -> flat slice of the parameters
    grads: dict[str, torch.Tensor]
    states: dict[str, torch.Tensor]  # state_key(state, pseudo-parameter) -> flat slice
    # pseudo-parameter -> lengths of its tensors' segments (each with its alignment padding)
    segments: dict[str, list[int]]
    # pseudo-parameter -> names of its parameter tensors, in layout order
    members: dict[str, list[str]] = dataclasses.field(default_factory=dict)


def _shared_base(tensors: dict[str, torch.Tensor], layout: FlatLayout) -> torch.Tensor | None:
    """The flat buffer the tensors already view with this layout (set up by a reducer)."""
    bases = {id(t._base): t._base for t in tensors.values() if t._base is not None}
    if len(bases) != 1 or len(tensors) != len(layout.entries):
        return None
    base = next(iter(bases.values()))
    if base.numel() != layout.numel:
        return None
    for e in layout.entries:
        if tensors[e.name].data_ptr() != base[e.offset :].data_ptr():
            return None
    return base


def flatten_update(
    state: TrainingState,
    kinds: tuple[str, ...] = FLAT_KINDS,
    whole_groups: bool = False,
    move_params: bool = True,
) -> FlatUpdate | None:
    """``kinds``: optimizers to flatten (the fused kernels also take LAMB, whose per-tensor
    norms they compute over ``segments``); ``whole_groups``: one pseudo-parameter per
    group (the kernels' way) instead of pieces of at most ``PIECE`` elements;
    ``move_params=False``: the parameters stay where they are (only gradients and state
    are flat; ``params`` is then empty and ``members`` lists each group's tensors) for an
    engine that takes lists of tensors."""
    spec = state.spec
    if spec.kind not in kinds or not state.grad_params:
        return None
    shapes = {p: tuple(state.params[p].shape) for p in state.grad_params}
    layout = FlatLayout.build(shapes, align=ALIGN)
    flat_g = _shared_base({p: state.grads[p] for p in shapes if p in state.grads}, layout)
    if flat_g is None:
        flat_g = torch.zeros(layout.numel, device=state.device)
        state.adopt_grads(layout.views(flat_g))
    if move_params:
        flat_p = torch.zeros(layout.numel, device=state.device)
        state.move_params(layout.views(flat_p))
    entries = {e.name: e for e in layout.entries}
    groups, pshapes, params, grads, states, segments, members = [], {}, {}, {}, {}, {}, {}
    for gi, group in enumerate(spec.groups):
        mine = [entries[p] for p in group.params if p in entries]
        if not mine:
            groups.append(GroupSpec((), group.nesterov, group.momentum, group.bias_correction))
            continue
        start, stop = mine[0].offset, mine[-1].stop
        if any(b.offset < a.stop for a, b in itertools.pairwise(mine)):
            raise AssertionError("flat layout is not ordered by param group")
        cuts = [*range(start, stop, stop - start if whole_groups else PIECE), stop]
        pieces = [(f"flat.group{gi}" + (f".{k}" if len(cuts) > 2 else ""), a, b)
                  for k, (a, b) in enumerate(itertools.pairwise(cuts))]  # fmt: skip
        names = tuple(name for name, _, _ in pieces)
        groups.append(GroupSpec(names, group.nesterov, group.momentum, group.bias_correction))
        bounds = [e.offset - start for e in mine] + [stop - start]
        for name, a, b in pieces:
            pshapes[name] = (b - a,)
            if move_params:
                params[name] = flat_p[a:b]
            grads[name] = flat_g[a:b]
            segments[name] = [b - a]
            members[name] = [e.name for e in mine if a <= e.offset < b]
        if len(pieces) == 1:  # the kernels' per-tensor segments
            segments[names[0]] = [b - a for a, b in itertools.pairwise(bounds)]
        for s in spec.state_names(group):
            flat_s = torch.zeros(stop - start, device=state.device)
            for name, a, b in pieces:
                states[state_key(s, name)] = flat_s[a - start : b - start]
            for e in mine:
                view = flat_s[e.offset - start : e.stop - start].view(e.shape)
                old = state.opt_state.get(state_key(s, e.name))
                if old is not None:  # loaded from a checkpoint before the first step
                    with torch.no_grad():
                        view.copy_(old)
                state.opt_state[state_key(s, e.name)] = view
    return FlatUpdate(
        OptimizerSpec(spec.kind, tuple(groups)), pshapes, params, grads, states, segments, members
    )
