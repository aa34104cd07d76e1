"""``nn.LSTM(proj_size=...)``: written out step by step in the export (``ortrain/export_lstm.py``),
one graph that trains like eager; before, the exporter's LSTM node took the five weights
four at a time and the module ran in eager."""

from __future__ import annotations

import collections

import pytest
import torch
import torch.nn.functional as F

from ortrain import ORTTrainer, TrainerOptions

SEQ, BATCH, IN, HIDDEN = 5, 3, 6, 8


class _Projected(torch.nn.Module):
    def __init__(self, **lstm) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.batch_first = lstm.get("batch_first", False)
        self.rnn = torch.nn.LSTM(IN, HIDDEN, **lstm)
        dirs = 2 if self.rnn.bidirectional else 1
        self.head = torch.nn.Linear(self.rnn.proj_size * dirs, 3)

    def forward(self, x, y, h0=None, c0=None):
        if not self.batch_first:
            x = x.transpose(0, 1)
        out, (h, c) = self.rnn(x) if h0 is None else self.rnn(x, (h0, c0))
        if not self.batch_first:
            out = out.transpose(0, 1)
        # every output: the steps' projected h, the final h and the final (unprojected) c
        return F.cross_entropy(self.head(out).flatten(0, 1), y.flatten()) + 0.1 * (
            h.square().mean() + c.square().mean()
        )


def _batches(rnn: torch.nn.LSTM, states: bool) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(4)
    layers = rnn.num_layers * (2 if rnn.bidirectional else 1)
    out = []
    for _ in range(3):
        item = {
            "x": torch.randn(BATCH, SEQ, IN, generator=g),
            "y": torch.randint(0, 3, (BATCH, SEQ), generator=g),
        }
        if states:
            item["h0"] = 0.5 * torch.randn(layers, BATCH, rnn.proj_size, generator=g)
            item["c0"] = 0.5 * torch.randn(layers, BATCH, HIDDEN, generator=g)
        out.append(item)
    return out


CASES = {
    "one_layer": (dict(proj_size=4), False),
    "bidirectional_with_states": (dict(proj_size=4, bidirectional=True), True),
    "two_layers_batch_first": (dict(proj_size=3, num_layers=2, batch_first=True), False),
    "two_layers_bidirectional_no_bias_states": (
        dict(proj_size=3, num_layers=2, bidirectional=True, bias=False), True,
    ),
}  # fmt: skip


@pytest.mark.parametrize("name", list(CASES))
def test_projected_lstm_is_one_graph_that_trains_like_eager(name: str) -> None:
    """3 SGD-with-momentum steps: losses within 1e-5 relative, every parameter (the
    projections ``weight_hr`` included) within 1e-5; one training graph with no LSTM
    node; the evaluation loss is eager's."""
    lstm, states = CASES[name]
    model, ref = _Projected(**lstm), _Projected(**lstm)
    batches = _batches(model.rnn, states)
    trainer = ORTTrainer(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                         TrainerOptions(fallback="off", graph_cache=False))  # fmt: skip
    opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    for i, batch in enumerate(batches):
        want = ref(**batch)
        opt.zero_grad()
        want.backward()
        opt.step()
        got = trainer.train_step(**batch)
        torch.testing.assert_close(got, want.detach(), rtol=1e-5, atol=0, msg=f"step {i}")
    assert trainer.program.whole
    ops = collections.Counter(n.op_type for n in trainer.train_graphs[0].graph)
    assert "LSTM" not in ops and ops["Tanh"] >= 2 * SEQ
    for (k, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=k)
    assert {k for k, _ in model.named_parameters() if "weight_hr" in k}
    with torch.no_grad():
        want = ref.eval()(**batches[0])
    got = trainer.eval_step(**batches[0])
    torch.testing.assert_close(got["loss"], want, rtol=1e-5, atol=0)


def test_a_projected_lstm_draws_its_dropout_between_layers() -> None:
    """Dropout between a training call's layers: one ONNX ``Dropout`` of the module's
    ratio in the one graph; over 32 draws at lr 0 its losses' mean is eager's mean over
    32 draws (within four standard errors of the two) and their spread is eager's."""
    model = _Projected(proj_size=3, num_layers=2, dropout=0.5)
    with torch.no_grad():
        model.head.weight.mul_(20)  # logits that the dropped units move visibly
    batch = _batches(model.rnn, False)[0]
    trainer = ORTTrainer(model, torch.optim.SGD(model.parameters(), lr=0.0),
                         TrainerOptions(fallback="off", graph_cache=False))  # fmt: skip
    got = torch.tensor([trainer.train_step(**batch).item() for _ in range(32)])
    assert trainer.program.whole
    drops = [n for n in trainer.train_graphs[0].graph if n.op_type == "Dropout"]
    assert len(drops) == 1
    torch.manual_seed(1)
    with torch.no_grad():
        want = torch.tensor([model.train()(**batch).item() for _ in range(32)])
        clean = model.eval()(**batch).item()
    error = ((got.var() + want.var()) / 32).sqrt().item()
    assert abs(got.mean().item() - want.mean().item()) < 4 * error
    # drawn as eager draws: losses spread alike around a mean near the clean loss
    assert want.std().item() > 1e-3 * abs(clean)
    assert 0.5 < got.std().item() / want.std().item() < 2.0
