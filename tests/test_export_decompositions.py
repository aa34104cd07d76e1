"""Ops decomposed for the exporter (``ortrain/export_decompositions.py``): adaptive pooling
with values and indices equal to torch's (the first maximum of a window with ties,
windows of unequal length), a CNN with adaptive max and 3-D average pooling, a ``pdist``
loss (equal rows included), ``MultiLabelMarginLoss`` (targets ending at a -1) and
``FractionalMaxPool`` (values and indices as torch's given its samples) training compiled
like eager."""

from __future__ import annotations

import copy
import math
import warnings

import pytest
import torch
import torch.nn.functional as F

from ortrain import ORTTrainer, TrainerOptions
from ortrain.export_decompositions import adaptive_avg_pool, adaptive_max_pool

CASES = [
    ((2, 3, 9), (4,)),  # 1-D, overlapping windows
    ((2, 3, 7, 5), (3, 2)),
    ((2, 3, 8, 8), (4, 4)),  # divisible
    ((2, 3, 7, 5), (1, 1)),  # global
    ((1, 2, 5, 6, 7), (2, 3, 4)),
    ((1, 2, 4, 4, 4), (4, 1, 3)),
]


@pytest.mark.parametrize(("shape", "out"), CASES, ids=[f"{s}->{o}" for s, o in CASES])
def test_pools_equal_torchs_with_ties(shape, out) -> None:
    torch.manual_seed(0)
    x = torch.relu(torch.randn(shape))  # zeros: windows with tied maxima
    pool = {1: F.adaptive_max_pool1d, 2: F.adaptive_max_pool2d, 3: F.adaptive_max_pool3d}
    values, indices = pool[len(out)](x, out, return_indices=True)
    ours, our_indices = adaptive_max_pool(x, out)
    assert torch.equal(ours, values) and torch.equal(our_indices, indices)
    avg = {1: F.adaptive_avg_pool1d, 2: F.adaptive_avg_pool2d, 3: F.adaptive_avg_pool3d}
    torch.testing.assert_close(adaptive_avg_pool(x, out), avg[len(out)](x, out))


