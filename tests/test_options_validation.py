"""Settings that would break training are refused up front (issue 35, item 5):
TrainerOptions fields by type and range, optimizer subclasses with their own ``step()``;
and a failed micro-batch ends its accumulation window the way the README says."""

from __future__ import annotations

import copy
import dataclasses
import math
import os
import pathlib
import types
import typing
from typing import Any

import numpy as np
import pytest
import torch

from ortrain import (
    BatchError,
    NonFiniteLossError,
    ORTTrainer,
    TrainerOptions,
)
from ortrain.core.errors import ExportError
from ortrain.loss_scaler import DynamicLossScale

FIELDS = [f.name for f in dataclasses.fields(TrainerOptions)]
HINTS = typing.get_type_hints(TrainerOptions)

# Values of many types: each one whose type a field's annotation does not allow must be
# refused for that field.
CANDIDATES: list[Any] = [
    None,
    True,
    False,
    0,
    3,
    -1,
    2.5,
    math.nan,
    math.inf,
    "bogus-value",
    b"cpu",
    [1],
    {"a": 1},
    object(),
    pathlib.Path("some-dir"),
    DynamicLossScale(),
]

# Fields whose annotation admits anything: the values their own check must refuse.
UNTYPED_BAD: dict[str, list[Any]] = {"process_group": ["gloo", 0, object()]}

# Values of the right type that are out of range, for every field a number may go in.
OUT_OF_RANGE: dict[str, list[Any]] = {
    "grad_accumulation_steps": [0, -1, -(2**40)],
    "max_grad_norm": [0.0, -1.0, -math.inf, math.nan, 0],
    "seed": [],  # any int: dropout seeds are taken modulo 2**31 - 1
    "intra_op_threads": [0, -2],
    "zero_stage": [4, -1],
    "reduce_bucket_mb": [0.0, -1.0, math.inf, math.nan, 0],
    "dist_timeout": [0, -5.0, math.inf, math.nan],
    "loss_scale": [0.0, -1.0, math.inf, math.nan],
}

# str fields that hold a path (any string); every other str field is a choice.
FREE_STRINGS = {"save_graphs_dir", "graph_cache"}


def _allows(tp: Any, value: Any) -> bool:
    """Whether annotation ``tp`` admits ``value`` (bool is not an int here)."""
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        return any(_allows(arg, value) for arg in typing.get_args(tp))
    simple = {
        type(None): lambda v: v is None,
        bool: lambda v: isinstance(v, bool),
        int: lambda v: isinstance(v, int) and not isinstance(v, bool),
        float: lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
        str: lambda v: isinstance(v, str),
        os.PathLike: lambda v: isinstance(v, os.PathLike),
        DynamicLossScale: lambda v: isinstance(v, DynamicLossScale),
    }
    if tp not in simple:
        raise AssertionError(f"annotation {tp!r}: teach this fuzz test what it admits")
    return simple[tp](value)


def _admits(tp: Any, kind: type) -> bool:
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        return any(_admits(arg, kind) for arg in typing.get_args(tp))
    return tp is kind


def _refused(field: str, value: Any) -> None:
    with pytest.raises((TypeError, ValueError), match=f"TrainerOptions.{field}\\b"):
        TrainerOptions(**{field: value})


@pytest.mark.parametrize("field", FIELDS)
def test_wrong_types_are_refused(field):
    tp = HINTS[field]
    if tp is Any:
        assert field in UNTYPED_BAD, f"{field}: typed Any, list the values it must refuse"
        bad = UNTYPED_BAD[field]
    else:
        bad = [v for v in CANDIDATES if not _allows(tp, v)]
    assert bad, f"{field}: no wrong-typed candidate; add one"
    for value in bad:
        _refused(field, value)


@pytest.mark.parametrize("field", FIELDS)
def test_out_of_range_values_are_refused(field):
    tp = HINTS[field]
    numeric = tp is not Any and (_admits(tp, int) or _admits(tp, float))
    if numeric:
        assert field in OUT_OF_RANGE, f"{field} takes a number: list its out-of-range values"
    for value in OUT_OF_RANGE.get(field, []):
        _refused(field, value)
    choice = tp is not Any and _admits(tp, str) and field not in FREE_STRINGS
    if choice:
        _refused(field, "bogus-value")


def test_every_table_entry_is_a_field():
    for table in (UNTYPED_BAD, OUT_OF_RANGE):
        assert set(table) <= set(FIELDS)
    assert FREE_STRINGS <= set(FIELDS)


