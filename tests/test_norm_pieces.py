"""The first-step check's float64 norms, taken a piece at a time (``verify._norm64``):
the same value as a whole float64 copy's norm, of a tensor and of a difference, across
piece edges, with non-finite values kept non-finite."""

from __future__ import annotations

import math

import pytest
import torch

from ortrain import verify


@pytest.fixture
def small_pieces(monkeypatch: pytest.MonkeyPatch) -> int:
    monkeypatch.setattr(verify, "NORM_PIECE", 7)
    return 7


@pytest.mark.parametrize("n", [1, 6, 7, 8, 49, 50, 1000])
def test_a_norm_in_pieces_is_the_whole_float64_norm(small_pieces: int, n: int) -> None:
    g = torch.Generator().manual_seed(n)
    a = torch.randn(n, generator=g) * 1e3
    b = a + torch.randn(n, generator=g) * 1e-4
    whole = float(torch.linalg.vector_norm(a.double()))
    assert math.isclose(verify._norm64(a), whole, rel_tol=1e-13)
    diff = float(torch.linalg.vector_norm(a.double() - b.double()))
    assert math.isclose(verify._norm64(a, b), diff, rel_tol=1e-13)
    # a shaped (non-flat) tensor reads the same elements
    if n % 10 == 0:
        assert verify._norm64(a.reshape(10, -1)) == verify._norm64(a)


def test_the_difference_of_close_float32_values_keeps_its_digits(small_pieces: int) -> None:
    a = torch.full((20,), 1.0)
    b = a + torch.tensor(2.0**-23)  # one ulp at 1: float32's own sum of squares would lose it
    assert verify._norm64(b, a) == pytest.approx(math.sqrt(20) * 2.0**-23, rel=1e-12)


@pytest.mark.parametrize("bad", [float("inf"), float("nan")])
def test_a_non_finite_element_makes_a_non_finite_norm(small_pieces: int, bad: float) -> None:
    a = torch.ones(30)
    a[17] = bad  # in the third piece
    assert not math.isfinite(verify._norm64(a))
    assert not math.isfinite(verify._norm64(torch.ones(30), a))


def test_an_empty_tensor_has_norm_zero() -> None:
    assert verify._norm64(torch.empty(0)) == 0.0
    assert verify._norm64(torch.empty(0, 3), torch.empty(0, 3)) == 0.0


def test_compare_finds_a_difference_past_the_first_piece(small_pieces: int) -> None:
    want = {"w": torch.ones(40)}
    got = {"w": torch.ones(40)}
    assert verify.compare(got, want, 1e-4) == []
    got["w"][33] = 1.5  # in the fifth piece
    bad = verify.compare(got, want, 1e-4)
    assert [m.name for m in bad] == ["w"]
    assert bad[0].difference == pytest.approx(0.5)


class _ClonesOf(torch.overrides.TorchFunctionMode):
    """Counts ``clone()`` calls on tensors that share the given tensors' storage (their
    detached views included)."""

    def __init__(self, watched: list[torch.Tensor]):
        super().__init__()
        self.storages = {t.untyped_storage().data_ptr() for t in watched}
        self.count = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if func is torch.Tensor.clone and args:
            if args[0].untyped_storage().data_ptr() in self.storages:
                self.count += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("off", [0.0, 0.5])
def test_the_check_copies_the_graphs_gradients_only_for_a_second_look(off: float) -> None:
    """Agreeing gradients are compared where the graph wrote them (no copy of the model's
    size); a mismatch copies them for the float64 second look, which still finds it."""
    torch.manual_seed(0)
    module = torch.nn.Linear(5, 3)
    x = torch.randn(4, 5)
    names = ["weight", "bias"]
    want = verify.eager_loss_and_grads(lambda: module(x).square().sum(), module, names)
    grads = {n: torch.zeros_like(p) for n, p in module.named_parameters()}
    loss = torch.zeros(())

    def run() -> None:  # the "graph": eager's values, the weight's off by ``off``
        loss.copy_(want[0])
        for n in names:
            grads[n].copy_(want[1][n])  # type: ignore[arg-type]
        grads["weight"][0, 0] += off

    with _ClonesOf(list(grads.values())) as clones:
        bad, _, _ = verify.graph_step_mismatches(
            lambda m: m(x.to(next(m.parameters()).dtype)).square().sum(),
            module,
            run,
            names,
            lambda: grads,
            list(grads.values()),
            None,
            verify.Tolerance.of(None),
            loss,
            exact=True,
            reference=want,
        )
    if off == 0:
        assert clones.count == 0
    else:
        assert clones.count >= len(names)
    assert [m.name for m in bad] == ([] if off == 0 else ["weight"])
    assert all(bool((g == 0).all()) for g in grads.values())  # put back as they were
