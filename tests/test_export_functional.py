"""Functions whose eager meaning a trace loses, exported as eager means them
(``ortrain/export_functional.py``): ``GaussianNLLLoss`` with its negative-variance check
kept as data (it trains compiled like eager, the variance's clamp included, and a batch
eager rejects is refused before its update), ``CosineSimilarity`` whose clamp of small
norms stays out of the gradient, ``Embedding(scale_grad_by_freq=True)``, and
``EmbeddingBag`` with a padding index."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from ortrain import ORTTrainer, TrainerOptions
from ortrain.core.errors import NonFiniteLossError
from ortrain.export_functional import functional_for_export


class _Regressor(torch.nn.Module):
    """A mean and a variance head; ``raw``: the variance is the head's output as it is
    (it can be negative), else a softplus of it."""

    def __init__(self, raw: bool, **loss: object) -> None:
        super().__init__()
        self.body = torch.nn.Sequential(torch.nn.Linear(5, 16), torch.nn.Tanh())
        self.mean = torch.nn.Linear(16, 3)
        self.var = torch.nn.Linear(16, 3)
        self.raw = raw
        self.loss = torch.nn.GaussianNLLLoss(**loss)

    def forward(self, x, y):
        h = self.body(x)
        v = self.var(h)
        return self.loss(self.mean(h), y, v if self.raw else F.softplus(v))


def _batch(g: torch.Generator) -> dict[str, torch.Tensor]:
    return {"x": torch.randn(8, 5, generator=g), "y": torch.randn(8, 3, generator=g)}


@pytest.mark.parametrize(
    "loss",
    [{}, {"full": True, "reduction": "sum"}, {"eps": 0.8}],  # eps 0.8: the clamp is active
    ids=["mean", "full-sum", "clamped"],
)
def test_gaussian_nll_trains_compiled_like_eager(loss: dict) -> None:
    torch.manual_seed(0)
    model = _Regressor(raw=False, **loss)
    ref = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    opt_ref = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9)
    trainer = ORTTrainer(model, opt, TrainerOptions(fallback="off"))
    g = torch.Generator().manual_seed(2)
    for step in range(4):
        batch = _batch(g)
        got = float(trainer.train_step(**batch))
        opt_ref.zero_grad()
        want = ref(**batch)
        want.backward()
        opt_ref.step()
        assert got == pytest.approx(float(want.detach()), rel=1e-5), step
    assert trainer.segments is None
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")
    if "eps" in loss:  # the clamp mattered: some variance below eps
        with torch.no_grad():
            assert (F.softplus(ref.var(ref.body(batch["x"]))) < loss["eps"]).any()


def test_a_negative_variance_is_refused_before_the_update() -> None:
    """Eager raises ValueError; the trainer raises NonFiniteLossError and keeps its
    parameters."""
    torch.manual_seed(0)
    model = _Regressor(raw=True)
    with torch.no_grad():
        model.var.bias.fill_(2.0)  # positive on the first batch
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    trainer = ORTTrainer(model, opt, TrainerOptions(fallback="off"))
    g = torch.Generator().manual_seed(3)
    trainer.train_step(**_batch(g))
    assert trainer.segments is None
    with torch.no_grad():
        model.var.bias.fill_(-5.0)
    trainer.state_dict()  # (the module's tensors are the trainer's)
    bad = _batch(g)
    with pytest.raises(ValueError, match="negative"):
        copy.deepcopy(model)(**bad)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(NonFiniteLossError, match="nan"):
        trainer.train_step(**bad)
    trainer.sync_to_module()
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k


def test_eager_is_untouched_outside_the_export() -> None:
    names = ("gaussian_nll_loss", "cosine_similarity", "embedding", "embedding_bag")
    originals = [getattr(F, n) for n in names]
    with pytest.raises(RuntimeError), functional_for_export():
        assert all(getattr(F, n) is not o for n, o in zip(names, originals))
        raise RuntimeError("an export that fails")
    assert [getattr(F, n) for n in names] == originals


class _Cosine(torch.nn.Module):
    """Rows compared by ``nn.CosineSimilarity`` along ``dim`` with a large ``eps``: small
    norms are clamped, and eager's gradient passes the clamp through."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.a = torch.nn.Linear(4, 6)
        self.b = torch.nn.Linear(4, 6)
        self.sim = torch.nn.CosineSimilarity(dim=dim, eps=eps)

    def forward(self, x):
        return (1.0 - self.sim(self.a(x), 0.1 * self.b(x))).mean()


