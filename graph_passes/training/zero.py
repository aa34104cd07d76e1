"""ZeRO-1: the graphs that update one rank's shard of the flat parameter/optimizer state.

1. Each trained parameter that intersects the shard is one 1-D *piece* there (a tensor
   straddling a shard boundary has a piece on each rank). The update graph is the
   ordinary one over the pieces, since Adam, AdamW and SGD update element-wise; its
   optimizer-state inputs are pieces too, so moments exist only for the shard.
2. Global-norm clipping needs the norm of all ranks' gradients: the runtime takes the
   shard's sum of squares of the scaled gradients (``sharded_state.shard_sq_norm``) and
   sums those over ranks (all-reduce), and the update graph takes the total as
   ``global_sq_norm``, so every rank takes the same clipping decision.
3. LAMB's trust ratio needs whole-tensor norms of the parameter and of its update;
   it is rejected with ``UnsupportedOptimizerError`` (use zero_stage=0 for LAMB).
"""

from __future__ import annotations

from collections.abc import Mapping

import onnx_ir as ir

from ortrain.core.errors import UnsupportedOptimizerError
from ortrain.core.optimizer_spec import EAGER, SHARDED_EAGER, OptimizerSpec
from ortrain.graph_passes.training.optimizer.update_graph import UpdateGraph, build_update_graph

F = ir.DataType.FLOAT
ELEMENTWISE = ("adam", "adamw", "sgd", SHARDED_EAGER)


def check_shardable(spec: OptimizerSpec) -> None:
    if spec.kind == EAGER:
        raise UnsupportedOptimizerError(
            f"ZeRO (TrainerOptions.zero_stage>=1) shards the optimizer state ortrain keeps for "
            f"AdamW, Adam, SGD and Lamb; {spec.source} keeps its own and runs its own step() "
            f"({spec.why_eager}): use zero_stage=0 (data parallel) or one of those"
        )
    if spec.kind not in ELEMENTWISE:
        raise UnsupportedOptimizerError(
            f"ZeRO-1 (TrainerOptions.zero_stage=1) does not support the {spec.kind} optimizer: "
            "its update needs whole-tensor norms, and a shard holds only pieces of tensors; "
            "use zero_stage=0 (data parallel) or AdamW/Adam/SGD"
        )


def build_shard_update_graph(
    spec: OptimizerSpec,
    piece_numels: Mapping[str, int],
    *,
    clip_grad_norm: bool,
    skip_nonfinite: bool = False,
) -> UpdateGraph:
    """The update graph of one shard; ``piece_numels``: parameter name -> piece length.

    Clipping and the overflow check both read the global sum of squares (an input),
    so every rank takes the same decision.
    """
    check_shardable(spec)
    shapes = {name: (n,) for name, n in piece_numels.items()}
    return build_update_graph(
        spec,
        shapes,
        clip_grad_norm=clip_grad_norm,
        global_sq_norm_input=clip_grad_norm or skip_nonfinite,
        skip_nonfinite=skip_nonfinite,
    )
