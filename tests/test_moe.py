"""Mixture-of-experts models trained through ortrain against eager.

transformers' default experts implementation (``grouped_mm``) traces to its custom op
``transformers::grouped_mm_fallback``, which ortrain's export translates
(``ortrain/export_ops.py``); the router's top-k runs as ONNX TopK, whose gradient goes
to the indices it returned. The op's translation is checked alone first (empty expert
groups, rows past the last group), then tiny Mixtral, Qwen2-MoE, OLMoE and Qwen3-MoE
models train 8 AdamW steps: first-step gradients element-wise against
``torch.autograd``, every loss, and the parameters after the last step.
"""

from __future__ import annotations

import collections
import copy
import dataclasses

import pytest
import torch

from ortrain import ORTTrainer, TrainerOptions
from ortrain.core.errors import ExportError
from ortrain.graph_passes.infra.tags import is_backward
from tests.test_model_families import _assert_close_scaled, _assert_gradients

V, H, L, E, K, B, S = 256, 64, 2, 4, 2, 2, 16
STEPS = 8
LOSS_RTOL = 1e-4
PARAM_RTOL, PARAM_ATOL = 1e-4, 1e-4


def _grouped_mm():
    pytest.importorskip("transformers.integrations.moe")  # registers the custom op
    return torch.ops.transformers.grouped_mm_fallback


class GroupedLinear(torch.nn.Module):
    """The custom op alone: rows of ``x`` grouped by expert, ``offs`` their group ends."""

    def __init__(self, inp: int = 5, out: int = 3) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(E, inp, out))

    def forward(self, x: torch.Tensor, offs: torch.Tensor, probe: torch.Tensor):
        y = _grouped_mm()(x, self.weight, offs)
        return (y * probe).sum(), y


@pytest.mark.parametrize(
    "offs",
    [[2, 3, 6, 8], [0, 4, 4, 8], [3, 3, 3, 8], [1, 2, 5, 6]],
    ids=["all-experts", "empty-groups", "one-big-group", "rows-past-the-last-group"],
)
def test_grouped_mm_translation_matches_the_op(offs: list[int]) -> None:
    torch.manual_seed(0)
    ref = GroupedLinear()
    model = copy.deepcopy(ref)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(8, 5, generator=g)
    probe = torch.randn(8, 3, generator=g)
    offs_t = torch.tensor(offs, dtype=torch.int32)
    trainer = ORTTrainer(
        model,
        torch.optim.AdamW(model.parameters(), lr=0.0, weight_decay=0.0),
        TrainerOptions(update_engine="torch"),
    )
    loss_ref, y_ref = ref(x, offs_t, probe)
    loss_ref.backward()
    loss = trainer.train_step(x, offs_t, probe)
    torch.testing.assert_close(loss, loss_ref.detach(), rtol=1e-5, atol=1e-6)
    _assert_close_scaled(trainer.grads["weight"], ref.weight.grad, "weight")
    out = trainer.eval_step(x, offs_t, probe)
    # The translation picks each row's own product: equal to the op's loop of matmuls.
    torch.testing.assert_close(out["output_1"], y_ref.detach())
    if offs[-1] < 8:
        assert not out["output_1"][offs[-1] :].any()  # rows past the last group are zero
    _assert_translated(trainer.train_graphs[0])


@dataclasses.dataclass(frozen=True)
class Moe:
    model: str
    config: str
    kwargs: dict
    experts: str | None = None  # experts implementation; None: transformers' default

    def build(self) -> torch.nn.Module:
        import transformers

        from tests.conftest import _quiet_transformers

        if not hasattr(transformers, self.model):
            pytest.skip(f"transformers {transformers.__version__} has no {self.model}")
        _quiet_transformers()
        torch.manual_seed(0)
        cfg = getattr(transformers, self.config)(
            vocab_size=V, hidden_size=H, num_hidden_layers=L, num_attention_heads=4,
            num_key_value_heads=2, intermediate_size=96, max_position_embeddings=S,
            attn_implementation="eager", attention_dropout=0.0, num_experts_per_tok=K,
            **self.kwargs,
        )  # fmt: skip
        model = getattr(transformers, self.model)(cfg)
        if self.experts is not None:
            model.set_experts_implementation(self.experts)
        return model


