"""Each graph timed against eager on its first steps, the faster kept
(``TrainerOptions.eager_if_faster``): every step equal to eager PyTorch's whichever ran it,
the trial's schedule fixed, the choice following the times."""

from __future__ import annotations

import copy

import pytest
import torch

from ortrain import ORTTrainer, TrainerOptions, explain
from ortrain.first_step import EagerTimes
from ortrain.speed_trial import (
    FORWARD_SHARE,
    GATE,
    GATE_STEPS,
    MARGIN,
    ROUNDS,
    SpeedTrial,
    Trial,
    faster,
)

LOSS_RTOL = 1e-5
# a trial's routes: the graph's checked first step, then alternating from the graph's
# first timed step, each route's first step untimed (the eager one runs twice in a row)
TRIAL = ["graph", "graph", "eager"] + ["eager", "graph"] * (ROUNDS - 1) + ["eager"]


class _ConvNet(torch.nn.Module):
    """Convolutions, BatchNorm (running statistics updated by every step) and a loss."""

    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 8, 3, padding=1, bias=False)  # (BatchNorm follows)
        self.norm = torch.nn.BatchNorm2d(8)
        self.head = torch.nn.Linear(8, 5)

    def forward(self, x, y):
        h = torch.relu(self.norm(self.conv(x))).mean(dim=(2, 3))
        return torch.nn.functional.cross_entropy(self.head(h), y, label_smoothing=0.1)


def _batches(n: int, rows: int = 6) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(3)
    return [
        {
            "x": torch.randn(rows, 3, 10, 10, generator=g),
            "y": torch.randint(0, 5, (rows,), generator=g),
        }
        for _ in range(n)
    ]


def _eager_step(model, opt, batch, max_norm: float | None) -> float:
    opt.zero_grad()
    loss = model(**batch)
    loss.backward()
    if max_norm is not None:
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    opt.step()
    return float(loss.detach())


def _pinned(trainer: ORTTrainer, graph_s: float, eager_s: float) -> list[str]:
    """The trial's times replaced by fixed ones; returns the list each step's route is
    appended to."""
    trial = trainer._program.trial
    routes: list[str] = []
    real_run = trial.run

    def run(sig, route, step, batch):
        routes.append(route)
        return real_run(sig, route, step, batch)

    trial.run = run
    trial._seconds = lambda route, measured: graph_s if route == "graph" else eager_s
    return routes


