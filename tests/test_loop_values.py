"""Python values the forward reads that the training loop changes between steps (a
temperature annealed through a module attribute, a config object or a module-level
global; a weight read by ``loss_fn``), and tensors a forward keeps for its next call (a
truncated-BPTT hidden state in a plain attribute or in a buffer assigned anew), train as
in eager. The graphs had held the values their export saw: the loss stayed at the first
step's temperature, the hidden state at zeros, with no warning.

A value changed once builds the graphs again (and they stay compiled); one changed at a
second step makes the modules whose code reads it run in eager PyTorch."""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from ortrain import ORTTrainer, TrainerOptions
from ortrain.core.errors import UnsupportedOptimizerError

pytestmark = pytest.mark.shared_graphs  # many trainers of the same few models

SCHEDULE = {"tau": 1.0}  # a module-level setting the loop anneals
BETA = 1.0  # a module-level float read by the loss


class _Cfg:
    def __init__(self, nested: bool = True) -> None:
        self.tau = 1.0
        if nested:  # a sub-config (a multimodal model's text_config)
            self.sub = _Cfg(nested=False)


class _Annealed(nn.Module):
    """Logits divided by a temperature read from ``where``."""

    def __init__(self, where: str) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(8, 16), nn.Tanh())
        self.head = nn.Linear(16, 4)
        self.where, self.tau, self.cfg = where, 1.0, _Cfg()

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        if self.where == "attribute":
            tau = self.tau
        elif self.where == "config":
            tau = self.cfg.tau
        elif self.where == "nested config":
            tau = self.cfg.sub.tau
        else:
            tau = SCHEDULE["tau"] if self.where == "global dict" else _tau()
        return F.cross_entropy(self.head(self.body(x)) / tau, y)


_TAU = [1.0]


def _tau() -> float:
    return TAU_NOW  # a global float, read through a helper function


TAU_NOW = 1.0


def _set(model: nn.Module, tau: float) -> None:
    global TAU_NOW
    model.tau = tau
    model.cfg.tau = tau
    model.cfg.sub.tau = tau
    SCHEDULE["tau"] = tau
    TAU_NOW = tau


