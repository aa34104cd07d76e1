"""Index batch inputs are range-checked as eager checks them (ortrain/index_check.py):
negative or too-large token ids and labels raise BatchError naming the input, the value,
its position and the valid range, where ONNX Gather would read (and train) another row."""

from __future__ import annotations

import re
import time
import warnings

import pytest
import torch

from ortrain import ORTTrainer, TrainerOptions
from ortrain.core.errors import BatchError
from ortrain.index_check import check_batch, index_ranges
from tests.conftest import bert_batches, bert_mlm, gpt2, lm_batches

VOCAB = 128


def _trainer(model: torch.nn.Module, accum: int = 2) -> ORTTrainer:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    return ORTTrainer(model, opt, TrainerOptions(grad_accumulation_steps=accum, graph_cache=False))


def _snapshot(trainer: ORTTrainer) -> dict[str, torch.Tensor]:
    state = {f"param:{n}": p.clone() for n, p in trainer.params.items()}
    state.update({f"grad:{n}": g.clone() for n, g in trainer.grads.items()})
    state.update({f"state:{n}": s.clone() for n, s in trainer.opt_state.items()})
    return state


def _assert_rejected(trainer, model, batch, name, value, where, valid) -> None:
    """Eager raises IndexError on ``batch``; ortrain a BatchError that names it all, with
    the trainer's state and accumulation window as they were."""
    with pytest.raises(IndexError):
        model(**batch)
    before, micro, step = _snapshot(trainer), trainer.micro_step, trainer.step
    with pytest.raises(BatchError) as err:
        trainer.train_step(**batch)
    msg = str(err.value)
    assert f"'{name}' holds {value} at {name}{where}" in msg, msg
    assert f"valid range {valid}" in msg, msg
    assert (trainer.micro_step, trainer.step) == (micro, step)
    after = _snapshot(trainer)
    assert after.keys() == before.keys()
    for k, t in before.items():
        assert torch.equal(after[k], t), k


@pytest.fixture(scope="module")
def gpt2_trained():
    model = gpt2(layers=1, hidden=64, vocab=VOCAB)
    trainer = _trainer(model)
    batch = lm_batches(1, batch=2, seq=16, vocab=VOCAB)[0]
    trainer.train_step(**batch)  # one micro-step of a 2-step window: the window is open
    assert trainer.micro_step == 1
    return model, trainer, batch


def test_gpt2_negative_and_too_large_token_ids(gpt2_trained):
    model, trainer, batch = gpt2_trained
    ids = batch["input_ids"].clone()
    ids[1, 3] = -5
    bad = {"input_ids": ids, "labels": batch["labels"]}
    _assert_rejected(trainer, model, bad, "input_ids", -5, "[1, 3]", f"[0, {VOCAB})")
    ids = batch["input_ids"].clone()
    ids[0, 7] = VOCAB
    bad = {"input_ids": ids, "labels": batch["labels"]}
    _assert_rejected(trainer, model, bad, "input_ids", VOCAB, "[0, 7]", f"[0, {VOCAB})")


def test_positions_past_the_position_table_raise_eager_s_error_naming_the_module():
    """A sequence longer than GPT-2's position table: the positions come from its length,
    not from a batch value, so eager's own IndexError is what stops the step (the first
    step's check runs eager). It says in which module of the model it was raised and the
    batch as given, and nothing of the trainer's state or open window changed."""
    model = gpt2(layers=1, hidden=32, vocab=VOCAB)
    trainer = _trainer(model)
    trainer.train_step(**lm_batches(1, batch=2, seq=16, vocab=VOCAB)[0])  # the window open
    long = lm_batches(1, batch=2, seq=70, vocab=VOCAB)[0]  # n_positions is 64
    with pytest.raises(IndexError):
        model(**long)
    before, micro, step = _snapshot(trainer), trainer.micro_step, trainer.step
    with pytest.raises(IndexError) as err, warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.train_step(**long)
    # a batch eager refuses says nothing of whether padding its layout is exact
    assert not [w for w in caught if "not padded to bucket lengths" in str(w.message)]
    assert all(v.exact for v in trainer.bucketing.verdicts.values())
    notes = "\n".join(getattr(err.value, "__notes__", []))
    assert "raised in eager PyTorch by transformer.wpe (Embedding) in GPT2LMHeadModel's" in notes
    assert "on the batch it ran (input_ids: [2, 70] int64" in notes, notes
    assert "eager training fails on it too" in notes
    assert (trainer.micro_step, trainer.step) == (micro, step)
    after = _snapshot(trainer)
    for k, t in before.items():
        assert torch.equal(after[k], t), k


