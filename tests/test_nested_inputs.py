"""Tensors inside a batch's Python containers (a list of views, a dict of features with a
flag beside them, a tuple) are inputs of the graph (``ortrain/nested_batch.py``): one
graph for every batch of the same shapes, trained like eager. Before, their values were
constants of the graph and every batch built a new one."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ortrain import ORTTrainer, TrainerOptions
from ortrain.nested_batch import Slot, filled, flat, split


class _Views(nn.Module):
    """Multi-view input: a list of tensors through one encoder."""

    def __init__(self) -> None:
        super().__init__()
        self.enc = nn.Sequential(nn.Linear(6, 8), nn.Tanh())
        self.head = nn.Linear(8, 3)

    def forward(self, views: list[torch.Tensor], y: torch.Tensor) -> torch.Tensor:
        h = sum(self.enc(v) for v in views) / len(views)
        return F.cross_entropy(self.head(h), y)


class _Features(nn.Module):
    """A dict argument: tensors and a Python setting beside them, and a tuple pair."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 3)
        self.emb = nn.Embedding(10, 3)

    def forward(self, feats: dict[str, Any], pair: tuple[torch.Tensor, torch.Tensor]):
        logits = self.lin(feats["x"]) * feats["scale"] + self.emb(feats["ids"])
        return F.cross_entropy(logits, pair[0]) * pair[1].mean()


def _views(g: torch.Generator) -> tuple:
    return (
        [torch.randn(4, 6, generator=g) for _ in range(3)],
        torch.randint(0, 3, (4,), generator=g),
    )


def _features(g: torch.Generator) -> tuple:
    feats = {
        "x": torch.randn(4, 6, generator=g),
        "ids": torch.randint(0, 10, (4,), generator=g),
        "scale": 0.5,
    }
    return (feats, (torch.randint(0, 3, (4,), generator=g), torch.rand(2, generator=g) + 0.5))


def _train(make, batch_of, ortrain: bool, steps: int = 4):
    torch.manual_seed(0)
    model = make()
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    trainer = ORTTrainer(model, opt, TrainerOptions()) if ortrain else None
    g = torch.Generator().manual_seed(5)
    losses = []
    for _ in range(steps):
        batch = batch_of(g)
        if trainer is not None:
            losses.append(float(trainer.train_step(*batch)))
            continue
        loss = model(*batch)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss))
    if trainer is not None:
        trainer.sync_to_module()
    return losses, model, trainer


def _assert_like_eager(make, batch_of) -> ORTTrainer:
    want, ref, _ = _train(make, batch_of, ortrain=False)
    got, model, trainer = _train(make, batch_of, ortrain=True)
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=1e-5, atol=0)
    for (k, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-6, msg=k)
    return trainer


def test_a_list_of_tensors_is_one_graph_for_every_batch():
    trainer = _assert_like_eager(_Views, _views)
    assert trainer.build_count == 1 and trainer.segments is None
    (graph,) = trainer._graphs.train.values()
    assert set(graph.batch_names) == {"views[0]", "views[1]", "views[2]", "y"}
    views, y = _views(torch.Generator().manual_seed(9))
    got = trainer.eval_step(views, y)["loss"]
    with torch.no_grad():
        want = trainer.module.eval()(views, y)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_a_dict_and_a_tuple_of_tensors_are_one_graph_for_every_batch():
    trainer = _assert_like_eager(_Features, _features)
    assert trainer.build_count == 1 and trainer.segments is None


def test_a_python_value_inside_a_container_is_still_a_constant_of_the_graph():
    """The dict's float is part of the signature: another value is another graph."""
    torch.manual_seed(0)
    model = _Features()
    trainer = ORTTrainer(model, torch.optim.SGD(model.parameters(), lr=0.1), TrainerOptions())
    g = torch.Generator().manual_seed(5)
    feats, pair = _features(g)
    trainer.train_step(feats, pair)
    trainer.train_step({**feats, "scale": 0.25}, pair)
    assert trainer.build_count == 2


def test_split_names_each_tensor_by_its_path_and_fills_it_back():
    x, m = torch.zeros(2), torch.ones(2)
    batch = {"a": x, "b": {"m": m, "k": 3}, "c": [x, (m, "s")], "d": 1.5}
    tensors, consts = split(batch)
    assert list(tensors) == ["a", "b['m']", "c[0]", "c[1][0]"]
    assert consts["b"] == {"m": Slot("b['m']"), "k": 3} and consts["d"] == 1.5
    back = filled(consts["c"], tensors)
    assert back[0] is x and back[1][0] is m and back[1][1] == "s"
    assert list(flat(batch)) == ["a", "b['m']", "c[0]", "c[1][0]", "b", "c", "d"]
