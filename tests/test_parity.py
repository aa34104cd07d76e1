"""End-to-end parity with PyTorch eager (fp32, dropout 0): every step's loss and the
final parameters, for several models, optimizers and trainer options."""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch

from ortrain import ORTTrainer, TrainerOptions
from tests.conftest import bert_batches, bert_mlm, bert_pretraining, decay_groups, gpt2, lm_batches

pytestmark = pytest.mark.shared_graphs  # many trainers of the same few models

LOSS_RTOL = 1e-4
PARAM_RTOL, PARAM_ATOL = 1e-4, 1e-5


def warmup(step: int) -> float:
    return min(1.0, (step + 1) / 5)


def run_both(
    make_model: Callable[[], torch.nn.Module],
    make_opt: Callable[[torch.nn.Module], torch.optim.Optimizer],
    batches: list[dict],
    options: TrainerOptions | None = None,
    schedule: bool = True,
):
    """Train an eager copy and an ORTTrainer copy side by side; returns both + trainer."""
    options = options or TrainerOptions()
    ref = make_model()
    model = copy.deepcopy(ref)
    opt_ref, opt = make_opt(ref), make_opt(model)
    sch_ref = torch.optim.lr_scheduler.LambdaLR(opt_ref, warmup) if schedule else None
    sch = torch.optim.lr_scheduler.LambdaLR(opt, warmup) if schedule else None
    trainer = ORTTrainer(model, opt, options)
    accum = options.grad_accumulation_steps
    losses_ref, losses = [], []
    for batch in batches:
        micro = [{k: v.chunk(accum)[i] for k, v in batch.items()} for i in range(accum)]
        opt_ref.zero_grad()
        for mb in micro:
            loss = ref(**mb).loss
            (loss / accum).backward()
            losses_ref.append(loss.item())
        if options.max_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(ref.parameters(), options.max_grad_norm)
        opt_ref.step()
        for mb in micro:
            losses.append(trainer.train_step(**mb).item())
        if schedule:
            sch_ref.step()
            sch.step()
    return ref, model, trainer, losses_ref, losses


