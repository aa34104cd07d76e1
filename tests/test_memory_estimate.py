"""ortrain.estimate_memory against what a trainer holds (ORTTrainer.state_bytes), and its
arithmetic per ZeRO stage. The distributed stages are measured in test_distributed.py."""

from __future__ import annotations

import pytest
import torch

from ortrain import ORTTrainer, TrainerOptions, estimate_memory
from ortrain.distributed.shard_config import IN_FLIGHT
from ortrain.memory_estimate import storage_bytes
from tests.conftest import gpt2, lm_batches


@pytest.mark.parametrize(
    "make_opt,states,engine",
    [
        (lambda ps: torch.optim.AdamW(ps, lr=1e-3), 2, "graph"),
        (lambda ps: torch.optim.AdamW(ps, lr=1e-3), 2, "auto"),  # the update in the backward
        (lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9), 1, "auto"),
    ],
    ids=["adamw-graph", "adamw-auto", "sgd-momentum"],
)
def test_a_single_process_holds_what_was_estimated(make_opt, states, engine):
    model = gpt2(layers=1, hidden=32, vocab=64)
    model.transformer.wpe.weight.requires_grad_(False)  # frozen: no gradient, no state
    opt = make_opt([p for p in model.parameters() if p.requires_grad])
    est = estimate_memory(model, optimizer=opt)
    trainer = ORTTrainer(model, opt, TrainerOptions(intra_op_threads=1, update_engine=engine))
    trainer.train_step(**lm_batches(1, batch=2, vocab=64)[0])
    held = trainer.state_bytes()
    psi = sum(p.numel() for p in model.parameters() if p.requires_grad)  # tied: once
    whole = sum(p.numel() for p in model.parameters())
    assert (est.parameters, est.gradients, est.optimizer_state) == (
        4 * whole,
        4 * psi,
        4 * states * psi,
    )
    assert held.parameters == est.parameters
    if trainer.update_engine.in_backward:  # each gradient dies at its update: none kept
        assert held.gradients == 0
    else:
        assert held.gradients == est.gradients
    assert held.optimizer_state == est.optimizer_state
    assert held.in_flight == est.in_flight == 0
    assert "optimizer state" in held.format() and f"{held.total / 2**20:.1f}" in held.format()


def test_an_optimizer_s_own_step_is_sized_by_the_state_it_keeps():
    """RMSprop (centered, momentum) keeps three tensors the size of each parameter, and
    a step count each; Adafactor's factored moments are not sized, and it says so."""
    model = gpt2(layers=1, hidden=32, vocab=64)
    opt = torch.optim.RMSprop(model.parameters(), lr=1e-3, momentum=0.9, centered=True)
    est = estimate_memory(model, optimizer=opt)
    with pytest.warns(UserWarning, match="own step"):
        trainer = ORTTrainer(model, opt, TrainerOptions(intra_op_threads=1))
    trainer.train_step(**lm_batches(1, batch=2, vocab=64)[0])
    psi = sum(p.numel() for p in model.parameters())
    assert est.optimizer_state == 4 * 3 * psi
    counts = len(opt.state)  # a float32 step per parameter
    assert counts == len(list(model.parameters()))
    assert trainer.state_bytes().optimizer_state == est.optimizer_state + 4 * counts
    assert estimate_memory(model, 4, 2, optimizer=opt).optimizer_state == 4 * 3 * psi // 4
    import transformers

    factored = transformers.optimization.Adafactor(model.parameters(), lr=1e-3, relative_step=False)
    with pytest.raises(ValueError, match="Adafactor keeps a state ortrain cannot size"):
        estimate_memory(model, optimizer=factored)