def test_an_error_raised_in_ortrain_s_own_code_is_not_put_on_the_model():
    """Only an error the model's own code raised is said to be the model's: one raised
    inside ortrain (a bug of ours, called from a forward) gets no such note."""
    from ortrain.step_errors import batch_shapes, note_failed_step

    class Calls(torch.nn.Module):
        def __init__(self, fail) -> None:
            super().__init__()
            self.inner = torch.nn.Linear(2, 2)
            self.fail = fail

        def forward(self, x):
            return self.fail(self.inner(x))

    def ours(_):
        return batch_shapes(None)  # raises inside ortrain.step_errors

    def theirs(h):
        return h[5]  # raises in torch, called from the model's forward

    batch = {"x": torch.zeros(1, 2)}
    for fail, named in ((ours, False), (theirs, True)):
        model = Calls(fail)
        with pytest.raises(Exception) as err:
            model(**batch)
        note_failed_step(err.value, model, batch, batch)
        notes = "\n".join(getattr(err.value, "__notes__", []))
        assert ("raised in eager PyTorch by the root module (Calls)" in notes) == named, notes
        assert ("eager training fails on it too" in notes) == named


def test_gpt2_negative_label_but_not_ignore_index(gpt2_trained):
    model, trainer, batch = gpt2_trained
    labels = batch["labels"].clone()
    labels[0, 2:6] = -100  # ignore_index: allowed
    labels[1, 9] = -3
    bad = {"input_ids": batch["input_ids"], "labels": labels}
    _assert_rejected(trainer, model, bad, "labels", -3, "[1, 9]", f"[0, {VOCAB}) or -100")
    labels[1, 9] = 5  # only ignore_index besides valid labels: trains as eager does
    trainer.train_step(input_ids=batch["input_ids"], labels=labels)
    assert trainer.micro_step == 0 and trainer.step == 1


def test_bert_negative_ids_token_types_and_labels():
    model = bert_mlm(vocab=VOCAB, hidden=64, layers=1)
    trainer = _trainer(model, accum=1)
    batch = bert_batches(1, batch=2, seq=16, vocab=VOCAB)[0]
    trainer.train_step(**batch)
    cases = [
        ("input_ids", (0, 4), -1, f"[0, {VOCAB})"),
        ("token_type_ids", (1, 2), 2, "[0, 2)"),  # type_vocab_size 2
        ("labels", (1, 1), -7, f"[0, {VOCAB}) or -100"),
    ]
    for name, (i, j), value, valid in cases:
        bad = {k: v.clone() for k, v in batch.items()}
        bad[name][i, j] = value
        _assert_rejected(trainer, model, bad, name, value, f"[{i}, {j}]", valid)