MIXTRAL = dict(num_local_experts=E, router_jitter_noise=0.0)
QWEN_MOE = dict(num_experts=E, moe_intermediate_size=48)
FAMILIES = {
    "mixtral": Moe("MixtralForCausalLM", "MixtralConfig", MIXTRAL),
    "mixtral-aux-loss": Moe(
        "MixtralForCausalLM", "MixtralConfig", dict(MIXTRAL, output_router_logits=True)
    ),
    "mixtral-batched-mm": Moe("MixtralForCausalLM", "MixtralConfig", MIXTRAL, "batched_mm"),
    "qwen2-moe": Moe(
        "Qwen2MoeForCausalLM", "Qwen2MoeConfig",
        dict(QWEN_MOE, shared_expert_intermediate_size=96),
    ),
    "olmoe": Moe("OlmoeForCausalLM", "OlmoeConfig", dict(num_experts=E)),
    "qwen3-moe": Moe("Qwen3MoeForCausalLM", "Qwen3MoeConfig", dict(QWEN_MOE, head_dim=16)),
}  # fmt: skip


def _batches(g: torch.Generator) -> list[dict[str, torch.Tensor]]:
    out = []
    for _ in range(STEPS):
        ids = torch.randint(0, V, (B, S), generator=g)
        out.append({"input_ids": ids, "labels": ids})
    return out


@pytest.mark.slow
@pytest.mark.parametrize("family", list(FAMILIES))
def test_moe_trains_like_eager(family: str) -> None:
    ref = FAMILIES[family].build()
    model = copy.deepcopy(ref)
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-3, weight_decay=0.01)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    # The update after the session keeps the gradients readable (see test_model_families).
    trainer = ORTTrainer(model, opt, TrainerOptions(update_engine="torch"))
    losses, losses_ref = [], []
    for step, batch in enumerate(_batches(torch.Generator().manual_seed(1))):
        opt_ref.zero_grad()
        loss = ref(**batch).loss
        loss.backward()
        losses_ref.append(loss.item())
        losses.append(trainer.train_step(**batch).item())
        if step == 0:
            _assert_gradients(ref, trainer)
            routers = [n for n in trainer.grads if n.endswith("mlp.gate.weight")]
            assert len(routers) == L and all(trainer.grads[n].abs().sum() > 0 for n in routers)
        opt_ref.step()
    torch.testing.assert_close(
        torch.tensor(losses), torch.tensor(losses_ref), rtol=LOSS_RTOL, atol=0
    )
    trainer.sync_to_module()
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(
            p, q, rtol=PARAM_RTOL, atol=PARAM_ATOL, msg=lambda m, n=name: f"{n}: {m}"
        )
    # one export: the eager forwards ortrain runs itself (eager_if_faster's look on the
    # third step) add the output-recording hooks of transformers' forward, no rebuild
    exports = [r for r in trainer.build_log if r.stage == "export"]
    assert len(exports) == 1, [(r.graph, r.seconds) for r in exports]
    graph = trainer.train_graphs[0].graph
    forward = collections.Counter(n.op_type for n in graph if not is_backward(n))
    # Per layer: the router's top-k, and (grouped_mm) the sort of the expert ids.
    sorts = 0 if FAMILIES[family].experts == "batched_mm" else L
    assert forward["TopK"] == L + sorts
    _assert_translated(trainer.train_graphs[0])


def _assert_translated(model) -> None:
    """The custom op became plain ONNX ops: no node or function of its domain is left."""
    assert not model.functions
    assert all(n.domain != "transformers" for n in model.graph)


def test_eager_experts_name_the_implementation_to_use() -> None:
    model = dataclasses.replace(FAMILIES["mixtral"], experts="eager").build()
    opts = TrainerOptions(fallback="off")  # the refusal (with "auto" the experts run in eager)
    trainer = ORTTrainer(model, torch.optim.AdamW(model.parameters()), opts)
    ids = torch.randint(0, V, (B, S))
    with pytest.raises(ExportError, match="experts_implementation"):
        trainer.train_step(input_ids=ids, labels=ids)


def test_the_experts_hint_needs_expert_modules() -> None:
    """transformers gives every model's config an experts implementation ("eager" by
    default): the hint goes only to models that hold expert modules, and an export error of
    a model without any names its own cause alone."""
    from ortrain.export_ops import export_hint
    from tests.conftest import gpt2

    dense = gpt2(layers=1, hidden=32, vocab=64)
    assert getattr(dense.config, "_experts_implementation", "eager") == "eager"
    assert export_hint(dense) == ""
    trainer = ORTTrainer(dense, torch.optim.SGD(dense.parameters(), lr=0.1))
    ids = torch.randint(0, 64, (2, 8))
    with pytest.raises(ExportError, match=r"'indices'") as err:
        trainer.train_step(input_ids=ids.float(), labels=ids)
    assert "expert" not in str(err.value)
    moe = dataclasses.replace(FAMILIES["mixtral"], experts="eager").build()
    assert "set_experts_implementation('grouped_mm')" in export_hint(moe)
    assert export_hint(FAMILIES["mixtral"].build()) == ""  # grouped_mm: no loop to trace
