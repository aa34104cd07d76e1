"""aten ops the exporter has no function for, translated (``ortrain/export_aten.py``).

``torch.cdist`` for every p (2, 1, inf, 0 and others), over a batch and against the same
set (zero distances, where torch's gradient is 0), trains one step with
``fallback="off"``: the loss and every parameter gradient against ``torch.autograd``;
the model is one graph.
"""

from __future__ import annotations

import math
import warnings

import pytest
import torch

from ortrain import ORTTrainer, TrainerOptions


class _Prototypes(torch.nn.Module):
    def __init__(self, p: float):
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Linear(6, 4)
        self.centres = torch.nn.Parameter(torch.randn(3, 4))
        self.p = p

    def forward(self, x, y):
        h = self.embed(x)  # [batch, set, 4]
        to_centres = torch.cdist(h, self.centres.expand(h.shape[0], -1, -1), p=self.p)
        within = torch.cdist(h, h, p=self.p).mean(-1, keepdim=True)  # zero on the diagonal
        return torch.nn.functional.cross_entropy((within - to_centres).transpose(1, 2), y)


@pytest.mark.parametrize("p", [2.0, 1.0, math.inf, 0.0, 3.0, 0.5])
def test_cdist_trains_like_autograd(p):
    g = torch.Generator().manual_seed(7)
    x, y = torch.randn(2, 5, 6, generator=g), torch.randint(0, 3, (2, 5), generator=g)
    model, ref = _Prototypes(p), _Prototypes(p)
    want = ref(x, y)
    want.backward()
    options = TrainerOptions(fallback="off", graph_cache=False, build_progress=False)
    trainer = ORTTrainer(model, torch.optim.SGD(model.parameters(), lr=0.0), options)
    torch.testing.assert_close(trainer.train_step(x, y), want.detach(), rtol=1e-5, atol=1e-7)
    for name, q in ref.named_parameters():
        torch.testing.assert_close(trainer.grads[name], q.grad, rtol=1e-5, atol=1e-6, msg=name)
    assert trainer.segments is None
    ops = {n.op_type for n in trainer.train_graphs[0].graph}
    if p == 2.0:
        assert "ReduceL2" in ops or "Sqrt" in ops, ops


class _MeanAggregate(torch.nn.Module):
    """Mean message aggregation (a GNN's): node rows scattered into their targets."""

    def __init__(self, include_self: bool, dim: int):
        super().__init__()
        torch.manual_seed(0)
        self.msg = torch.nn.Linear(6, 8)
        self.base = torch.nn.Parameter(torch.randn(4, 8))
        self.include_self, self.dim = include_self, dim

    def forward(self, x, idx, t):
        m = self.msg(x)  # [rows, 8]
        if self.dim == 0:
            index, src, base = idx.unsqueeze(-1).expand(-1, 8), m, self.base
        else:  # targets along the last axis
            index, src, base = idx.unsqueeze(0).expand(8, -1), m.T, self.base.T
        out = base.scatter_reduce(
            self.dim, index, src, reduce="mean", include_self=self.include_self
        )
        return ((out if self.dim == 0 else out.T) - t).pow(2).mean()