class _Guarded(torch.nn.Module):
    """Ids sanitised before the lookup (left alone), and advanced indexing (wraps
    negatives in eager as in ONNX: a negative index is valid there)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(10, 4)
        self.w = torch.nn.Parameter(torch.randn(10, 4))

    def forward(self, ids: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        safe = torch.where(ids < 0, torch.zeros_like(ids), ids)
        return self.emb(safe).square().mean() + self.w[rows].square().mean()


def test_values_that_do_not_reach_an_index_unchanged_are_left_alone():
    torch.manual_seed(0)
    model = _Guarded()
    ref = _Guarded()
    ref.load_state_dict(model.state_dict())
    trainer = _trainer(model, accum=1)
    batch = {"ids": torch.tensor([[1, -4, 3]]), "rows": torch.tensor([2, -1, -10])}
    loss = trainer.train_step(**batch)
    expected = ref(**batch)  # eager accepts this batch
    torch.testing.assert_close(loss, expected.detach(), rtol=1e-5, atol=1e-6)
    (graph,) = trainer._graphs.train.values()
    checks = graph.graph.index_checks
    assert "ids" not in checks  # went through Where first
    assert [(lo, hi) for lo, hi, _, _ in checks["rows"]] == [(-10, 10)]
    batch["rows"] = torch.tensor([2, 10, 0])
    with pytest.raises(IndexError):
        ref(**batch)
    with pytest.raises(BatchError, match=re.escape("'rows' holds 10 at rows[1]")):
        trainer.train_step(**batch)


def test_index_ranges_of_exported_gpt2_and_check_cost():
    """Which inputs are checked, against what; and what the check costs on a GPT-2
    batch of 8 x 1024 tokens (printed: ``pytest -s``)."""
    from ortrain.export import export_here

    model = gpt2(layers=1, hidden=64, vocab=VOCAB)
    batch = lm_batches(1, batch=2, seq=16, vocab=VOCAB)[0]
    ex = export_here(model, batch, True, None, False)
    checks = index_ranges(ex.model, ex.io)
    assert sorted(checks) == ["input_ids", "labels"]
    assert [(u[0], u[1], u[2]) for u in checks["input_ids"]] == [(0, VOCAB, ())]
    assert [(u[0], u[1], u[2]) for u in checks["labels"]] == [(0, VOCAB, (-100,))]
    assert "Gather" in checks["input_ids"][0][3] and "aten.embedding" in checks["input_ids"][0][3]
    assert "SoftmaxCrossEntropyLoss" in checks["labels"][0][3]

    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, VOCAB, (8, 1024), generator=g)
    labels = ids.clone()
    labels[:, :100] = -100
    big = {"input_ids": ids, "labels": labels}
    check_batch(checks, big)
    n = 200
    start = time.perf_counter()
    for _ in range(n):
        check_batch(checks, big)
    per_batch = (time.perf_counter() - start) / n
    print(f"index check of an 8x1024 GPT-2 batch (labels with ignore_index): {per_batch:.1e} s")


class _Computed(torch.nn.Module):
    """Indices made by arithmetic on the batch: ids - 1, a clamp of a sum, positions from
    a cumsum of the mask (as left-padded decoders make them)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = torch.nn.Embedding(VOCAB, 8)
        self.pos = torch.nn.Embedding(6, 8)
        self.w = torch.nn.Parameter(torch.randn(VOCAB, 8))

    def forward(self, ids: torch.Tensor, mask: torch.Tensor, shift: torch.Tensor):
        positions = mask.cumsum(-1) - 1
        h = self.emb(ids - 1) + self.pos(positions)
        picked = torch.index_select(self.w, 0, (ids + shift).clamp(max=VOCAB + 3).reshape(-1))
        return h.square().mean() + picked.square().mean()


@pytest.mark.parametrize(
    "change, where",
    [
        ({"ids": torch.tensor([[3, 0, 2]])}, "aten.embedding"),  # 0 - 1 = -1
        ({"shift": torch.tensor(VOCAB)}, "aten.index_select"),  # past the table
        ({"mask": torch.tensor([[0, 1, 1]])}, "aten.embedding"),  # a position of -1
    ],
    ids=["ids-1", "clamp", "cumsum"],
)
def test_an_index_computed_from_the_batch_is_checked(change, where):
    torch.manual_seed(0)
    model, ref = _Computed(), _Computed()
    ref.load_state_dict(model.state_dict())
    trainer = _trainer(model)
    good = {"ids": torch.tensor([[3, 1, 2]]), "mask": torch.ones(1, 3, dtype=torch.long),
            "shift": torch.tensor(2)}  # fmt: skip
    torch.testing.assert_close(trainer.train_step(**good), ref(**good).detach(),
                               rtol=1e-5, atol=1e-6)  # fmt: skip
    (graph,) = trainer._graphs.train.values()
    computed = graph.graph.computed_indices
    assert computed is not None and sorted(computed.inputs) == ["ids", "mask", "shift"]
    assert len(computed.outputs) == 3  # one per Gather; the batch inputs reach none unchanged
    bad = {**good, **change}
    with pytest.raises(IndexError):
        ref(**bad)
    before, micro = _snapshot(trainer), trainer.micro_step
    with pytest.raises(BatchError, match="is computed from batch input") as err:
        trainer.train_step(**bad)
    assert where in str(err.value) and "nothing was applied" in str(err.value)
    assert trainer.micro_step == micro
    for k, t in _snapshot(trainer).items():
        assert torch.equal(before[k], t), k
    assert trainer.build_count == 1  # no rebuild


