"""Ops that compare or order values compile (``ortrain/export_order.py``,
``ortrain/export_stacks.py``) and train like eager: whole-tensor ``amax``/``amin`` with
ties, ``fmax``/``fmin`` with NaNs and equal operands, stable sorts with ties in both
directions, ``searchsorted`` (1-D, batched, ``right``/``side``, ``sorter``), and the
``hstack`` family over scalars, vectors and matrices."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from ortrain import ORTTrainer, TrainerOptions

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

NAN = float("nan")


class _Values(torch.nn.Module):
    """``fn`` of trainable values (with a batch offset ``x``) weighted into a loss."""

    def __init__(self, values: torch.Tensor, fn: Callable[..., torch.Tensor]):
        super().__init__()
        self.v = torch.nn.Parameter(values.clone())
        self.fn = fn
        with torch.no_grad():
            shape = fn(values).shape
        g = torch.Generator().manual_seed(1)
        self.register_buffer("w", torch.rand(shape, generator=g) + 0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (torch.nan_to_num(self.fn(self.v + x), nan=0.0) * self.w).sum()


def _trains_like_eager(values: torch.Tensor, fn: Callable[..., torch.Tensor]) -> None:
    model, ref = _Values(values, fn), _Values(values, fn)
    x = torch.zeros(values.shape)
    trainer = ORTTrainer(
        model, torch.optim.SGD(model.parameters(), lr=1.0),
        TrainerOptions(build_progress=False, fallback="off"),
    )  # fmt: skip
    loss = trainer.train_step(x)
    trainer.sync_to_module()
    assert trainer.segments is None
    want = ref(x)
    want.backward()
    torch.testing.assert_close(loss, want.detach(), rtol=1e-6, atol=1e-6)
    stepped = values - ref.v.grad  # SGD at rate 1 (a NaN value stays NaN on both sides)
    torch.testing.assert_close(model.v.detach(), stepped, rtol=1e-6, atol=1e-6, equal_nan=True)


TIES = torch.tensor([[1.0, 3.0, 3.0, -2.0], [0.5, 0.5, 0.5, 0.5], [-1.0, 2.0, 0.0, 2.0]])


@pytest.mark.parametrize(
    "fn",
    [
        lambda v: v.amax(),
        lambda v: v.amin() * 3,
        lambda v: torch.amax(v, dim=(0, 1), keepdim=True),
        lambda v: torch.stack(torch.aminmax(v)),
        lambda v: v[0, 1].amax(),  # a 0-d tensor
    ],
    ids=["amax", "amin", "amax_dims_keepdim", "aminmax", "scalar"],
)
def test_whole_tensor_extrema_spread_ties_like_torch(fn):
    _trains_like_eager(TIES, fn)


@pytest.mark.parametrize("name", ["fmax", "fmin"])
def test_fmax_fmin_choose_and_differentiate_like_torch(name):
    a = torch.tensor([1.0, NAN, 2.0, NAN, -1.0, 0.0, 4.0, 3.0])
    b = torch.tensor([2.0, 1.0, NAN, NAN, -1.0, -0.0, 1.0, 3.0])
    op = getattr(torch, name)
    _trains_like_eager(a, lambda v: op(v, b * 2 - 3))  # NaN, ties, each side chosen
    _trains_like_eager(b, lambda v: op(a[:, None] * 0.5, v))  # broadcast: [8, 8]


@pytest.mark.parametrize("descending", [False, True])
def test_a_stable_sort_keeps_ties_in_index_order(descending):
    g = torch.Generator().manual_seed(0)
    values = torch.randint(0, 4, (3, 50), generator=g).float()
    ramp = torch.arange(50.0)

    def sort_then_weigh(v):  # a position-dependent use: a tie's order moves its gradient
        sorted_v, idx = torch.sort(v, dim=1, descending=descending, stable=True)
        return sorted_v * ramp + v.gather(1, idx.flip(1)) * 0.1

    _trains_like_eager(values, sort_then_weigh)
    _trains_like_eager(values, lambda v: v.gather(1, v.argsort(dim=0, stable=True)[:, :7]).T)


@pytest.mark.parametrize(
    "how",
    [{}, {"right": True}, {"side": "right"}, {"out_int32": True}, {"sorter": True}],
    ids=["left", "right", "side", "int32", "sorter"],
)
@pytest.mark.parametrize("batched", [False, True])
def test_searchsorted_finds_torchs_index(how, batched):
    bounds = torch.tensor([-1.0, 0.0, 0.0, 1.5, 3.0])
    values = torch.tensor([[-2.0, 0.0, 0.7, 1.5], [3.0, 4.0, -1.0, 0.1]])
    if batched:
        bounds = torch.stack([bounds, bounds * 2])
    kw = dict(how)
    if kw.pop("sorter", False):
        perm = torch.tensor([3, 0, 4, 1, 2])
        kw["sorter"] = torch.argsort(perm).expand(bounds.shape)
        bounds = bounds[..., perm]
    table = torch.linspace(1.0, 2.0, 6)

    def weigh_by_bucket(v):  # the index picks a weight: a wrong bucket changes the loss
        idx = torch.searchsorted(bounds, v.detach(), **kw).long()
        return v * table[idx]

    _trains_like_eager(values, weigh_by_bucket)


@pytest.mark.parametrize("name", ["hstack", "vstack", "dstack", "column_stack"])
@pytest.mark.parametrize("rank", [0, 1, 2])
def test_stacks_compile_for_scalars_vectors_and_matrices(name, rank):
    shape = {0: (), 1: (4,), 2: (2, 4)}[rank]
    values = torch.arange(1.0, 1.0 + max(1, torch.Size(shape).numel())).reshape(shape)
    op = getattr(torch, name)
    _trains_like_eager(values, lambda v: op([v, v * v, v.sin()]))
