"""A tied embedding trained as segments: the embedding's rows are added in place to the
gradient the LM head's backward already made (``ortrain/segments/accumulate.py``,
``TiedGradients`` in ``ortrain/segments/runner.py``), and training stays eager's."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from ortrain import TrainerOptions
from ortrain.core.roles import Role
from ortrain.segments.runner import TiedGradients
from tests.test_fallback import train_like_eager

V, D = 40, 16


class _Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(D)
        self.up = torch.nn.Linear(D, 2 * D)
        self.down = torch.nn.Linear(2 * D, D)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.down(F.gelu(self.up(self.norm(h))))


class _LM(torch.nn.Module):
    """Token embedding, two blocks, an LM head; ``tied``: the head's weight is the
    embedding's; ``eager_read``: the root's own forward reads the tied table too."""

    def __init__(self, tied: bool = True, eager_read: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = torch.nn.Embedding(V, D)
        self.blocks = torch.nn.ModuleList(_Block() for _ in range(2))
        self.head = torch.nn.Linear(D, V, bias=False)
        if tied:
            self.head.weight = self.emb.weight
        self.eager_read = eager_read

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        h = self.emb(ids)
        for b in self.blocks:
            h = b(h)
        loss = F.cross_entropy(self.head(h).flatten(0, 1), labels.flatten())
        if self.eager_read:
            loss = loss + 1e-2 * self.emb.weight[:4].square().sum()
        return loss


def _batches(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(3)
    return [
        (torch.randint(0, V, (4, 6), generator=g), torch.randint(0, V, (4, 6), generator=g))
        for _ in range(n)
    ]


BLOCKS = TrainerOptions(segments="blocks")


def test_the_rows_go_into_the_heads_gradient_and_train_like_eager():
    trainer = train_like_eager(_LM, _batches(4), BLOCKS)
    seg = trainer.segments.model
    emb_runner = next(iter(seg.runners["emb"].values()))
    # the embedding's backward has a variant whose rows add into an input, not into zeros
    acc = [r for r in emb_runner.graphs.backward_acc.inputs if r.role is Role.ACCUMULATOR]
    assert [(r.name, r.of) for r in acc] == [("acc:weight", "weight")]
    assert emb_runner.graphs.accumulators == {"weight": "acc:weight"}
    assert seg.tied.eligible == {id(trainer.module.emb.weight)}
    assert seg.tied.added_count == 4  # every backward: the head's gradient came first
    assert emb_runner.bwd_acc is not None and emb_runner._bwd is None


@pytest.mark.slow
def test_accumulation_and_eager_code_reading_the_tied_table():
    """Two micro-steps per update (the rows go into this micro-step's gradient, autograd
    adds it to ``.grad``), and a loss term in the root's eager forward on the same table
    (a third gradient of it, which autograd adds): both as eager."""
    trainer = train_like_eager(
        lambda: _LM(eager_read=True),
        _batches(4),
        TrainerOptions(segments="blocks", grad_accumulation_steps=2),
        accumulation=2,
    )
    assert trainer.segments.model.tied.eligible  # the head and the embedding make one each


def test_an_untied_embedding_keeps_its_own_rows():
    """Its rows go into zeros made per backward: the plain graph, whose zeros ONNX Runtime
    would fold into a table-sized constant its session keeps, is never made."""
    trainer = train_like_eager(lambda: _LM(tied=False), _batches(2), BLOCKS)
    seg = trainer.segments.model
    assert not seg.tied.eligible and seg.tied.added_count == 0
    runner = next(iter(seg.runners["emb"].values()))
    assert runner.bwd_acc is not None and runner._bwd is None
    block = next(iter(seg.runners["blocks.0"].values()))
    assert block.graphs.backward_acc is None and block._bwd is not None  # no rows: plain


def test_a_gradient_replaced_after_the_rows_went_in_raises():
    """The guard: autograd must accumulate the very tensor the rows were added to."""
    tied = TiedGradients()
    p = torch.nn.Parameter(torch.ones(3))
    tied.watch(p)
    # rows "added" into a tensor autograd does not hold (kept alive: a freed one's memory
    # could be the gradient's, whose address would then match)
    elsewhere = torch.zeros(3)
    tied.added(p, elsewhere)
    with pytest.raises(RuntimeError, match="rows would be lost"):
        (2 * p).sum().backward()
    assert p.grad is None
    tied.clear()
    (2 * p).sum().backward()  # nothing added this backward: no check
    torch.testing.assert_close(p.grad, torch.full((3,), 2.0))