def test_stages_shard_what_the_zero_papers_say():
    """Per rank at N ranks, Adam: data parallel 16 bytes per parameter, ZeRO-1 4 + 4 + 8/N,
    ZeRO-2 4 + 4/N + 8/N (plus the buckets in flight)."""
    model = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(6)])
    psi = sum(p.numel() for p in model.parameters())
    block = 64 * 64 + 64
    n = 4
    dp, z1, z2 = (estimate_memory(model, n, s, "adam", reduce_bucket_mb=0.01) for s in (0, 1, 2))
    assert dp.total == 16 * psi
    assert z1.total == 4 * psi + 4 * psi + 8 * psi // n
    # a bucket closes at the first parameter boundary past its size: up to a block's
    # largest parameter more
    bucket = int(0.01 * 2**20) // 4 + 64 * 64
    # the Linears are repeated blocks: the buckets one's gradients are written into (none
    # reaching past its ends) and the buckets on their way, each with a bucket's worth
    # beside it for the stretches its owners receive
    assert z2.in_flight == 4 * (IN_FLIGHT * 2 * bucket + block)
    assert z2.total - z2.in_flight == 4 * psi + 4 * psi // n + 8 * psi // n
    one = estimate_memory(model, 1, 2, "adam")  # one rank: no sharding, whatever the stage
    assert one.zero_stage == 0 and one.total == dp.total
    with pytest.raises(ValueError, match="zero_stage"):
        estimate_memory(model, 2, 4)
    with pytest.raises(ValueError, match="optimizer"):
        estimate_memory(model, 2, 1, "rmsprop-ish")


def test_storage_bytes_counts_a_shared_buffer_once():
    flat = torch.zeros(100)
    assert storage_bytes([flat[:10], flat[10:50], flat]) == 400
    assert storage_bytes([torch.zeros(3), torch.zeros(3)]) == 24


@pytest.mark.parametrize("segments", ["auto", "blocks"])
def test_memory_report_accounts_for_the_rank_by_class(segments):
    model = gpt2(layers=2, hidden=32, vocab=64)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    trainer = ORTTrainer(
        model, opt, TrainerOptions(intra_op_threads=1, segments=segments, verify=False)
    )
    with pytest.raises(RuntimeError, match="run train_step first"):
        trainer.memory_report()
    for b in lm_batches(2, batch=2, vocab=64):
        trainer.train_step(**b)
    rep = trainer.memory_report()
    assert rep.states == trainer.state_bytes()
    assert rep.buckets == rep.gathered == 0  # one process: nothing reduced or gathered
    # the process itself: torch and ONNX Runtime loaded, the model's tensors not in it
    assert 50 * 2**20 < rep.runtime < rep.measured_peak - rep.states.parameters
    assert rep.sessions >= 0  # resident bytes they added: 0 where freed memory was reused
    if segments == "blocks":
        assert rep.graph is None
        tally = trainer.segments.model.tally
        assert tally.held == 0  # every segment's saved tensors were released by its backward
        # at least one block's saved activations (batch 2 x 32 tokens x 32 wide, fp32)
        assert rep.activations == tally.peak >= 2 * 32 * 32 * 4
    else:
        assert rep.graph is not None
        assert 0 < rep.activations == rep.graph.arena_peak_bytes < rep.graph.planned_peak_bytes
    assert rep.total <= rep.measured_peak
    assert rep.unaccounted == rep.measured_peak - rep.total
    text = rep.format()
    assert "gathered parameters" in text and f"{rep.total / 2**20:.1f}" in text


def test_the_first_steps_whole_parameters_and_later_gathers_count_once():
    """ZeRO-3 plans its first step on whole parameters and shards them before any bucket
    or gather exists: the report's total counts the larger of the two, not both."""
    import dataclasses

    from ortrain.memory_estimate import StateBytes
    from ortrain.rank_memory import RankMemory

    states = StateBytes(
        world_size=2, zero_stage=3, parameters=100, gradients=100, in_flight=0, optimizer_state=200
    )
    base = RankMemory(states, 50, 30, 40, 0, 20, 10, 1000, 900, None)
    assert base.total == 50 + 400 + 30 + 40 + 20 + 10
    bigger = dataclasses.replace(base, first_step=100)
    assert bigger.total == base.total - 70 + 100
    smaller = dataclasses.replace(base, first_step=60)
    assert smaller.total == base.total
    # on CPU the shards of gradients and state are not taken before the first backward and
    # update: the first step's whole parameters are counted without them
    lazy = dataclasses.replace(base, first_step=500, lazy_state=True)
    assert lazy.total == 50 + 100 + 500 + 20 + 10  # not 100 + 200 more
    assert dataclasses.replace(lazy, first_step=300).total == base.total  # 300 < 370
