"""Training steps keep the modes a user gives sub-modules (``verify.in_mode``,
``ProgramContext.modes_changed``): a BatchNorm frozen in evaluation mode normalizes with
its running statistics and leaves them, a Dropout in evaluation mode drops nothing, as in
eager; switching a sub-module's mode between steps builds the graph again."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn.functional as F

from ortrain import ORTTrainer, TrainerOptions


class _Net(torch.nn.Module):
    def __init__(self, segmented: bool = False):
        super().__init__()
        torch.manual_seed(0)
        self.conv = torch.nn.Conv2d(3, 8, 3)
        self.bn = torch.nn.BatchNorm2d(8)
        self.drop = torch.nn.Dropout(0.5)
        self.head = torch.nn.Linear(8, 3)
        self.segmented = segmented
        with torch.no_grad():
            self.bn.running_mean.uniform_(-0.5, 0.5)
            self.bn.running_var.uniform_(0.5, 2.0)

    def forward(self, x, y):
        h = F.relu(self.bn(self.conv(x))).mean((2, 3))
        if self.segmented:  # a data-dependent shape: no whole graph
            h = h[h.sum(-1) > -1e9]
        return F.cross_entropy(self.head(self.drop(h)), y)


def _batches(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(3)
    return [
        (torch.randn(4, 3, 8, 8, generator=g), torch.randint(0, 3, (4,), generator=g))
        for _ in range(n)
    ]


@pytest.mark.parametrize("segmented", [False, True], ids=["whole", "segments"])
def test_frozen_batch_norm_and_dropout_train_like_eager_and_may_thaw(segmented: bool) -> None:
    model = _Net(segmented)
    model.train()
    model.bn.eval()
    model.drop.eval()
    ref = copy.deepcopy(model)
    trainer = ORTTrainer(model, torch.optim.SGD(model.parameters(), lr=0.1), TrainerOptions())
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for i, (x, y) in enumerate(_batches(6)):
        if i == 3:  # thaw the BatchNorm: batch statistics from now on, and they move
            model.bn.train()
            ref.bn.train()
        opt.zero_grad()
        want = ref(x, y)
        want.backward()
        opt.step()
        got = trainer.train_step(x, y)
        torch.testing.assert_close(got, want.detach(), rtol=1e-5, atol=0, msg=f"step {i}")
    trainer.sync_to_module()
    for (k, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=k)
    for k in ("running_mean", "running_var"):  # frozen for 3 steps, then updated 3 times
        torch.testing.assert_close(getattr(model.bn, k), getattr(ref.bn, k), rtol=1e-5, atol=1e-6)
    assert not model.drop.training and model.bn.training  # the user's modes, untouched
    assert (trainer.segments is not None) == segmented


@pytest.mark.parametrize("segmented", [False, True], ids=["whole", "segments"])
def test_a_model_in_evaluation_mode_trains_as_eager_does_in_it(segmented: bool) -> None:
    """``model.eval()`` before training (to turn dropout off, or a model as
    ``from_pretrained`` returns it): eager trains it with dropout off and BatchNorm on its
    running statistics, which stay; so does ortrain, with one warning that says so.
    ``model.train()`` later builds again, in the user's modes (the Dropout kept in eval);
    ``model.eval()`` after that (an evaluation, then no ``model.train()``) builds again and
    says so."""
    model = _Net(segmented)
    model.eval()
    ref = copy.deepcopy(model)
    stats = [model.bn.running_mean.clone(), model.bn.running_var.clone()]
    trainer = ORTTrainer(model, torch.optim.SGD(model.parameters(), lr=0.1), TrainerOptions())
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    builds = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for i, (x, y) in enumerate(_batches(8)):
            if i == 3:  # training mode from here, the Dropout left in evaluation mode
                for m in (model, ref):
                    m.train()
                    m.drop.eval()
            if i == 6:  # evaluation mode again for the last two steps
                for m in (model, ref):
                    m.eval()
                later = [model.bn.running_mean.clone(), model.bn.running_var.clone()]
            opt.zero_grad()
            want = ref(x, y)
            want.backward()
            opt.step()
            got = trainer.train_step(x, y)
            torch.testing.assert_close(got, want.detach(), rtol=1e-5, atol=0, msg=f"step {i}")
            builds.append(trainer.build_count)
            if i == 2:  # three steps in evaluation mode: the running statistics untouched
                torch.testing.assert_close(model.bn.running_mean, stats[0], rtol=0, atol=0)
                torch.testing.assert_close(model.bn.running_var, stats[1], rtol=0, atol=0)
    said = [w for w in caught if "evaluation mode" in str(w.message)]
    assert len(said) == 2, [str(w.message) for w in caught]
    assert all(w.filename == __file__ and "dropout off" in str(w.message) for w in said)
    assert "is in evaluation mode" in str(said[0].message)
    assert "went into evaluation mode" in str(said[1].message)
    trainer.sync_to_module()
    for (k, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=k)
    for k in ("running_mean", "running_var"):  # updated by steps 4 to 6 only
        torch.testing.assert_close(getattr(model.bn, k), getattr(ref.bn, k), rtol=1e-5, atol=1e-6)
    assert not torch.equal(model.bn.running_mean, stats[0])
    torch.testing.assert_close(model.bn.running_mean, later[0], rtol=0, atol=0)  # the last two
    torch.testing.assert_close(model.bn.running_var, later[1], rtol=0, atol=0)
    assert not model.training and not model.drop.training  # the user's modes, untouched
    assert (trainer.segments is not None) == segmented
    if not segmented:  # a graph in evaluation mode, one after model.train(), one after eval()
        assert builds == [1, 1, 1, 2, 2, 2, 3, 3]


def test_a_transformers_model_in_evaluation_mode_trains_as_eager_does_in_it() -> None:
    """GPT-2 with its config's dropout (0.1 in three places) put in evaluation mode, as a
    user does to compare runs or as ``from_pretrained`` leaves it: AdamW steps and an
    evaluation as eager's, no dropout drawn."""
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(
        vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2, use_cache=True
    )
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config).eval()
    ref = copy.deepcopy(model)
    trainer = ORTTrainer(model, torch.optim.AdamW(model.parameters(), lr=1e-3), TrainerOptions())
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(5)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for i in range(4):
            ids = torch.randint(0, 64, (2, 12), generator=g)
            opt.zero_grad()
            want = ref(input_ids=ids, labels=ids).loss
            want.backward()
            opt.step()
            got = trainer.train_step(input_ids=ids, labels=ids)
            torch.testing.assert_close(got, want.detach(), rtol=1e-5, atol=0, msg=f"step {i}")
        assert trainer.build_count == 1 and trainer.segments is None  # one training graph
        out = trainer.eval_step(input_ids=ids, labels=ids)
    with torch.no_grad():
        torch.testing.assert_close(out.loss, ref(input_ids=ids, labels=ids).loss, rtol=1e-5, atol=0)
    assert trainer.build_count == 2  # and an eval graph
    assert not model.training