@pytest.mark.parametrize("dim", [0, 1])
@pytest.mark.parametrize("include_self", [True, False])
def test_scatter_reduce_mean_trains_like_eager_when_indices_repeat(include_self, dim):
    """The exporter's function took ``reduce="mean"`` as the last write: right only where
    no index repeats, so a first batch without duplicates passed the first-step check and
    later ones trained another loss. Batches without, with all-same and with some repeated
    indices (a target left untouched keeps ``self``): SGD losses and parameters against
    eager, one graph."""
    g = torch.Generator().manual_seed(2)
    indices = ([2, 0, 3, 1], [1, 1, 1, 1], [2, 2, 0, 0], [3, 0, 3, 3])
    batches = [
        (torch.randn(4, 6, generator=g), torch.tensor(i), torch.randn(4, 8, generator=g))
        for i in indices
    ]
    model, ref = _MeanAggregate(include_self, dim), _MeanAggregate(include_self, dim)
    options = TrainerOptions(fallback="off", graph_cache=False, build_progress=False)
    trainer = ORTTrainer(model, torch.optim.SGD(model.parameters(), lr=0.1), options)
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for i, b in enumerate(batches):
        want = ref(*b)
        want.backward()
        opt.step()
        opt.zero_grad()
        torch.testing.assert_close(trainer.train_step(*b), want.detach(), rtol=1e-5, atol=0,
                                   msg=f"step {i}")  # fmt: skip
    for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=name)
    ops = [n.op_type for n in trainer.train_graphs[0].graph]
    # the sum and the count (ScatterElements, or the CPU kernels it is lowered to)
    assert sum("Scatter" in op for op in ops) >= 2, ops


class _CumulativeScores(torch.nn.Module):
    """Log-cumulative scores along an axis (a CRF's or a survival model's), some rows
    shifted far up at their end or masked to -inf (a padded row)."""

    def __init__(self, dim: int):
        super().__init__()
        torch.manual_seed(0)
        self.pre = torch.nn.Linear(6, 8)
        self.dim = dim

    def forward(self, x, shift, mask, t):
        h = (self.pre(x) + shift).masked_fill(mask, -math.inf)  # [4, 8]
        h = h if self.dim == 1 else h.T.contiguous()  # the same rows, along axis 0
        out = torch.logcumsumexp(h, self.dim)
        out = out if self.dim == 1 else out.T
        return (out.clamp(min=-5) - t).pow(2).mean()  # a masked row's -inf: clamped


@pytest.mark.parametrize("dim", [0, 1])
def test_logcumsumexp_trains_like_eager_past_float32s_range(dim):
    """The exporter's function subtracts the row's maximum in float32: a prefix more than
    ~88 below it became -inf (a wrong loss, then NaN parameters) and a row of -inf NaN.
    Batches: plain, a last element 120 above the rest, a row masked to -inf, a masked
    prefix under a gap; SGD against eager, one graph."""
    g = torch.Generator().manual_seed(2)
    plain, gap = torch.zeros(4, 8), torch.zeros(4, 8)
    gap[:, -1] = 120.0
    none, row, prefix = (torch.zeros(4, 8, dtype=torch.bool) for _ in range(3))
    row[1], prefix[:, :3] = True, True
    batches = [
        (torch.randn(4, 6, generator=g), shift, mask, torch.randn(4, 8, generator=g))
        for shift, mask in ((plain, none), (gap, none), (plain, row), (gap, prefix))
    ]
    model, ref = _CumulativeScores(dim), _CumulativeScores(dim)
    options = TrainerOptions(fallback="off", graph_cache=False, build_progress=False)
    trainer = ORTTrainer(model, torch.optim.SGD(model.parameters(), lr=0.1), options)
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for i, b in enumerate(batches):
        want = ref(*b)
        want.backward()
        opt.step()
        opt.zero_grad()
        torch.testing.assert_close(trainer.train_step(*b), want.detach(), rtol=1e-5, atol=0,
                                   msg=f"step {i}")  # fmt: skip
    for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        assert torch.isfinite(p).all(), name
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=name)


class _ScaledProducts(torch.nn.Module):
    """``beta * c + alpha * product`` in each of its four forms, ``c`` a batch input."""

    def __init__(self, form: str, beta: float, alpha: float):
        super().__init__()
        torch.manual_seed(0)
        self.lin = torch.nn.Linear(6, 6)
        self.form, self.beta, self.alpha = form, beta, alpha

    def forward(self, x, c):
        h = self.lin(x)  # [2, 6]
        kw = {"beta": self.beta, "alpha": self.alpha}
        if self.form == "baddbmm":
            out = torch.baddbmm(c.view(2, 3, 3), h.view(2, 3, 2), h.view(2, 2, 3), **kw)
        elif self.form == "addbmm":
            out = torch.addbmm(c[:9].view(3, 3), h.view(2, 3, 2), h.view(2, 2, 3), **kw)
        elif self.form == "addmv":
            out = torch.addmv(c[:6], h.view(6, 2), h[0, :2], **kw)
        else:
            out = torch.addr(c[:6].view(2, 3), h[0, :2], h[1, :3], **kw)
        return (out - 0.3).pow(2).mean()