def _batches(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(3)
    return [
        (torch.randn(8, 8, generator=g), torch.randint(0, 4, (8,), generator=g)) for _ in range(n)
    ]


def _train(
    model: nn.Module, taus: list[float], trainer: bool, **kw
) -> tuple[list[float], nn.Module]:
    opt = torch.optim.SGD(model.parameters(), lr=0.3)
    tr = (
        ORTTrainer(model, opt, options=TrainerOptions(build_progress=False), **kw)
        if trainer
        else None
    )
    losses = []
    for tau, (x, y) in zip(taus, _batches(len(taus)), strict=True):
        _set(model, tau)
        if tr is not None:
            losses.append(tr.train_step(x=x, y=y).item())
        else:
            opt.zero_grad()
            loss = model(x, y)
            loss.backward()
            opt.step()
            losses.append(loss.item())
    if tr is not None:
        tr.sync_to_module()
    return losses, model


def _assert_like_eager(got: tuple[list[float], nn.Module], want: tuple[list[float], nn.Module]):
    torch.testing.assert_close(torch.tensor(got[0]), torch.tensor(want[0]), rtol=1e-5, atol=0)
    for (n, p), q in zip(got[1].named_parameters(), want[1].parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=lambda m, n=n: f"{n}: {m}")


@pytest.mark.parametrize(
    "where", ["attribute", "config", "nested config", "global dict", "global float"]
)
def test_a_temperature_annealed_by_the_loop_trains_like_eager(where):
    torch.manual_seed(0)
    model = _Annealed(where)
    ref = copy.deepcopy(model)
    taus = [1.0, 0.5, 0.25, 0.125]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = _train(model, taus, trainer=True)
    _assert_like_eager(got, _train(ref, taus, trainer=False))
    _set(model, 1.0)
    said = [str(w.message) for w in caught if "changes Python values" in str(w.message)]
    assert len(said) == 1 and "0.5 -> 0.25" in said[0], said


def test_a_value_changed_once_keeps_the_model_compiled():
    """A setting changed once (at step 3): the graph is built again with it, and the
    model stays one graph."""
    torch.manual_seed(0)
    model, ref = _Annealed("attribute"), None
    ref = copy.deepcopy(model)
    taus = [1.0, 1.0, 0.5, 0.5, 0.5]
    opt = torch.optim.SGD(model.parameters(), lr=0.3)
    tr = ORTTrainer(model, opt, options=TrainerOptions(build_progress=False))
    losses = []
    for tau, (x, y) in zip(taus, _batches(len(taus)), strict=True):
        _set(model, tau)
        losses.append(tr.train_step(x=x, y=y).item())
    tr.sync_to_module()
    assert tr.segments is None and tr.build_count == 2
    _assert_like_eager((losses, model), _train(ref, taus, trainer=False))
    _set(model, 1.0)


def _weighted(out: torch.Tensor, batch: dict) -> torch.Tensor:
    return out * BETA


class _Plain(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x).pow(2).mean()


def test_a_weight_the_loss_fn_reads_follows_the_loop():
    global BETA
    torch.manual_seed(0)
    model = _Plain()
    ref = copy.deepcopy(model)
    tr = ORTTrainer(
        model,
        torch.optim.SGD(model.parameters(), lr=0.2),
        loss_fn=_weighted,
        options=TrainerOptions(build_progress=False),
    )
    opt = torch.optim.SGD(ref.parameters(), lr=0.2)
    g = torch.Generator().manual_seed(1)
    try:
        for beta in (1.0, 2.0, 0.5, 3.0):
            BETA = beta
            x = torch.randn(4, 6, generator=g)
            got = tr.train_step(x=x).item()
            opt.zero_grad()
            want = _weighted(ref(x), {})
            want.backward()
            opt.step()
            assert got == pytest.approx(want.item(), rel=1e-5), beta
    finally:
        BETA = 1.0


class _Carried(nn.Module):
    """Truncated BPTT: the last hidden state is kept for the next call."""

    def __init__(self, as_buffer: bool) -> None:
        super().__init__()
        self.rnn = nn.GRU(3, 5, batch_first=True)
        self.head = nn.Linear(5, 1)
        if as_buffer:
            self.register_buffer("h", torch.zeros(1, 2, 5))
        else:
            self.h = torch.zeros(1, 2, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, hn = self.rnn(x, self.h)
        self.h = hn.detach()
        return self.head(out).pow(2).mean()


@pytest.mark.parametrize("as_buffer", [False, True], ids=["attribute", "buffer"])
def test_a_hidden_state_carried_to_the_next_step_trains_like_eager(as_buffer):
    torch.manual_seed(0)
    model = _Carried(as_buffer)
    ref = copy.deepcopy(model)
    tr = ORTTrainer(
        model,
        torch.optim.SGD(model.parameters(), lr=0.3),
        options=TrainerOptions(build_progress=False),
    )
    opt = torch.optim.SGD(ref.parameters(), lr=0.3)
    g = torch.Generator().manual_seed(2)
    for _ in range(4):
        x = torch.randn(2, 6, 3, generator=g)
        got = tr.train_step(x=x).item()
        opt.zero_grad()
        want = ref(x)
        want.backward()
        opt.step()
        assert got == pytest.approx(want.item(), rel=1e-5)
    tr.sync_to_module()
    torch.testing.assert_close(model.h, ref.h, rtol=1e-5, atol=1e-6)
    for p, q in zip(model.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
    assert tr.segments is not None  # the module carrying it runs in eager


# --------------------------------------------------------------------------- the optimizer
def _small_trainer(opt: torch.optim.Optimizer, model: nn.Module) -> ORTTrainer:
    return ORTTrainer(model, opt, options=TrainerOptions(build_progress=False))


@pytest.mark.parametrize(
    "make, change, told",
    [
        (lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9), ("nesterov", True), "nesterov"),
        (lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9), ("momentum", 0.0), "momentum"),
        (lambda ps: torch.optim.SGD(ps, lr=0.1), ("maximize", True), "maximize=True"),
        (lambda ps: torch.optim.Adam(ps, lr=0.1), ("decoupled_weight_decay", True), "decoupled"),
        (lambda ps: torch.optim.AdamW(ps, lr=0.1), ("amsgrad", True), "amsgrad=True"),
    ],
    ids=["nesterov", "momentum-off", "maximize", "decoupled", "amsgrad"],
)
def test_an_update_flag_changed_mid_run_is_refused_before_the_step(make, change, told):
    """The compiled update does what the flags selected when it was laid out: a flag the
    loop flips later (eager honours it at once) stops the step, nothing of it run."""
    torch.manual_seed(0)
    model = _Plain()
    opt = make(model.parameters())
    trainer = _small_trainer(opt, model)
    x = torch.randn(4, 6)
    for _ in range(2):
        trainer.train_step(x=x)
    before = {n: p.detach().clone() for n, p in trainer.params.items()}
    opt.param_groups[0][change[0]] = change[1]
    with pytest.raises(UnsupportedOptimizerError, match="param group 0") as info:
        trainer.train_step(x=x)
    assert told in str(info.value) and "after the ORTTrainer was made" in str(info.value)
    for n, p in trainer.params.items():
        torch.testing.assert_close(p, before[n], rtol=0, atol=0)


def test_a_param_group_added_mid_run_is_refused():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 6), nn.Linear(6, 1))
    model[1].requires_grad_(True)
    opt = torch.optim.AdamW(model[0].parameters(), lr=0.1)
    trainer = ORTTrainer(
        model,
        opt,
        loss_fn=lambda out, batch: out.pow(2).mean(),
        options=TrainerOptions(build_progress=False),
    )
    x = torch.randn(4, 6)
    trainer.train_step(x)
    opt.add_param_group({"params": list(model[1].parameters()), "lr": 0.01})
    with pytest.raises(UnsupportedOptimizerError, match="2 param groups, 1 when"):
        trainer.train_step(x)


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(6, 8)
        self.b = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self.b(torch.tanh(self.a(x))), y)


