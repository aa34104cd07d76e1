"""Automatic bucketing (ortrain/bucketing.py): variable-length batches padded to a few
lengths, with the loss, gradients and outputs of the unpadded batches."""

from __future__ import annotations

import copy
import re
import sysconfig
import time
import warnings
from pathlib import Path

import pytest
import torch

from ortrain import ORTTrainer, TrainerOptions, whole_program
from ortrain.bucketing import (
    BORROW_LIMIT,
    IGNORE_INDEX,
    Bucketing,
    Layout,
    bucket_length,
    bucket_lengths,
    layout,
)
from tests.adam_noise import AdamDrift, TrainerGradients, assert_params_close
from tests.conftest import bert_mlm, decay_groups, gpt2
from tests.test_parity import LOSS_RTOL, PARAM_ATOL, PARAM_RTOL


def varlen_batch(
    lengths: list[int], vocab: int = 512, seed: int = 0, left: bool = False, mlm: bool = False
) -> dict[str, torch.Tensor]:
    """Rows of the given lengths padded to the longest (right, or left), with a mask and
    labels that skip the padding (masked-LM: 15% of the real tokens, at least one)."""
    g = torch.Generator().manual_seed(seed)
    n = max(lengths)
    ids = torch.randint(1, vocab, (len(lengths), n), generator=g)
    pos = torch.arange(n)[None]
    lens = torch.tensor(lengths)[:, None]
    mask = (pos >= n - lens) if left else (pos < lens)
    mask = mask.long()
    ids = ids.masked_fill(mask == 0, 0)
    labels = ids.masked_fill(mask == 0, IGNORE_INDEX)
    if mlm:
        pick = (torch.rand(ids.shape, generator=g) < 0.15) & (mask == 1)
        pick[:, 0] |= mask[:, 0] == 1  # at least one label where a row starts with a token
        labels = labels.masked_fill(~pick, IGNORE_INDEX)
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def random_lengths(steps: int, batch: int, lo: int, hi: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(lo, hi + 1, (batch,), generator=g).tolist() for _ in range(steps)]


