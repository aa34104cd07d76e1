"""Each graph timed against eager on its first steps, the faster kept
(``TrainerOptions.eager_if_faster``): every step equal to eager PyTorch's whichever ran it,
the trial's schedule fixed, the choice following the times."""

from __future__ import annotations

import copy

import pytest
import torch

from ortrain import ORTTrainer, TrainerOptions, explain
from ortrain.speed_trial import FORWARD_SHARE, GATE, GATE_STEPS, MARGIN, ROUNDS, Trial, faster

LOSS_RTOL = 1e-5


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
    trial_part = ["graph"] + ["graph", "eager"] * ROUNDS
    assert routes == trial_part + [winner] * (len(batches) - len(trial_part))
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
    routes = _pinned(trainer, 2.0, 1.0)
    small, large = _batches(8, rows=4), _batches(8, rows=7)
    order = small[:7] + large[:8] + small[7:]
    for i, batch in enumerate(order):
        loss = float(trainer.train_step(**batch))
        assert loss == pytest.approx(_eager_step(ref, opt_ref, batch, None), rel=LOSS_RTOL), i
    trial = ["graph"] + ["graph", "eager"] * ROUNDS
    assert routes == trial + trial + ["eager"] * 2
    assert trainer.build_count == 2


def test_choice_needs_eager_clearly_faster():
    """The decision on the medians: eager only where the graph's is over ``MARGIN``
    times eager's; outliers do not decide."""
    assert faster([1.0, 1.0, 1.0], [1.0 / MARGIN * 0.99] * 3) == "eager"
    assert faster([1.0, 1.0, 1.0], [1.0 / MARGIN * 1.01] * 3) == "graph"
    assert faster([1.0, 9.0, 1.0], [0.95, 0.95, 0.95]) == "graph"  # one slow graph step
    t = Trial()
    seen = []
    for _ in range(1 + 2 * ROUNDS):
        route = t.route()
        seen.append(route)
        t.record(route, 1.0 if route == "graph" else 0.5)
    assert seen == ["graph"] + ["graph", "eager"] * ROUNDS and t.choice == "eager"
    t.record("graph", 0.1)  # decided: later times change nothing
    assert t.route() == "eager" and len(t.graph) == ROUNDS


def test_gate_estimate_is_never_below_the_checks_eager_step():
    """The gate's estimate of eager's step: three forwards, or the first-step check's
    eager forward and backward over the thread count where that is more; a graph step
    under that floor goes to no trial."""
    for floor, expected in ((0.0, ""), (1.5, "graph")):
        t = Trial(gated=True, floor=floor)
        for _ in range(1 + GATE_STEPS):
            t.record(t.route(), 1.0)
        assert t.weighing()
        t.gate(0.1)  # three forwards: 0.3 s
        assert t.estimate == pytest.approx(max(FORWARD_SHARE * 0.1, floor))
        assert t.choice == expected  # "": the trial's steps are next


@pytest.mark.parametrize("slow", [False, True], ids=["graph-fast", "graph-slow"])
def test_auto_weighs_a_trial_on_eager_forward(slow):
    """With "auto" (the default) a graph step is first weighed against eager's step
    estimated from one eager forward: a clearly faster graph keeps every step (no eager
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
    forwards = []
    real_forward = trial._forward_seconds

    def forward_seconds(batch):
        forwards.append(real_forward(batch))  # runs eager's forward, as unpinned
        # the graph's step against GATE times eager's estimate, just above or below
        return (0.99 if slow else 1.01) * graph_s / (GATE * FORWARD_SHARE)

    trial._forward_seconds = forward_seconds
    torch.manual_seed(1)
    batches = _batches(10)
    for i, batch in enumerate(batches):
        loss = float(trainer.train_step(**batch))
        expected = _eager_step(ref, opt_ref, batch, None)
        assert loss == pytest.approx(expected, rel=LOSS_RTOL), f"step {i} ({routes[i]})"
    assert len(forwards) == 1  # one gate per signature
    # the floor from the first-step check's eager step of this small model: well under
    # the pinned graph step, so the pinned forward decides
    (weighed,) = trial.trials.values()
    assert 0 < weighed.floor < 0.1 * graph_s
    gate = ["graph"] * (1 + GATE_STEPS)
    if slow:
        rest = ["eager", "eager", "graph", "eager"]  # the trial's, after the gate's steps
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