def _pair(make):
    torch.manual_seed(0)
    model = _Net()
    ref = copy.deepcopy(model)
    opt, ref_opt = make(model.parameters()), make(ref.parameters())
    return model, opt, _small_trainer(opt, model), ref, ref_opt


def _eager_step(model, opt, x, y) -> float:
    opt.zero_grad()
    loss = model(x, y)
    loss.backward()
    opt.step()
    return loss.item()


def _assert_states_close(got: dict, want: dict) -> None:
    assert got["param_groups"] == want["param_groups"]
    assert sorted(got["state"]) == sorted(want["state"])
    for i, entry in want["state"].items():
        assert sorted(got["state"][i]) == sorted(entry), i
        for k, t in entry.items():
            torch.testing.assert_close(
                torch.as_tensor(got["state"][i][k]).float(), torch.as_tensor(t).float(),
                rtol=1e-5, atol=1e-7, msg=lambda m, i=i, k=k: f"state {i} {k}: {m}",
            )  # fmt: skip


@pytest.mark.parametrize(
    "make",
    [
        lambda ps: torch.optim.AdamW(ps, lr=0.05, weight_decay=0.1),
        lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, nesterov=True),
    ],
    ids=["adamw", "sgd-nesterov"],
)
def test_the_optimizer_s_state_dict_is_the_state_ortrain_trains_with(make):
    """``optimizer.state_dict()`` after ortrain's steps is eager's after the same steps
    (it was empty: a loop that checkpoints it saved no moments); loading an earlier one
    mid-run goes on as eager does from it, and so does a fresh optimizer's (no state)."""
    model, opt, trainer, ref, ref_opt = _pair(make)
    g = torch.Generator().manual_seed(5)
    batches = [
        (torch.randn(5, 6, generator=g), torch.randint(0, 3, (5,), generator=g)) for _ in range(7)
    ]
    assert opt.state_dict()["state"] == {} == ref_opt.state_dict()["state"]
    for x, y in batches[:2]:
        trainer.train_step(x=x, y=y)
        _eager_step(ref, ref_opt, x, y)
    early = copy.deepcopy(ref_opt.state_dict())
    for x, y in batches[2:4]:
        trainer.train_step(x=x, y=y)
        _eager_step(ref, ref_opt, x, y)
    _assert_states_close(opt.state_dict(), ref_opt.state_dict())
    assert opt.state == {}  # ortrain's state is the one: no second copy
    fresh = make([torch.nn.Parameter(p.detach().clone()) for p in ref.parameters()])
    for loaded in (early, fresh.state_dict()):
        opt.load_state_dict(copy.deepcopy(loaded))
        ref_opt.load_state_dict(copy.deepcopy(loaded))
        for x, y in batches[4:6]:
            got = trainer.train_step(x=x, y=y).item()
            assert got == pytest.approx(_eager_step(ref, ref_opt, x, y), rel=1e-5)
        _assert_states_close(opt.state_dict(), ref_opt.state_dict())
    trainer.sync_to_module()
    for p, q in zip(model.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


def test_an_evaluation_after_a_change_reads_the_new_value():
    torch.manual_seed(0)
    model = _Annealed("attribute")
    trainer = ORTTrainer(
        model,
        torch.optim.SGD(model.parameters(), lr=0.3),
        options=TrainerOptions(build_progress=False),
    )
    (x, y), (ex, ey) = _batches(2)
    trainer.train_step(x=x, y=y)
    trainer.eval_step(x=ex, y=ey)  # an evaluation graph at tau 1
    for tau in (0.5, 0.2):
        _set(model, tau)
        got = trainer.eval_step(x=ex, y=ey).loss.item()
        trainer.sync_to_module()
        model.eval()
        with torch.no_grad():
            want = model(ex, ey).item()
        model.train()
        assert got == pytest.approx(want, rel=1e-5), tau
    _set(model, 1.0)


def test_a_parameter_in_no_param_group_stays_and_the_rest_compiles():
    """A layer that requires grad but is in no param group: eager computes its gradient
    and never updates it. The model compiles whole (it had fallen back to segments on a
    first step said to disagree: "only eager has it") and trains like eager."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 1))
    ref = copy.deepcopy(model)
    trainer = ORTTrainer(
        model,
        torch.optim.SGD(model[0].parameters(), lr=0.1),
        loss_fn=lambda out, batch: out.pow(2).mean(),
        options=TrainerOptions(build_progress=False),
    )
    opt = torch.optim.SGD(ref[0].parameters(), lr=0.1)
    g = torch.Generator().manual_seed(4)
    for _ in range(3):
        x = torch.randn(4, 6, generator=g)
        got = trainer.train_step(x).item()
        opt.zero_grad()
        want = ref(x).pow(2).mean()
        want.backward()
        opt.step()
        assert got == pytest.approx(want.item(), rel=1e-5)
    assert trainer.segments is None
    trainer.sync_to_module()
    for p, q in zip(model.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


class _Watched(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(2, 2)
        self.tau = 1.0
        self.seen: list[int] = []
        self.weights = {"a": 1.0, "b": 0.5}
        self.many = [0.0] * 100
        self.huge = [0.0] * 5000
        self.cfg = type("Cfg", (), {})()
        self.cfg.scale = 2
        self.lin.state = torch.zeros(2)


def test_the_value_watch_sees_each_kind_of_change_and_no_false_one():
    """``ValueWatch`` answers from object identity when nothing was assigned: each kind of
    change is still seen (a scalar, a list grown in place, a config's field, a tensor
    attribute assigned anew, a module-level value), and an equal value assigned anew is no
    change."""
    from ortrain.python_state import ValueWatch

    model = _Watched()
    watch = ValueWatch(model, None)
    assert watch.changes() == {}
    model.tau = float("1.0")  # an equal value, another object
    assert watch.changes() == {}
    model.tau = 0.5
    assert set(watch.changes()) == {("", "tau")}
    assert watch.changes() == {}
    model.seen.append(1)
    assert set(watch.changes()) == {("", "seen")}
    model.seen[0] = 2  # an item set in place: the same length
    assert set(watch.changes()) == {("", "seen")}
    model.weights["b"] = 0.25
    assert set(watch.changes()) == {("", "weights")}
    model.many[5] = 1.0  # beyond _CONTENT_ITEMS items: by a digest of them
    assert set(watch.changes()) == {("", "many")}
    assert watch.changes() == {}
    model.huge[5] = 1.0  # beyond _DIGEST_ITEMS: by length only
    assert watch.changes() == {}
    model.huge.append(0.0)
    assert set(watch.changes()) == {("", "huge")}
    model.cfg.scale = 3
    assert set(watch.changes()) == {("", "cfg.scale")}
    model.lin.state = torch.zeros(2)
    assert set(watch.changes()) == {("lin", "state")}
    model.lin.state.add_(1.0)  # in place: a constant of the graphs changed all the same
    assert set(watch.changes()) == {("lin", "state")}
    assert watch.changes() == {}
    model.lin.extra = 1  # a new attribute: no value the graphs read changed
    assert watch.changes() == {}
    model.lin.extra = 2
    assert set(watch.changes()) == {("lin", "extra")}
    assert watch.changes() == {}


_TABLE = torch.linspace(-1.0, 1.0, 4)  # a module-level tensor the loop updates in place


class _ReadsTable(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Linear(8, 4)
        self.head = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.body(x)) * _TABLE)


@pytest.mark.parametrize("where", ["discriminator in loss_fn", "global tensor"])
def test_a_tensor_the_model_does_not_own_changed_in_place_is_followed(where):
    """A GAN's generator trained with ``loss_fn`` reading the discriminator, which its own
    optimizer steps in place between the generator's steps; a module-level tensor the loop
    updates in place. Their values are constants of the graphs: they stayed at their first
    values (the generator trained against a frozen discriminator, silently). Their
    in-place versions are watched: the graphs are built again, then what reads them runs
    in eager, and the losses and parameters follow eager's."""
    table = _TABLE.clone()
    torch.manual_seed(1)
    disc = nn.Linear(4, 1)
    g = torch.Generator().manual_seed(5)
    batches = [(torch.randn(6, 8, generator=g), torch.randn(6, 4, generator=g)) for _ in range(4)]

    def loss_fn(out: torch.Tensor, batch: dict) -> torch.Tensor:
        if where == "discriminator in loss_fn":
            return F.softplus(-disc(out)).mean()
        return F.mse_loss(out, batch["y"])

    def run(trainer: bool) -> tuple[list[float], nn.Module]:
        _TABLE.copy_(table)
        torch.manual_seed(1)
        disc.load_state_dict(nn.Linear(4, 1).state_dict())
        d_opt = torch.optim.SGD(disc.parameters(), lr=0.5)
        model = _ReadsTable()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        tr = ORTTrainer(model, opt, TrainerOptions(build_progress=False), loss_fn=loss_fn)
        losses = []
        for x, y in batches:
            if trainer:
                losses.append(tr.train_step(x=x, y=y).item())
            else:
                opt.zero_grad()
                loss = loss_fn(model(x), {"y": y})
                loss.backward()
                opt.step()
                losses.append(loss.item())
            # the loop's other updates: the discriminator's step, the table's drift
            d_opt.zero_grad()
            F.softplus(disc(torch.randn(6, 4, generator=g)) - 1).mean().backward()
            d_opt.step()
            with torch.no_grad():
                _TABLE.mul_(0.5).add_(0.25)
        if trainer:
            tr.sync_to_module()
        return losses, model

    state = g.get_state()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = run(trainer=True)
    g.set_state(state)
    want = run(trainer=False)
    _assert_like_eager(got, want)
    said = [str(w.message) for w in caught if "changes Python values" in str(w.message)]
    assert said and "versions" in said[0], said


l = torch.zeros(())  # a script's loss variable, named as an attribute the forward reads


class _ReadsAttributeL(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.l = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self.l(x), y)


def test_an_attribute_named_like_a_global_is_no_global_read():
    """``self.l`` is an attribute, not the global ``l`` a script reassigns every step (its
    loss): the names read as globals are those loaded as globals, so the model stays one
    graph (it fell back to eager, for a value it never read)."""
    global l
    from ortrain.user_code import global_names

    assert global_names(_ReadsAttributeL.forward.__code__) == {"F"}
    model = _ReadsAttributeL()
    trainer = ORTTrainer(model, torch.optim.SGD(model.parameters(), lr=0.1))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for x, y in _batches(3):
            l = trainer.train_step(x, y)
    assert not [w for w in caught if "changes Python values" in str(w.message)]
    assert trainer.segments is None


class _TwoLayers(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.l1, self.l2 = nn.Linear(6, 8), nn.Linear(8, 1)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(self.l2(torch.tanh(self.l1(x))).squeeze(-1), y)


@pytest.mark.parametrize("plan", ["OOEE", "EEOO", "OEOE", "*EEOO", "*OOOO"])
@pytest.mark.parametrize(
    "make",
    [lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9), lambda p: torch.optim.Adam(p, lr=0.05)],
    ids=["sgd-momentum", "adam"],
)
def test_a_run_handed_between_eager_and_ortrain_keeps_the_optimizer_state(make, plan):
    """Steps of ortrain (O) and of eager PyTorch (E) on one torch optimizer, handed over
    with ``sync_to_module()`` (as a loop that evaluates or saves in eager does): the
    moments and step count go with the run. Before, eager steps after ortrain's started
    from the moments as they were before ortrain (2 steps behind), and a trainer made over
    an optimizer eager had stepped started from none; ``*``: the trainer is made before
    the first step, so eager's steps come between it and its first (they were lost)."""
    g = torch.Generator().manual_seed(17)
    batches = [(torch.randn(4, 6, generator=g), torch.randn(4, generator=g)) for _ in range(4)]

    def run(plan: str) -> tuple[list[float], nn.Module]:
        model = _TwoLayers()
        opt, trainer, losses = make(model.parameters()), None, []
        if plan.startswith("*"):
            trainer = ORTTrainer(model, opt, TrainerOptions(build_progress=False))
        for who, b in zip(plan.lstrip("*"), batches, strict=True):
            if who == "O":
                trainer = trainer or ORTTrainer(model, opt, TrainerOptions(build_progress=False))
                losses.append(trainer.train_step(*b).item())
                continue
            if trainer is not None:
                trainer.sync_to_module()
            opt.zero_grad()
            loss = model(*b)
            loss.backward()
            opt.step()
            losses.append(loss.item())
        if trainer is not None:
            trainer.sync_to_module()
        return losses, model

    _assert_like_eager(run(plan), run("EEEE"))


class _Centered(nn.Module):
    """DINO's centering: a plain tensor attribute (not a buffer) the forward moves in
    place toward the batch's mean."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.l = nn.Linear(8, 4)
        self.center = torch.zeros(4)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        out = self.l(x)
        with torch.no_grad():
            self.center.mul_(0.9).add_(out.mean(0), alpha=0.1)
        return F.cross_entropy(out - self.center, y)


def test_a_tensor_attribute_the_forward_moves_in_place_trains_like_eager():
    """The module runs in eager (a graph cannot move it); ortrain's own eager runs (the
    recording forward, the first step's check) moved it too, so even step 0 differed:
    their in-place changes are put back."""
    model, ref = _Centered(), _Centered()
    got = _train_plain(model, trainer=True)
    want = _train_plain(ref, trainer=False)
    _assert_like_eager(got, want)
    torch.testing.assert_close(model.center, ref.center, rtol=1e-5, atol=1e-7)


def _train_plain(model: nn.Module, trainer: bool) -> tuple[list[float], nn.Module]:
    opt = torch.optim.SGD(model.parameters(), lr=0.3)
    tr = ORTTrainer(model, opt, TrainerOptions(build_progress=False)) if trainer else None
    losses = []
    for x, y in _batches(4):
        if tr is not None:
            losses.append(tr.train_step(x, y).item())
            continue
        opt.zero_grad()
        loss = model(x, y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    if tr is not None:
        tr.sync_to_module()
    return losses, model


def _taken_from_a_base() -> nn.Module:
    """A model made of some of a base model's layers, the base in its class's closure
    (one unused layer left in it): the base's BatchNorm statistics move with every step,
    as the model's own."""
    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 8))

    class Taken(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.body = nn.Sequential(base[0], base[1])
            self.head = nn.Linear(8, 2)

        def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            return F.cross_entropy(self.head(self.body(x)), y)

    return Taken()


def test_a_base_model_in_a_closure_is_no_value_the_loop_changes():
    """Its tensors that the model owns change through the model's own steps; only the
    others (the unused layer) are watched. Before, the statistics' updates counted as the
    base changing between calls: the model ran in eager (fallback "off": an error)."""
    g = torch.Generator().manual_seed(1)
    batches = [
        (torch.randn(6, 4, generator=g), torch.randint(0, 2, (6,), generator=g)) for _ in range(3)
    ]
    model, ref = _taken_from_a_base(), _taken_from_a_base()
    opt, opt_ref = (torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, ref))
    trainer = ORTTrainer(model, opt, TrainerOptions(fallback="off"))
    for x, y in batches:
        want = ref(x, y)
        want.backward()
        opt_ref.step()
        opt_ref.zero_grad()
        torch.testing.assert_close(trainer.train_step(x, y), want.detach(), rtol=1e-5, atol=0)
    assert trainer.segments is None and trainer.build_count == 1


