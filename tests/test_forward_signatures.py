"""Modules whose forward takes ``*args`` or ``**kwargs``, trained through ortrain against eager.

The batch inputs of ``*args`` are named by position (``args_0``, ``args_1``, ... after the
parameter's name), those of ``**kwargs`` by key; a ``loss_fn`` gets them under those
names with the keywords the forward does not take. Per module: 8 AdamW steps, the loss of
every step and the parameters after them against eager.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch

from ortrain import BatchError, ORTTrainer

F, B, STEPS = 6, 8, 8
LOSS_RTOL = 1e-4
PARAM_RTOL, PARAM_ATOL = 1e-4, 1e-6


def _net() -> torch.nn.Sequential:
    return torch.nn.Sequential(torch.nn.Linear(F, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))


class StarArgs(torch.nn.Module):
    """forward(*args): features, targets, per-row weights; returns the loss."""

    def __init__(self) -> None:
        super().__init__()
        self.net = _net()

    def forward(self, *args: torch.Tensor) -> torch.Tensor:
        x, y, w = args
        return (w * (self.net(x).squeeze(-1) - y) ** 2).mean()


class HeadAndRest(torch.nn.Module):
    """forward(x, *rest): a second feature tensor in ``rest``; returns the prediction."""

    def __init__(self) -> None:
        super().__init__()
        self.net = _net()
        self.side = torch.nn.Linear(F, 1, bias=False)

    def forward(self, x: torch.Tensor, *rest: torch.Tensor) -> torch.Tensor:
        out = self.net(x)
        for r in rest:
            out = out + self.side(r)
        return out.squeeze(-1)


class Predict(torch.nn.Module):
    """forward(*args): predicts from the first input; the others are for the loss_fn."""

    def __init__(self) -> None:
        super().__init__()
        self.net = _net()

    def forward(self, *args: torch.Tensor) -> torch.Tensor:
        return self.net(args[0]).squeeze(-1)


class StarKwargs(torch.nn.Module):
    """forward(**kwargs): inputs by key; returns a dict with the loss and the prediction."""

    def __init__(self) -> None:
        super().__init__()
        self.net = _net()

    def forward(self, **kwargs: torch.Tensor) -> dict[str, torch.Tensor]:
        pred = self.net(kwargs["features"] * kwargs["scale"]).squeeze(-1)
        return {"loss": torch.nn.functional.mse_loss(pred, kwargs["target"]), "pred": pred}


def _data(g: torch.Generator) -> dict[str, torch.Tensor]:
    return {
        "x": torch.randn(B, F, generator=g),
        "x2": torch.randn(B, F, generator=g),
        "y": torch.randn(B, generator=g),
        "w": torch.rand(B, generator=g) + 0.5,
    }


def _mse_on(key: str) -> Callable:
    """A loss_fn reading the target from the batch under ``key``."""
    return lambda out, batch: torch.nn.functional.mse_loss(out, batch[key])


# name: (module class, loss_fn, eager call, ortrain call, the graph's batch inputs); each
# call: data -> (args, kwargs)
CASES = {
    "star-args": (
        StarArgs, None,
        lambda d: ((d["x"], d["y"], d["w"]), {}),
        lambda d: ((d["x"], d["y"], d["w"]), {}),
        ["args_0", "args_1", "args_2"],
    ),
    "star-args-loss-fn-by-position": (
        Predict, _mse_on("args_1"),  # the target: the forward's second positional input
        lambda d: ((d["x"], d["y"]), {}),
        lambda d: ((d["x"], d["y"]), {}),
        ["args_0", "args_1"],
    ),
    "head-and-rest-keyword-target": (
        HeadAndRest, _mse_on("y"),  # y: a keyword the forward does not take
        lambda d: ((d["x"], d["x2"]), {}),
        lambda d: ((d["x"], d["x2"]), {"y": d["y"]}),
        ["x", "rest_0", "y"],
    ),
    "head-and-rest-empty": (
        HeadAndRest, _mse_on("y"),
        lambda d: ((), {"x": d["x"]}),
        lambda d: ((), {"x": d["x"], "y": d["y"]}),
        ["x", "y"],
    ),
    "star-kwargs": (
        StarKwargs, None,
        lambda d: ((), {"features": d["x"], "scale": d["w"][:, None], "target": d["y"]}),
        lambda d: ((), {"features": d["x"], "scale": d["w"][:, None], "target": d["y"]}),
        ["features", "scale", "target"],
    ),
}  # fmt: skip


def _eager_loss(model, loss_fn, call, data) -> torch.Tensor:
    args, kwargs = call(data)
    out = model(*args, **kwargs)
    if loss_fn is not None:
        return loss_fn(out, {"y": data["y"], "args_1": data["y"]})
    return out["loss"] if isinstance(out, dict) else out


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_signature_trains_like_eager(case: str) -> None:
    cls, loss_fn, eager_call, our_call, names = CASES[case]
    torch.manual_seed(0)
    ref = cls()
    model = copy.deepcopy(ref)
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.01)
    trainer = ORTTrainer(
        model, torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01), loss_fn=loss_fn
    )
    g = torch.Generator().manual_seed(1)
    losses, losses_ref = [], []
    for _ in range(STEPS):
        data = _data(g)
        opt_ref.zero_grad()
        loss = _eager_loss(ref, loss_fn, eager_call, data)
        loss.backward()
        opt_ref.step()
        losses_ref.append(loss.item())
        args, kwargs = our_call(data)
        losses.append(trainer.train_step(*args, **kwargs).item())
    torch.testing.assert_close(
        torch.tensor(losses), torch.tensor(losses_ref), rtol=LOSS_RTOL, atol=0
    )
    trainer.sync_to_module()
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(
            p, q, rtol=PARAM_RTOL, atol=PARAM_ATOL, msg=lambda m, n=name: f"{n}: {m}"
        )
    # One graph, whose batch inputs carry the names the batch was normalized to.
    (compiled,) = trainer._graphs.train.values()
    assert compiled.batch_names == names
    graph_inputs = {v.name for v in compiled.model.graph.inputs}
    assert set(names) <= graph_inputs


def test_eval_step_with_star_args_matches_eager() -> None:
    torch.manual_seed(0)
    model = HeadAndRest()
    trainer = ORTTrainer(
        model, torch.optim.AdamW(model.parameters(), lr=1e-2), loss_fn=_mse_on("y")
    )
    data = _data(torch.Generator().manual_seed(3))
    trainer.train_step(data["x"], data["x2"], y=data["y"])
    trainer.sync_to_module().eval()
    out = trainer.eval_step(data["x"], data["x2"], y=data["y"])
    with torch.no_grad():
        pred = model(data["x"], data["x2"])
        ref = torch.nn.functional.mse_loss(pred, data["y"])
    torch.testing.assert_close(out.loss, ref, rtol=1e-5, atol=0)


def test_wrong_number_of_positional_inputs_is_a_clear_error() -> None:
    torch.manual_seed(0)
    model = HeadAndRest()
    trainer = ORTTrainer(
        model, torch.optim.AdamW(model.parameters(), lr=1e-2), loss_fn=_mse_on("y")
    )
    data = _data(torch.Generator().manual_seed(4))
    trainer.train_step(data["x"], data["x2"], y=data["y"])
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(BatchError, match=r"2 positional inputs .*rest_0, rest_1.*first step 1"):
        trainer.train_step(data["x"], data["x2"], data["x2"], y=data["y"])
    with pytest.raises(BatchError, match=r"0 positional inputs .*none.*first step 1"):
        trainer.eval_step(data["x"], y=data["y"])
    assert trainer.step == 1 and len(trainer.train_graphs) == 1
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k
    # The count of the first step still trains.
    trainer.train_step(data["x"], data["x2"], y=data["y"])
    assert trainer.step == 2


def test_keyword_spelled_like_a_positional_input_is_refused() -> None:
    model = StarArgs()
    trainer = ORTTrainer(model, torch.optim.AdamW(model.parameters()), loss_fn=_mse_on("y"))
    x = torch.randn(B, F)
    with pytest.raises(TypeError, match=r"keyword 'args_1' names a value of \*args"):
        trainer.train_step(x, args_1=x)


def test_too_few_inputs_for_the_named_parameters_is_a_clear_error() -> None:
    class TwoInputs(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.net = _net()

        def forward(self, x: torch.Tensor, y: torch.Tensor, /) -> torch.Tensor:
            return torch.nn.functional.mse_loss(self.net(x).squeeze(-1), y)

    model = TwoInputs()
    trainer = ORTTrainer(model, torch.optim.AdamW(model.parameters()))
    x, y = torch.randn(B, F), torch.randn(B)
    with pytest.raises(TypeError, match=r"batch does not match TwoInputs\.forward"):
        trainer.train_step(x, y, y)
    # Positional-only parameters go to the forward by position.
    with torch.no_grad():
        ref = model(x, y)
    torch.testing.assert_close(trainer.train_step(x, y), ref, rtol=1e-5, atol=0)
