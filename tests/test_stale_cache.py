"""A graph-cache entry made stale by what the key may not see is caught by the first-step
check and built again (ortrain/whole_program.py), or missed by a key that sees it: one test
per kind of value a forward reads besides its structure, options and batch signature; each
run trains like eager either way."""

from __future__ import annotations

import types
import warnings
from collections.abc import Callable

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from ortrain import ORTTrainer, TrainerOptions

CONFIG = types.SimpleNamespace(scale=1.0)  # a config module's attribute set from the CLI


class Reads(torch.nn.Module):
    """A linear classifier whose logits are scaled by what ``kind`` names."""

    def __init__(self, kind: str):
        super().__init__()
        torch.manual_seed(0)
        self.kind = kind
        self.lin = torch.nn.Linear(8, 4)
        self.table = np.ones(5000)  # its repr elides the middle
        self.flag = 1.0

    def factor(self) -> float:
        return 1.0

    def forward(self, x, y):
        kind = self.kind
        if kind == "patched_method":
            scale = self.factor()
        elif kind == "numpy_middle":
            scale = float(self.table[2500])
        elif kind == "config_attribute":
            scale = CONFIG.scale
        else:  # "changed_in_place": an attribute set after the first step
            scale = self.flag
        return F.cross_entropy(self.lin(x) * scale, y)


def _batch(rows: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, 8, generator=g), torch.randint(0, 4, (rows,), generator=g)


def _change(kind: str, model: Reads, monkeypatch: pytest.MonkeyPatch) -> None:
    if kind == "patched_method":  # how kernel-patching libraries work
        monkeypatch.setattr(Reads, "factor", lambda self: 3.0)
    elif kind == "numpy_middle":
        model.table[2500] = 3.0
    elif kind == "config_attribute":
        monkeypatch.setattr(CONFIG, "scale", 3.0)
    else:
        model.flag = 3.0


def _trains_like_eager(
    make: Callable[[], torch.nn.Module], options: TrainerOptions, batches: list
) -> ORTTrainer:
    model, ref = make(), make()
    trainer = ORTTrainer(model, torch.optim.SGD(model.parameters(), lr=0.1), options)
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for x, y in batches:
        opt.zero_grad()
        want = ref(x, y)
        want.backward()
        opt.step()
        torch.testing.assert_close(trainer.train_step(x, y), want.detach(), rtol=1e-5, atol=0)
    trainer.sync_to_module()
    for (k, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=k)
    return trainer


@pytest.mark.slow
@pytest.mark.parametrize(
    "kind", ["patched_method", "numpy_middle", "config_attribute", "changed_in_place"]
)
def test_a_warm_start_after_a_change_beside_the_key_trains_like_eager(kind, tmp_path, monkeypatch):
    monkeypatch.setenv("ORTRAIN_GRAPH_CACHE", "1")  # conftest turns it off
    options = TrainerOptions(graph_cache=str(tmp_path))
    first = Reads(kind)
    trainer = ORTTrainer(first, torch.optim.SGD(first.parameters(), lr=0.1), options)
    trainer.train_step(*_batch(16, 0))
    if kind == "changed_in_place":
        # the module changes after its key was taken: a later shape's graph is stored
        # under the old key, and a fresh model (flag 1) meets it
        _change(kind, first, monkeypatch)
        trainer.train_step(*_batch(12, 1))

        def make() -> Reads:
            return Reads(kind)
    else:

        def make() -> Reads:
            model = Reads(kind)
            if kind == "numpy_middle":
                model.table[2500] = 3.0
            return model

        if kind != "numpy_middle":
            _change(kind, Reads(kind), monkeypatch)
    rows = 12 if kind == "changed_in_place" else 16
    batches = [_batch(rows, 2), _batch(rows, 3)]
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        second = _trains_like_eager(make, options, batches)
    stale = [w for w in seen if "graph cache disagrees with eager" in str(w.message)]
    # a key that sees the change misses; one that does not is caught by the check
    assert second.cache_hits == len(stale) and second.build_count == 1 + len(stale)
    assert second.segments is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the entry was replaced: a hit that checks out
        third = _trains_like_eager(make, options, batches[:1])
    assert third.cache_hits == 1 and third.build_count == 1


class Logits(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.lin = torch.nn.Linear(8, 4)

    def forward(self, x, y):
        return self.lin(x)


def test_a_loss_module_made_outside_the_model_with_other_options_trains_like_eager(
    tmp_path, monkeypatch
):
    monkeypatch.setenv("ORTRAIN_GRAPH_CACHE", "1")
    options = TrainerOptions(graph_cache=str(tmp_path))
    for smoothing in (0.0, 0.3):  # the second run meets the first's entry, or misses it
        crit = torch.nn.CrossEntropyLoss(label_smoothing=smoothing)
        model, ref = Logits(), Logits()
        trainer = ORTTrainer(
            model,
            torch.optim.SGD(model.parameters(), lr=0.1),
            options,
            loss_fn=lambda out, batch, c=crit: c(out, batch["y"]),
        )
        opt = torch.optim.SGD(ref.parameters(), lr=0.1)
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            for seed in (2, 3):
                x, y = _batch(16, seed)
                opt.zero_grad()
                want = crit(ref(x, y), y)
                want.backward()
                opt.step()
                got = trainer.train_step(x, y)
                torch.testing.assert_close(got, want.detach(), rtol=1e-5, atol=0)
        stale = [w for w in seen if "graph cache disagrees" in str(w.message)]
        # a key that sees the options misses; one that does not is caught by the check
        assert trainer.cache_hits == len(stale) and trainer.segments is None
