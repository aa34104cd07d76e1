"""Bucketing and what a forward does in Python. A forward that branches in Python on the
sequence length trains like eager under bucketing (``ortrain/length_branches.py``):
before, a batch padded across the threshold ran the other branch's graph, silently (the
layout's check had sampled a first batch on the bucket length's side of it). A buffer the
forward assigns anew is put back after the padding check's eager runs."""

from __future__ import annotations

import os
import warnings

import torch
import torch.nn.functional as F
from torch import nn

from ortrain import ORTTrainer, TrainerOptions
from ortrain.length_branches import branch_free_lengths
from tests.test_bucketing import graph_lengths, varlen_batch

THRESHOLD = 20


class _LengthBranch(nn.Module):
    """Per-token (so padding is exact), with a path for sequences over ``THRESHOLD``."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(64, 16)
        self.out = nn.Linear(16, 64)

    def forward(self, input_ids, attention_mask, labels):
        h = self.emb(input_ids)
        if input_ids.shape[1] > THRESHOLD:  # "long inputs": another scaling
            h = torch.tanh(h) * 2.0
        return F.cross_entropy(self.out(h).flatten(0, 1), labels.flatten())


def test_a_batch_is_padded_only_within_the_lengths_of_one_branch():
    # bucket 32 for all of them; the first batch (23) is on the bucket's side of 20
    lengths = [[23, 21], [18, 12], [25, 24], [19, 19], [30, 22], [17, 9]]
    batches = [varlen_batch(ls, vocab=64, seed=i) for i, ls in enumerate(lengths)]
    torch.manual_seed(0)
    model, ref = _LengthBranch(), _LengthBranch()
    ref.load_state_dict(model.state_dict())
    opt, opt_ref = (torch.optim.SGD(m.parameters(), lr=0.5) for m in (model, ref))
    trainer = ORTTrainer(model, opt, TrainerOptions(eager_if_faster=False))  # (every shape built)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for batch in batches:
            want = ref(**batch)
            want.backward()
            opt_ref.step()
            opt_ref.zero_grad()
            got = trainer.train_step(**batch)
            torch.testing.assert_close(got, want.detach(), rtol=1e-5, atol=0)
    trainer.sync_to_module()
    for (k, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=k)
    # the long batches share the 32 graph; the short ones run at their own lengths
    assert graph_lengths(trainer) == {32, 18, 19, 17}
    told = [str(w.message) for w in caught if "branches in Python" in str(w.message)]
    assert len(told) == 1 and f"lengths {THRESHOLD + 1} to " in told[0]


def test_the_range_is_the_lengths_that_take_the_example_s_branches():
    batch = varlen_batch([26, 26], vocab=64)
    keys = ["input_ids", "attention_mask", "labels"]
    assert branch_free_lengths(_LengthBranch(), None, batch, keys, 512, True) == (21, 512)
    short = varlen_batch([12, 12], vocab=64)
    assert branch_free_lengths(_LengthBranch(), None, short, keys, 512, True) == (2, 20)


class _RunMax(nn.Module):
    """A running maximum kept in a buffer the forward assigns anew (not in place)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(64, 8)
        self.lin = nn.Linear(8, 1)
        self.register_buffer("mx", torch.zeros(1))

    def forward(self, input_ids, labels):
        h = self.emb(input_ids)
        pred = self.lin(h[:, 0] * (1 + 0.1 * self.mx)).squeeze(-1)
        self.mx = torch.maximum(self.mx, h.detach().abs().amax())
        return F.mse_loss(pred, labels)


def test_the_padding_check_puts_back_a_buffer_the_forward_assigns_anew():
    """The check's two eager runs (the batch and it padded) moved the buffer, which they
    put back only where it was changed in place: step 0 already differed."""
    g = torch.Generator().manual_seed(61)
    batches = [
        {
            "input_ids": torch.randint(2, 64, (3, n), generator=g),
            "labels": torch.randn(3, generator=g),
        }
        for n in (5, 7, 5, 6)
    ]
    torch.manual_seed(0)
    model, ref = _RunMax(), _RunMax()
    ref.load_state_dict(model.state_dict())
    opt, opt_ref = (torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, ref))
    trainer = ORTTrainer(model, opt, TrainerOptions(eager_if_faster=False))  # (every shape built)
    for batch in batches:
        want = ref(**batch)
        want.backward()
        opt_ref.step()
        opt_ref.zero_grad()
        got = trainer.train_step(**batch)
        torch.testing.assert_close(got, want.detach(), rtol=1e-5, atol=0)
        trainer.sync_to_module()
        torch.testing.assert_close(model.mx, ref.mx, rtol=0, atol=0)


def _train(trainer: ORTTrainer, lengths: list[list[int]]) -> list[str]:
    """Steps over ``lengths``' batches; the branch warnings they gave."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for i, ls in enumerate(lengths):
            trainer.train_step(**varlen_batch(ls, vocab=64, seed=i))
    return [str(w.message) for w in caught if "branches in Python" in str(w.message)]


def test_the_range_is_traced_once_per_machine(tmp_path, monkeypatch):
    """The trace (a whole-forward export) is kept in the graph cache: a second trainer
    over the same model code traces nothing and still refuses to pad across the
    threshold."""
    import ortrain.length_branches as lb

    pids = tmp_path / "pids"
    traced = lb.branch_free_lengths

    def tracing(*args, **kwargs):
        with open(pids, "a") as f:
            f.write(f"{os.getpid()}\n")
        return traced(*args, **kwargs)

    monkeypatch.setattr(lb, "branch_free_lengths", tracing)
    monkeypatch.setenv("ORTRAIN_GRAPH_CACHE", str(tmp_path / "cache"))
    lengths = [[23, 21], [18, 12], [25, 24]]
    options = TrainerOptions(eager_if_faster=False)  # (every shape built)
    torch.manual_seed(0)
    model = _LengthBranch()
    first = ORTTrainer(model, torch.optim.SGD(model.parameters(), lr=0.1), options)
    told = _train(first, lengths)
    assert len(pids.read_text().split()) == 1  # one range traced
    assert len(told) == 1 and f"lengths {THRESHOLD + 1} to {1 << 20} " in told[0]
    assert graph_lengths(first) == {32, 18}
    pids.unlink()
    model = _LengthBranch()
    second = ORTTrainer(model, torch.optim.SGD(model.parameters(), lr=0.1), options)
    told = _train(second, lengths)
    assert not pids.exists()  # recalled, not traced
    assert len(told) == 1 and f"lengths {THRESHOLD + 1} to {1 << 20} " in told[0]
    assert graph_lengths(second) == {32, 18}
    assert first.cache_hits == 0 and second.cache_hits == first.build_count