@pytest.mark.parametrize("form", ["baddbmm", "addbmm", "addmv", "addr"])
@pytest.mark.parametrize("beta,alpha", [(0.0, 1.0), (0.0, 2.0), (0.5, 1.5)])
def test_beta_zero_ignores_the_added_tensor_like_torch(form, beta, alpha):
    """With beta=0 torch ignores ``c``, NaN included (a buffer from torch.empty); the
    exporter's functions multiplied it by 0: a NaN loss from the first such batch."""
    g = torch.Generator().manual_seed(3)
    batches = [(torch.randn(2, 6, generator=g), torch.randn(18, generator=g)) for _ in range(3)]
    if beta == 0:
        batches[1] = (batches[1][0], torch.full((18,), float("nan")))
    model, ref = _ScaledProducts(form, beta, alpha), _ScaledProducts(form, beta, alpha)
    opt_ref = torch.optim.SGD(ref.parameters(), lr=0.1)
    trainer = ORTTrainer(
        model, torch.optim.SGD(model.parameters(), lr=0.1), TrainerOptions(fallback="off")
    )
    for x, c in batches:
        want = ref(x, c)
        want.backward()
        opt_ref.step()
        opt_ref.zero_grad()
        torch.testing.assert_close(trainer.train_step(x, c), want.detach(), rtol=1e-5, atol=0)
    trainer.sync_to_module()
    for (k, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=k)


