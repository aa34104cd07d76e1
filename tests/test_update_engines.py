"""The update engines' one interface and the one place that picks one
(``ortrain/runtime/update_engines.py``), the training state they share
(``ortrain/runtime/training_state.py``), and the rule that only the trainer touches its
own privates."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import pytest
import torch

from ortrain.core.errors import UnsupportedOptimizerError
from ortrain.core.names import UpdateInBackwardError
from ortrain.core.optimizer_spec import GroupSpec, OptimizerSpec
from ortrain.runtime.training_state import TrainingState
from ortrain.runtime.update_engines import ENGINES, EngineFacts, choose_engine

pytestmark = pytest.mark.unit
ROOT = Path(__file__).resolve().parents[1]
CPU = torch.device("cpu")

# The update in the backward can run these facts ("auto" picks it).
BASE = EngineFacts(
    requested="auto",
    device=CPU,
    kind="adamw",
    zero_stage=None,
    cpu_kernels=True,
    accumulation=1,
    clipping=False,
    fp32=True,
)


def _facts(**changes: object) -> EngineFacts:
    return dataclasses.replace(BASE, **changes)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("changes", "engine"),
    [
        ({}, "backward"),
        ({"requested": "backward"}, "backward"),
        # auto on CPU, Adam-type, one process, but something the backward lacks: torch
        ({"clipping": True}, "torch"),
        ({"accumulation": 2}, "torch"),
        ({"fp32": False}, "torch"),
        ({"cpu_kernels": False}, "torch"),
        ({"kind": "adam", "clipping": True}, "torch"),
        # other optimizers, other engines asked for, distributed: the graph
        ({"kind": "lamb"}, "graph"),
        ({"kind": "sgd"}, "graph"),
        ({"requested": "graph"}, "graph"),
        ({"requested": "torch"}, "torch"),
        ({"zero_stage": 0}, "graph"),
        ({"zero_stage": 0, "requested": "graph"}, "graph"),
        # ZeRO on CPU: torch's kernels over the shard where they run the optimizer
        ({"zero_stage": 1}, "zero-torch"),
        ({"zero_stage": 3, "kind": "adam", "clipping": True}, "zero-torch"),
        # ZeRO-2/3 without clipping, scaling or accumulation: each bucket's stretch
        # updated as it lands, in the backward
        ({"zero_stage": 3}, "zero-backward"),
        ({"zero_stage": 3, "kind": "adam", "requested": "backward"}, "zero-backward"),
        ({"zero_stage": 3, "accumulation": 2}, "zero-torch"),
        ({"zero_stage": 3, "fp32": False}, "zero-torch"),
        ({"zero_stage": 3, "cpu_kernels": False}, "zero-backward"),  # torch's kernels
        ({"zero_stage": 3, "kind": "sgd"}, "zero1"),
        ({"zero_stage": 2}, "zero-backward"),
        ({"zero_stage": 2, "clipping": True}, "zero-torch"),
        ({"zero_stage": 1}, "zero-torch"),
        ({"zero_stage": 3, "requested": "graph"}, "zero1"),
        ({"zero_stage": 2, "requested": "graph"}, "zero1"),
        ({"zero_stage": 1, "kind": "sgd"}, "zero1"),
        ({"zero_stage": 1, "kind": "lamb", "requested": "graph"}, "zero1"),
        ({"zero_stage": 2, "device": torch.device("meta")}, "zero1"),
        # an optimizer ortrain does not compile: its own step, in a process or data parallel
        ({"kind": "eager"}, "eager"),
        ({"kind": "eager", "zero_stage": 0, "clipping": True}, "eager"),
    ],
)
def test_choice(changes, engine):
    assert choose_engine(_facts(**changes)) == engine


@pytest.mark.parametrize(
    ("changes", "error", "match"),
    [
        ({"requested": "torch", "kind": "sgd"}, UnsupportedOptimizerError, "'torch' supports"),
        ({"requested": "torch", "zero_stage": 0}, ValueError, "single-process only"),
        ({"requested": "kernels", "kind": "sgd"}, UnsupportedOptimizerError, "'kernels'"),
        ({"requested": "kernels", "zero_stage": 1}, ValueError, "single-process only"),
        ({"requested": "backward", "clipping": True}, ValueError, r"no clipping"),
        ({"requested": "backward", "zero_stage": 1}, ValueError, r"ZeRO-1 needs ZeRO-2 or"),
        (
            {"requested": "backward", "zero_stage": 3, "accumulation": 4},
            ValueError,
            r"ZeRO-3 needs grad_accumulation_steps=1",
        ),
        ({"requested": "backward", "zero_stage": 0, "kind": "lamb"}, ValueError, "Adam or AdamW"),
        ({"requested": "graph", "kind": "eager"}, UnsupportedOptimizerError, "own step"),
        ({"requested": "backward", "kind": "eager"}, UnsupportedOptimizerError, "own step"),
    ],
)
def test_refusals_name_what_is_missing(changes, error, match):
    with pytest.raises(error, match=match):
        choose_engine(_facts(**changes))


def test_a_graph_that_refuses_the_update_in_the_backward():
    """The fallback is decided here: "auto" takes the engine it would pick without the
    update in the backward, before any update is laid out; otherwise the refusal stands."""
    refused = UpdateInBackwardError("W is read after its gradient")
    assert choose_engine(_facts(refused=refused)) == "torch"
    assert choose_engine(_facts(refused=refused, device=torch.device("meta"))) == "graph"
    for changes in ({"requested": "backward"}, {"first_build": False}):
        with pytest.raises(UpdateInBackwardError) as info:
            choose_engine(_facts(refused=refused, **changes))
        assert info.value is refused


def test_every_engine_has_the_interface():
    assert set(ENGINES) == {
        *("graph", "zero1", "zero-torch", "zero-backward", "zero-eager", "kernels", "torch"),
        *("backward", "eager"),
    }
    for name, cls in ENGINES.items():
        assert cls.name == name
        assert cls.in_backward == (name == "backward")
        for method in ("prepare", "bind_train", "before_run", "step", "applied"):
            assert callable(getattr(cls, method)), (name, method)
        assert isinstance(cls.update_graph, property)


def _state(module: torch.nn.Module, **kwargs: object) -> TrainingState:
    names = tuple(n for n, _ in module.named_parameters())
    spec = OptimizerSpec("adamw", (GroupSpec(names, False, 0.0, True),))
    return TrainingState.of_module(module, spec, CPU, **kwargs)  # type: ignore[arg-type]


def test_state_moves_parameters_and_counts_only_finite_updates():
    module = torch.nn.Linear(3, 2)
    weight = module.weight.detach().clone()
    state = _state(module, accumulation=4)
    assert state.trainable == ["weight", "bias"] and state.step == 0
    flat = torch.zeros(8)
    state.move_params({"weight": flat[:6].view(2, 3), "bias": flat[6:]})
    assert torch.equal(flat[:6].view(2, 3), weight)
    assert module.weight.data_ptr() == flat.data_ptr() == state.params["weight"].data_ptr()
    state.record_update(torch.tensor(False))
    assert state.step == 0 and not bool(state.grads_finite)
    state.record_update(torch.tensor(True))
    assert state.step == 1 and bool(state.grads_finite)
    state.grad_multiplier = 2.0
    assert state.grad_scale(world_size=2) == 2.0 / (4 * 2)
    state.set_counters(7, 3)
    assert (state.step, state.micro_step) == (7, 3)


def test_state_rejects_non_float32_parameters():
    with pytest.raises(TypeError, match="float64"):
        _state(torch.nn.Linear(2, 2).double())


def _private_trainer_accesses(path: Path, root: Path = ROOT) -> list[str]:
    """``trainer._x`` / ``tr._x`` / ``<anything>.trainer._x`` in one module."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if not isinstance(node, ast.Attribute) or not node.attr.startswith("_"):
            continue
        if node.attr.startswith("__"):
            continue
        owner = node.value
        name = None
        if isinstance(owner, ast.Name):
            name = owner.id
        elif isinstance(owner, ast.Attribute):
            name = owner.attr
        if name in ("trainer", "tr", "ortrainer"):
            found.append(
                (node.lineno, f"{path.relative_to(root)}:{node.lineno}: {name}.{node.attr}")
            )
    return [text for _, text in sorted(found)]


