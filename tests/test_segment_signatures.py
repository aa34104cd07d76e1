"""A compiled segment's new call signatures: built when they pay, not on every step.

A model whose forward selects rows by a mask (the masked positions of an MLM loss, the
tokens routed to an expert) does not compile whole (a size the data sets); it trains as
segments, and the module after the selection is called with a row count that changes
from step to step. Each count is a new call signature; building and checking a graph for
each cost seconds per step for a call of milliseconds. Such calls run in eager until
their time lost against the segment's compiled forward reaches a build's
(``ortrain/ski_rental.py``); ``eager_if_faster=False`` builds every signature at once.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

import ortrain.segments.partition as partition
from ortrain import ORTTrainer, TrainerOptions
from ortrain.ski_rental import Rented, keeps_renting

V, D = 50, 16


class _MaskedHead(torch.nn.Module):
    """An encoder over every position, a head over the positions the labels select."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = torch.nn.Embedding(V, D)
        self.enc = torch.nn.Sequential(
            torch.nn.Linear(D, 2 * D), torch.nn.GELU(), torch.nn.Linear(2 * D, D)
        )
        self.head = torch.nn.Sequential(torch.nn.LayerNorm(D), torch.nn.Linear(D, V))

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        h = self.enc(self.emb(ids))
        picked = labels != -100
        return F.cross_entropy(self.head(h[picked]), labels[picked])


def _batches(n: int, seed: int = 3) -> list[dict[str, torch.Tensor]]:
    """Batches of one shape whose selected counts differ (the first two alike)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        ids = torch.randint(0, V, (4, 12), generator=g)
        labels = torch.full_like(ids, -100)
        k = 6 if i < 2 else 6 + i  # rows selected: 6, 6, 8, 9, ...
        rows = torch.randperm(ids.numel(), generator=g)[:k]
        labels.view(-1)[rows] = ids.view(-1)[rows]
        out.append({"ids": ids, "labels": labels})
    return out


class _TiedHead(_MaskedHead):
    """The head's projection is the embedding table (BERT's tied decoder)."""

    def __init__(self) -> None:
        super().__init__()
        self.head[1].weight = self.emb.weight


def _train(
    batches: list[dict], options: TrainerOptions, make: type[_MaskedHead] = _MaskedHead
) -> ORTTrainer:
    """ortrain against eager, step by step and in the parameters (SGD)."""
    model = make()
    ref = copy.deepcopy(model)
    trainer = ORTTrainer(model, torch.optim.SGD(model.parameters(), lr=0.1), options)
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for i, b in enumerate(batches):
        opt.zero_grad()
        want = ref(**b)
        want.backward()
        opt.step()
        got = trainer.train_step(**b)
        torch.testing.assert_close(got, want.detach(), rtol=1e-5, atol=0, msg=f"step {i}")
    for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=name)
    return trainer


def test_the_rule_rents_until_the_loss_reaches_a_build() -> None:
    assert keeps_renting(None, 1e-3, 100, price=1.0)  # first call: nothing timed yet
    r = Rented()
    r.add(0.5, 100)  # 0.5 s eager against 0.1 s compiled: 0.4 s lost
    assert r.lost(1e-3) == pytest.approx(0.4)
    assert keeps_renting(r, 1e-3, 100, price=1.0)  # 0.4 + 0.4 < 1.0
    r.add(0.5, 100)
    assert not keeps_renting(r, 1e-3, 100, price=1.0)  # 0.8 + 0.4 reaches it: build
    fast = Rented()
    fast.add(0.05, 100)  # eager faster than the graph's estimate: never built
    fast.add(0.05, 100)
    assert keeps_renting(fast, 1e-3, 100, price=0.0)


def test_data_dependent_rows_run_in_eager_not_built_each_step() -> None:
    trainer = _train(_batches(6), TrainerOptions())
    seg = trainer.segments
    assert seg is not None and seg.model is not None
    assert "head" in seg.model.compiled
    head = [r for r in seg.model.runners["head"].values() if r is not None]
    assert len(head) == 1  # the planned count's graph only
    assert head[0].runs == 2  # the two steps of that count ran on it
    assert seg.model.eager_calls("head") == 4  # counts 8, 9, 10, 11 in eager
    assert seg.model.builds == len({id(r) for t in seg.model.runners.values() for r in t.values()})
    assert "4 call(s) of new signatures in eager" in seg.explain()


@pytest.mark.slow
def test_a_signature_is_built_once_its_eager_calls_have_lost_a_build(monkeypatch) -> None:
    """The rule's verdict (here: build at a signature's second call) makes the graph,
    which is checked and runs the later calls of that signature."""
    seen: list[tuple[int, float]] = []

    def second_call_builds(r, per_element, elements, price):
        seen.append((elements, price))
        return r is None  # rent the first call, build at the second

    monkeypatch.setattr(partition, "keeps_renting", second_call_builds)
    batches = _batches(3)
    batches += [batches[2], batches[2]]  # the count of step 3 twice more
    trainer = _train(batches, TrainerOptions())
    seg = trainer.segments
    assert seg is not None and seg.model is not None
    assert seg.model.eager_calls("head") == 1  # step 3's first call
    head = {id(r): r for r in seg.model.runners["head"].values() if r is not None}
    assert len(head) == 2  # the planned count and step 3's, built at its second call
    assert all(price > 0 for _, price in seen)  # priced at a measured build's time


@pytest.mark.slow
def test_eager_if_faster_false_builds_every_signature() -> None:
    trainer = _train(_batches(4), TrainerOptions(eager_if_faster=False))
    seg = trainer.segments
    assert seg is not None and seg.model is not None
    assert seg.model.eager_calls("head") == 0
    head = {id(r) for r in seg.model.runners["head"].values() if r is not None}
    assert len(head) == 3  # counts 6, 8 and 9


@pytest.mark.slow
def test_a_tied_head_in_eager_beside_the_compiled_embedding_rows() -> None:
    """The embedding's compiled rows add into the tied table's gradient where the head's
    graph made it, and into autograd's where the head ran in eager."""
    trainer = _train(_batches(6), TrainerOptions(), make=_TiedHead)
    seg = trainer.segments
    assert seg is not None and seg.model is not None
    assert sorted(seg.model.compiled) == ["emb", "enc", "head"]
    assert seg.model.eager_calls("head") == 4
    assert seg.model.tied.added_count == 2  # the two steps whose head ran on its graph