class _Draws(torch.nn.Module):
    """Draws a mask per row with the row's probability; the loss is how far each row's
    share of ones is from its probability."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = torch.nn.Parameter(torch.ones(()))
        self.register_buffer("p", torch.tensor([0.1, 0.3, 0.7, 0.9]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        probs = self.p[:, None].expand(4, x.shape[1])
        share = (torch.bernoulli(probs) * self.scale).mean(1)
        return (share - self.p).pow(2).sum() + 0 * x.sum()


def test_bernoulli_draws_one_with_probability_p() -> None:
    """``torch.bernoulli(p)``: ONNX Runtime's Bernoulli kernel drew 1 with probability
    1 - p (the loss here was 1.6); 4,000 draws per row land within a few hundredths of
    p, and the graph has no Bernoulli node."""
    model = _Draws()
    trainer = ORTTrainer(model, torch.optim.SGD(model.parameters(), lr=0.0),
                         TrainerOptions(fallback="off"))  # fmt: skip
    losses = [trainer.train_step(torch.zeros(1, 4000)).item() for _ in range(3)]
    assert trainer.program.whole
    ops = {n.op_type for n in trainer.train_graphs[0].graph}
    assert "Bernoulli" not in ops and "RandomUniformLike" in ops
    assert max(losses) < 0.01 and len(set(losses)) == 3, losses


class _NoisyEmbedding(torch.nn.Module):
    """NEFTune's embedding noise (transformers.integrations.neftune): ``uniform_(-m, m)``
    with ``m`` a 0-dim tensor computed from the shape, added in training only."""

    def __init__(self, alpha: float) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.alpha = alpha
        self.embed = torch.nn.Embedding(50, 16)
        self.head = torch.nn.Linear(16, 50)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids)
        if self.training:
            mag = self.alpha / torch.sqrt(torch.tensor(h.size(1) * h.size(2)))
            h = h + torch.zeros_like(h).uniform_(-mag, mag)
        return torch.nn.functional.cross_entropy(self.head(h).flatten(0, 1), ids.flatten())


def test_uniform_with_bounds_from_tensors_compiles_and_is_checked() -> None:
    """The exporter decomposed ``uniform_(-m, m)`` to ``prims::uniform`` and had no function
    for it: NEFTune's embedding ran in eager. One graph now, its first step checked with
    the draw fixed; the noise is drawn in the bounds while it trains."""
    ids = torch.randint(0, 50, (4, 16), generator=torch.Generator().manual_seed(1))
    model = _NoisyEmbedding(alpha=64.0)  # bounds 64 / sqrt(16 * 16) = 4: far above the embeddings
    trainer = ORTTrainer(model, torch.optim.SGD(model.parameters(), lr=0.0),
                         TrainerOptions(fallback="off", graph_cache=False))  # fmt: skip
    losses = [trainer.train_step(ids).item() for _ in range(3)]
    assert trainer.program.whole and trainer.program.segments[0].checked == 1
    node = next(n for n in trainer.train_graphs[0].graph if n.op_type == "RandomUniformLike")
    assert [node.attributes[k].value for k in ("low", "high")] == pytest.approx([-4.0, 4.0])
    model.eval()
    with torch.no_grad():
        clean = model(ids).item()
    assert len(set(losses)) == 3 and min(losses) > clean + 0.3, (losses, clean)
    assert trainer.eval_step(ids)["loss"].item() == pytest.approx(clean, rel=1e-5)


class _ComplexRotary(torch.nn.Module):
    """Rotary embedding written with complex numbers (Llama 4's ``apply_rotary_emb``): the
    queries as complex pairs times a complex table, unsqueezed (and expanded) over heads."""

    def __init__(self, expand: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.expand = expand
        self.q = torch.nn.Linear(16, 16)
        self.head = torch.nn.Linear(16, 4)
        angles = torch.arange(8.0)[:, None] / 10000 ** (torch.arange(0, 8, 2.0) / 8)[None]
        self.register_buffer("freqs", torch.polar(torch.ones_like(angles), angles), False)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        q = self.q(x).view(x.shape[0], x.shape[1], 2, 8)  # batch, position, head, dim
        qc = torch.view_as_complex(q.reshape(*q.shape[:-1], -1, 2))
        table = self.freqs[: x.shape[1]].unsqueeze(1)  # position, 1, dim / 2
        if self.expand:
            table = table.expand(-1, 2, -1)
        out = torch.view_as_real(qc * table).flatten(3).flatten(2)
        return torch.nn.functional.cross_entropy(self.head(out).mean(1), y)


@pytest.mark.parametrize("expand", [False, True])
def test_complex_unsqueeze_and_expand_compile_like_eager(expand) -> None:
    """The exporter had no complex ``unsqueeze``/``expand``: such a rotary embedding ran
    in eager (Llama 4's attention). One graph now, per-step losses and parameters as eager's."""
    g = torch.Generator().manual_seed(2)
    batches = [(torch.randn(2, 8, 16, generator=g), torch.randint(0, 4, (2,), generator=g))
               for _ in range(3)]  # fmt: skip
    model, ref = _ComplexRotary(expand), _ComplexRotary(expand)
    trainer = ORTTrainer(model, torch.optim.SGD(model.parameters(), lr=0.1),
                         TrainerOptions(fallback="off", graph_cache=False))  # fmt: skip
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for x, y in batches:
        want = ref(x, y)
        opt.zero_grad()
        want.backward()
        opt.step()
        torch.testing.assert_close(trainer.train_step(x, y), want.detach(), rtol=1e-5, atol=0)
    assert trainer.program.whole
    for (k, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=k)


class _Spectral(torch.nn.Module):
    """A Fourier neural operator's layer: the lowest ``modes`` frequencies of each channel
    mixed by complex weights (kept as real pairs), the rest zeroed, back to the signal."""

    def __init__(self, modes: int) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.modes = modes
        self.lift = torch.nn.Conv1d(1, 4, 1)
        self.weights = torch.nn.Parameter(torch.randn(4, 4, modes, 2) / 4)
        self.proj = torch.nn.Conv1d(4, 1, 1)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.lift(x)
        spectrum = torch.fft.rfft(h)
        mixed = torch.zeros_like(spectrum)
        w = torch.view_as_complex(self.weights)
        low = spectrum[:, :, : self.modes]
        mixed[:, :, : self.modes] = torch.einsum("bim,iom->bom", low, w)
        out = torch.fft.irfft(mixed, n=x.shape[-1])
        out = out + torch.view_as_real(spectrum.select(-1, 1)).sum(-1, keepdim=True)
        return torch.nn.functional.mse_loss(self.proj(torch.nn.functional.gelu(out + h)), y)


@pytest.mark.parametrize("modes", [3, 9])
def test_complex_zeros_einsum_and_slice_assignment_compile_like_eager(modes) -> None:
    """A spectral layer's complex ``zeros_like``, two-operand ``einsum``, slice
    assignment (``copy`` into a ``slice_scatter``), ``select`` and a whole slice
    (``alias``) had no translation: it ran as segments around eager. One graph now,
    per-step losses and parameters as eager's (a band of frequencies, and all 9 of a
    16-sample signal's)."""
    g = torch.Generator().manual_seed(3)
    batches = [(torch.randn(3, 1, 16, generator=g), torch.randn(3, 1, 16, generator=g))
               for _ in range(3)]  # fmt: skip
    model, ref = _Spectral(modes), _Spectral(modes)
    trainer = ORTTrainer(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                         TrainerOptions(fallback="off", graph_cache=False))  # fmt: skip
    opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    for x, y in batches:
        want = ref(x, y)
        opt.zero_grad()
        want.backward()
        opt.step()
        torch.testing.assert_close(trainer.train_step(x, y), want.detach(), rtol=1e-5, atol=0)
    assert trainer.program.whole
    graph = trainer.train_graphs[0].graph
    assert sum(n.op_type == "Einsum" for n in graph) >= 4  # the complex product's four
    for (k, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=k)


class _ComplexWrites(torch.nn.Module):
    """Writes into a complex spectrum: a real value (its imaginary parts zero), a Python
    number and a complex one, zeros of a real dtype from a complex tensor, and a real
    value whose last axis is 2 that a complex one broadcast could also be."""

    def __init__(self, mode: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.mode = mode
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        z = torch.fft.rfft(h)  # [rows, 5]
        w = torch.zeros_like(z)
        if self.mode == "real_value":
            w[:, :2] = h[:, :2]
            w[:, 2:4] = z[:, 2:4]
        elif self.mode == "numbers":
            w[:, 1] = 3.0
            w[:, 0] = 1 - 2j
            w[:, 2:] = z[:, 2:]
        elif self.mode == "real_dtype":
            w = torch.zeros_like(z, dtype=torch.float32) + h[:, :5]
            return w.square().mean() + torch.view_as_real(z).square().mean()
        elif self.mode == "ambiguous":
            w = torch.zeros_like(z[0, :2])  # complex [2]: its real view [2, 2]
            w[:] = h[0, :2]  # real [2]: or a complex scalar's real view, by shape alone
            return torch.view_as_real(w * z[:, :2]).square().mean()
        return torch.view_as_real(w).square().mean() + torch.fft.irfft(w, n=8).square().mean()


@pytest.mark.parametrize("mode", ["real_value", "numbers", "real_dtype", "ambiguous"])
def test_complex_writes_compile_like_eager_or_not_at_all(mode) -> None:
    """A real value copied into a complex tensor, ``fill`` with a number (real or
    complex), ``select_scatter`` and ``zeros_like(..., dtype=float32)``: one graph with
    eager's losses and parameters. A copy whose operand the shapes cannot tell real from
    complex is refused (the real view carries no dtype) and trains in eager around it."""
    g = torch.Generator().manual_seed(5)
    batches = [torch.randn(4, 8, generator=g) for _ in range(3)]
    model, ref = _ComplexWrites(mode), _ComplexWrites(mode)
    options = TrainerOptions(fallback="auto" if mode == "ambiguous" else "off", graph_cache=False)
    trainer = ORTTrainer(model, torch.optim.SGD(model.parameters(), lr=0.1), options)
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for x in batches:
            want = ref(x)
            opt.zero_grad()
            want.backward()
            opt.step()
            torch.testing.assert_close(trainer.train_step(x), want.detach(), rtol=1e-5, atol=0)
    for (k, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=k)
    assert trainer.program.whole == (mode != "ambiguous")
    if mode == "ambiguous":
        assert any("ambiguous" in str(w.message) for w in caught)


_EDGES = [0.0, -0.0, 1.0, -1.0, 2.5, -0.3, math.inf, -math.inf, math.nan]


class _Angles(torch.nn.Module):
    """``atan2`` and a complex ``angle`` over every pair of edge values (signed zeros,
    infinities, NaN), their values as outputs, a loss over the finite ones."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = torch.nn.Parameter(torch.ones(1))

    def forward(self, y: torch.Tensor, x: torch.Tensor):
        a = torch.atan2(y * self.scale, x)
        b = torch.angle(torch.view_as_complex(torch.stack([x * self.scale, y], -1)))
        # the loss over the pairs whose gradient is finite (a zero y over a negative x too)
        tame = torch.isfinite(y) & torch.isfinite(x) & ((y != 0) | (x != 0))
        ys, xs = torch.where(tame, y, 1.0), torch.where(tame, x, 1.0)
        ys_xs = torch.view_as_complex(torch.stack([xs * self.scale, ys], -1))
        loss = (torch.atan2(ys * self.scale, xs) * torch.angle(ys_xs)).sum()
        return loss, a, b


def test_atan2_and_complex_angle_on_every_edge_like_torch() -> None:
    """The exporter's ``atan2`` gave -pi for a zero ``y`` over a negative ``x`` (torch:
    pi; the DC bin of a spectrum's angle) and 0 for NaN; both are ortrain's now: every
    pair of edge values as torch (within float32 rounding, NaN where torch's is), and a
    step's gradient of the scale as eager's."""
    pairs = [(a, b) for a in _EDGES for b in _EDGES]
    y = torch.tensor([p[0] for p in pairs])
    x = torch.tensor([p[1] for p in pairs])
    model, ref = _Angles(), _Angles()
    trainer = ORTTrainer(model, torch.optim.SGD(model.parameters(), lr=0.01),
                         TrainerOptions(fallback="off", graph_cache=False))  # fmt: skip
    got = trainer.eval_step(y, x)
    want_loss, want_a, want_b = ref(y, x)
    for name, g, w in (("atan2", got["output_1"], want_a), ("angle", got["output_2"], want_b)):
        assert torch.equal(g.isnan(), w.isnan()), name
        torch.testing.assert_close(g, w, rtol=1e-6, atol=0, equal_nan=True, msg=name)
    assert got["output_1"][pairs.index((0.0, -1.0))].item() == pytest.approx(math.pi)
    want_loss.backward()
    loss = trainer.train_step(y, x)
    torch.testing.assert_close(loss, want_loss.detach(), rtol=1e-6, atol=0)
    trainer.sync_to_module()
    torch.testing.assert_close(model.scale, 1.0 - 0.01 * ref.scale.grad, rtol=1e-6, atol=0)


class _SumPool(torch.nn.Module):
    """A convolution, then windows summed over a divisor of the user's (``divisor_override``),
    in 2-D or 3-D, with padding and ``ceil_mode`` (windows clipped at the padded edge)."""

    def __init__(self, spatial: int, **pool) -> None:
        super().__init__()
        torch.manual_seed(0)
        conv = torch.nn.Conv2d if spatial == 2 else torch.nn.Conv3d
        pooling = torch.nn.AvgPool2d if spatial == 2 else torch.nn.AvgPool3d
        self.conv = conv(2, 3, 3, padding=1)
        self.pool = pooling(**pool)

    def forward(self, x, y):
        return (self.pool(self.conv(x)).flatten(1).mean(1) - y).pow(2).mean()


@pytest.mark.parametrize(
    "spatial, pool",
    [
        (2, dict(kernel_size=3, stride=2, padding=1, divisor_override=4)),
        (2, dict(kernel_size=3, stride=2, padding=1, ceil_mode=True, divisor_override=5)),
        (2, dict(kernel_size=(2, 3), stride=(2, 1), divisor_override=2)),
        (3, dict(kernel_size=3, stride=2, padding=1, ceil_mode=True, divisor_override=3)),
    ],
)
def test_avg_pool_divisor_override_trains_like_eager(spatial, pool):
    """The exporter's function dropped ``divisor_override`` (an average where torch sums
    over the divisor): one graph (``fallback="off"``), losses and parameters as eager's."""
    shape = (2, 2, 7, 7) if spatial == 2 else (2, 2, 5, 4, 5)
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(shape, generator=g), torch.randn(2, generator=g)) for _ in range(3)]
    model, ref = _SumPool(spatial, **pool), _SumPool(spatial, **pool)
    opt_ref = torch.optim.SGD(ref.parameters(), lr=0.1)
    trainer = ORTTrainer(
        model, torch.optim.SGD(model.parameters(), lr=0.1), TrainerOptions(fallback="off")
    )
    for x, y in batches:
        want = ref(x, y)
        want.backward()
        opt_ref.step()
        opt_ref.zero_grad()
        torch.testing.assert_close(trainer.train_step(x, y), want.detach(), rtol=1e-5, atol=0)
    assert trainer.segments is None  # one graph
    trainer.sync_to_module()
    for (k, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=k)


class _KthPooling(torch.nn.Module):
    """A trimmed pooling: each row's k-th smallest value (and a second along another axis,
    its axis kept), plus the index as a number the loss reads without a gradient."""

    def __init__(self, k: int) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.k = k
        self.proj = torch.nn.Linear(6, 12)
        self.head = torch.nn.Linear(12, 3)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.proj(x)  # [B, T, 12]
        over_time = torch.kthvalue(h, self.k, dim=1).values  # [B, 12]
        v, i = torch.kthvalue(h, 2, dim=-1, keepdim=True)  # [B, T, 1]
        feature = over_time + (v * i.to(v.dtype)).mean(1) * 0.1
        return torch.nn.functional.cross_entropy(self.head(feature), y)


@pytest.mark.parametrize("k", [1, 3, 5])
def test_kthvalue_compiles_and_trains_like_eager(k: int) -> None:
    """The exporter has no function for ``aten.kthvalue``: the module ran in eager. One
    graph now, its values, indices and gradients eager's (SGD, three steps)."""
    g = torch.Generator().manual_seed(3)
    batches = [(torch.randn(4, 5, 6, generator=g), torch.randint(0, 3, (4,), generator=g))
               for _ in range(3)]  # fmt: skip
    model, ref = _KthPooling(k), _KthPooling(k)
    options = TrainerOptions(fallback="off", graph_cache=False, build_progress=False)
    trainer = ORTTrainer(model, torch.optim.SGD(model.parameters(), lr=0.1), options)
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for i, b in enumerate(batches):
        want = ref(*b)
        want.backward()
        opt.step()
        opt.zero_grad()
        torch.testing.assert_close(trainer.train_step(*b), want.detach(), rtol=1e-5, atol=0,
                                   msg=f"step {i}")  # fmt: skip
    assert trainer.segments is None  # one graph
    for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=name)
