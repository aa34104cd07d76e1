"""``train_step`` called inside the user's ``torch.autocast``: eager computes the step in
autocast's dtypes, a graph in those it was built for. Such steps run in eager (the model
as segments, whose calls under autocast run eagerly), whatever ran before them."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch

from ortrain import ORTTrainer, TrainerOptions
from ortrain.core.errors import ExportError
from ortrain.segmented_program import SegmentedProgram
from tests.conftest import gpt2, lm_batches

LR = 0.1


def _eager_step(model: torch.nn.Module, opt: torch.optim.Optimizer, batch: dict, on: bool):
    opt.zero_grad()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=on):
        loss = model(**batch).loss
    loss.backward()
    opt.step()
    return loss.item()


def _assert_same_parameters(model: torch.nn.Module, reference: torch.nn.Module) -> None:
    for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize("before", [0, 2], ids=["from-the-first-step", "after-float32-steps"])
def test_steps_inside_autocast_train_as_eager_does_in_it(before: int) -> None:
    """``before`` float32 steps (a whole graph built and stepping), then autocast steps:
    each step's loss and the parameters after it as eager's, in the same dtypes (before:
    the autocast steps ran the float32 graph)."""
    model = gpt2(layers=2, hidden=64, vocab=128)
    reference = copy.deepcopy(model)
    trainer = ORTTrainer(model, torch.optim.SGD(model.parameters(), lr=LR))
    opt = torch.optim.SGD(reference.parameters(), lr=LR)
    batches = lm_batches(before + 2, batch=2, seq=16, vocab=128)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for i, batch in enumerate(batches):
            on = i >= before
            if on and i == before and before:
                # from the same weights: casting to bfloat16 turns float32's last-bit
                # differences (the graph's own summation order) into bfloat16's
                with torch.no_grad():
                    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
                        q.copy_(p)
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=on):
                loss = trainer.train_step(**batch).item()
            expected = _eager_step(reference, opt, batch, on)
            assert loss == pytest.approx(expected, rel=1e-6), (i, on)
            trainer.sync_to_module()
            _assert_same_parameters(model, reference)
    said = [str(w.message) for w in caught if "torch.autocast('cpu'" in str(w.message)]
    assert len(said) == 1 and "train_step runs inside torch.autocast" in said[0], said
    assert isinstance(trainer._program, SegmentedProgram)


def test_autocast_without_fallback_is_refused_by_name() -> None:
    model = gpt2(layers=1, hidden=32, vocab=64)
    trainer = ORTTrainer(
        model, torch.optim.SGD(model.parameters(), lr=LR), TrainerOptions(fallback="off")
    )
    batch = lm_batches(1, batch=2, seq=8, vocab=64)[0]
    before = [p.detach().clone() for p in model.parameters()]
    said = r"GPT2LMHeadModel: train_step runs inside torch\.autocast"
    with torch.autocast("cpu", dtype=torch.bfloat16), pytest.raises(ExportError, match=said):
        trainer.train_step(**batch)
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before, strict=True))


def test_evaluation_inside_autocast_runs_in_eager_in_its_dtypes() -> None:
    """Inside autocast: eager's outputs, in autocast's dtype (it built a bfloat16 graph
    that ONNX Runtime refused, raising out of eval_step); one warning; outside it
    again: the float32 graph."""
    model = gpt2(layers=2, hidden=64, vocab=128)
    reference = copy.deepcopy(model).eval()
    trainer = ORTTrainer(model, torch.optim.SGD(model.parameters(), lr=LR))
    batch = lm_batches(1, batch=2, seq=16, vocab=128)[0]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            with torch.autocast("cpu", dtype=torch.bfloat16), torch.no_grad():
                got, want = trainer.eval_step(**batch), reference(**batch)
            assert got["logits"].dtype == want.logits.dtype == torch.bfloat16
            assert torch.equal(got["logits"], want.logits) and torch.equal(got.loss, want.loss)
        assert not trainer._ctx.graphs.eval
        got = trainer.eval_step(**batch)
    with torch.no_grad():
        want = reference(**batch)
    assert got["logits"].dtype == torch.float32
    torch.testing.assert_close(got["logits"], want.logits, rtol=1e-5, atol=1e-5)
    assert len(trainer._ctx.graphs.eval) == 1
    said = [str(w.message) for w in caught if "autocast" in str(w.message)]
    assert len(said) == 1 and "eval_step runs inside torch.autocast('cpu'" in said[0], said


def test_an_evaluation_graph_onnxruntime_refuses_runs_in_eager(monkeypatch) -> None:
    """A session ONNX Runtime will not make (a kernel it lacks for the graph's types):
    eager's outputs and a warning naming it, not the runtime's exception."""
    from onnxruntime.capi.onnxruntime_pybind11_state import NotImplemented as Refused

    model = gpt2(layers=1, hidden=32, vocab=64)
    reference = copy.deepcopy(model).eval()
    trainer = ORTTrainer(model, torch.optim.SGD(model.parameters(), lr=LR))
    batch = lm_batches(1, batch=2, seq=16, vocab=64)[0]

    def refuse(*args, **kwargs):
        raise Refused("Could not find an implementation for FusedMatMul(1)")

    monkeypatch.setattr(trainer._ctx, "session", refuse)
    with pytest.warns(UserWarning, match="ONNX Runtime refused the graph: Could not find"):
        got = trainer.eval_step(**batch)
    with torch.no_grad():
        want = reference(**batch)
    assert torch.equal(got.loss, want.loss)