def test_valid_values_are_kept():
    TrainerOptions()
    opts = TrainerOptions(
        grad_accumulation_steps=np.int64(2),
        max_grad_norm=1,  # an int is a float here
        dist_timeout=30,
        loss_scale=128.0,
        intra_op_threads=1,
        seed=-3,
        save_graphs_dir=pathlib.Path("graphs"),
    )
    assert opts.grad_accumulation_steps == 2 and opts.max_grad_norm == 1
    # Infinity: no clipping, the norm still reported (the HF integration's unclipped case).
    assert TrainerOptions(max_grad_norm=math.inf).max_grad_norm == math.inf


def test_issue_values():
    """The values of the report: a NaN norm bound, a fractional accumulation count."""
    with pytest.raises(ValueError, match="max_grad_norm must be a number, got nan"):
        TrainerOptions(max_grad_norm=float("nan"))
    with pytest.raises(TypeError, match=r"grad_accumulation_steps must be int, got 2\.5"):
        TrainerOptions(grad_accumulation_steps=2.5)
    with pytest.raises(TypeError, match="check_finite must be bool, got 0"):
        TrainerOptions(check_finite=0)


class _OwnStep(torch.optim.AdamW):
    def step(self, closure=None):  # e.g. a gradient tweak that ortrain would never run
        return super().step(closure)


class _Inherits(torch.optim.AdamW):
    pass


class _OwnStepBelow(_Inherits):
    def step(self, closure=None):
        return None


def test_optimizer_subclass_with_own_step_runs_it_in_eager():
    """A compiled AdamW update would never run a subclass's own step(): the subclass's
    update runs as its own step in eager PyTorch (said once)."""
    model = torch.nn.Linear(4, 2)
    for cls in (_OwnStep, _OwnStepBelow):
        with pytest.warns(UserWarning, match=f"{cls.__name__} overrides step"):
            trainer = ORTTrainer(model, cls(model.parameters(), lr=1e-3))
        assert trainer.spec.kind == "eager"
    trainer = ORTTrainer(model, _Inherits(model.parameters(), lr=1e-3))  # plain AdamW
    assert trainer.spec.kind == "adamw"


class _Regressor(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(16, 8)
        self.head = torch.nn.Linear(8, 1)

    def forward(self, ids: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        out = self.head(self.emb(ids)).squeeze(-1)
        return torch.nn.functional.mse_loss(out, target)


def _batches(n: int) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [
        {"ids": torch.randint(0, 16, (4, 3), generator=g), "target": torch.randn(4, 3, generator=g)}
        for _ in range(n)
    ]


@pytest.mark.slow
@pytest.mark.parametrize("failure", ["nan_loss", "run_error"])
def test_failed_micro_batch_restarts_the_window(failure, monkeypatch):
    # the out-of-range id must fail inside ONNX Runtime, not in the batch's range check
    monkeypatch.setattr("ortrain.whole_graph.check_batch", lambda checks, batch: None)
    """README: a micro-batch that fails in ONNX Runtime or gives a NaN loss ends its window;
    the window starts over without the good micro-batches before it, and the error says
    how many it discarded; one refused before it runs changes nothing. The next full window
    equals eager's on its own micro-batches (float64 reference)."""
    torch.manual_seed(0)
    model = _Regressor()
    ref = copy.deepcopy(model).double()
    trainer = ORTTrainer(
        model,
        torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9),
        TrainerOptions(grad_accumulation_steps=3),
    )
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    good = _batches(5)
    if failure == "nan_loss":
        bad = {"ids": good[0]["ids"], "target": torch.full((4, 3), math.nan)}
        error, match = NonFiniteLossError, "discarding its earlier 2 micro-batches"
    else:
        bad = {"ids": good[0]["ids"] + 100, "target": good[0]["target"]}  # no such row
        error, match = BatchError, "no update was applied; .*discarding its earlier 2 micro"
    trainer.train_step(**good[0])
    trainer.train_step(**good[1])
    with pytest.raises(ExportError, match="fails on this batch in eager PyTorch too"):
        trainer.train_step(ids=good[1]["ids"].double(), target=good[1]["target"])
    assert trainer.micro_step == 2  # refused before it ran: the window goes on
    with pytest.raises(error, match=match):
        trainer.train_step(**bad)
    assert trainer.micro_step == 0 and trainer.step == 0
    for name, p in model.named_parameters():
        assert torch.equal(p, before[name]), name
    opt_ref = torch.optim.SGD(ref.parameters(), lr=0.5, momentum=0.9)
    for batch in good[2:]:
        trainer.train_step(**batch)
        (ref(batch["ids"], batch["target"].double()) / 3).backward()
    opt_ref.step()
    assert trainer.step == 1
    trainer.sync_to_module()
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        expected = q.detach().float()
        torch.testing.assert_close(
            p, expected, rtol=1e-5, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}"
        )