@pytest.mark.parametrize("winner", ["eager", "graph"])
def test_trial_steps_and_chosen_route_train_like_eager(winner):
    """AdamW with weight decay and clipping over a CNN with BatchNorm: the trial alternates
    graph and eager after the graph's checked first step, then every step takes the winner;
    each step's loss, the final parameters, buffers and AdamW's moments equal eager's."""
    torch.manual_seed(0)
    base = _ConvNet()
    ref = copy.deepcopy(base)
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
    opt = torch.optim.AdamW(base.parameters(), lr=1e-2, weight_decay=0.1)
    trainer = ORTTrainer(base, opt, TrainerOptions(eager_if_faster=True, max_grad_norm=0.5))
    slow, fast = 2.0, 1.0
    routes = _pinned(trainer, *((slow, fast) if winner == "eager" else (fast, slow)))
    batches = _batches(10)
    for i, batch in enumerate(batches):
        loss = float(trainer.train_step(**batch))
        expected = _eager_step(ref, opt_ref, batch, max_norm=0.5)
        assert loss == pytest.approx(expected, rel=LOSS_RTOL), f"step {i} ({routes[i]})"
    assert routes == TRIAL + [winner] * (len(batches) - len(TRIAL))
    assert trainer.eager_steps == routes.count("eager")
    assert trainer.build_count == 1
    for (name, p), q in zip(base.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")
    for (name, b), c in zip(base.named_buffers(), ref.buffers()):
        torch.testing.assert_close(b, c, rtol=1e-5, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")
    state = trainer.state_dict()["optimizer"]["state"]
    for idx, p in enumerate(q for g in opt_ref.param_groups for q in g["params"]):
        for s in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(state[idx][s], opt_ref.state[p][s], rtol=1e-4, atol=1e-7)
    report = explain(trainer)
    where = "in eager" if winner == "eager" else "on the graph"
    graph_ms, eager_ms = (2000.0, 1000.0) if winner == "eager" else (1000.0, 2000.0)
    assert f"graph {graph_ms:.1f} ms, eager {eager_ms:.1f} ms a step: runs {where}" in report


def test_each_signature_has_its_own_trial():
    """A second batch shape gets its own graph, checked, then its own trial; the first
    shape's choice stands."""
    torch.manual_seed(0)
    base = _ConvNet()
    ref = copy.deepcopy(base)
    opt_ref = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9)
    opt = torch.optim.SGD(base.parameters(), lr=0.05, momentum=0.9)
    trainer = ORTTrainer(base, opt, TrainerOptions(eager_if_faster=True))
    trainer._program.deferred = None  # (the second shape built at once: its trial is tested)
    routes = _pinned(trainer, 2.0, 1.0)
    small, large = _batches(len(TRIAL) + 2, rows=4), _batches(len(TRIAL), rows=7)
    order = small[: len(TRIAL) - 1] + large + small[len(TRIAL) - 1 :]
    for i, batch in enumerate(order):
        loss = float(trainer.train_step(**batch))
        assert loss == pytest.approx(_eager_step(ref, opt_ref, batch, None), rel=LOSS_RTOL), i
    # the small shape's trial waits through the large one's (its last step after it)
    small_trial = TRIAL[:-1]
    assert routes == small_trial + TRIAL + TRIAL[-1:] + ["eager"] * 2
    assert trainer.build_count == 2


def test_choice_follows_the_medians():
    """The decision on the medians: eager where the graph's is over ``MARGIN`` times
    eager's, the graph at a tie; outliers do not decide."""
    assert faster([1.0, 1.0, 1.0], [1.0 / MARGIN * 0.99] * 3) == "eager"
    assert faster([1.0, 1.0, 1.0], [1.0 / MARGIN * 1.01] * 3) == "graph"
    assert faster([1.0, 1.0, 1.0], [1.0 / MARGIN] * 3) == "graph"  # a tie
    assert faster([1.0, 9.0, 1.0], [1.05 / MARGIN] * 3) == "graph"  # one slow graph step
    assert faster([1.0, 1.0, 1.0], [0.5, 9.0, 0.5]) == "eager"  # one slow eager step
    t = Trial()
    seen = []
    for _ in range(len(TRIAL)):
        route = t.route()
        seen.append(route)
        t.record(route, 1.0 if route == "graph" else 0.5)
    assert seen == TRIAL and t.choice == "eager"
    assert len(t.graph) == len(t.eager) == ROUNDS  # the first of each untimed
    t.record("graph", 0.1)  # decided: later times change nothing
    assert t.route() == "eager" and len(t.graph) == ROUNDS


@pytest.mark.parametrize(
    "share, floor, forward, expected",
    [
        (FORWARD_SHARE, 0.0, 0.1, ""),  # no child: three forwards, 0.3 s, under the 1 s step
        (FORWARD_SHARE, 0.0, 0.4, "graph"),  # 1.2 s
        (2.0, 0.0, 0.4, ""),  # the child's ratio (a frozen backbone's): 0.8 s
        (2.0, 1.5, 0.4, "graph"),  # never below the child's step over the thread count
        (2.0, 0.5, 0.1, ""),
    ],
)
def test_gate_estimates_eager_from_its_forward_the_ratio_and_the_floor(
    share, floor, forward, expected
):
    """The gate's estimate of eager's step: its forward times the step-to-forward ratio
    the first-step check's child measured (``FORWARD_SHARE`` without it), never below
    that child's step over the thread count; a graph step under it goes to no trial."""
    t = Trial(gated=True, floor=floor, share=share)
    for _ in range(1 + GATE_STEPS):
        t.record(t.route(), 1.0)
    assert t.weighing()
    t.gate(forward)
    assert t.estimate == pytest.approx(max(share * forward, floor))
    assert t.choice == expected  # "": the trial's steps are next


@pytest.mark.parametrize("floor, kept", [(1.0 / GATE + 0.01, True), (1.0 / GATE - 0.01, False)])
def test_a_graph_under_the_floor_is_kept_without_timing_eagers_forward(floor, kept):
    """Where the graph's step is under ``GATE`` times the floor (the child's one-thread
    step over the thread count) no forward could change the gate's answer: the graph is
    kept without one (an eager forward's activations would set the peak for nothing);
    just over it, the forward is timed as before."""
    trial = SpeedTrial.__new__(SpeedTrial)
    trial.gated, trial.trials = True, {}
    sig = ("sig",)
    t = trial._trial(sig)
    t.floor = floor
    looks: list[dict] = []

    class Steps:
        def look(self, batch):
            looks.append(batch)

    trial.eager = Steps()
    trial._seconds = lambda route, measured: 1.0  # every graph step: 1 s
    for _ in range(1 + GATE_STEPS):
        trial.run(sig, trial.route(sig), lambda batch: torch.zeros(()), {})
    assert t.choice == ("graph" if kept else t.choice)
    assert (len(looks) == 0) == kept
    assert t.floored == kept
    if kept:
        assert t.estimate == floor
        assert "or more" in trial.summary()


def test_measured_sets_the_ratio_and_the_floor():
    trial = SpeedTrial.__new__(SpeedTrial)
    trial.gated, trial.trials = True, {}
    trial.measured(("sig",), EagerTimes(step=0.8, forward=0.32))
    (t,) = trial.trials.values()
    assert t.share == pytest.approx(2.5)
    assert t.floor == pytest.approx(0.8 / torch.get_num_threads())
    trial.measured(("other",), EagerTimes(step=0.8, forward=0.0))  # too fast to time
    assert trial.trials[("other",)].share == FORWARD_SHARE
    trial.measured(("noisy",), EagerTimes(step=0.8, forward=1.6))  # never under a forward
    assert trial.trials[("noisy",)].share == 1.0
    trial.measured(("conv",), EagerTimes(step=0.8, forward=0.2))  # nor over FORWARD_SHARE
    assert trial.trials[("conv",)].share == FORWARD_SHARE


@pytest.mark.parametrize("slow", [False, True], ids=["graph-fast", "graph-slow"])
def test_auto_weighs_a_trial_on_eager_forward(slow):
    """With "auto" (the default) a graph step is first weighed against eager's step
    estimated from one eager forward and the step-to-forward ratio the first-step check's
    child measured: a clearly faster graph keeps every step (no eager
    step, the forward's buffers and random draws put back); a slower one goes on to the
    trial, which decides. Every step equals eager's either way."""
    torch.manual_seed(0)
    base = _ConvNet()
    ref = copy.deepcopy(base)
    opt_ref = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9)
    opt = torch.optim.SGD(base.parameters(), lr=0.05, momentum=0.9)
    trainer = ORTTrainer(base, opt, TrainerOptions())  # "auto" is the default
    graph_s, eager_s = 1.0, 0.5
    routes = _pinned(trainer, graph_s, eager_s)
    trial = trainer._program.trial
    assert trial is not None and trial.gated
    forwards, measured = [], []
    real_forward, real_measured = trial._forward_seconds, trial.measured

    def forward_seconds(batch):
        forwards.append(real_forward(batch))  # runs eager's forward, as unpinned
        # the graph's step against GATE times eager's estimate, just above or below
        (weighing,) = trial.trials.values()
        return (0.99 if slow else 1.01) * graph_s / (GATE * weighing.share)

    def measured_times(sig, times):
        measured.append(times)
        real_measured(sig, times)

    trial._forward_seconds = forward_seconds
    trial.measured = measured_times
    torch.manual_seed(1)
    batches = _batches(10)
    for i, batch in enumerate(batches):
        loss = float(trainer.train_step(**batch))
        expected = _eager_step(ref, opt_ref, batch, None)
        assert loss == pytest.approx(expected, rel=LOSS_RTOL), f"step {i} ({routes[i]})"
    assert len(forwards) == 1  # one gate per signature
    # the first-step check's child timed this small model's eager step and forward: the
    # floor well under the pinned graph step, so the pinned forward decides; the ratio
    # theirs
    (times,) = measured
    assert 0 < times.forward and 0 < times.step < 0.1 * graph_s
    (weighed,) = trial.trials.values()
    assert weighed.floor == pytest.approx(times.step / torch.get_num_threads())
    assert weighed.share == pytest.approx(min(max(times.step / times.forward, 1), FORWARD_SHARE))
    gate = ["graph"] * (1 + GATE_STEPS)
    if slow:
        # the trial's, after the gate's steps: eager's untimed first, then as many timed
        # as the graph has, then alternating
        rest = ["eager"] * (1 + GATE_STEPS) + ["graph", "eager"] * (ROUNDS - GATE_STEPS)
        assert routes == gate + rest + ["eager"] * (len(batches) - len(gate) - len(rest))
    else:
        assert routes == ["graph"] * len(batches) and trainer.eager_steps == 0
        assert "runs on the graph (no trial)" in explain(trainer)
    for (name, b), c in zip(base.named_buffers(), ref.buffers()):
        torch.testing.assert_close(b, c, rtol=1e-5, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")


def test_auto_trial_stays_out_where_eager_cannot_stand_in():
    """Outside the trial's limits "auto" runs every step on its graph, no error."""
    model = _ConvNet()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    options = TrainerOptions(eager_if_faster="auto", grad_accumulation_steps=2)
    trainer = ORTTrainer(model, opt, options)
    assert trainer._program.trial is None
    other = _ConvNet()
    off = ORTTrainer(
        other, torch.optim.AdamW(other.parameters()), TrainerOptions(eager_if_faster=False)
    )
    assert off._program.trial is None


@pytest.mark.parametrize(
    "options,why",
    [
        (TrainerOptions(eager_if_faster=True, grad_accumulation_steps=2), "grad_accumulation"),
        (TrainerOptions(eager_if_faster=True, mixed_precision="fp16"), "full precision"),
    ],
)
def test_refused_where_eager_steps_cannot_stand_in(options, why):
    model = _ConvNet()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with pytest.raises(ValueError, match=f"eager_if_faster=True: .*{why}"):
        ORTTrainer(model, opt, options)


class _TrainsOnly(torch.nn.Module):
    """A forward that refuses to run without gradients (as a model that differentiates
    inside its forward would fail)."""

    def __init__(self):
        super().__init__()
        self.body = torch.nn.Linear(8, 8)
        self.head = torch.nn.Linear(8, 1)

    def forward(self, x, y):
        if not torch.is_grad_enabled():
            raise RuntimeError("this model runs with gradients only")
        out = self.head(torch.tanh(self.body(x))).squeeze(-1)
        return torch.nn.functional.mse_loss(out, y)


def test_auto_keeps_the_graph_where_eager_cannot_run_without_gradients():
    """The gate's forward without gradients fails: the graph keeps every step (no trial,
    no error), each equal to eager's."""
    torch.manual_seed(0)
    model = _TrainsOnly()
    ref = copy.deepcopy(model)
    opt_ref = torch.optim.SGD(ref.parameters(), lr=0.1)
    trainer = ORTTrainer(model, torch.optim.SGD(model.parameters(), lr=0.1), TrainerOptions())
    routes = _pinned(trainer, graph_s=1.0, eager_s=0.5)  # eager would win a trial
    g = torch.Generator().manual_seed(2)
    for i in range(2 + GATE_STEPS + 2 * ROUNDS):
        batch = {"x": torch.randn(16, 8, generator=g), "y": torch.randn(16, generator=g)}
        loss = float(trainer.train_step(**batch))
        assert loss == pytest.approx(_eager_step(ref, opt_ref, batch, None), rel=LOSS_RTOL), i
    assert set(routes) == {"graph"} and trainer.eager_steps == 0
    (decided,) = trainer._program.trial.trials.values()
    assert decided.choice == "graph" and not decided.eager
    assert "does not run without gradients: runs on the graph (no trial)" in explain(trainer)