@pytest.mark.parametrize(("dim", "eps"), [(1, 0.5), (0, 0.5), (1, 1e-8)])
def test_cosine_similarity_clamps_without_the_gradient_seeing_it(dim: int, eps: float) -> None:
    torch.manual_seed(0)
    model = _Cosine(dim, eps)
    ref = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    opt_ref = torch.optim.SGD(ref.parameters(), lr=0.5)
    trainer = ORTTrainer(model, opt, TrainerOptions(fallback="off"))
    g = torch.Generator().manual_seed(4)
    for step in range(3):
        x = torch.randn(5, 4, generator=g)
        got = float(trainer.train_step(x=x))
        opt_ref.zero_grad()
        want = ref(x)
        want.backward()
        opt_ref.step()
        assert got == pytest.approx(float(want.detach()), rel=1e-5), step
    assert trainer.segments is None
    for (name, w), v in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(w, v, rtol=1e-5, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")
    if eps > 0.1:  # the clamp was active
        with torch.no_grad():
            norms = torch.linalg.vector_norm(0.1 * ref.b(x), dim=dim)
        assert (norms < eps).any()


class _Bag(torch.nn.Module):
    """Token embeddings with ``scale_grad_by_freq`` (and a padding index), mean-pooled."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(12, 4, padding_idx=0, scale_grad_by_freq=True)
        self.head = torch.nn.Linear(4, 2)

    def forward(self, ids, y):
        return F.cross_entropy(self.head(self.emb(ids).mean(1)), y)


def test_embedding_scales_each_rows_gradient_by_its_frequency() -> None:
    torch.manual_seed(0)
    model = _Bag()
    ref = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    opt_ref = torch.optim.SGD(ref.parameters(), lr=0.5)
    trainer = ORTTrainer(model, opt, TrainerOptions(fallback="off"))
    ids = torch.tensor([[3, 3, 3, 5, 0], [5, 7, 7, 0, 0], [1, 2, 3, 4, 3]])  # repeats, padding
    y = torch.tensor([0, 1, 1])
    for step in range(3):
        got = float(trainer.train_step(ids=ids, y=y))
        opt_ref.zero_grad()
        want = ref(ids, y)
        want.backward()
        opt_ref.step()
        assert got == pytest.approx(float(want.detach()), rel=1e-5), step
    assert trainer.segments is None
    for (name, w), v in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(w, v, rtol=1e-5, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")
    assert torch.equal(model.emb.weight[0], ref.emb.weight[0])  # the padding row never moved


class _Bags(torch.nn.Module):
    def __init__(self, mode: str, weighted: bool) -> None:
        super().__init__()
        self.bag = torch.nn.EmbeddingBag(10, 4, mode=mode, padding_idx=0)
        self.head = torch.nn.Linear(4, 2)
        self.weighted = weighted

    def forward(self, ids, y, offsets=None, psw=None):
        out = self.bag(ids, offsets, per_sample_weights=psw if self.weighted else None)
        return F.cross_entropy(self.head(out), y)


BAG_CASES = [
    ("mean", "rows", False),
    ("sum", "rows", True),
    ("max", "rows", False),
    ("sum", "offsets", True),
    ("mean", "offsets", False),
]


@pytest.mark.parametrize(("mode", "layout", "weighted"), BAG_CASES)
def test_embedding_bag_with_padding_trains_compiled_like_eager(mode, layout, weighted) -> None:
    """Padding entries left out of sums, means' counts and maxima; a bag of padding only
    (and, with offsets, an empty bag) is zeros."""
    torch.manual_seed(0)
    model = _Bags(mode, weighted)
    ref = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    opt_ref = torch.optim.SGD(ref.parameters(), lr=0.5)
    trainer = ORTTrainer(model, opt, TrainerOptions(fallback="off"))
    if layout == "rows":
        batch = {"ids": torch.tensor([[3, 0, 5, 3], [0, 0, 0, 0], [7, 2, 0, 9]]),
                 "y": torch.tensor([0, 1, 1])}  # fmt: skip
        psw_shape = (3, 4)
    else:  # 1-D with offsets: bags [0, 3), [3, 3) (empty), [3, 7)
        batch = {"ids": torch.tensor([3, 0, 5, 0, 7, 2, 9]), "y": torch.tensor([0, 1, 1]),
                 "offsets": torch.tensor([0, 3, 3])}  # fmt: skip
        psw_shape = (7,)
    if weighted:
        batch["psw"] = torch.rand(psw_shape, generator=torch.Generator().manual_seed(3))
    for step in range(3):
        got = float(trainer.train_step(**batch))
        opt_ref.zero_grad()
        want = ref(**batch)
        want.backward()
        opt_ref.step()
        assert got == pytest.approx(float(want.detach()), rel=1e-5), step
    assert trainer.segments is None
    for (name, w), v in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(w, v, rtol=1e-5, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")


_SDPA = F.scaled_dot_product_attention  # a reference taken at import, as user code does


class _Attends(torch.nn.Module):
    def __init__(self, form: str = "F") -> None:
        super().__init__()
        self.form = form
        self.proj = torch.nn.Linear(8, 24)
        self.mha = torch.nn.MultiheadAttention(8, 2, dropout=0.5, batch_first=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.form == "MultiheadAttention":
            out = self.mha(x, x, x, need_weights=False)[0]
            return out.pow(2).sum(-1).mean()
        q, k, v = self.proj(x).unflatten(-1, (3, 2, 4)).permute(2, 0, 3, 1, 4)
        if self.form == "captured, bool mask, grouped heads":
            mask = torch.ones(x.shape[1], x.shape[1], dtype=torch.bool).tril()
            out = _SDPA(q, k[:, :1], v[:, :1], attn_mask=mask, dropout_p=0.5, enable_gqa=True)
        else:
            out = F.scaled_dot_product_attention(q, k, v, dropout_p=0.5, is_causal=True)
        return out.pow(2).sum(-1).mean()


@pytest.mark.parametrize("form", ["F", "captured, bool mask, grouped heads", "MultiheadAttention"])
def test_attention_dropout_is_drawn_in_the_graph(form: str) -> None:
    """``F.scaled_dot_product_attention(dropout_p=0.5)`` however the model reaches it: the
    graph drops the probabilities (the exporter's translation wrote an inference-mode
    Dropout: a constant loss at lr 0), its first step agrees with eager's with dropout off
    (``fallback="off"`` raises otherwise), and its mean loss over 40 draws is eager's."""
    torch.manual_seed(0)
    model = _Attends(form)
    x = torch.randn(6, 7, 8, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        eager = torch.tensor([model(x).item() for _ in range(40)])
    trainer = ORTTrainer(model, torch.optim.SGD(model.parameters(), lr=0.0),
                         TrainerOptions(fallback="off"))  # fmt: skip
    compiled = torch.tensor([trainer.train_step(x).item() for _ in range(40)])
    assert trainer.program.whole
    drops = [n for n in trainer.train_graphs[0].graph if n.op_type == "Dropout"]
    assert len(drops) == 1
    assert compiled.std() > 0.2 * eager.std()
    spread = (eager.var() / 40 + compiled.var() / 40).sqrt()
    assert abs(compiled.mean() - eager.mean()) < 4 * spread, (eager.mean(), compiled.mean())


def test_an_export_that_loses_a_dropout_is_caught_at_the_first_step(monkeypatch) -> None:
    """The check runs with dropout off, where a graph without a dropout agrees with eager;
    it also counts the places each draws. An export that loses one (here the exporter's
    attention as it comes, whose Dropout is in inference mode) raises with
    ``fallback="off"`` and trains the module in eager with ``fallback="auto"``, as eager
    draws."""
    from ortrain import export
    from ortrain.core.errors import VerificationError

    monkeypatch.setattr(export, "draw_attention_dropout", lambda model: 0)
    x = torch.randn(6, 7, 8, generator=torch.Generator().manual_seed(1))
    torch.manual_seed(0)
    model = _Attends()
    trainer = ORTTrainer(model, torch.optim.SGD(model.parameters(), lr=0.0),
                         TrainerOptions(fallback="off"))  # fmt: skip
    with pytest.raises(VerificationError, match=r"dropout: eager draws it at 1 place\(s\), "
                       r"the graph at 0"):  # fmt: skip
        trainer.train_step(x)
    with torch.no_grad():
        eager = torch.tensor([model(x).item() for _ in range(40)])
    trainer = ORTTrainer(model, torch.optim.SGD(model.parameters(), lr=0.0))
    with pytest.warns(UserWarning, match="dropout: eager draws it at 1"):
        compiled = torch.tensor([trainer.train_step(x).item() for _ in range(40)])
    kinds = {s.module: s.kind for s in trainer.program.segments}
    assert not trainer.program.whole and kinds.get("proj") == "compiled", kinds
    spread = (eager.var() / 40 + compiled.var() / 40).sqrt()
    assert compiled.std() > 0.2 * eager.std()
    assert abs(compiled.mean() - eager.mean()) < 4 * spread, (eager.mean(), compiled.mean())
