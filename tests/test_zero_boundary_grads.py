"""Gradients and losses at the boundaries where a naive formula gives NaN or a capped value,
against ``torch.autograd`` element by element.

1. ``Pow`` at a zero base: torch's ``pow_backward_self`` is 0 where the exponent is 0
   and ``pow_backward_exponent`` is 0 where the base is 0 and the exponent >= 0 (the
   plain formulas give 0 * inf and 0 * -inf there).
2. The p-norm (p = 3, 4, 2.5) of a zero row among nonzero ones, and of rows holding zero
   elements: torch's ``norm_backward`` is 0 where the norm is 0.
3. Cross-entropy over logits scaled by 1000 (logit gaps far beyond the ~87 at which a
   float32 probability underflows): the loss itself, not only its gradient.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from ortrain import ORTTrainer, TrainerOptions
from tests.gradcheck import Const, In, case, check_gradients

_OPTIONS = TrainerOptions(fallback="off", graph_cache=False, build_progress=False)


def _value(arr: object, grad: bool = True) -> In:
    a = np.asarray(arr, dtype=np.float32)
    return In(a.shape, "float32", grad=grad, value=a)


# Zero bases under exponents 0, 1 (d/dx = 1), 1.5, 2 and 3; exponent 0 at nonzero bases;
# a negative exponent only where the base is nonzero (torch's gradient is inf at zero).
_BASE = [[0.0, 0.0, 0.0, 1.5, 0.0], [0.0, 2.0, 0.5, 0.0, 0.7]]
_EXPONENT = [[0.0, 1.5, 2.0, 0.0, 1.0], [3.0, 0.0, -1.2, 0.0, 2.5]]


@pytest.mark.parametrize(
    "spec",
    [
        case("Pow-zero-base", "Pow", [_value(_BASE), _value(_EXPONENT)], torch.pow),
        case(
            "Pow-zero-base-bcast",
            "Pow",
            [_value([[[0.0], [1.5]], [[0.0], [0.0]]]), _value([0.0, 1.0, 2.0])],
            torch.pow,
        ),
        case("Pow-zero-base-exponent-only", "Pow", [_value(_BASE, False), _value(_EXPONENT)],
             torch.pow),
        case("Pow-const-exponent-zero", "Pow", [_value(_BASE), Const(0.0, "float32")],
             torch.pow),
    ],
    ids=lambda s: s.id,
)  # fmt: skip
def test_pow_at_zero_base(spec) -> None:
    check_gradients(spec)


class _Norms(torch.nn.Module):
    """Norms of ``w * mask`` per row (row 0 all zero, row 2 partly zero) and of the whole."""

    def __init__(self, p: float):
        super().__init__()
        torch.manual_seed(0)
        self.w = torch.nn.Parameter(torch.randn(4, 5))
        self.p = p

    def forward(self, mask: torch.Tensor) -> torch.Tensor:
        v = self.w * mask
        rows = v.norm(p=self.p, dim=1)
        kept = torch.linalg.vector_norm(v, ord=self.p, dim=-1, keepdim=True)
        whole = torch.norm(v[:1], p=self.p)  # the zero row alone: a zero norm, no dim
        coef = torch.arange(1.0, 5.0)
        return (rows * coef).sum() + (kept.squeeze(1) * coef.flip(0)).sum() + 2 * whole


@pytest.mark.parametrize("p", [3.0, 4.0, 2.5])
def test_vector_norm_of_zero_row(p: float) -> None:
    mask = torch.ones(4, 5)
    mask[0] = 0.0
    mask[2, 1:3] = 0.0
    model, ref = _Norms(p), _Norms(p)
    want = ref(mask)
    want.backward()
    trainer = ORTTrainer(model, torch.optim.SGD(model.parameters(), lr=0.0), _OPTIONS)
    torch.testing.assert_close(trainer.train_step(mask), want.detach(), rtol=1e-5, atol=1e-6)
    for name, q in ref.named_parameters():
        got = trainer.grads[name]
        assert torch.isfinite(got).all(), name
        torch.testing.assert_close(got, q.grad, rtol=1e-5, atol=1e-6, msg=name)
    assert trainer.segments is None


class _Classifier(torch.nn.Module):
    """The logits themselves are the parameter: each gradient element is one row's
    ``prob - onehot``, not a sum over rows where +-1000 cancel down to rounding."""

    def __init__(self, reduction: str, ignore_index: int):
        super().__init__()
        torch.manual_seed(0)
        self.scores = torch.nn.Parameter(torch.randn(6, 5))
        self.reduction, self.ignore_index = reduction, ignore_index

    def forward(self, y: torch.Tensor) -> torch.Tensor:
        logits = self.scores * 1000.0
        loss = F.cross_entropy(logits, y, reduction=self.reduction, ignore_index=self.ignore_index)
        return loss.sum() if self.reduction == "none" else loss


@pytest.mark.parametrize(
    "reduction, ignore_index", [("mean", -100), ("sum", -100), ("mean", 3), ("none", 1)]
)
def test_cross_entropy_loss_at_large_logits(reduction: str, ignore_index: int) -> None:
    y = torch.tensor([0, 1, 2, 3, 4, 1])
    model, ref = _Classifier(reduction, ignore_index), _Classifier(reduction, ignore_index)
    want = ref(y)
    want.backward()
    assert want.item() > 200.0  # gaps far beyond a float32 probability's range
    trainer = ORTTrainer(model, torch.optim.SGD(model.parameters(), lr=0.0), _OPTIONS)
    torch.testing.assert_close(trainer.train_step(y), want.detach(), rtol=1e-5, atol=0.0)
    for name, q in ref.named_parameters():
        torch.testing.assert_close(trainer.grads[name], q.grad, rtol=1e-5, atol=1e-6, msg=name)
    ops = {n.op_type for n in trainer.train_graphs[0].graph}
    assert "SoftmaxCrossEntropyLoss" not in ops and "Softmax" in ops, ops  # the softmax form
