"""The segmented model's eager cross-entropy over pooled buffers (ortrain/segments/pooled_loss.py)
equals ``F.cross_entropy`` in value and gradient to the bit, routes only the calls it keeps exactly,
and reuses its buffers from step to step."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from ortrain.runtime.buffer_pool import ReusePool
from ortrain.segments.pooled_loss import PooledCrossEntropy, pooled_cross_entropy
from ortrain.segments.twice import SecondOrderError


def _case(n: int, c: int, seed: int, ignored: float) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(n, c, generator=g) * 3).requires_grad_()
    target = torch.randint(0, c, (n,), generator=g)
    target[torch.rand(n, generator=g) < ignored] = -100
    return logits, target


def _loss_and_grad(fn, logits: torch.Tensor, *args, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
    x = logits.detach().clone().requires_grad_()
    loss = fn(x, *args, **kwargs)
    (loss * 1.7).backward()  # a scale, as the loss scaler and accumulation give
    return loss.detach(), x.grad


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize(("n", "c", "ignored"), [(7, 5, 0.0), (64, 1000, 0.3), (33, 2, 0.5)])
def test_matches_eager(reduction: str, n: int, c: int, ignored: float) -> None:
    logits, target = _case(n, c, n + c, ignored)
    pool = ReusePool()
    with pooled_cross_entropy(pool) as route:
        got = _loss_and_grad(F.cross_entropy, logits, target, reduction=reduction)
    assert route is not None and route.calls == 1
    want = _loss_and_grad(F.cross_entropy, logits, target, reduction=reduction)
    torch.testing.assert_close(got[0], want[0], rtol=0, atol=0)
    torch.testing.assert_close(got[1], want[1], rtol=0, atol=0)
    assert (got[1][target == -100] == 0).all()


def test_other_ignore_index_and_positional_arguments() -> None:
    logits, target = _case(20, 9, 3, 0.0)
    target[::3] = 4  # class 4 is the ignored one here
    pool = ReusePool()
    with pooled_cross_entropy(pool) as route:
        got = _loss_and_grad(F.cross_entropy, logits, target, None, None, 4)
    want = _loss_and_grad(F.cross_entropy, logits, target, None, None, 4)
    assert route is not None and route.calls == 1
    torch.testing.assert_close(got[0], want[0], rtol=0, atol=0)
    torch.testing.assert_close(got[1], want[1], rtol=0, atol=0)


def test_every_target_ignored_is_nan_with_zero_gradient_as_eager() -> None:
    logits, target = _case(6, 4, 5, 1.1)  # all ignored
    with pooled_cross_entropy(ReusePool()):
        got = _loss_and_grad(F.cross_entropy, logits, target)
    want = _loss_and_grad(F.cross_entropy, logits, target)
    assert got[0].isnan() and want[0].isnan()
    torch.testing.assert_close(got[1], want[1], rtol=0, atol=0)  # zeros on both sides
    assert (got[1] == 0).all()


@pytest.mark.parametrize(
    "kwargs",
    [
        {"label_smoothing": 0.1},
        {"weight": torch.rand(5)},
        {"reduction": "none"},
    ],
    ids=["label_smoothing", "weight", "none"],
)
def test_other_calls_run_as_eager(kwargs: dict) -> None:
    logits, target = _case(8, 5, 7, 0.2)
    with pooled_cross_entropy(ReusePool()) as route:
        got = F.cross_entropy(logits, target, **kwargs)
    assert route is not None and route.calls == 0
    torch.testing.assert_close(got, F.cross_entropy(logits, target, **kwargs), rtol=0, atol=0)


def test_other_shapes_dtypes_and_no_grad_run_as_eager() -> None:
    pool = ReusePool()
    with pooled_cross_entropy(pool) as route:
        F.cross_entropy(torch.randn(4, 3, 6, requires_grad=True), torch.randint(0, 3, (4, 6)))
        double = torch.randn(4, 3, dtype=torch.float64, requires_grad=True)
        F.cross_entropy(double, torch.ones(4).long())
        F.cross_entropy(torch.randn(4, 3, requires_grad=True), torch.rand(4, 3))  # probabilities
        F.cross_entropy(torch.randn(4, 3), torch.ones(4).long())  # nothing to differentiate
        with torch.no_grad():
            F.cross_entropy(torch.randn(4, 3, requires_grad=True), torch.ones(4).long())
    assert route is not None and route.calls == 0


def test_target_out_of_range_fails_as_eager() -> None:
    logits, target = _case(4, 3, 1, 0.0)
    target[1] = 3
    with pooled_cross_entropy(ReusePool()), pytest.raises(IndexError, match="out of bounds"):
        F.cross_entropy(logits, target)


def test_buffers_come_back_to_the_pool() -> None:
    logits, target = _case(16, 300, 2, 0.1)
    pool = ReusePool()
    for _ in range(3):
        with pooled_cross_entropy(pool):
            _loss_and_grad(F.cross_entropy, logits, target)
    # step 1 makes the log-probabilities, the loss's gradient and the logits'; steps 2
    # and 3 reuse all three
    assert pool.reused == 6
    assert pool.out_bytes == 0 and pool.free_bytes == 3 * 16 * 300 * 4


def test_second_order_raises() -> None:
    logits, target = _case(5, 4, 9, 0.0)
    loss = PooledCrossEntropy.apply(logits, target, -100, "mean", ReusePool())
    with pytest.raises(SecondOrderError, match="create_graph=True"):
        torch.autograd.grad(loss, logits, create_graph=True)