_SCALE = [1.0]  # a module-level list whose item the loop sets
_WEIGHTS = {"aux": 1.0}


class _ReadsInPlace(nn.Module):
    """A loss weight read from a container whose item the loop sets in place, or from a
    closure of a forward set on the instance."""

    def __init__(self, where: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Sequential(nn.Linear(8, 16), nn.Tanh())
        self.head = nn.Linear(16, 4)
        self.where, self.mix = where, {"aux": 1.0}
        self.table = [1.0] * 200  # a schedule table: past the items compared one by one
        if where == "instance forward":
            weight = [1.0]
            self.set_weight = lambda w: weight.__setitem__(0, w)

            def forward(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
                return self._loss(x, y, weight[0])

            self.forward = forward  # type: ignore[method-assign]

    def _loss(self, x: torch.Tensor, y: torch.Tensor, w: float) -> torch.Tensor:
        h = self.body(x)
        return F.cross_entropy(self.head(h), y) + w * h.pow(2).mean()

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        if self.where == "global list":
            w = _SCALE[0]
        elif self.where == "global dict":
            w = _WEIGHTS["aux"]
        elif self.where == "long list":
            w = self.table[7]
        else:
            w = self.mix["aux"]
        return self._loss(x, y, w)


def _set_in_place(model: nn.Module, w: float) -> None:
    _SCALE[0] = w
    _WEIGHTS["aux"] = w
    model.mix["aux"] = w
    model.table[7] = w
    if model.where == "instance forward":
        model.set_weight(w)


@pytest.mark.parametrize(
    "where", ["global list", "global dict", "attribute dict", "long list", "instance forward"]
)
def test_a_value_set_in_place_or_in_a_closure_trains_like_eager(where):
    """Only the place the forward reads changes (no attribute beside it: the model's
    other code stays compiled). Before, containers were compared by length and a forward
    set on the instance was not read: the graphs trained with the first weight, silently."""
    runs = []
    for trainer in (True, False):
        model = _ReadsInPlace(where)
        opt = torch.optim.SGD(model.parameters(), lr=0.2)
        tr = ORTTrainer(model, opt, TrainerOptions(build_progress=False)) if trainer else None
        losses = []
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for w, (x, y) in zip([1.0, 0.5, 2.0, 0.1], _batches(4), strict=True):
                _set_in_place(model, w)
                if tr is not None:
                    losses.append(tr.train_step(x, y).item())
                else:
                    opt.zero_grad()
                    loss = model(x, y)
                    loss.backward()
                    opt.step()
                    losses.append(loss.item())
        runs.append((losses, model))
    _set_in_place(runs[0][1], 1.0)
    _assert_like_eager(runs[0], runs[1])


class _Focal(nn.Module):
    """A loss module whose ``gamma`` the loop anneals."""

    def __init__(self) -> None:
        super().__init__()
        self.gamma = 0.0

    def forward(self, logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        logp = torch.log_softmax(logits, -1).gather(1, y[:, None]).squeeze(1)
        return (-((1 - logp.exp()) ** self.gamma) * logp).mean()


class _FocalOnBatch(_Focal):
    def forward(self, logits: torch.Tensor, batch: dict) -> torch.Tensor:  # type: ignore[override]
        return super().forward(logits, batch["y"])


class _Knobs:
    gamma = 0.0


def _loss_fns(where: str) -> tuple[object, Callable[[float], None]]:
    """``loss_fn`` reading an annealed ``gamma``, and what sets it."""
    if where == "module as loss_fn":
        crit = _FocalOnBatch()
        return crit, lambda g: setattr(crit, "gamma", g)
    crit, knobs = _Focal(), _Knobs()
    if where == "module in a closure":
        return (lambda out, b: crit(out, b["y"])), lambda g: setattr(crit, "gamma", g)
    if where == "module as a default":
        return (lambda out, b, c=crit: c(out, b["y"])), lambda g: setattr(crit, "gamma", g)

    def loss(out: torch.Tensor, b: dict) -> torch.Tensor:  # a plain object's field
        crit.gamma = knobs.gamma
        return crit(out, b["y"])

    return loss, lambda g: setattr(knobs, "gamma", g)


@pytest.mark.parametrize(
    "where",
    ["module in a closure", "module as a default", "module as loss_fn", "object in a closure"],
)
def test_a_loss_module_s_setting_annealed_by_the_loop_trains_like_eager(where):
    """A focal loss's gamma set by the loop: before, only the tensors of a module
    ``loss_fn`` reads were followed, and the graphs trained at the first gamma, silently."""
    runs = []
    for trainer in (True, False):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
        loss_fn, set_gamma = _loss_fns(where)
        opt = torch.optim.SGD(model.parameters(), lr=0.2)
        opts = TrainerOptions(build_progress=False)
        tr = ORTTrainer(model, opt, opts, loss_fn=loss_fn) if trainer else None  # type: ignore[arg-type]
        losses = []
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for g, (x, y) in zip([0.0, 1.0, 2.0, 0.5], _batches(4), strict=True):
                set_gamma(g)
                if tr is not None:
                    losses.append(tr.train_step(x, y=y).item())
                else:
                    opt.zero_grad()
                    loss = loss_fn(model(x), {"y": y})  # type: ignore[operator]
                    loss.backward()
                    opt.step()
                    losses.append(loss.item())
        runs.append((losses, model))
    _assert_like_eager(runs[0], runs[1])