# ----------------------------------------------------------------------------- units
def test_bucket_lengths_are_few_and_tight():
    for n in range(1, 2049):
        b = bucket_length(n)
        assert b >= n and b % 16 == 0 and bucket_length(b) == b
        assert b - n < max(16, n / 4)  # padding adds under 25% (under 16 tokens up to 64)
    assert bucket_lengths(128) == [16, 32, 48, 64, 80, 96, 112, 128]
    for top in (64, 128, 256, 512, 1024, 2048):
        assert len(bucket_lengths(top)) == 4 * (top // 64).bit_length()


def test_padding_values():
    ids = torch.tensor([[5, 6, 7], [8, 9, 0]])
    batch = {
        "input_ids": ids,
        "attention_mask": torch.tensor([[1, 1, 1], [1, 1, 0]]),
        "labels": torch.tensor([[5, 6, 7], [8, 9, -100]]),
        "token_type_ids": torch.tensor([[0, 1, 1], [0, 0, 0]]),
        "position_ids": torch.tensor([[0, 1, 2], [3, 4, 5]]),
        "next_sentence_label": torch.tensor([1, 0]),
        "return_dict": True,
    }
    plan = layout(batch, pad_id=3)
    assert isinstance(plan, Layout) and plan.length == 3 and plan.right_padded
    out = plan.apply(batch, 5)
    assert out["input_ids"].tolist() == [[5, 6, 7, 3, 3], [8, 9, 0, 3, 3]]
    assert out["attention_mask"].tolist() == [[1, 1, 1, 0, 0], [1, 1, 0, 0, 0]]
    assert out["labels"].tolist() == [[5, 6, 7, -100, -100], [8, 9, -100, -100, -100]]
    assert out["token_type_ids"].tolist() == [[0, 1, 1, 0, 0], [0, 0, 0, 0, 0]]
    assert out["position_ids"].tolist() == [[0, 1, 2, 3, 4], [3, 4, 5, 6, 7]]
    assert out["next_sentence_label"] is batch["next_sentence_label"]
    assert out["return_dict"] is True
    assert all(out[k].dtype == batch[k].dtype for k in ("input_ids", "labels", "attention_mask"))


@pytest.mark.parametrize(
    "change,why",
    [
        (
            lambda b: (b.pop("attention_mask"), b.update(input_ids=b["input_ids"].float())),
            "no 2-D integer tensor",
        ),
        (lambda b: b.update(attention_mask=b["attention_mask"][:, None]), "no 2-D"),
        (lambda b: b["attention_mask"].__setitem__((0, 0), 2), "other than 0 and 1"),
        (lambda b: b.update(bias=torch.zeros(2, 4, 6)), "on an axis other than 1"),
        (lambda b: b.update(labels=b["labels"].float()), "not token ids"),
    ],
    ids=["no-mask", "3d-mask", "mask-values", "length-axis", "float-labels"],
)
def test_layouts_left_unbucketed(change, why):
    batch = varlen_batch([6, 4])
    change(batch)
    plan = layout(batch, pad_id=0)
    assert isinstance(plan, str) and why in plan
    bucketing = Bucketing(gpt2(layers=1, hidden=32), None)
    out = bucketing.pad(dict(batch), train=True)
    assert out.length is None and out.batch == batch and not bucketing.verdicts


def test_check_accepts_exact_layouts_and_refuses_others():
    lengths = [37, 30, 21, 12]
    model = gpt2(layers=2, hidden=64)
    b = Bucketing(model, None)
    padded = b.pad(varlen_batch(lengths), train=True)
    assert padded.batch["input_ids"].shape == (4, 48) and padded.length == 37
    evaluated = b.pad(varlen_batch(lengths), train=False)
    assert evaluated.seq_axes == {"logits": (1,)}
    # Left padding: GPT-2 predicts the first real label from a fully masked row, whose
    # uniform attention the appended keys change: refused, batch left as it is.
    with pytest.warns(UserWarning, match="left-padded batches .* not padded"):
        left = b.pad(varlen_batch(lengths, left=True), train=True)
    assert left.length is None and left.batch["input_ids"].shape == (4, 37)
    # An encoder masks padded keys whatever the side: left-padded BERT is exact.
    bert = Bucketing(bert_mlm(), None)
    out = bert.pad(varlen_batch(lengths, left=True, mlm=True), train=True)
    assert out.batch["input_ids"].shape == (4, 48) and all(v.exact for v in bert.verdicts.values())
    # A loss over every position (padding included) changes: refused with the reason.
    mean_logits = Bucketing(model, lambda out, batch: out.logits.mean())
    with pytest.warns(UserWarning, match="padding changed the loss"):
        kept = mean_logits.pad(varlen_batch(lengths), train=True)
    assert kept.batch["input_ids"].shape == (4, 37)
    off = Bucketing(model, None, mode="off").pad(varlen_batch(lengths), train=True)
    assert off.batch["input_ids"].shape == (4, 37)


def test_rare_lengths_borrow_a_longer_graph_then_get_their_own():
    b = Bucketing(gpt2(layers=1, hidden=32), None)
    assert b.pad(varlen_batch([40, 7]), train=True).batch["input_ids"].shape[1] == 48
    for _ in range(BORROW_LIMIT):  # bucket 32 has no graph: it runs on 48's
        out = b.pad(varlen_batch([20, 7]), train=True)
        assert out.batch["input_ids"].shape[1] == 48 and out.length == 20
    assert b.pad(varlen_batch([20, 7]), train=True).batch["input_ids"].shape[1] == 32
    assert b.pad(varlen_batch([30, 7]), train=True).batch["input_ids"].shape[1] == 32
    # a shorter graph is never borrowed, and evaluation keeps its own graphs
    assert b.pad(varlen_batch([60, 7]), train=True).batch["input_ids"].shape[1] == 64
    assert b.pad(varlen_batch([20, 7]), train=False).batch["input_ids"].shape[1] == 32


def test_check_leaves_module_state_alone():
    model = gpt2(layers=1, hidden=32, dropout=0.1)
    model.train()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    rng = torch.get_rng_state()
    Bucketing(model, None).pad(varlen_batch([20, 9]), train=True)
    assert model.training and torch.equal(torch.get_rng_state(), rng)
    assert all(p.grad is None for p in model.parameters())
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())


# ----------------------------------------------------------------------------- trainer
def adamw(model: torch.nn.Module) -> torch.optim.AdamW:
    # test_parity's, at half its lr: 30 steps on short masked rows at 2e-3 move a few
    # weights of near-zero gradient by Adam-normalized float noise (eager against itself on
    # 1 vs 2 threads reaches a quarter of the tolerance there)
    return torch.optim.AdamW(decay_groups(model, 0.01), lr=1e-3, betas=(0.9, 0.98), eps=1e-6)