def assert_parity(ref, model, trainer, losses_ref, losses):
    torch.testing.assert_close(
        torch.tensor(losses), torch.tensor(losses_ref), rtol=LOSS_RTOL, atol=0
    )
    trainer.sync_to_module()
    for (name, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        p, q = drop_key_bias(name, p, ref), drop_key_bias(name, q, ref)
        torch.testing.assert_close(
            p, q, rtol=PARAM_RTOL, atol=PARAM_ATOL, msg=lambda m, n=name: f"{n}: {m}"
        )
    # Training really moved the weights (the comparison is not between initial values).
    moved = [
        (p - q).abs().max().item() for p, q in zip(model.parameters(), make_initial(model, trainer))
    ]
    assert max(moved) > 1e-3


def drop_key_bias(name: str, p: torch.Tensor, model: torch.nn.Module) -> torch.Tensor:
    """Leave out attention key biases. Softmax is shift invariant, so their exact gradient
    is zero and the computed one is float32 rounding noise (~1e-7 of the logits' scale) in
    both implementations; Adam-type optimizers normalise that noise to steps of ~lr, so
    the two trajectories of those entries are arbitrary, not comparable."""
    if name.endswith("attention.self.key.bias"):
        return p[:0]
    if name.endswith("attn.c_attn.bias"):  # GPT-2 packs q|k|v biases in one tensor
        h = model.config.n_embd
        return torch.cat([p[:h], p[2 * h :]])
    return p


_initial: dict[int, list[torch.Tensor]] = {}


def make_initial(model, trainer):
    return _initial[id(trainer)]


def adamw(model):
    return torch.optim.AdamW(decay_groups(model, 0.01), lr=2e-3, betas=(0.9, 0.98), eps=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize(
    "name,make_model,batches",
    [
        ("gpt2", lambda: gpt2(layers=4, hidden=256), lambda: lm_batches(20)),
        ("bert_mlm", lambda: bert_mlm(), lambda: bert_batches(20)),
        ("bert_pretraining", lambda: bert_pretraining(), lambda: bert_batches(20, nsp=True)),
    ],
)
def test_adamw_param_groups_and_warmup(name, make_model, batches):
    init = copy.deepcopy(make_model())
    ref, model, trainer, lr_, lo = run_both(make_model, adamw, batches())
    _initial[id(trainer)] = [p.detach().clone() for p in init.parameters()]
    assert_parity(ref, model, trainer, lr_, lo)
    assert trainer.step == 20


def _check(make_model, make_opt, batches, options=None, schedule=True):
    init = [p.detach().clone() for p in make_model().parameters()]
    ref, model, trainer, lr_, lo = run_both(make_model, make_opt, batches, options, schedule)
    _initial[id(trainer)] = init
    assert_parity(ref, model, trainer, lr_, lo)
    return trainer


def small_gpt2():
    return gpt2(layers=2, hidden=64, vocab=256)


@pytest.mark.slow
def test_sgd_momentum_nesterov_weight_decay():
    def opt(m):
        return torch.optim.SGD(
            [
                {"params": [p for p in m.parameters() if p.ndim >= 2], "nesterov": True},
                {
                    "params": [p for p in m.parameters() if p.ndim < 2],
                    "momentum": 0.5,
                    "dampening": 0.1,
                },
            ],
            lr=0.5,
            momentum=0.9,
            weight_decay=1e-3,
        )

    _check(small_gpt2, opt, lm_batches(12, vocab=256))


@pytest.mark.slow
@pytest.mark.parametrize("engine", ["auto", "graph"])
def test_plain_sgd_and_adam_l2(engine):
    _check(small_gpt2, lambda m: torch.optim.SGD(m.parameters(), lr=0.3), lm_batches(6, vocab=256))
    _check(
        small_gpt2,
        lambda m: torch.optim.Adam(m.parameters(), lr=1e-3, eps=1e-6, weight_decay=0.05),
        lm_batches(6, vocab=256),
        TrainerOptions(update_engine=engine),
    )


@pytest.mark.slow
def test_lamb_matches_eager_lamb():
    from ortrain.optim import Lamb

    def opt(m):
        return Lamb(decay_groups(m, 0.01), lr=5e-3, betas=(0.9, 0.999), eps=1e-6)

    _check(lambda: bert_mlm(hidden=64), opt, bert_batches(12))


# "auto" updates Adam/AdamW on CPU with torch's fused kernels; "graph" with the update graph.
@pytest.mark.slow
@pytest.mark.parametrize("engine", ["auto", "graph"])
def test_gradient_clipping(engine):
    options = TrainerOptions(max_grad_norm=0.05, update_engine=engine)
    trainer = _check(small_gpt2, adamw, lm_batches(8, vocab=256), options)
    assert trainer.last_grad_norm > 0.05  # clipping was active, not a no-op
    assert (trainer.update_graph is None) == (engine == "auto")


@pytest.mark.slow
@pytest.mark.parametrize("engine", ["auto", "graph"])
def test_gradient_accumulation_micro_batches(engine):
    _check(
        small_gpt2,
        adamw,
        lm_batches(6, batch=4, vocab=256),
        TrainerOptions(grad_accumulation_steps=2, update_engine=engine),
    )


@pytest.mark.slow
def test_gradient_accumulation_equals_one_big_batch():
    ref = small_gpt2()
    model = copy.deepcopy(ref)
    opt_ref = adamw(ref)
    trainer = ORTTrainer(model, adamw(model), TrainerOptions(grad_accumulation_steps=4))
    for batch in lm_batches(5, batch=8, vocab=256):
        opt_ref.zero_grad()
        big = ref(**batch).loss
        big.backward()
        opt_ref.step()
        micro = [
            trainer.train_step(**{k: v.chunk(4)[i] for k, v in batch.items()}).item()
            for i in range(4)
        ]
        assert sum(micro) / 4 == pytest.approx(big.item(), rel=LOSS_RTOL)
    for (name, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        p, q = drop_key_bias(name, p, ref), drop_key_bias(name, q, ref)
        torch.testing.assert_close(p, q, rtol=PARAM_RTOL, atol=PARAM_ATOL)
    assert trainer.step == 5


def test_frozen_parameters_get_no_gradient_nodes():
    def make():
        m = small_gpt2()
        m.transformer.wpe.weight.requires_grad_(False)
        for p in m.transformer.h[0].parameters():
            p.requires_grad_(False)
        return m

    def opt(m):
        return torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=1e-3)

    ref_init = make()
    trainer = _check(make, opt, lm_batches(5, vocab=256))
    model = trainer.module
    frozen = ["transformer.wpe.weight"] + [
        f"transformer.h.0.{n}" for n, _ in model.transformer.h[0].named_parameters()
    ]
    graph = trainer.train_graphs[0]
    outputs = {v.name for v in graph.graph.outputs}
    for name in frozen:
        assert f"grad:{name}" not in outputs
        assert torch.equal(
            dict(model.named_parameters())[name], dict(ref_init.named_parameters())[name]
        )
    # Only the token embedding is scattered into; the frozen position embedding is not.
    row_scatters = [
        n
        for n in graph.graph
        if (n.op_type == "ScatterElements" and n.attributes.get_int("axis", 0) == 0)
        or n.op_type
        == "ScatterAddRows"  # the CPU kernel (graph_passes/targets/cpu/scatter_rows.py)
    ]
    assert len(row_scatters) == 1
    # No gradient node reads a frozen parameter's Gemm weight path: the first block's
    # weight-gradient Gemms (transA=1 on its inputs) are absent.
    assert f"grad:{frozen[1]}" not in outputs


@pytest.mark.slow
@pytest.mark.parametrize("which", ["adamw-clip", "sgd-momentum"])
def test_update_in_pieces_matches_eager(monkeypatch, which):
    """The update graph cuts each param group's flat buffer into chains of at most
    ``PIECE`` elements; with a tiny (unaligned) piece the cuts fall inside tensors and
    between groups' ends: the same losses and parameters as eager, and one chain per
    piece."""
    from ortrain.runtime import flat_update

    monkeypatch.setattr(flat_update, "PIECE", 3001)
    if which == "adamw-clip":
        make_opt, options = adamw, TrainerOptions(max_grad_norm=0.05, update_engine="graph")
    else:
        make_opt = lambda m: torch.optim.SGD(  # noqa: E731
            decay_groups(m, 1e-3), lr=0.3, momentum=0.9, nesterov=True
        )
        options = TrainerOptions()
    trainer = _check(small_gpt2, make_opt, lm_batches(6, vocab=256), options)
    numel = sum(p.numel() for p in small_gpt2().parameters())
    pieces = [v.name for v in trainer.update_graph.graph.inputs if v.name.startswith("flat.")]
    assert len(pieces) >= numel // 3001 + 1 and len(pieces) <= numel // 3001 + 2, len(pieces)
