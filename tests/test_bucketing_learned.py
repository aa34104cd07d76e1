"""Bucketing of batches whose tensors have names it does not know (ortrain/padding_roles.py):
nanoGPT's ``(idx, targets)`` and other hand-written signatures, padded as exactly as
``input_ids`` / ``labels`` are, or refused as they would be."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn.functional as F

from ortrain import ORTTrainer, TrainerOptions
from ortrain.bucketing import Bucketing, Layout, bucket_length, layout
from ortrain.padding_roles import Pad, padding_values
from tests.adam_noise import AdamDrift, TrainerGradients, assert_params_close
from tests.test_loss_outputs import GPT, GPTConfig

V, H = 64, 16


def _nano_batch(n: int, g: torch.Generator, cfg: GPTConfig, rows: int = 4) -> dict:
    data = torch.randint(0, cfg.vocab_size, (rows, n + 1), generator=g)
    y = data[:, 1:].clone()
    y[0, :3] = -1  # nanoGPT's loss skips -1
    return {"idx": data[:, :-1], "targets": y}


def _follow(model: torch.nn.Module, batch: dict, loss_fn=None) -> dict[str, Pad]:
    def run(b):
        out = model(**b)
        return loss_fn(out, b) if loss_fn is not None else out

    with torch.no_grad():
        return padding_values(run, batch, list(batch), pad_id=7)


class _Shifted(torch.nn.Module):
    """Targets shifted inside the loss as transformers' causal LM loss shifts them
    (``F.pad`` with the ignore index, a slice, ``contiguous``), under names of its own."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(V, H)
        self.head = torch.nn.Linear(H, V)

    def forward(self, tokens, answers, weights):
        logits = self.head(self.emb(tokens) * weights[..., None])
        shifted = F.pad(answers, (0, 1), value=-5)[:, 1:].contiguous()
        return torch.nn.CrossEntropyLoss(ignore_index=-5)(logits.flatten(0, 1), shifted.view(-1))


def test_the_padding_of_unknown_names_is_followed_to_the_loss():
    cfg = GPTConfig()
    g = torch.Generator().manual_seed(0)
    # nanoGPT: targets reach cross_entropy(ignore_index=-1) through a view; idx the table
    found = _follow(GPT(cfg), _nano_batch(12, g, cfg))
    assert found == {"idx": 7, "targets": -1}
    # through F.pad, a slice, contiguous and nn.CrossEntropyLoss; a float tensor: zeros
    batch = {
        "tokens": torch.randint(0, V, (2, 9), generator=g),
        "answers": torch.randint(0, V, (2, 9), generator=g),
        "weights": torch.rand(2, 9, generator=g),
    }
    found = _follow(_Shifted(), batch)
    assert found == {"tokens": 7, "answers": -5, "weights": 0}
    # the plan pads what it does not know with zeros until told, then as learned
    plan = layout(batch, 7)
    assert isinstance(plan, Layout) and plan.learn == ("tokens", "answers", "weights")
    plan = layout(batch, 7, found)
    assert isinstance(plan, Layout) and plan.learn == ()
    out = plan.apply(batch, 12)
    assert out["answers"][:, 9:].eq(-5).all() and out["tokens"][:, 9:].eq(7).all()
    assert out["weights"][:, 9:].eq(0).all() and plan.holds["tokens"] == 7