def train_both(make_model, batches, options=None):
    """Eager on the batches as they are, ORTTrainer on the same (it pads them)."""
    ref = make_model()
    model = copy.deepcopy(ref)
    init = [p.detach().clone() for p in ref.parameters()]
    opt_ref, opt = adamw(ref), adamw(model)
    trainer = ORTTrainer(model, opt, options)
    # per element, what float noise in the gradients may move AdamW's steps by (an
    # attention key bias, a weight whose gradient cancels: tests/adam_noise.py)
    group = opt_ref.param_groups[0]
    drift = AdamDrift(group["lr"], betas=group["betas"], eps=group["eps"])
    read = TrainerGradients(trainer)
    losses_ref, losses = [], []
    for batch in batches:
        opt_ref.zero_grad()
        loss = ref(**batch).loss
        loss.backward()
        opt_ref.step()
        losses_ref.append(loss.item())
        losses.append(trainer.train_step(**batch).item())
        grads = {n: p.grad for n, p in ref.named_parameters() if p.grad is not None}
        drift.observe(grads, read(grads))
    torch.testing.assert_close(
        torch.tensor(losses), torch.tensor(losses_ref), rtol=LOSS_RTOL, atol=0
    )
    trainer.sync_to_module()
    assert_params_close(
        dict(model.named_parameters()),
        dict(ref.named_parameters()),
        rtol=PARAM_RTOL,
        atol=PARAM_ATOL,
        drift=drift,
    )
    moved = max((p - q).abs().max().item() for p, q in zip(model.parameters(), init))
    assert moved > 1e-3
    return trainer


def graph_lengths(trainer: ORTTrainer) -> set[int]:
    """The sequence length of each training graph's input_ids."""
    out = set()
    for model in trainer.train_graphs:
        (ids,) = [v for v in model.graph.inputs if v.name == "input_ids"]
        out.add(ids.shape[1])
    return out


@pytest.mark.slow
@pytest.mark.parametrize(
    "make_model,mlm",
    [(lambda: gpt2(layers=4, hidden=256), False), (lambda: bert_mlm(), True)],
    ids=["gpt2", "bert_mlm"],
)
def test_varlen_training_matches_eager_with_few_graphs(make_model, mlm):
    lengths = random_lengths(30, 4, 5, 48, seed=3)
    batches = [varlen_batch(ls, seed=i, mlm=mlm) for i, ls in enumerate(lengths)]
    trainer = train_both(make_model, batches)
    buckets = {bucket_length(max(ls)) for ls in lengths}
    distinct = {max(ls) for ls in lengths}
    assert len(distinct) > 2 * len(buckets)  # per-shape would build many more graphs
    assert graph_lengths(trainer) <= buckets and len(buckets) <= len(bucket_lengths(48))
    # BERT's masked-LM loss also builds a graph per labelled-row count (label_sparsity.py)
    assert trainer.build_count <= (2 if mlm else 1) * len(buckets)
    # the padded layout's training graph was analysed and proven exact (ortrain/padding/)
    assert list(trainer.bucketing.proofs.values()) == [("exact", "")]


