"""Padding exactness proven on the exported training graph (ortrain/padding/): the
ops that mix padded positions into the loss are found by node, the masked ones pass, and
the trainer refuses to pad a layout whose graph mixes even where eager's sample agreed."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn.functional as F

from ortrain import ORTTrainer, TrainerOptions
from ortrain.build import padding_proof, training_view
from ortrain.export import export_forward
from tests.conftest import bert_mlm, gpt2
from tests.test_bucketing import varlen_batch

V, H, C = 50, 16, 3


class Pooled(torch.nn.Module):
    """Token embeddings pooled over the sequence in one of several ways, then classified."""

    def __init__(self, kind: str):
        super().__init__()
        torch.manual_seed(0)
        self.kind = kind
        self.emb = torch.nn.Embedding(V, H)
        self.head = torch.nn.Linear(H, C)
        self.norm = torch.nn.BatchNorm1d(H)
        self.conv = torch.nn.Conv1d(H, H, 3)
        self.enc = torch.nn.TransformerEncoderLayer(H, 2, 32, dropout=0.0, batch_first=True)

    def forward(self, input_ids, attention_mask, labels):
        h = self.emb(input_ids)
        m = attention_mask.unsqueeze(-1).to(h.dtype)
        kind = self.kind
        if kind == "mean":
            p = h.mean(1)
        elif kind == "masked_mean":
            p = (h * m).sum(1) / m.sum(1)
        elif kind == "max":
            p = h.max(1).values
        elif kind == "masked_max":
            p = h.masked_fill(m == 0, -1e9).max(1).values
        elif kind == "batch_norm":
            p = (self.norm(h.transpose(1, 2)).transpose(1, 2) * m).sum(1)
        elif kind == "last":
            p = h[:, -1]
        elif kind == "first":
            p = h[:, 0]
        elif kind == "causal_conv":
            p = (self.conv(F.pad(h.transpose(1, 2), (2, 0))).transpose(1, 2) * m).sum(1)
        elif kind == "same_conv":
            p = (self.conv(F.pad(h.transpose(1, 2), (1, 1))).transpose(1, 2) * m).sum(1)
        elif kind == "encoder":
            p = (self.enc(h) * m).sum(1)
        else:  # "masked_encoder"
            p = (self.enc(h, src_key_padding_mask=attention_mask == 0) * m).sum(1)
        return F.cross_entropy(self.head(p), labels)


def proof_of(model: torch.nn.Module, batch: dict) -> tuple[str, str]:
    return padding_proof(batch, training_view(export_forward(model, batch, train=True)))


def pooled_batch(n: int = 16) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    mask = torch.ones(2, n, dtype=torch.long)
    mask[1, n // 2 :] = 0
    ids = torch.randint(1, V, (2, n), generator=g)
    return {"input_ids": ids, "attention_mask": mask, "labels": torch.tensor([0, 2])}


@pytest.mark.parametrize(
    "kind,op,why",
    [
        ("mean", "ReduceMean", "count includes padding"),
        ("max", "ReduceMax", "where it is not masked"),
        ("batch_norm", "ReduceMean", "in norm"),  # the decomposed batch statistics
        ("last", "Gather", "reads position 15"),
        ("same_conv", "Conv", "across the padded end"),
        ("encoder", "Softmax", "in enc.self_attn normalises over the padded axis"),
    ],
)
def test_ops_that_mix_padding_in_are_named(kind, op, why):
    verdict, detail = proof_of(Pooled(kind).train(), pooled_batch())
    assert verdict == "mixes"
    assert detail.startswith(f"{op} node ") and why in detail, detail


@pytest.mark.parametrize(
    "kind", ["masked_mean", "masked_max", "first", "causal_conv", "masked_encoder"]
)
def test_masked_forms_are_proven_exact(kind):
    assert proof_of(Pooled(kind).train(), pooled_batch()) == ("exact", "")


@pytest.mark.parametrize("case", ["bert_masked", "gpt2_masked", "gpt2_unmasked"])
def test_transformers_attention_is_proven_exact(case):
    batch = varlen_batch([20, 11, 16], vocab=128, mlm=case.startswith("bert"))
    if case == "gpt2_unmasked":
        del batch["attention_mask"]
        batch["labels"] = batch["input_ids"].clone()
    make = bert_mlm if case.startswith("bert") else gpt2
    model = make(vocab=128, hidden=32, layers=2).train()
    assert proof_of(model, batch) == ("exact", "")


@pytest.mark.parametrize("length", [48, 100])
def test_a_causal_mask_left_unfolded_is_proven_exact(length):
    """nanoGPT's ``is_causal`` attention: a small causal mask is exported folded to a
    constant, a large one as ``Where(Equal(Trilu(ones)))``; both are followed."""
    from tests.test_loss_outputs import GPT, GPTConfig

    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=128, n_layer=1))
    g = torch.Generator().manual_seed(0)
    batch = {
        "idx": torch.randint(0, 96, (2, length), generator=g),
        "targets": torch.randint(0, 96, (2, length), generator=g),
    }
    ex = training_view(export_forward(model, batch, train=True))
    assert any(n.op_type == "Trilu" for n in ex.model.graph) == (length == 100)
    assert padding_proof(batch, ex, 0, {"idx": None, "targets": -1}) == ("exact", "")
    # the same graph with targets padded by a value the loss does not skip: mixes
    verdict, why = padding_proof(batch, ex, 0, {"idx": None, "targets": 0})
    assert verdict == "mixes" and "ignore_index" in why


def test_labels_that_do_not_skip_the_padding_mix_in():
    # a token-level loss whose ignore_index is not what bucketing pads labels with
    class Tagger(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = torch.nn.Embedding(V, C)

        def forward(self, input_ids, attention_mask, labels):
            logits = self.emb(input_ids) * attention_mask[..., None]
            return F.cross_entropy(logits.flatten(0, 1), labels.flatten() + 100)

    batch = pooled_batch()
    batch["labels"] = torch.randint(-100, -100 + C, (2, 16))
    verdict, detail = proof_of(Tagger(), batch)
    assert verdict == "mixes" and "ignore_index" in detail, detail


def test_a_batch_without_a_sequence_axis_has_no_proof():
    model = torch.nn.Linear(4, 2)
    batch = {"input": torch.randn(3, 4)}
    ex = training_view(export_forward(model, batch, train=True, loss_fn=lambda o, b: o.sum()))
    assert padding_proof(batch, ex) == ("", "")


class MaxOverTime(torch.nn.Module):
    """A max over time that ignores the mask, with the pad token's embedding far below the
    others at first: eager's sample of the padded batch agrees, the graph does not."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = torch.nn.Embedding(V, H)
        with torch.no_grad():
            self.emb.weight[0] = -100.0
        self.head = torch.nn.Linear(H, C)

    def forward(self, input_ids, attention_mask, labels):
        return F.cross_entropy(self.head(self.emb(input_ids).max(1).values), labels)


