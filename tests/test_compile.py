"""``ORTTrainer.compile``: the program for a batch's signature built before training, the
same graph the first step then runs, nothing trained by it."""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F

from ortrain import ORTTrainer, TrainerOptions
from tests.conftest import gpt2, lm_batches
from tests.test_bucketing import graph_lengths
from tests.unexportable import smoothed_cross_entropy


def test_compile_builds_the_graph_the_first_step_runs_and_trains_nothing():
    model = gpt2(layers=1, hidden=32, vocab=64)
    ref = copy.deepcopy(model)
    # SGD: AdamW's first step moves weights of float-noise gradients by a whole lr
    trainer = ORTTrainer(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    before = [p.detach().clone() for p in model.parameters()]
    batch = lm_batches(1, batch=2, seq=20, vocab=64)[0]
    program = trainer.compile(**batch)
    assert [s.kind for s in program.segments] == ["graph"] and program == trainer.program
    assert trainer.build_count == 1 and graph_lengths(trainer) == {32}  # bucketed as a step
    assert int(trainer.state.step_tensor) == 0 and not trainer.optimizer.state
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before, strict=True))
    # no eager reference step is held for a step that may come with another batch
    assert not trainer._program._references  # type: ignore[union-attr]
    # steps on other batches of that bucket run on that graph (no second build), its first
    # step checked against eager on its own batch, and train like eager
    opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    for other in lm_batches(2, batch=2, seq=25, vocab=64, seed=7):
        opt.zero_grad()
        want = ref(**other).loss
        want.backward()
        opt.step()
        got = trainer.train_step(**other)
        torch.testing.assert_close(got, want.detach(), rtol=1e-5, atol=0)
    assert trainer.build_count == 1 and trainer.segments is None
    assert list(trainer.bucketing.proofs.values()) == [("exact", "")]
    trainer.sync_to_module()
    for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-6, msg=name)


class _CustomLoss(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = torch.nn.Linear(8, 4)

    def forward(self, x, y):
        return smoothed_cross_entropy(F.relu(self.lin(x)), y, 0.1)


def test_compile_of_a_model_that_cannot_be_one_graph_returns_its_segmented_program():
    model = _CustomLoss()
    options = TrainerOptions(graph_cache=False)
    trainer = ORTTrainer(model, torch.optim.SGD(model.parameters(), lr=0.1), options)
    x, y = torch.randn(6, 8), torch.randint(0, 4, (6,))
    program = trainer.compile(x, y)
    assert trainer.segments is not None and "graph" not in {s.kind for s in program.segments}
    ref = copy.deepcopy(model)
    want = ref(x, y)
    want.backward()
    torch.optim.SGD(ref.parameters(), lr=0.1).step()
    torch.testing.assert_close(trainer.train_step(x, y), want.detach(), rtol=1e-5, atol=0)
