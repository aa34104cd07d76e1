"""Activation checkpoints (``torch.utils.checkpoint``) in the model's forward.

Reentrant ones (``use_reentrant=True``) run their forward under ``no_grad`` and again in
the backward, and refuse ``torch.autograd.grad``, which ortrain's checks against eager
used: the first step's check raised torch's error. The export now traces the function
they wrap (``ortrain/export_checkpoints.py``), and the checks take eager's gradients
through them (``ortrain/eager_grads.py``). ZeRO-2's side: ``tests/test_distributed.py``.
Either kind's recompute replays its forward's dropouts, which the check counted as sites
the graph had lost.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch.utils.checkpoint import checkpoint

from ortrain import ORTTrainer, TrainerOptions
from ortrain.eager_grads import grads_of, has_reentrant_checkpoint
from tests.dist_worker import Checkpointed, CheckpointedBlock, reentrant_batches


def test_a_model_with_reentrant_checkpoints_compiles_whole_and_trains_as_eager():
    """One graph (before: the check raised, or with the gradients taken another way the
    export's detached outputs left every block parameter without a gradient, and the model
    fell back to segments); five AdamW steps equal eager's."""
    torch.manual_seed(0)
    model = Checkpointed()
    ref = copy.deepcopy(model)
    trainer = ORTTrainer(
        model, torch.optim.AdamW(model.parameters(), lr=1e-2), TrainerOptions(graph_cache=False)
    )
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    for batch in reentrant_batches(0, 1):
        loss = trainer.train_step(**batch)
        opt.zero_grad()
        want = ref(**batch)
        want.backward()
        opt.step()
        torch.testing.assert_close(loss, want.detach(), rtol=1e-5, atol=1e-6)
    assert trainer.program.whole and trainer.build_count == 1
    for (name, p), q in zip(trainer.module.named_parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-5, msg=name)


def test_grads_through_a_reentrant_checkpoint_are_autograds_and_fire_no_hook():
    """``grads_of`` equals ``torch.autograd.grad`` on the same function without the
    checkpoint, leaves ``.grad`` as it was and runs no post-accumulation hook (ZeRO-2's
    would take the check's gradients for a step's)."""
    torch.manual_seed(0)
    block = CheckpointedBlock(8)
    x = torch.randn(3, 8, requires_grad=True)
    seed = torch.randn(3, 8)
    params = list(block.parameters())
    want = torch.autograd.grad(block(x), [x, *params], seed)
    held = torch.full_like(params[0], 7.0)
    params[0].grad = held
    fired: list[int] = []
    handle = params[1].register_post_accumulate_grad_hook(lambda p: fired.append(1))
    out = checkpoint(block, x, use_reentrant=True)
    assert has_reentrant_checkpoint([out]) and not has_reentrant_checkpoint([block(x)])
    got = grads_of([out], [x, *params], [seed])
    handle.remove()
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w)
    assert params[0].grad is held and params[1].grad is None and x.grad is None
    assert not fired


@pytest.mark.parametrize("reentrant", [True, False], ids=["reentrant", "non-reentrant"])
def test_dropout_inside_checkpoints_is_not_taken_for_lost_dropout(reentrant):
    """A checkpoint's recompute replays the dropouts of its forward (the same masks): the
    check counted them as eager's draws, saw more than the graph's, and called the
    export's dropout lost (the model fell back to segments). One graph now, drawing each
    site once a step."""
    torch.manual_seed(0)
    model = Checkpointed(dropout=0.2, reentrant=reentrant)
    trainer = ORTTrainer(
        model, torch.optim.AdamW(model.parameters(), lr=1e-2), TrainerOptions(graph_cache=False)
    )
    losses = [trainer.train_step(**b).item() for b in reentrant_batches(0, 1)]
    assert trainer.program.whole and trainer.build_count == 1, trainer.program
    ops = [n.op_type for n in trainer.train_graphs[0].graph]
    assert ops.count("Dropout") == 2, ops  # one per block
    assert all(torch.isfinite(torch.tensor(losses)))