def test_trainer_refuses_padding_the_graph_mixes_in_where_eager_agreed():
    model = MaxOverTime()
    ref = copy.deepcopy(model)
    options = TrainerOptions(eager_if_faster=False)  # (every shape built)
    trainer = ORTTrainer(model, torch.optim.SGD(model.parameters(), lr=0.1), options, loss_fn=None)
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(1)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        for n in (21, 27, 21):
            batch = {
                "input_ids": torch.randint(1, V, (2, n), generator=g),
                "attention_mask": torch.ones(2, n, dtype=torch.long),
                "labels": torch.tensor([0, 1]),
            }
            loss = trainer.train_step(**batch)
            opt.zero_grad()
            expected = ref(**batch)
            expected.backward()
            opt.step()
            torch.testing.assert_close(loss, expected.detach(), rtol=1e-5, atol=0)
    refusals = [str(w.message) for w in seen if "padding reaching the loss" in str(w.message)]
    assert len(refusals) == 1 and "ReduceMax node" in refusals[0], refusals
    (key,) = trainer.bucketing.verdicts
    assert trainer.bucketing.verdicts[key].exact is False
    assert trainer.bucketing.proofs[key][0] == "mixes"
    lengths = set()
    for m in trainer.train_graphs:
        (ids,) = [v for v in m.graph.inputs if v.name == "input_ids"]
        lengths.add(ids.shape[1])
    assert lengths == {21, 27}  # the padded graph (32) was dropped, each length its own