class _TokensAreTargets(torch.nn.Module):
    """One tensor, both the tokens and (shifted) the targets: no padding value is exact."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = torch.nn.Embedding(V, H)
        self.head = torch.nn.Linear(H, V)

    def forward(self, seq):
        logits = self.head(self.emb(seq))
        return F.cross_entropy(logits[:, :-1].flatten(0, 1), seq[:, 1:].flatten())


def test_one_shape_is_not_padded_until_a_second_comes():
    """Data of one shape under names bucketing does not know runs as given: nothing
    learned, checked or traced; the second length starts the padding."""
    b = Bucketing(_TokensAreTargets(), None)
    g = torch.Generator().manual_seed(2)
    for _ in range(3):
        seq = torch.randint(0, V, (2, 21), generator=g)
        assert b.pad({"seq": seq}, train=True).batch["seq"] is seq
    assert not b.learned and not b.verdicts and not b.branches.regions
    seq = torch.randint(0, V, (2, 19), generator=g)
    with pytest.warns(UserWarning, match="seq are not padded .*padding changed the loss"):
        out = b.pad({"seq": seq}, train=True)
    assert out.length is None and out.batch["seq"] is seq
    (key,) = b.verdicts
    assert b.learned[key] == {"seq": 0}  # it reaches the table too: the pad token


@pytest.mark.slow
def test_nanogpt_with_varying_lengths_is_bucketed_and_trains_like_eager():
    lr = 1e-3
    cfg = GPTConfig(block_size=64)
    torch.manual_seed(0)
    ref = GPT(cfg)
    model = copy.deepcopy(ref)
    opt_ref = ref.configure_optimizers(0.1, lr, (0.9, 0.95))
    no_deferral = TrainerOptions(eager_if_faster=False)  # (every shape built)
    trainer = ORTTrainer(model, model.configure_optimizers(0.1, lr, (0.9, 0.95)), no_deferral)
    drift, read = AdamDrift(lr, betas=(0.9, 0.95)), TrainerGradients(trainer)
    g = torch.Generator().manual_seed(1)
    lengths = [40, 45, 51, 64, 33, 58, 47, 62, 39, 50]
    for step, n in enumerate(lengths):
        batch = _nano_batch(n, g, cfg)
        opt_ref.zero_grad(set_to_none=True)
        _, want = ref(**batch)
        want.backward()
        opt_ref.step()
        got = trainer.train_step(**batch)
        torch.testing.assert_close(got, want.detach(), rtol=1e-5, atol=0, msg=f"step {step}")
        grads = {k: p.grad for k, p in ref.named_parameters()}
        drift.observe(grads, read(grads))
    # the first length's graph, then one per bucket (whatever each batch's labelled rows)
    buckets = {bucket_length(n) for n in lengths[1:]}
    assert trainer.build_count == 1 + len(buckets) == 3
    (key,) = trainer.bucketing.verdicts
    assert trainer.bucketing.verdicts[key].exact
    assert trainer.bucketing.learned[key]["targets"] == -1
    # the graph's proof, taken on its export with the learned padding
    assert trainer.bucketing.proofs[key] == ("exact", "")
    trainer.sync_to_module()
    assert_params_close(
        dict(model.named_parameters()),
        dict(ref.named_parameters()),
        rtol=1e-4,
        atol=1e-5,
        drift=drift,
    )


class _MaxOverTokens(torch.nn.Module):
    """A max over time with the pad token's embedding far below the others at first:
    eager's sample of the padded batch agrees, the graph's proof does not."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = torch.nn.Embedding(V, H)
        with torch.no_grad():
            self.emb.weight[0] = -100.0
        self.head = torch.nn.Linear(H, 3)

    def forward(self, tokens, y):
        return F.cross_entropy(self.head(self.emb(tokens).max(1).values), y)


def test_the_graph_s_proof_refuses_learned_padding_that_mixes_in():
    model = _MaxOverTokens()
    ref = copy.deepcopy(model)
    options = TrainerOptions(eager_if_faster=False)  # (every shape built)
    trainer = ORTTrainer(model, torch.optim.SGD(model.parameters(), lr=0.1), options)
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(1)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        for n in (21, 27, 21):
            batch = {"tokens": torch.randint(1, V, (2, n), generator=g), "y": torch.tensor([0, 2])}
            loss = trainer.train_step(**batch)
            opt.zero_grad()
            expected = ref(**batch)
            expected.backward()
            opt.step()
            torch.testing.assert_close(loss, expected.detach(), rtol=1e-5, atol=0)
    refusals = [str(w.message) for w in seen if "padding reaching the loss" in str(w.message)]
    assert len(refusals) == 1 and "ReduceMax node" in refusals[0], refusals
    (key,) = trainer.bucketing.verdicts
    assert trainer.bucketing.proofs[key][0] == "mixes"
    lengths = {
        v.shape[1] for m in trainer.train_graphs for v in m.graph.inputs if v.name == "tokens"
    }
    assert lengths == {21, 27}  # the padded graph (32) was dropped, each length its own


class _Bounded(torch.nn.Module):
    """A causal LM with a position table of 40 rows and nothing that names its size
    (``asserts``: but an assert on the length)."""

    def __init__(self, asserts: bool = True) -> None:
        super().__init__()
        self.asserts = asserts
        torch.manual_seed(0)
        self.emb = torch.nn.Embedding(V, H)
        self.pos = torch.nn.Embedding(40, H)
        self.head = torch.nn.Linear(H, V)

    def forward(self, tokens, answers):
        t = tokens.shape[1]
        if self.asserts:
            assert t <= 40, f"sequence {t} > 40"
        h = self.emb(tokens) + self.pos(torch.arange(t))
        h = torch.cumsum(h, 1) / torch.arange(1, t + 1)[:, None]  # causal: a running mean
        return F.cross_entropy(self.head(h).flatten(0, 1), answers.flatten(), ignore_index=-1)


