"""A graph pass that fails on a graph (a defect of ortrain's compiler, not of the model)
stops no training: the error names the pass and what it raised (``PassError``); with
``fallback="auto"`` the model trains as segments, the module whose graph the pass cannot
take in eager, like eager; with ``fallback="off"`` the error is raised."""

from __future__ import annotations

import pytest
import torch

from ortrain import ORTTrainer, TrainerOptions
from ortrain.core.errors import PassError
from tests.test_verify import _batches, _Net

pytestmark = pytest.mark.unit


def _recompute_fails_on_tanh(monkeypatch: pytest.MonkeyPatch) -> None:
    """A test-only defect: the recompute pass raises KeyError on a graph with a Tanh."""
    from ortrain.graph_passes import training_pipeline

    right = training_pipeline.recompute_cheap_values

    def broken(model, policy):
        if any(n.op_type == "Tanh" for n in model.graph):
            raise KeyError("a value the pass did not expect")
        return right(model, policy)

    monkeypatch.setattr(training_pipeline, "recompute_cheap_values", broken)


def test_a_failing_pass_is_named_when_off(monkeypatch):
    _recompute_fails_on_tanh(monkeypatch)
    model = _Net()
    options = TrainerOptions(fallback="off", graph_cache=False)
    trainer = ORTTrainer(model, torch.optim.SGD(model.parameters(), lr=0.1), options)
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(PassError, match=r"graph pass 'recompute' failed: KeyError: .*did not"):
        trainer.train_step(*_batches(1)[0])
    for p, q in zip(model.parameters(), before, strict=True):
        assert torch.equal(p, q)  # nothing trained


def test_a_failing_pass_trains_like_eager_when_auto(monkeypatch):
    _recompute_fails_on_tanh(monkeypatch)
    model, ref = _Net(), _Net()
    opt_ref = torch.optim.SGD(ref.parameters(), lr=0.1)
    options = TrainerOptions(graph_cache=False)
    with pytest.warns(UserWarning, match="PassError: graph pass 'recompute' failed: KeyError"):
        trainer = ORTTrainer(model, torch.optim.SGD(model.parameters(), lr=0.1), options)
        for x, y in _batches(3):
            opt_ref.zero_grad()
            want = ref(x, y)
            want.backward()
            opt_ref.step()
            torch.testing.assert_close(trainer.train_step(x, y), want.detach(), rtol=1e-5, atol=0)
    # the Linears compile on their own (no Tanh in their graphs); the Tanh runs in eager
    assert trainer.segments is not None
    assert sorted(trainer.segments.model.compiled) == ["body.0", "body.3"]
    for (k, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=k)