def test_models_without_computed_indices_get_no_index_graph(gpt2_trained):
    _, trainer, _ = gpt2_trained
    (graph,) = trainer._graphs.train.values()
    assert graph.graph.computed_indices is None  # positions from arange: static


class _OneHot(torch.nn.Module):
    """Class scores picked by ``F.one_hot`` of the labels (a hand-written loss)."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 4)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        hot = torch.nn.functional.one_hot(y, 4).float()
        return -(hot * self.lin(x).log_softmax(-1)).sum(-1).mean()


@pytest.mark.parametrize("bad", [4, -1, -5])
def test_one_hot_of_a_class_out_of_range_is_refused_as_eager_refuses_it(bad):
    """torch decomposes ``one_hot`` into ``eq(y[..., None], arange(n))``, a row of zeros
    for a class out of range, where eager raises: exported as OneHot, whose depth the
    check reads. In range, it trains like eager."""
    torch.manual_seed(0)
    model = _OneHot()
    ref = _OneHot()
    ref.load_state_dict(model.state_dict())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    trainer = ORTTrainer(model, opt, TrainerOptions(), loss_fn=lambda out, batch: out)
    x, y = torch.randn(3, 8), torch.tensor([0, 3, 1])
    loss = trainer.train_step(x, y)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    expected = ref(x, y)
    expected.backward()
    ref_opt.step()
    torch.testing.assert_close(loss, expected.detach(), rtol=1e-6, atol=1e-7)
    for p, q in zip(model.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=1e-5, atol=1e-7)
    ops = {n.op_type for n in trainer.train_graphs[0].graph}
    assert "OneHot" in ops and "Range" not in ops
    before = [p.detach().clone() for p in model.parameters()]
    wrong = torch.tensor([0, bad, 1])
    with pytest.raises(RuntimeError):
        ref(x, wrong)  # eager's own refusal
    with pytest.raises(BatchError, match=rf"'y' holds {bad} at y\[1\].*\[0, 4\).*OneHot"):
        trainer.train_step(x, wrong)
    for p, b in zip(model.parameters(), before, strict=True):
        assert torch.equal(p.detach(), b)


class _BCE(torch.nn.Module):
    def __init__(self, reduction: str):
        super().__init__()
        self.lin = torch.nn.Linear(8, 4)
        self.reduction = reduction

    def forward(self, x: torch.Tensor, target: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        p = torch.sigmoid(self.lin(x))
        loss = torch.nn.functional.binary_cross_entropy(p, target, w, reduction=self.reduction)
        return loss if self.reduction != "none" else loss.pow(2).mean()


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_binary_cross_entropy_targets_outside_0_1_are_refused_as_eager_refuses_them(reduction):
    """torch decomposes ``binary_cross_entropy`` into element-wise ops that no longer say
    which input is the target, so soft labels above 1 trained where eager raises: it is
    exported as one op (``ortrain/export_bce.py``) and its target range-checked, bounds
    included; its weight (here a batch input above 1) is not bounded. In range, it
    trains like eager, whatever the reduction."""
    torch.manual_seed(0)
    model = _BCE(reduction)
    ref = _BCE(reduction)
    ref.load_state_dict(model.state_dict())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    trainer = ORTTrainer(model, opt, TrainerOptions(), loss_fn=lambda out, batch: out)
    x, w = torch.randn(3, 8), torch.rand(3, 4) * 3
    target = torch.rand(3, 4)
    target[0, 0], target[1, 1] = 0.0, 1.0  # the bounds themselves are valid
    loss = trainer.train_step(x, target, w)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    expected = ref(x, target, w)
    expected.backward()
    ref_opt.step()
    torch.testing.assert_close(loss, expected.detach(), rtol=1e-6, atol=1e-7)
    for p, q in zip(model.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=1e-5, atol=1e-7)
    before = [p.detach().clone() for p in model.parameters()]
    for bad in (1.5, -0.25, float("nan")):
        wrong = target.clone()
        wrong[2, 3] = bad
        with pytest.raises(RuntimeError, match="between 0 and 1"):
            ref(x, wrong, w)  # eager's own refusal
        with pytest.raises(
            BatchError, match=r"'target' holds .* at target\[2, 3\], outside \[0, 1\]"
        ):
            trainer.train_step(x, wrong, w)
    for p, b in zip(model.parameters(), before, strict=True):
        assert torch.equal(p.detach(), b)
    assert trainer.build_count == 1