def test_buckets_stop_where_the_model_s_lengths_do():
    """Padding 38 tokens to 48 fails in eager (the assert): that batch runs as given and
    later ones pad within the traced range of lengths (the assert's 40), not beyond."""
    b = Bucketing(_Bounded(), None)
    g = torch.Generator().manual_seed(0)

    def batch(n: int) -> dict:
        return {
            "tokens": torch.randint(0, V, (2, n), generator=g),
            "answers": torch.randint(0, V, (2, n), generator=g),
        }

    assert b.pad(batch(10), train=True).length is None  # (its first length: as given)
    with pytest.warns(UserWarning, match="not padded to 48 or more .*AssertionError"):
        assert b.pad(batch(38), train=True).length is None
    assert not b.verdicts  # the layout is not refused
    out = b.pad(batch(20), train=True)
    assert out.length == 20 and out.batch["tokens"].shape == (2, 32)
    out = b.pad(batch(37), train=True)
    assert out.length == 37 and out.batch["tokens"].shape == (2, 40)
    assert out.batch["answers"][:, 37:].eq(-1).all()


def test_a_bucket_past_a_table_nothing_names_is_not_padded_to():
    """Without the assert a layout's first check (at 32) passes and the trace finds no
    bound: a batch of 38 would go to 48, past the table. Eager runs the forward at each
    new bucket length once first, so that batch and those after it run as given."""
    b = Bucketing(_Bounded(asserts=False), None)
    g = torch.Generator().manual_seed(0)

    def batch(n: int) -> dict:
        return {
            "tokens": torch.randint(0, V, (2, n), generator=g),
            "answers": torch.randint(0, V, (2, n), generator=g),
        }

    assert b.pad(batch(12), train=True).length is None  # (its first length: as given)
    assert b.pad(batch(20), train=True).batch["tokens"].shape == (2, 32)
    with pytest.warns(UserWarning, match="not padded to 48 or more .*IndexError"):
        assert b.pad(batch(38), train=True).length is None
    assert b.pad(batch(35), train=True).length is None
    assert b.pad(batch(25), train=True).batch["tokens"].shape == (2, 32)
    # a bad batch (a token past the table) fails unpadded too: no bound is learned from it
    b = Bucketing(_Bounded(asserts=False), None)
    assert b.pad(batch(12), train=True).length is None
    assert b.pad(batch(10), train=True).batch["tokens"].shape == (2, 16)
    bad = batch(25)
    bad["tokens"][0, 0] = V
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # (no bound said)
        assert b.pad(bad, train=True).length is None
    assert b.pad(batch(26), train=True).batch["tokens"].shape == (2, 32)


def test_needs_eager_says_beforehand_whether_pad_runs_the_module():
    """ZeRO-3 asks ``needs_eager`` before ``pad`` (its ranks then gather every parameter
    together): it must say yes exactly where ``pad`` will run the module (learning the
    padding, the check, the trace, a new bucket length's forward), and change nothing."""
    model = _Bounded(asserts=False)
    calls = []
    model.register_forward_pre_hook(lambda m, args: calls.append(1))
    b = Bucketing(model, None)
    g = torch.Generator().manual_seed(0)
    said = []
    for n in (10, 10, 20, 25, 20, 37, 12, 3, 30, 38, 12):
        batch = {
            "tokens": torch.randint(0, V, (2, n), generator=g),
            "answers": torch.randint(0, V, (2, n), generator=g),
        }
        state = copy.deepcopy((b.learned, b.verdicts, b._lengths, b._borrowed, b._graphs))
        needed = b.needs_eager(batch, train=True)
        assert b.needs_eager(batch, train=True) == needed
        assert copy.deepcopy((b.learned, b.verdicts, b._lengths, b._borrowed, b._graphs)) == state
        before = len(calls)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # (38 is not padded past the table: it warns)
            b.pad(batch, train=True)
        assert needed == (len(calls) > before), (n, needed)
        said.append(needed)
    # the first length as given; the second learns, checks and traces; 37 tries the new
    # bucket length 48 (past the table: it fails), so 38 runs as given without a try
    assert said == [False, False, True, False, False, True, False, False, False, False, False]