def test_only_the_trainer_touches_its_privates():
    """distributed/, the checkpoints, the engines and the integrations go through the
    trainer's public methods and its ``state``."""
    links = (ROOT / "ortrain" / "graph_passes", ROOT / "ortrain" / "recipes")
    sources = [
        p
        for p in (ROOT / "ortrain").rglob("*.py")
        if not any(p.is_relative_to(link) for link in links)
    ]
    sources += [*(ROOT / "graph_passes").rglob("*.py"), *(ROOT / "recipes").rglob("*.py")]
    offenders = [
        hit
        for path in sources
        if path != ROOT / "ortrain" / "trainer.py"
        for hit in _private_trainer_accesses(path)
    ]
    assert len(sources) > 40  # the walk found the packages
    assert offenders == []


def test_the_private_access_check_can_fail(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text("def f(trainer, self):\n    trainer._save(1)\n    self.trainer._x = 2\n")
    hits = _private_trainer_accesses(probe, root=tmp_path)
    assert [h.split(": ")[1] for h in hits] == ["trainer._save", "trainer._x"]


def test_one_adam_element_function_for_the_c_and_cuda_kernels():
    """The update in the backward's C kernel and the CUDA kernel (with its CPU reference)
    compile one Adam element function (ortrain/runtime/adam_math.h); the numbers are
    checked against torch by tests/test_update_in_backward.py and test_cuda_kernels.py."""
    shared = (ROOT / "ortrain" / "runtime" / "adam_math.h").read_text()
    assert "ortrain_adam_element(" in shared and "ortrain_adam_coeffs_of(" in shared
    c_kernel = (ROOT / "ortrain" / "runtime" / "update_kernels.c").read_text()
    cuda_math = (ROOT / "cuda_kernels" / "optim_math.h").read_text()
    assert '#include "adam_math.h"' in c_kernel
    assert '#include "../ortrain/runtime/adam_math.h"' in cuda_math
    for source in (c_kernel, cuda_math):
        assert "ortrain_adam_element(" in source and "ortrain_adam_coeffs_of(" in source
        assert "sqrtf(" not in source.split("ortrain.optim.Lamb")[0]  # no second formula
    for name in ("adam.cu", "adam.cpp"):
        assert "adam_element(" in (ROOT / "cuda_kernels" / name).read_text()