@pytest.mark.slow
def test_eval_outputs_cut_back_to_the_batch_length():
    model = gpt2(layers=2, hidden=64)
    trainer = ORTTrainer(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    for i, lengths in enumerate(([37, 20, 5], [40, 33, 33])):  # both in bucket 48
        batch = varlen_batch(lengths, seed=i)
        out = trainer.eval_step(**batch)
        model.eval()
        with torch.no_grad():
            ref = model(**batch)
        assert out.logits.shape == ref.logits.shape == (3, max(lengths), 512)
        torch.testing.assert_close(out.logits, ref.logits, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(out.loss, ref.loss, rtol=1e-5, atol=0)
    assert trainer.build_count == 1
    (graph,) = [c.model for c in trainer._graphs.eval.values()]
    (ids,) = [v for v in graph.graph.inputs if v.name == "input_ids"]
    assert ids.shape[1] == 48


@pytest.mark.slow
@pytest.mark.parametrize("case", ["inexact", "off"])
def test_refused_batches_build_one_graph_per_shape(case, monkeypatch):
    monkeypatch.setattr(whole_program, "_cores", lambda: 2)  # (a test worker has one thread)
    model = gpt2(layers=1, hidden=32)
    # (every shape built, not deferred: what the test counts)
    options = TrainerOptions(bucketing="off" if case == "off" else "auto", eager_if_faster=False)
    loss_fn = (lambda out, batch: out.logits.mean()) if case == "inexact" else None
    trainer = ORTTrainer(model, torch.optim.AdamW(model.parameters(), lr=1e-3), options,
                         loss_fn=loss_fn)  # fmt: skip
    for n in (20, 24, 20):
        batch = varlen_batch([n, n - 3], seed=n)
        del batch["attention_mask"]
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            trainer.train_step(**batch)
        refusals = [w for w in seen if "padding changed the loss" in str(w.message)]
        assert len(refusals) == (case == "inexact" and n == 20 and trainer.step == 1)
    assert trainer.build_count == 2
    assert graph_lengths(trainer) == {20, 24}
    # "inexact": the padded batch's graph, started while the eager check ran, was dropped
    program = trainer._program
    assert (program.started_early, program.dropped_early) == (
        (1, 1) if case == "inexact" else (0, 0)
    )
    verdicts = trainer.bucketing.verdicts
    assert len(verdicts) == (case == "inexact") and not any(v.exact for v in verdicts.values())


def packed_batches(steps: int, lo: int, hi: int, seed: int, vocab: int = 512) -> list[dict]:
    """Batches without a mask whose length changes every step (packed or length-sorted
    data): every token real, labels the ids."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        n = int(torch.randint(lo, hi + 1, (1,), generator=g))
        ids = torch.randint(1, vocab, (4, n), generator=g)
        out.append({"input_ids": ids, "labels": ids.clone()})
    return out


@pytest.mark.slow
def test_unmasked_causal_batches_are_bucketed_and_train_like_eager(monkeypatch):
    monkeypatch.setattr(whole_program, "_cores", lambda: 2)  # (a test worker has one thread)
    batches = packed_batches(24, 6, 60, seed=5)
    lengths = {b["input_ids"].shape[1] for b in batches}
    assert len(lengths) >= 15
    trainer = train_both(lambda: gpt2(layers=2, hidden=64), batches)
    buckets = {bucket_length(n) for n in lengths}
    assert graph_lengths(trainer) <= buckets and trainer.build_count <= len(buckets)
    (key,) = trainer.bucketing.verdicts
    assert key[2] == "unmasked" and trainer.bucketing.verdicts[key].exact
    assert trainer.bucketing.proofs[key] == ("exact", "")
    # the first padded batch's graph started before the layout's eager check and length
    # trace, and was the one its step ran on
    assert (trainer._program.started_early, trainer._program.dropped_early) == (1, 0)


def test_an_unmasked_encoder_is_not_padded():
    # without a mask a bidirectional encoder attends to the appended tokens: the check
    # (in training mode, dropout off) refuses it
    b = Bucketing(bert_mlm(), None)
    batch = varlen_batch([21, 21], mlm=True)
    del batch["attention_mask"]
    with pytest.warns(UserWarning, match="not padded"):
        out = b.pad(batch, train=True)
    assert out.length is None and out.batch["input_ids"].shape == (2, 21)


class _TokenBatchNorm(torch.nn.Module):
    """BatchNorm over tokens: in training its statistics include the padded positions."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = torch.nn.Embedding(512, 8)
        self.norm = torch.nn.BatchNorm1d(8)
        self.head = torch.nn.Linear(8, 512)

    def forward(self, input_ids, attention_mask, labels):
        h = self.norm(self.emb(input_ids).transpose(1, 2)).transpose(1, 2)
        h = h * attention_mask[..., None]
        logits = self.head(h)
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())


def test_batch_statistics_over_tokens_refuse_padding_in_training():
    model = _TokenBatchNorm()
    running = model.norm.running_mean.clone()
    b = Bucketing(model, lambda out, batch: out)
    with pytest.warns(UserWarning, match="padding changed"):
        out = b.pad(varlen_batch([20, 9]), train=True)
    assert out.length is None
    assert torch.equal(model.norm.running_mean, running)  # the check put the buffers back
    # evaluation normalises with the running statistics: padding is exact there
    assert b.pad(varlen_batch([20, 9]), train=False).length == 20


def test_left_padding_and_masks_with_holes_are_keyed_apart():
    left = layout(varlen_batch([6, 4], left=True), 0)
    holes = varlen_batch([6, 4])
    holes["attention_mask"][0, 2] = 0
    right = layout(varlen_batch([6, 4]), 0)
    plans = [left, layout(holes, 0), right]
    assert all(isinstance(p, Layout) for p in plans)
    assert [p.side for p in plans] == ["left", "holes", "right"]  # type: ignore[union-attr]
    assert len({p.key(True) for p in plans}) == 3  # type: ignore[union-attr]


def test_option_is_validated():
    with pytest.raises(ValueError, match="bucketing must be 'auto' or 'off'"):
        TrainerOptions(bucketing="on")


# ----------------------------------------------------------------------------- 200 steps
def stdlib_text_lengths(limit: int = 4000) -> list[int]:
    """Token counts (words and punctuation) of the paragraphs of the Python stdlib's
    sources, the recipe corpus: a real, long-tailed spread of lengths."""
    root = Path(sysconfig.get_paths()["stdlib"])
    out: list[int] = []
    for path in sorted(root.glob("*.py")):
        for para in re.split(r"\n\s*\n", path.read_text(errors="replace")):
            count = len(re.findall(r"\w+|[^\w\s]", para))
            if count >= 4:
                out.append(count)
        if len(out) >= limit:
            break
    return out


@pytest.mark.slow
def test_200_steps_of_realistic_lengths():
    from transformers import GPT2Config, GPT2LMHeadModel

    pool = stdlib_text_lengths()
    g = torch.Generator().manual_seed(0)
    lengths = [
        [min(128, pool[int(i)]) for i in torch.randint(0, len(pool), (8,), generator=g)]
        for _ in range(200)
    ]
    batches = [varlen_batch(ls, seed=i) for i, ls in enumerate(lengths)]

    def make():
        torch.manual_seed(0)
        cfg = GPT2Config(  # small: what is checked is the lengths, builds and losses
            n_layer=2, n_embd=64, n_head=4, vocab_size=512, n_positions=128,
            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, attn_implementation="eager",
        )  # fmt: skip
        return GPT2LMHeadModel(cfg)

    start = time.perf_counter()
    trainer = train_both(make, batches)
    buckets = {bucket_length(max(ls)) for ls in lengths}
    distinct = {max(ls) for ls in lengths}
    print(
        f"200 steps, {len(distinct)} lengths -> {trainer.build_count} graphs "
        f"({sorted(buckets)}); eager + ortrain {time.perf_counter() - start:.1f} s"
    )
    assert len(distinct) >= 20
    assert graph_lengths(trainer) <= buckets
    assert trainer.build_count <= len(buckets) <= len(bucket_lengths(128))


def _mean_logits(out, batch):
    return out.logits.mean()  # a loss over every position, the padding's too


def test_a_layout_s_verdict_is_kept_in_the_graph_cache(tmp_path, monkeypatch):
    """The eager check of a layout (two eager steps) runs once per machine: a second run
    with the same bucket takes its verdict from the graph cache, the output axes to cut
    and a refusal (still warned) included."""
    from ortrain.build_cache import GraphCache

    monkeypatch.setenv("ORTRAIN_GRAPH_CACHE", str(tmp_path))
    checked: list[int] = []
    real = Bucketing._check

    def counting(self, batch, plan, to, train):
        checked.append(to)
        return real(self, batch, plan, to, train)

    monkeypatch.setattr(Bucketing, "_check", counting)
    model = gpt2(layers=2, hidden=64)
    lengths = [37, 30, 21, 12]

    def run(loss_fn):
        b = Bucketing(model, loss_fn, cache=GraphCache(TrainerOptions(), model, loss_fn))
        return b.pad(varlen_batch(lengths), train=True), b.pad(varlen_batch(lengths), train=False)

    first = run(None)
    assert checked == [48, 48]
    again = run(None)
    assert checked == [48, 48]  # nothing checked again
    for a, b in zip(first, again, strict=True):
        assert b.length == a.length == 37 and b.batch["input_ids"].shape == (4, 48)
        assert dict(b.seq_axes) == dict(a.seq_axes)
    assert dict(again[1].seq_axes) == {"logits": (1,)}
    for _ in (1, 2):  # refused, and warned, the second time from the cache
        with pytest.warns(UserWarning, match="padding changed the loss"):
            refused, _ = run(_mean_logits)
        assert refused.length is None and refused.batch["input_ids"].shape == (4, 37)
    assert checked == [48, 48, 48, 48]  # its two layouts (training, evaluation) once each