def test_a_new_sub_module_in_another_mode_builds_once_and_a_flip_after_it_again() -> None:
    """Modes are watched by each module's flag between steps (no names made while none
    moves): a sub-module put in anew in another mode than the one it replaces is one
    structure change (one build, with its mode), not a structure change and then a mode
    change; freezing another afterwards builds again. Every step as eager's."""
    model = _Net()
    model.drop.eval()
    ref = copy.deepcopy(model)
    trainer = ORTTrainer(model, torch.optim.SGD(model.parameters(), lr=0.1), TrainerOptions())
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    builds = []
    for i, (x, y) in enumerate(_batches(7)):
        if i == 2:  # a Dropout in training mode that drops nothing, for one in evaluation
            model.drop = torch.nn.Dropout(0.0)
            ref.drop = torch.nn.Dropout(0.0)
        if i == 5:  # the BatchNorm frozen
            model.bn.eval()
            ref.bn.eval()
        opt.zero_grad()
        want = ref(x, y)
        want.backward()
        opt.step()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            got = trainer.train_step(x, y)
        torch.testing.assert_close(got, want.detach(), rtol=1e-5, atol=0, msg=f"step {i}")
        builds.append(trainer.build_count)
    # built at step 0, again at the new module (step 2), again at the freeze (step 5)
    assert builds == [1, 1, 2, 2, 2, 3, 3]


def test_the_cache_is_off_in_every_config_while_segments_run() -> None:
    """``no_kv_cache``: every distinct config of the model's sub-modules (T5's decoder keeps
    a copy of its own) asks for no cache inside and for it again after; a read-only
    config of the user's is left as it is."""
    import dataclasses

    from ortrain.verify import no_kv_cache

    @dataclasses.dataclass(frozen=True)
    class Frozen:
        use_cache: bool = True

    @dataclasses.dataclass
    class Plain:
        use_cache: bool = True

    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))
    shared, own, frozen = Plain(), Plain(), Frozen()
    model.config = shared  # type: ignore[assignment]
    model[0].config = shared  # type: ignore[assignment]
    model[1].config = own  # type: ignore[assignment]
    model[2].config = frozen  # type: ignore[assignment]
    with no_kv_cache(model):
        assert (shared.use_cache, own.use_cache, frozen.use_cache) == (False, False, True)
    assert (shared.use_cache, own.use_cache, frozen.use_cache) == (True, True, True)