@pytest.mark.parametrize("p", [2.0, 1.0, 3.0])
def test_pdist_trains_compiled_like_eager(p: float) -> None:
    """Rows embedded by a Linear, their pairwise distances (two rows equal: a zero
    distance, whose gradient is 0 in torch's pdist) in a loss."""
    torch.manual_seed(0)
    model = _Loss(torch.nn.Linear(4, 3), p)
    ref = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    opt_ref = torch.optim.SGD(ref.parameters(), lr=0.1)
    trainer = ORTTrainer(model, opt, TrainerOptions(fallback="off"))
    g = torch.Generator().manual_seed(6)
    for step in range(3):
        x = torch.randn(6, 4, generator=g)
        x[3] = x[1]  # equal rows
        got = float(trainer.train_step(x=x))
        opt_ref.zero_grad()
        want = ref(x)
        want.backward()
        opt_ref.step()
        assert got == pytest.approx(float(want.detach()), rel=1e-5), step
    assert trainer.segments is None
    for (name, w), v in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(w, v, rtol=1e-5, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")


class _Loss(torch.nn.Module):
    def __init__(self, inner: torch.nn.Module, p: float) -> None:
        super().__init__()
        self.inner, self.p = inner, p

    def forward(self, x):
        return (F.pdist(self.inner(x), self.p) - 1.0).square().mean()


class _Net(torch.nn.Module):
    """2-D features max-pooled adaptively after a ReLU (ties in the windows), and a 3-D
    branch average-pooled adaptively."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = torch.nn.Conv2d(2, 4, 3, padding=1)
        self.pool = torch.nn.AdaptiveMaxPool2d((3, 2))
        self.conv3 = torch.nn.Conv3d(1, 2, 3, padding=1)
        self.pool3 = torch.nn.AdaptiveAvgPool3d((2, 3, 2))
        self.head = torch.nn.Linear(4 * 3 * 2 + 2 * 2 * 3 * 2, 3)

    def forward(self, x, v, y):
        a = self.pool(torch.relu(self.conv(x))).flatten(1)
        b = self.pool3(self.conv3(v)).flatten(1)
        return F.cross_entropy(self.head(torch.cat([a, b], 1)), y)


def test_adaptive_pools_train_compiled_like_eager() -> None:
    torch.manual_seed(0)
    model = _Net()
    ref = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    opt_ref = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    trainer = ORTTrainer(model, opt, TrainerOptions(fallback="off"))
    g = torch.Generator().manual_seed(4)
    for step in range(4):
        batch = {
            "x": torch.randn(3, 2, 7, 5, generator=g),
            "v": torch.randn(3, 1, 5, 7, 4, generator=g),
            "y": torch.randint(0, 3, (3,), generator=g),
        }
        got = float(trainer.train_step(**batch))
        opt_ref.zero_grad()
        want = ref(**batch)
        want.backward()
        opt_ref.step()
        assert got == pytest.approx(float(want.detach()), rel=1e-5), step
    ops = {n.op_type for n in trainer.train_graphs[0].graph}
    assert trainer.segments is None and "ArgMax" in ops  # the first maximum, not a spread
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")


class _MultiLabel(torch.nn.Module):
    def __init__(self, reduction: str) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 5)
        self.loss = torch.nn.MultiLabelMarginLoss(reduction=reduction)

    def forward(self, x, y):
        out = self.loss(self.lin(x), y)
        return out.mean() if out.dim() else out


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_multilabel_margin_targets_end_at_the_first_minus_one(reduction: str) -> None:
    """Targets after a -1 are not targets (torch's own decomposition reads them), a
    repeated target counts twice; trains compiled like eager."""
    torch.manual_seed(0)
    model = _MultiLabel(reduction)
    ref = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    opt_ref = torch.optim.SGD(ref.parameters(), lr=0.1)
    trainer = ORTTrainer(model, opt, TrainerOptions(fallback="off"))
    y = torch.tensor([[3, 0, -1, 1, 2], [1, 1, -1, 4, 4], [4, -1, 0, 0, 0], [0, 1, 2, 3, 4]])
    g = torch.Generator().manual_seed(8)
    for step in range(3):
        x = torch.randn(4, 4, generator=g)
        got = float(trainer.train_step(x=x, y=y))
        opt_ref.zero_grad()
        want = ref(x, y)
        want.backward()
        opt_ref.step()
        assert got == pytest.approx(float(want.detach()), rel=1e-5), step
    assert trainer.segments is None
    for (name, w), v in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(w, v, rtol=1e-5, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")


FRACTIONAL = [
    ((2, 3, 9, 8), (2, 2), (4, 3)),
    ((2, 3, 7, 7), (3, 2), (3, 3)),
    ((3, 9, 8), (2, 2), (4, 3)),  # unbatched
    ((2, 2, 5, 5), (2, 2), (1, 4)),  # one cell on an axis
    ((1, 2, 6, 7, 8), (2, 2, 2), (3, 3, 4)),
]


@pytest.mark.parametrize(("shape", "kernel", "out"), FRACTIONAL, ids=[str(f) for f in FRACTIONAL])
def test_fractional_pools_equal_torchs_given_the_samples(shape, kernel, out) -> None:
    from ortrain.export_decompositions import _fractional_max

    torch.manual_seed(0)
    x = torch.relu(torch.randn(shape))  # ties at zero
    d = len(kernel)
    samples = torch.rand(shape[0] if len(shape) == d + 2 else 1, shape[-d - 1], d)
    pool = F.fractional_max_pool2d if d == 2 else F.fractional_max_pool3d
    values, indices = pool(x, kernel, output_size=out, return_indices=True, _random_samples=samples)
    ours, our_indices = _fractional_max(x, kernel, out, samples)
    assert torch.equal(ours, values) and torch.equal(our_indices, indices)


class _Fractional(torch.nn.Module):
    def __init__(self, samples: torch.Tensor | None) -> None:
        super().__init__()
        self.conv = torch.nn.Conv2d(2, 3, 3, padding=1)
        self.pool = torch.nn.FractionalMaxPool2d(2, output_size=(4, 3), _random_samples=samples)
        self.head = torch.nn.Linear(3 * 4 * 3, 2)

    def forward(self, x, y):
        return F.cross_entropy(self.head(self.pool(self.conv(x)).flatten(1)), y)


def test_fractional_pool_trains_compiled_like_eager_given_its_samples() -> None:
    torch.manual_seed(0)
    model = _Fractional(torch.rand(3, 3, 2))
    ref = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    opt_ref = torch.optim.SGD(ref.parameters(), lr=0.1)
    trainer = ORTTrainer(model, opt, TrainerOptions(fallback="off"))
    g = torch.Generator().manual_seed(5)
    for step in range(3):
        batch = {
            "x": torch.randn(3, 2, 9, 7, generator=g),
            "y": torch.randint(0, 2, (3,), generator=g),
        }
        got = float(trainer.train_step(**batch))
        opt_ref.zero_grad()
        want = ref(**batch)
        want.backward()
        opt_ref.step()
        assert got == pytest.approx(float(want.detach()), rel=1e-5), step
    assert trainer.segments is None
    for (name, w), v in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(w, v, rtol=1e-5, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")


def test_fractional_pool_drawing_its_samples_compiles_and_is_checked() -> None:
    """Its samples drawn in the graph (as eager draws its own, ``torch.rand``): both take
    fixed values in the first step's check (prepare/random_switch.py), which compares them
    (it was trusted unchecked, with a warning, before); losses finite, and it draws."""
    torch.manual_seed(0)
    model = _Fractional(None)
    options = TrainerOptions(fallback="off")
    trainer = ORTTrainer(model, torch.optim.SGD(model.parameters(), lr=0.1), options)
    g = torch.Generator().manual_seed(5)
    batch = {"x": torch.randn(3, 2, 9, 7, generator=g), "y": torch.randint(0, 2, (3,), generator=g)}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        losses = [float(trainer.train_step(**batch)) for _ in range(3)]
    assert trainer.segments is None and all(math.isfinite(v) for v in losses)
    assert trainer.program.segments[0].checked == 1


class _Leaky(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 64)
        self.act = torch.nn.RReLU(0.1, 0.3)

    def forward(self, x):
        return self.act(self.lin(x)).mean()


def test_rrelu_draws_slopes_in_training_and_uses_their_mean_in_eval() -> None:
    """Training: the slopes of the negative elements are drawn in the graph (the first
    step is trusted with a warning naming the draw); evaluation equals eager's (the
    slopes' mean) to float32's rounding."""
    torch.manual_seed(0)
    model = _Leaky()
    ref = copy.deepcopy(model)
    trainer = ORTTrainer(model, torch.optim.SGD(model.parameters(), lr=0.1))
    x = torch.randn(8, 4)
    with pytest.warns(UserWarning, match="not checked against eager: it draws random numbers"):
        losses = [float(trainer.train_step(x=x)) for _ in range(3)]
    assert trainer.segments is None and all(math.isfinite(v) for v in losses)
    (graph,) = trainer.train_graphs
    assert {"RandomUniformLike", "RandomUniform"} & {n.op_type for n in graph.graph}
    trainer.sync_to_module()
    ref.load_state_dict(model.state_dict())
    ref.eval()
    got = trainer.eval_step(x=x)["loss"]
    want = ref(x).detach()
    # float32's tolerance (ONNX Runtime's GEMM and mean against torch's, on whichever CPU
    # runs this); a slope other than the mean moves the loss far more than that: the
    # bounds' slopes, for one, would
    torch.testing.assert_close(got, want)
    with torch.no_grad():
        h = ref.lin(x)
        for slope in (0.1, 0.3):
            wrong = torch.where(h <= 0, h * slope, h).mean()
            assert abs(float(wrong) - float(want)) > 100 * (1e-5 + 1.3e-6 * abs(float(want)))


def test_rrelu_decomposition_draws_within_the_bounds() -> None:
    from ortrain.export_decompositions import _rrelu

    x = torch.cat([-torch.rand(1000) - 0.1, torch.zeros(1), torch.rand(10) + 0.1])
    out, slopes = _rrelu(x, torch.empty(0), 0.1, 0.3, True)
    drawn = slopes[:1001]
    assert ((drawn >= 0.1) & (drawn <= 0.3)).all() and drawn.std() > 0.03
    assert torch.equal(out[1001:], x[1001:]) and torch.equal(out, x * slopes)
    out, slopes = _rrelu(x, torch.empty(0), 0.1, 0.3, False)
    torch.testing.assert_close(out, F.rrelu(x, 0.1, 0.3, training=False))
