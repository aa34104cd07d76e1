"""One rank of the distributed tests, started torchrun-style by tests/test_distributed.py:

    RANK=r WORLD_SIZE=n MASTER_ADDR=127.0.0.1 MASTER_PORT=p python -m tests.dist_worker SCENARIO OUT

train   data parallel, then ZeRO-1 (which also writes a sharded checkpoint, a consolidated
        state dict and the LR scheduler's state after RESUME_AT steps) on per-rank batches
resume  ZeRO-1 from that sharded checkpoint, for the remaining steps
reshard ZeRO-1 on another world size loads that checkpoint and consolidates it again
loop    data-parallel steps until the test kills or stops a rank (fault tests; the
        timeout comes from ORTRAIN_TEST_TIMEOUT)
overflow  data parallel and ZeRO-1 with loss scaling: rank 1 alone overflows one step;
        every rank must skip that update and keep its state
segmented data parallel, then ZeRO-1, of a model that trains as compiled segments (its
        loss's label smoothing is lost in the export: the first step disagrees with eager)
zero2   ZeRO-2 (sharded checkpoint after RESUME_AT steps); zero2_resume continues from it
reorder ZeRO-3 on a model whose blocks run in reverse order on some micro-steps (the
        order its gathers are prefetched along changes)
eager_reads ZeRO-3 on a model whose eager code reads parameters (its root's forward, a
        module that falls back to eager, a weight tied by hand)
rmsprop data parallel with an optimizer ortrain does not compile (its own step, in eager)
layer_drop data parallel of a model that skips blocks at random: the same coins on every
        rank, then each rank its own
reentrant ZeRO-2 of a model whose blocks run inside reentrant activation checkpoints
bucketed data parallel or ZeRO-2/3 (ORTRAIN_TEST_STAGE) with bucketing on, each rank a
        length of its own every micro-step
landing ZeRO-``ORTRAIN_TEST_STAGE`` without clipping or accumulation: the update in the
        backward (or the engine ORTRAIN_TEST_ENGINE names), a sharded checkpoint halfway
landing_table the same over a tied table whose gradient goes as factors, against the
        update after the backward (max_grad_norm=inf)
detached ZeRO-2/3 of a model whose backward reads a weight after its gradient arrived
elementwise ZeRO-1/2/3 (ORTRAIN_TEST_STAGE) with an optimizer ortrain does not compile
        that works element by element (ORTRAIN_TEST_OPT): its own step on the shard; a
        sharded checkpoint after two optimizer steps (ORTRAIN_TEST_RESUME: resumed from it)

The same loop runs single-process in the test (``world=1``) on the combined batches.
Each rank's model starts from a different seed: the trainer must broadcast rank 0's.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import os
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import torch

from ortrain import ORTTrainer, RankFailureError, TrainerOptions, estimate_memory
from ortrain.core.roles import Role
from ortrain.runtime.update_engines import GraphUpdate, ShardTorchUpdate
from tests.conftest import decay_groups, gpt2, lm_batches
from tests.unexportable import opaque_mul, smoothed_cross_entropy

STEPS, ACCUM, RESUME_AT = 6, 2, 3  # optimizer steps; micro-steps per step; checkpoint step
PER_RANK = 2  # sequences per rank per micro-step
CLIP = 0.5  # below the gradient norms of this workload: clipping is active


def warmup(step: int) -> float:
    return min(1.0, (step + 1) / 5)


def make_trainer(
    zero_stage: int,
    seed: int = 0,
    timeout: float = 120.0,
    group=None,
    layers: int = 2,
    vocab: int = 128,
    sgd: bool = False,
    hidden: int = 64,
    **options: Any,
):
    model = gpt2(layers=layers, hidden=hidden, vocab=vocab, seed=seed)
    if sgd:
        opt = torch.optim.SGD(decay_groups(model, 0.01), lr=0.05, momentum=0.9)
    else:
        opt = torch.optim.AdamW(decay_groups(model, 0.01), lr=2e-3, betas=(0.9, 0.98), eps=1e-6)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, warmup)
    options = TrainerOptions(
        zero_stage=zero_stage,
        max_grad_norm=CLIP,
        grad_accumulation_steps=ACCUM,
        intra_op_threads=1,
        dist_timeout=timeout,
        process_group=group,
        **options,
    )
    return ORTTrainer(model, opt, options), sched


def micro_batches(
    rank: int, world: int, total: int = 2 * PER_RANK
) -> list[dict[str, torch.Tensor]]:
    """Micro-step i of rank r: its slice of the combined micro-batch i of ``total``
    sequences (world=1: all)."""
    combined = lm_batches(STEPS * ACCUM, batch=total, vocab=128, seed=11)
    per = total // world
    return [{k: v[rank * per : (rank + 1) * per] for k, v in b.items()} for b in combined]


def run(trainer: ORTTrainer, sched, batches: list[dict], start: int, stop: int) -> list[float]:
    """Micro-steps [start, stop); the scheduler steps after each optimizer step."""
    losses = []
    for i in range(start, stop):
        losses.append(trainer.train_step(**batches[i]).item())
        if (i + 1) % ACCUM == 0 and sched is not None:
            sched.step()
    return losses


def state_bytes(trainer: ORTTrainer) -> dict[str, Any]:
    """Optimizer-state bytes of what the shard's update reads and writes (the update
    graph's bound OrtValues, or the pieces torch's kernels update), and of the storages
    behind them."""
    engine = trainer.update_engine
    if isinstance(engine, ShardTorchUpdate):
        values = [t for _, _, avg, avg_sq in engine.groups for t in (*avg, *avg_sq)]
        storages = {
            t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
            for t in trainer.opt_state.values()
        }
    else:
        assert isinstance(engine, GraphUpdate) and engine.name == "zero1"
        graph, session = engine.graph, engine.session
        assert graph is not None and session is not None
        names = [io.name for io in graph.io if io.role is Role.OPTIMIZER_STATE]
        values = [session.bound_inputs[n] for n in names]
        storages = {
            t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
            for t in (trainer.opt_state[n] for n in names)
        }
    bound = sum(v.numel() * v.element_size() for v in values)
    ptrs = sorted((v.data_ptr(), v.numel() * v.element_size()) for v in values)
    overlap = any(a + n > b for (a, n), (b, _) in itertools.pairwise(ptrs))
    return {"bound": bound, "storage": sum(storages.values()), "overlap": overlap}


def params(trainer: ORTTrainer) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in trainer.module.named_parameters()}


def scenario_train(rank: int, world: int, out: Path) -> dict[str, Any]:
    batches = micro_batches(rank, world)
    result: dict[str, Any] = {}
    trainer, sched = make_trainer(0, seed=rank)
    result["dp_losses"] = run(trainer, sched, batches, 0, STEPS * ACCUM)
    result["dp_grad_norm"] = trainer.last_grad_norm
    if rank == 0:
        torch.save(params(trainer), out / "dp_params.pt")

    trainer, sched = make_trainer(1, seed=rank)
    mid = RESUME_AT * ACCUM
    losses = run(trainer, sched, batches, 0, mid)
    trainer.save_checkpoint(out / "sharded")
    consolidated = trainer.state_dict()
    if rank == 0:
        torch.save(consolidated, out / "consolidated_mid.pt")
        torch.save(sched.state_dict(), out / "sched_mid.pt")
    else:
        assert consolidated == {}
    losses += run(trainer, sched, batches, mid, STEPS * ACCUM)
    result["zero_losses"] = losses
    result["zero_grad_norm"] = trainer.last_grad_norm
    result["zero_state_bytes"] = state_bytes(trainer)
    layout = trainer.reducer.config.layout  # type: ignore[union-attr]
    result["layout"] = {"padding": layout.padding, "numel": layout.numel}
    final = trainer.state_dict()
    if rank == 0:
        torch.save(params(trainer), out / "zero_params.pt")
        torch.save(final, out / "zero_state_dict.pt")
    return result


def scenario_resume(rank: int, world: int, out: Path) -> dict[str, Any]:
    batches = micro_batches(rank, world)
    trainer, sched = make_trainer(1, seed=rank + 100)  # the checkpoint replaces everything
    trainer.load_checkpoint(out / "sharded")
    sched.load_state_dict(torch.load(out / "sched_mid.pt", weights_only=True))
    losses = run(trainer, sched, batches, RESUME_AT * ACCUM, STEPS * ACCUM)
    if rank == 0:
        torch.save(params(trainer), out / "resumed_params.pt")
    return {"losses": losses}


def scenario_reshard(rank: int, world: int, out: Path) -> dict[str, Any]:
    """Another world size loads the 2-rank sharded checkpoint (over a group passed in)."""
    group = torch.distributed.new_group(list(range(world)))
    trainer, _ = make_trainer(1, seed=rank, group=group)
    trainer.load_checkpoint(out / "sharded")
    state = trainer.state_dict()
    if rank == 0:
        torch.save(state, out / f"resharded{world}.pt")
    return {"empty": state == {}, "shard_numel": trainer.reducer.config.layout.shard_numel}


def scenario_overflow(rank: int, world: int, out: Path) -> dict[str, Any]:
    from ortrain.loss_scaler import DynamicLossScale

    batches = micro_batches(rank, world)
    result: dict[str, Any] = {}
    for stage in (0, 1):
        model = gpt2(layers=1, hidden=64, vocab=128, seed=0)
        opt = torch.optim.AdamW(model.parameters(), lr=2e-3)
        options = TrainerOptions(
            zero_stage=stage,
            grad_accumulation_steps=ACCUM,
            intra_op_threads=1,
            loss_scale=DynamicLossScale(initial=1024.0),
        )
        trainer = ORTTrainer(model, opt, options)
        run(trainer, None, batches, 0, ACCUM)  # one good step
        before = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).clone()
        if rank == 1:  # only this rank's gradients overflow (sum of squares > fp32 max)
            assert trainer.scaler is not None
            trainer.scaler.scale = 2.0**120
        run(trainer, None, batches, ACCUM, 2 * ACCUM)
        after = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
        result[f"stage{stage}"] = {
            "step": trainer.step,
            "skipped": trainer.skipped_steps,
            "unchanged": bool(torch.equal(before, after)),
            "checksum": float(after.double().sum()),
        }
    return result


def scenario_loop(rank: int, world: int, out: Path) -> dict[str, Any]:
    batches = micro_batches(rank, world)
    timeout = float(os.environ["ORTRAIN_TEST_TIMEOUT"])  # set by the fault tests
    stage = int(os.environ.get("ORTRAIN_TEST_STAGE", "0"))
    trainer, _ = make_trainer(stage, seed=0, timeout=timeout, layers=1)  # any model will do
    step = 0
    try:
        while True:
            trainer.train_step(**batches[step % len(batches)])
            step += 1
            print(f"STEP {step}", flush=True)
    except RankFailureError as exc:
        print(f"FAILED at {time.time():.3f} ranks={exc.ranks}: {exc}", flush=True)
        sys.exit(3)


def smoothed_loss(out, batch) -> torch.Tensor:
    """A loss the exporter cannot translate: the model trains as segments."""
    logits = out.logits[:, :-1].flatten(0, 1)
    labels = batch["labels"][:, 1:].flatten()
    return smoothed_cross_entropy(logits, labels, 0.1)


def make_segmented(zero_stage: int, seed: int = 0) -> ORTTrainer:
    model = gpt2(layers=1, hidden=64, vocab=128, seed=seed)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    options = TrainerOptions(
        zero_stage=zero_stage,
        max_grad_norm=CLIP,
        grad_accumulation_steps=ACCUM,
        intra_op_threads=1,
    )
    return ORTTrainer(model, opt, options, loss_fn=smoothed_loss)


def scenario_segmented(rank: int, world: int, out: Path) -> dict[str, Any]:
    batches = micro_batches(rank, world)
    result: dict[str, Any] = {}
    for stage in (0, 1):
        trainer = make_segmented(stage, seed=rank)
        result[f"stage{stage}"] = run(trainer, None, batches, 0, 2 * ACCUM)
        result[f"segments{stage}"] = sorted(trainer.segments.model.compiled)  # type: ignore[union-attr]
        if rank == 0:
            torch.save(params(trainer), out / f"segmented{stage}_params.pt")
    return result


ZERO2_TOTAL = 6  # sequences per combined micro-batch: splits over 2 and 3 ranks
ZERO2_BUCKET_MB = 0.05  # about 13k gradient elements: a 2-layer model has several buckets


def make_zero2(stage: int = 2, seed: int = 0, **options: Any):
    return make_trainer(stage, seed=seed, reduce_bucket_mb=ZERO2_BUCKET_MB, **options)


def _stage() -> int:
    return int(os.environ.get("ORTRAIN_TEST_STAGE", "2"))


def whole_params(trainer: ORTTrainer) -> dict[str, torch.Tensor]:
    """The parameters, gathered where ZeRO-3 shards them (a collective)."""
    materialized = getattr(trainer.reducer, "materialized", None)
    if materialized is None:
        return params(trainer)
    with materialized():
        return params(trainer)


def scenario_zero2(rank: int, world: int, out: Path) -> dict[str, Any]:
    """ZeRO-2 (or ZeRO-``ORTRAIN_TEST_STAGE``) over all the steps, a sharded checkpoint at
    RESUME_AT."""
    stage = _stage()
    tag = f"zero{stage}_{world}"
    batches = micro_batches(rank, world, ZERO2_TOTAL)
    trainer, sched = make_zero2(stage, seed=rank)
    opt = trainer.optimizer
    estimate = estimate_memory(trainer.module, world, stage, opt, reduce_bucket_mb=ZERO2_BUCKET_MB)
    mid = RESUME_AT * ACCUM
    # ZeRO-3: per acquire inside a backward, by a module other than the tied head, whether
    # the tied table was whole then (its last reader is the head's backward: dropped there)
    table_held: list[bool] = []
    # per forward acquire by a module that does not read the tied table, the same
    table_held_fwd: list[bool] = []
    table_gathers = [0]  # gathers that brought the tied table (read twice in a forward)
    if stage == 3:
        home = trainer.reducer
        acquire, start = home.acquire, home._start  # type: ignore[union-attr]
        assert trainer.module.lm_head.weight is trainer.module.transformer.wte.weight

        def watched(module: torch.nn.Module, only: Any = None) -> None:
            acquire(module, only)
            in_backward = torch._C._current_autograd_node() is not None
            held = "transformer.wte.weight" in home.gathered  # type: ignore[union-attr]
            if in_backward and module is not trainer.module.lm_head:
                table_held.append(held)
            readers = (trainer.module.lm_head, trainer.module.transformer.wte)
            if not in_backward and all(module is not m for m in readers):
                table_held_fwd.append(held)

        def counted(names: list[str]) -> Any:
            table_gathers[0] += "transformer.wte.weight" in names
            return start(names)

        home.acquire = watched  # type: ignore[union-attr]
        home._start = counted  # type: ignore[union-attr]
    losses = run(trainer, sched, batches, 0, mid)
    table_gathers_mid = table_gathers[0]  # before the checkpoint's and evaluation's gathers
    reducer = trainer.reducer
    training_gathered = getattr(reducer, "peak_gathered_numel", 0)
    between = [p.numel() for p in trainer.module.parameters()]
    report = trainer.memory_report()
    memory = {**dict(report.rows()), "states_match": report.states == trainer.state_bytes()}
    trainer.save_checkpoint(out / tag)
    if rank == 0:
        torch.save(sched.state_dict(), out / f"{tag}_sched.pt")
    losses += run(trainer, sched, batches, mid, STEPS * ACCUM)
    eval_loss = float(trainer.eval_step(**micro_batches(0, 1, ZERO2_TOTAL)[0]).loss)
    reducer = trainer.reducer
    layout = reducer.config.layout  # type: ignore[union-attr]
    segments = trainer.segments
    assert segments is not None and segments.model is not None
    result = {
        "losses": losses,
        "grad_norm": trainer.last_grad_norm,
        "whole_grads": len(trainer.grads),
        "flat_grads": reducer.flat_grads is not None,  # type: ignore[union-attr]
        "grad_shard": reducer.grad_shard.numel(),  # type: ignore[union-attr]
        "shard_numel": layout.shard_numel,
        "numel": layout.numel,
        "buckets": list(reducer.bucket_sizes()),  # type: ignore[union-attr]
        "peak_open": reducer.peak_open_numel,  # type: ignore[union-attr]
        "compiled": sorted(segments.model.compiled),
        "builds": segments.model.builds,
        "engine": trainer.update_engine.name,
        "state_bytes": dataclasses.asdict(trainer.state_bytes()),
        "estimate": dataclasses.asdict(estimate),
        "padding": layout.padding,
        "training_gathered": training_gathered,
        "prefetched": getattr(reducer, "prefetched_numel", 0),
        "buckets_reused": reducer.bucket_pool.reused,  # type: ignore[union-attr]
        "buckets_kept": reducer.bucket_pool.free_numel,  # type: ignore[union-attr]
        "buckets_made": reducer.bucket_pool.made,  # type: ignore[union-attr]
        "gathers_reused": getattr(getattr(reducer, "gather_pool", None), "reused", 0),
        "gathers_in_place": getattr(reducer, "gathered_in_place", 0),
        "outputs_reused": segments.model.outputs.reused if segments.model.outputs else 0,
        "tied_rows_added": segments.model.tied.added_count,
        "routed": list(reducer.routed),  # type: ignore[union-attr]
        "table_held_in_backward": table_held,
        "table_held_in_forward": table_held_fwd,
        "written_in_place": reducer.written_in_place,  # type: ignore[union-attr]
        "table_gathers": table_gathers_mid,
        "micro_steps_mid": mid,
        "numel_between_steps": sum(between),
        "param_shard": getattr(reducer, "param_shard", torch.empty(0)).numel(),
        "eval_loss": eval_loss,
        "memory_report": memory,
    }
    final = trainer.state_dict()
    whole = whole_params(trainer)
    if rank == 0:
        torch.save(whole, out / f"{tag}_params.pt")
        torch.save(final, out / f"{tag}_state.pt")
    return result


# few tokens against a large tied table: one 16-token sequence per rank (16 is a bucket
# length: no padding); a rank holds (world + 1) x 16 x (4096 + width) elements of
# factors at once, less than the 4096 x width table (width 64 up to 2 ranks, 128 to 3)
FACTORED_VOCAB, FACTORED_SEQ = 4096, 16


def factored_width(world: int) -> int:
    return 64 if world <= 2 else 128


def make_factored(stage: int = 2, seed: int = 0, world: int = 2):
    """SGD: the table's gradient is summed in another order than one process sums it, and
    AdamW's normalisation would make that float noise lr-sized in near-zero elements."""
    return make_trainer(
        stage,
        seed=seed,
        vocab=FACTORED_VOCAB,
        hidden=factored_width(world),
        sgd=True,
        reduce_bucket_mb=ZERO2_BUCKET_MB,
    )


def factored_batches(rank: int, world: int, total: int) -> list[dict[str, torch.Tensor]]:
    combined = lm_batches(
        STEPS * ACCUM, batch=total, seq=FACTORED_SEQ, vocab=FACTORED_VOCAB, seed=12
    )
    per = total // world
    return [{k: v[rank * per : (rank + 1) * per] for k, v in b.items()} for b in combined]


def scenario_factored(rank: int, world: int, out: Path) -> dict[str, Any]:
    """ZeRO-``ORTRAIN_TEST_STAGE`` where the tied head's gradient goes as factors."""
    stage = _stage()
    trainer, sched = make_factored(stage, seed=rank, world=world)
    table_gathers = [0]  # gathers that brought the whole tied table
    if stage == 3:
        start = trainer.reducer._start  # type: ignore[union-attr]

        def counted(names: list[str]) -> Any:
            table_gathers[0] += "transformer.wte.weight" in names
            return start(names)

        trainer.reducer._start = counted  # type: ignore[union-attr]
    losses = run(trainer, sched, factored_batches(rank, world, world), 0, STEPS * ACCUM)
    reducer = trainer.reducer
    result = {
        "losses": losses,
        "grad_norm": trainer.last_grad_norm,
        "routed": list(reducer.routed),  # type: ignore[union-attr]
        "rows_gathered": reducer.rows_gathered,  # type: ignore[union-attr]
        "factors_gathered": reducer.factors_gathered,  # type: ignore[union-attr]
        "embedding_rows": getattr(reducer, "rows_gathered_numel", 0),
        "table_gathers": table_gathers[0],
        "peak_open": reducer.peak_open_numel,  # type: ignore[union-attr]
        "table_numel": FACTORED_VOCAB * factored_width(world),
    }
    whole = whole_params(trainer)
    if rank == 0:
        torch.save(whole, out / f"factored{stage}_{world}_params.pt")
    return result


class Reordered(torch.nn.Module):
    """Blocks of one structure, run in reverse order where ``reverse`` is set (by the loop,
    alike on every rank and in the single process)."""

    def __init__(self, seed: int):
        super().__init__()
        torch.manual_seed(seed)
        self.inp = torch.nn.Linear(6, 16)
        self.blocks = torch.nn.ModuleList(
            torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Tanh()) for _ in range(3)
        )
        self.out = torch.nn.Linear(16, 1)
        self.reverse = False

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for block in reversed(self.blocks) if self.reverse else self.blocks:
            h = block(h)
        return torch.nn.functional.mse_loss(self.out(h), y)


REORDER_STEPS = 9  # micro-steps; every third runs the blocks in reverse


def reorder_batches(rank: int, world: int) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(5)
    per = 6 // world
    out = []
    for _ in range(REORDER_STEPS):
        x, y = torch.randn(6, 6, generator=g), torch.randn(6, 1, generator=g)
        out.append({"x": x[rank * per : (rank + 1) * per], "y": y[rank * per : (rank + 1) * per]})
    return out


def train_reordered(stage: int, seed: int, batches: list[dict]) -> tuple[ORTTrainer, list[float]]:
    model = Reordered(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    options = TrainerOptions(
        zero_stage=stage, segments="blocks", intra_op_threads=1, reduce_bucket_mb=0.001
    )
    trainer = ORTTrainer(model, opt, options, loss_fn=lambda out, batch: out)
    losses = []
    for i, batch in enumerate(batches):
        model.reverse = i % 3 == 2
        losses.append(trainer.train_step(**batch).item())
    return trainer, losses


def scenario_reorder(rank: int, world: int, out: Path) -> dict[str, Any]:
    trainer, losses = train_reordered(3, rank, reorder_batches(rank, world))
    whole = whole_params(trainer)
    if rank == 0:
        torch.save(whole, out / "reorder_params.pt")
    reducer = trainer.reducer
    names = {id(m): n for n, m in trainer.module.named_modules()}
    return {
        "losses": losses,
        "prefetched": reducer.prefetched_numel,  # type: ignore[union-attr]
        "trace": [names[id(a.module)] for a in reducer._trace],  # type: ignore[union-attr]
    }


class TokenBlocks(torch.nn.Module):
    """Token embeddings, two per-token blocks and a head: batches of any length."""

    def __init__(self, seed: int):
        super().__init__()
        torch.manual_seed(seed)
        self.emb = torch.nn.Embedding(20, 16)
        self.blocks = torch.nn.ModuleList(
            torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Tanh()) for _ in range(2)
        )
        self.out = torch.nn.Linear(16, 20)

    def forward(self, ids: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.emb(ids)
        for block in self.blocks:
            h = block(h)
        return torch.nn.functional.cross_entropy(self.out(h).flatten(0, 1), y.flatten())


NEW_SHAPE_LENGTHS = (6, 6, 9, 9, 12)


def new_shape_batches(rank: int, world: int) -> list[dict[str, torch.Tensor]]:
    """Six rows a step, cut among the ranks; the length changes after the first step."""
    g = torch.Generator().manual_seed(6)
    per = 6 // world
    out = []
    for n in NEW_SHAPE_LENGTHS:
        ids, y = (
            torch.randint(0, 20, (6, n), generator=g),
            torch.randint(0, 20, (6, n), generator=g),
        )
        out.append(
            {"ids": ids[rank * per : (rank + 1) * per], "y": y[rank * per : (rank + 1) * per]}
        )
    return out


def train_new_shapes(stage: int, batches: list[dict]) -> tuple[ORTTrainer, list[float]]:
    model = TokenBlocks(0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    # bucketing off: every length is a call signature of its own
    options = TrainerOptions(
        zero_stage=stage, segments="blocks", intra_op_threads=1, bucketing="off"
    )
    trainer = ORTTrainer(model, opt, options, loss_fn=lambda out, batch: out)
    return trainer, [trainer.train_step(**b).item() for b in batches]


def scenario_new_shapes(rank: int, world: int, out: Path) -> dict[str, Any]:
    trainer, losses = train_new_shapes(3, new_shape_batches(rank, world))
    whole = whole_params(trainer)
    if rank == 0:
        torch.save(whole, out / "new_shapes_params.pt")
    segments = trainer.segments
    assert segments is not None and segments.model is not None
    return {"losses": losses, "compiled": sorted(segments.model.compiled)}


# per micro-step, each rank's length (ranks differ): the first as given, the rest padded
BUCKETED_LENGTHS = ((6, 7), (6, 11), (13, 6), (10, 9), (12, 14), (5, 17), (20, 3), (8, 8))


def bucketed_batches(world: int) -> list[list[dict[str, torch.Tensor]]]:
    """Per micro-step, every rank's batch: three rows of that rank's length."""
    g = torch.Generator().manual_seed(9)

    def batch(n: int) -> dict[str, torch.Tensor]:
        ids = torch.randint(0, 20, (3, n), generator=g)
        return {"ids": ids, "y": torch.randint(0, 20, (3, n), generator=g)}

    return [[batch(n) for n in lengths[:world]] for lengths in BUCKETED_LENGTHS]


def scenario_bucketed(rank: int, world: int, out: Path) -> dict[str, Any]:
    """Data parallel (one graph per length) or ZeRO-``ORTRAIN_TEST_STAGE`` (segments)
    with bucketing on, ranks of other lengths each step."""
    stage = _stage()
    model = TokenBlocks(rank)  # rank 0's weights are broadcast
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    segments = "blocks" if stage >= 2 else "auto"
    options = TrainerOptions(zero_stage=stage, segments=segments, intra_op_threads=1)
    trainer = ORTTrainer(model, opt, options, loss_fn=lambda out, batch: out)
    losses = [trainer.train_step(**per[rank]).item() for per in bucketed_batches(world)]
    whole = whole_params(trainer)
    if rank == 0:
        torch.save(whole, out / f"bucketed{stage}_params.pt")
    if trainer.segments is None:  # the lengths of its graphs
        graphs = trainer.train_graphs
        lengths = {v.shape[1] for m in graphs for v in m.graph.inputs if v.name == "ids"}
    else:  # of its first block's call signatures
        assert trainer.segments.model is not None
        lengths = {key[0] for key in trainer.segments.model.runners["blocks.0"]}
    return {
        "losses": losses,
        "compiled": len(lengths),
        "verdicts": [v.exact for v in trainer.bucketing.verdicts.values()],
    }


class SharedBlock(torch.nn.Module):
    """A block applied twice in one forward, apart (ALBERT-style sharing): two calls of one
    segment, its parameters' gradients added from both backwards."""

    def __init__(self, seed: int):
        super().__init__()
        torch.manual_seed(seed)
        self.inp = torch.nn.Linear(6, 16)
        self.blocks = torch.nn.ModuleList(
            torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Tanh()) for _ in range(2)
        )
        self.out = torch.nn.Linear(16, 1)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.blocks[0](self.inp(x))
        h = self.blocks[0](self.blocks[1](h))
        return torch.nn.functional.mse_loss(self.out(h), y)


def train_shared(stage: int, seed: int, batches: list[dict]) -> tuple[ORTTrainer, list[float]]:
    model = SharedBlock(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    options = TrainerOptions(
        zero_stage=stage, segments="blocks", intra_op_threads=1, reduce_bucket_mb=0.0005
    )
    trainer = ORTTrainer(model, opt, options, loss_fn=lambda out, batch: out)
    return trainer, [trainer.train_step(**b).item() for b in batches]


def scenario_shared(rank: int, world: int, out: Path) -> dict[str, Any]:
    stage = _stage()
    trainer, losses = train_shared(stage, rank, reorder_batches(rank, world))
    whole = whole_params(trainer)
    if rank == 0:
        torch.save(whole, out / f"shared{stage}_params.pt")
    assert trainer.segments is not None and trainer.segments.model is not None
    return {
        "losses": losses,
        "compiled": sorted(trainer.segments.model.compiled),
        "written_in_place": trainer.reducer.written_in_place,  # type: ignore[union-attr]
    }


class TemperedBlock(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(16, 16)
        self.temp = 1.0  # a Python value the loop changes

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.lin(h) / self.temp)


class Tempered(torch.nn.Module):
    def __init__(self, seed: int):
        super().__init__()
        torch.manual_seed(seed)
        self.inp = torch.nn.Linear(6, 16)
        self.blocks = torch.nn.ModuleList(TemperedBlock() for _ in range(3))
        self.out = torch.nn.Linear(16, 1)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for block in self.blocks:
            h = block(h)
        return torch.nn.functional.mse_loss(self.out(h), y)


TEMPS = {3: 2.0}  # micro-step -> the blocks' new temperature
TEMPERED_STEPS = 5


def train_tempered(
    stage: int, seed: int, batches: list[dict]
) -> tuple[ORTTrainer, list[float], list[str]]:
    """The trainer, its losses, and its compiled segments before the change."""
    model = Tempered(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    options = TrainerOptions(
        zero_stage=stage, segments="blocks", intra_op_threads=1, reduce_bucket_mb=0.0005
    )
    trainer = ORTTrainer(model, opt, options, loss_fn=lambda out, batch: out)
    losses, between = [], []
    for i, batch in enumerate(batches[:TEMPERED_STEPS]):
        for block in model.blocks if i in TEMPS else ():
            block.temp = TEMPS[i]
        losses.append(trainer.train_step(**batch).item())
        if i == min(TEMPS) - 1:
            assert trainer.segments is not None and trainer.segments.model is not None
            between = sorted(trainer.segments.model.compiled)
    return trainer, losses, between


def scenario_tempered(rank: int, world: int, out: Path) -> dict[str, Any]:
    trainer, losses, between = train_tempered(3, rank, reorder_batches(rank, world))
    whole = whole_params(trainer)
    if rank == 0:
        torch.save(whole, out / "tempered_params.pt")
    assert trainer.segments is not None and trainer.segments.model is not None
    return {
        "losses": losses,
        "compiled": sorted(trainer.segments.model.compiled),
        "before": between,
        "sharded": trainer.reducer.sharded,  # type: ignore[union-attr]
    }


class EagerReads(torch.nn.Module):
    """Parameters read by eager code: the root's own ``scale``, ``gate.w`` (the gate's
    product has no ONNX function: it runs in eager) and the embedding's weight, tied by
    hand as the output projection; on odd micro-steps the last block's call takes an
    argument no graph can take, so that call of a compiled module runs in eager."""

    def __init__(self, seed: int):
        super().__init__()
        torch.manual_seed(seed)
        self.embed = torch.nn.Embedding(32, 16)
        self.blocks = torch.nn.ModuleList(Block(16) for _ in range(2))
        self.gate = Gate(16)
        self.scale = torch.nn.Parameter(torch.linspace(0.5, 1.5, 16))
        self.odd = False  # set by the loop: the last block's call then runs in eager

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids) * self.scale
        for k, block in enumerate(self.blocks):
            h = block(h, Note() if self.odd and k == 1 else None)
        logits = self.gate(h) @ self.embed.weight.T
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())


class Note:
    """An argument no graph can take: a call given one runs in eager."""


class Block(torch.nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.linear = torch.nn.Linear(width, width)

    def forward(self, h: torch.Tensor, note: Note | None = None) -> torch.Tensor:
        return torch.tanh(self.linear(h))


class Gate(torch.nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.norm = torch.nn.LayerNorm(width)
        self.w = torch.nn.Parameter(torch.linspace(-1.0, 1.0, width))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return opaque_mul(self.norm(h), self.w)


EAGER_READS_STEPS = 6  # micro-steps


def eager_reads_batches(rank: int, world: int) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(11)
    per = 6 // world
    out = []
    for _ in range(EAGER_READS_STEPS):
        ids = torch.randint(0, 32, (6, 5), generator=g)
        labels = torch.randint(0, 32, (6, 5), generator=g)
        out.append(
            {
                "ids": ids[rank * per : (rank + 1) * per],
                "labels": labels[rank * per : (rank + 1) * per],
            }
        )
    return out


def train_eager_reads(
    stage: int, seed: int, batches: list[dict], clip: float | None = 1.0
) -> tuple[ORTTrainer, list[float]]:
    """``clip=None``: under ZeRO-3 the update runs in the backward ("zero-backward")."""
    model = EagerReads(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=2e-2)
    options = TrainerOptions(
        zero_stage=stage,
        segments="blocks",
        intra_op_threads=1,
        reduce_bucket_mb=0.001,
        max_grad_norm=clip,
    )
    trainer = ORTTrainer(model, opt, options, loss_fn=lambda out, batch: out)
    losses = []
    for i, batch in enumerate(batches):
        model.odd = i % 2 == 1
        losses.append(trainer.train_step(**batch).item())
        if i == 0:  # ZeRO-3: what its first micro-step's gathers got by prefetch
            trainer.first_prefetched = getattr(trainer.reducer, "prefetched_numel", 0)  # type: ignore[attr-defined]
    model.odd = False
    return trainer, losses


def scenario_eager_reads(rank: int, world: int, out: Path) -> dict[str, Any]:
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        clip = None if os.environ.get("ORTRAIN_TEST_CLIP") == "none" else 1.0
        trainer, losses = train_eager_reads(3, rank, eager_reads_batches(rank, world), clip)
    reducer = trainer.reducer
    held = {
        n: p.numel() for n, p in trainer.module.named_parameters()
    }  # between steps: whole only what eager code reads
    whole = whole_params(trainer)
    if rank == 0:
        torch.save(whole, out / "eager_reads_params.pt")
    assert trainer.segments is not None and trainer.segments.model is not None
    return {
        "losses": losses,
        "warnings": [str(w.message) for w in said],
        "first_prefetched": trainer.first_prefetched,  # type: ignore[attr-defined]
        "engine": trainer.update_engine.name,
        "whole": sorted(reducer.whole),  # type: ignore[union-attr]
        "held": held,
        "compiled": sorted(trainer.segments.model.compiled),
        "eval_loss": float(trainer.eval_step(**eager_reads_batches(0, 1)[0]).loss),
    }


def train_rmsprop(seed: int, batches: list[dict]) -> tuple[ORTTrainer, list[float]]:
    """Data parallel (one process: plain) with an optimizer ortrain does not compile: its
    own step runs in eager over the all-reduced gradients."""
    model = Reordered(seed)
    opt = torch.optim.RMSprop(model.parameters(), lr=1e-2, momentum=0.9, centered=True)
    options = TrainerOptions(intra_op_threads=1, max_grad_norm=0.5, grad_accumulation_steps=ACCUM)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (its update runs in eager: said once)
        trainer = ORTTrainer(model, opt, options, loss_fn=lambda out, batch: out)
    return trainer, [trainer.train_step(**b).item() for b in batches]


def scenario_rmsprop(rank: int, world: int, out: Path) -> dict[str, Any]:
    trainer, losses = train_rmsprop(rank, reorder_batches(rank, world))
    if rank == 0:
        torch.save(params(trainer), out / "rmsprop_params.pt")
    return {"losses": losses, "engine": trainer.program.update}


def train_frozen(batches: list[dict]) -> tuple[ORTTrainer, list[float]]:
    """Data parallel (one process: plain), the input layer frozen at the second step and
    thawed with the output layer frozen at the fourth, AdamW: the trainer lays the
    graphs and the update out anew at each change, alike on every rank."""
    model = Reordered(0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    trainer = ORTTrainer(
        model, opt, TrainerOptions(intra_op_threads=1), loss_fn=lambda out, batch: out
    )
    losses = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (laid out anew: said at each change)
        for i, b in enumerate(batches):
            if i in (1, 3):
                model.inp.requires_grad_(i == 3)
                model.out.requires_grad_(i == 1)
            losses.append(trainer.train_step(**b).item())
    return trainer, losses


class NormNet(torch.nn.Module):
    """A small CNN with BatchNorm: its running statistics are buffers every training
    forward writes, from each rank's own batch."""

    def __init__(self) -> None:
        super().__init__()
        nn = torch.nn
        self.net = nn.Sequential(
            nn.Conv2d(3, 8, 3, padding=1),
            nn.BatchNorm2d(8),
            nn.ReLU(),
            nn.AdaptiveAvgPool2d(1),
            nn.Flatten(),
            nn.Linear(8, 4),
        )

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.cross_entropy(self.net(x), y)


def scenario_batch_norm(rank: int, world: int, out: Path) -> dict[str, Any]:
    """ZeRO-``ORTRAIN_TEST_STAGE`` (or data parallel) over a BatchNorm model beside torch's
    DDP in the same group, ``broadcast_buffers`` as ``ORTRAIN_TEST_BROADCAST``: each rank's
    batches scaled apart, so that their running statistics differ; an evaluation after."""
    broadcast = os.environ.get("ORTRAIN_TEST_BROADCAST", "1") == "1"
    torch.manual_seed(0)
    model = NormNet()
    ref = NormNet()
    ref.load_state_dict(model.state_dict())
    g = torch.Generator().manual_seed(100 + rank)
    batches = [
        {"x": torch.randn(4, 3, 8, 8, generator=g) * (1 + rank), "y": torch.randint(0, 4, (4,))}
        for _ in range(4)
    ]
    options = TrainerOptions(zero_stage=_stage(), broadcast_buffers=broadcast, intra_op_threads=1)
    trainer = ORTTrainer(model, torch.optim.SGD(model.parameters(), lr=0.1), options)
    ddp = torch.nn.parallel.DistributedDataParallel(ref, broadcast_buffers=broadcast)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    losses, ref_losses = [], []
    for b in batches:
        losses.append(trainer.train_step(**b).item())
        opt.zero_grad()
        loss = ddp(**b)
        loss.backward()
        opt.step()
        ref_losses.append(loss.item())
    probe = {"x": torch.randn(4, 3, 8, 8, generator=torch.Generator().manual_seed(7))}
    probe["y"] = torch.arange(4)
    evaluated = float(trainer.eval_step(**probe).loss)
    ddp.eval()
    with torch.no_grad():
        ref_evaluated = float(ddp(**probe))  # DDP broadcasts its buffers before this forward
    whole = whole_params(trainer)  # a collective under ZeRO-3
    trainer.sync_to_module()
    buffers = dict(model.named_buffers())
    return {
        "losses": losses,
        "ref_losses": ref_losses,
        "eval": evaluated,
        "ref_eval": ref_evaluated,
        "buffer_diff": max(
            float((buffers[n].double() - b.double()).abs().max()) for n, b in ref.named_buffers()
        ),
        "running_mean": buffers["net.1.running_mean"].tolist(),
        "param_diff": max(
            float((whole[n] - q.detach()).abs().max()) for n, q in ref.named_parameters()
        ),
    }


def scenario_frozen(rank: int, world: int, out: Path) -> dict[str, Any]:
    trainer, losses = train_frozen(reorder_batches(rank, world))
    if rank == 0:
        torch.save(params(trainer), out / "frozen_params.pt")
    return {"losses": losses, "builds": trainer.build_count}


def layer_drop_batches(rank: int, world: int, steps: int = 8) -> list[dict[str, torch.Tensor]]:
    """This rank's share of each combined batch of 12 rows (world 1: all of it)."""
    g = torch.Generator().manual_seed(1)
    n, out = 12 // world, []
    for _ in range(steps):
        x, y = torch.randn(12, 8, generator=g), torch.randint(0, 3, (12,), generator=g)
        out.append({"x": x[rank * n : (rank + 1) * n], "y": y[rank * n : (rank + 1) * n]})
    return out


def train_layer_drop(coin_seed: int, batches: list[dict]) -> tuple[ORTTrainer, list[float]]:
    """A model that skips blocks at random (tests/test_layer_drop.py) under data parallel
    (one process: plain), AdamW; the coins from ``coin_seed``."""
    from tests.test_layer_drop import LayerDropNet

    torch.manual_seed(0)
    model = LayerDropNet()
    model.ran = []
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (segments, the update moved to eager: said once)
        trainer = ORTTrainer(model, opt, TrainerOptions(intra_op_threads=1))
        torch.manual_seed(coin_seed)
        return trainer, [trainer.train_step(**b).item() for b in batches]


def scenario_layer_drop(rank: int, world: int, out: Path) -> dict[str, Any]:
    batches = layer_drop_batches(rank, world)
    trainer, losses = train_layer_drop(5, batches)  # every rank the same coins
    if rank == 0:
        torch.save(params(trainer), out / "layer_drop_params.pt")
    other, _ = train_layer_drop(5 + rank, batches)  # each rank its own coins
    return {
        "losses": losses,
        "engine": trainer.update_engine.name,
        "other_coins": other.module.ran,
        "other_engine": other.update_engine.name,
        "other_sum": sum(float(p.double().sum()) for p in params(other).values()),
    }


T5_STEPS = 3


def t5_batches(rank: int, world: int) -> list[dict[str, torch.Tensor]]:
    """Each rank's slice of 4 sequences a step (T5's loss: a mean over the label tokens,
    the same count on every rank)."""
    g = torch.Generator().manual_seed(7)
    per = 4 // world
    out = []
    for _ in range(T5_STEPS):
        ids = torch.randint(3, 64, (4, 10), generator=g)
        labels = torch.randint(3, 64, (4, 6), generator=g)
        mine = slice(rank * per, (rank + 1) * per)
        out.append({"input_ids": ids[mine], "labels": labels[mine]})
    return out


def train_t5(stage: int, batches: list[dict]) -> tuple[ORTTrainer, list[float]]:
    """Tiny T5: one table read by the encoder, the decoder and the tied head; its config
    asks for the key/value cache (the decoder's own copy of it too)."""
    import transformers
    from transformers.utils import logging

    logging.set_verbosity_error()
    torch.manual_seed(0)
    config = transformers.T5Config(
        vocab_size=64, d_model=16, d_kv=4, d_ff=32, num_layers=1, num_heads=4,
        decoder_start_token_id=0, dropout_rate=0.0,
    )  # fmt: skip
    model = transformers.T5ForConditionalGeneration(config)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    options = TrainerOptions(zero_stage=stage, intra_op_threads=1, reduce_bucket_mb=0.001)
    trainer = ORTTrainer(model, opt, options)
    return trainer, [trainer.train_step(**b).item() for b in batches]


def scenario_t5(rank: int, world: int, out: Path) -> dict[str, Any]:
    stage = _stage()
    trainer, losses = train_t5(stage, t5_batches(rank, world))
    whole = whole_params(trainer)
    if rank == 0:
        torch.save(whole, out / f"t5_{stage}_params.pt")
    assert trainer.segments is not None and trainer.segments.model is not None
    return {
        "losses": losses,
        "added_in_place": trainer.segments.model.tied.added_count,
        "compiled": sorted(trainer.segments.model.compiled),
    }


def scenario_zero2_resume(rank: int, world: int, out: Path) -> dict[str, Any]:
    stage = _stage()
    tag = f"zero{stage}_{world}"
    batches = micro_batches(rank, world, ZERO2_TOTAL)
    trainer, sched = make_zero2(stage, seed=rank + 100)  # the checkpoint replaces everything
    trainer.load_checkpoint(out / tag)
    sched.load_state_dict(torch.load(out / f"{tag}_sched.pt", weights_only=True))
    losses = run(trainer, sched, batches, RESUME_AT * ACCUM, STEPS * ACCUM)
    whole = whole_params(trainer)
    if rank == 0:
        torch.save(whole, out / f"{tag}_resumed_params.pt")
    return {"losses": losses}


class CheckpointedBlock(torch.nn.Module):
    def __init__(self, width: int, dropout: float = 0.0):
        super().__init__()
        self.norm = torch.nn.LayerNorm(width)
        self.up, self.down = torch.nn.Linear(width, 2 * width), torch.nn.Linear(2 * width, width)
        self.drop = torch.nn.Dropout(dropout)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        # the dropout mid-block: a recompute that stops early still reaches it
        return h + self.down(self.drop(torch.nn.functional.gelu(self.up(self.norm(h)))))


class Checkpointed(torch.nn.Module):
    """Blocks called through ``torch.utils.checkpoint`` with ``use_reentrant=True`` (what
    older transformers' ``gradient_checkpointing_enable`` did): their forward runs under
    ``no_grad``, and again in the backward."""

    def __init__(
        self, vocab: int = 32, width: int = 16, blocks: int = 2, *, dropout: float = 0.0,
        reentrant: bool = True,
    ):  # fmt: skip
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, width)
        self.blocks = torch.nn.ModuleList(CheckpointedBlock(width, dropout) for _ in range(blocks))
        self.head = torch.nn.Linear(width, vocab)
        self.reentrant = reentrant

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        from torch.utils.checkpoint import checkpoint

        h = self.embed(ids)
        for block in self.blocks:
            h = checkpoint(block, h, use_reentrant=self.reentrant)
        return torch.nn.functional.cross_entropy(self.head(h).flatten(0, 1), labels.flatten())


REENTRANT_STEPS = 5


def reentrant_batches(rank: int, world: int) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(11)
    per = 4 // world
    mine = slice(rank * per, (rank + 1) * per)
    out = []
    for _ in range(REENTRANT_STEPS):
        ids = torch.randint(0, 32, (4, 6), generator=g)
        out.append({"ids": ids[mine], "labels": torch.roll(ids, -1, 1)[mine]})
    return out


def train_reentrant(stage: int, batches: list[dict]) -> tuple[ORTTrainer, list[float]]:
    torch.manual_seed(0)
    model = Checkpointed()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    options = TrainerOptions(zero_stage=stage, intra_op_threads=1, reduce_bucket_mb=0.001)
    trainer = ORTTrainer(model, opt, options)
    return trainer, [trainer.train_step(**b).item() for b in batches]


def scenario_reentrant(rank: int, world: int, out: Path) -> dict[str, Any]:
    trainer, losses = train_reentrant(2, reentrant_batches(rank, world))
    whole = whole_params(trainer)
    if rank == 0:
        torch.save(whole, out / "reentrant_params.pt")
    assert trainer.segments is not None and trainer.segments.model is not None
    return {"losses": losses, "compiled": sorted(trainer.segments.model.compiled)}


# torch optimizers ortrain does not compile whose update works element by element: under
# ZeRO their own step runs over each rank's pieces (``ortrain/optim/sharded_eager.py``)
ELEMENTWISE_OPTIMIZERS = {
    "adagrad": lambda ps: torch.optim.Adagrad(ps, lr=0.05, initial_accumulator_value=0.1),
    "rmsprop": lambda ps: torch.optim.RMSprop(
        ps, lr=1e-2, momentum=0.9, centered=True, weight_decay=0.01
    ),
    "amsgrad": lambda ps: torch.optim.Adam(ps, lr=1e-2, amsgrad=True, weight_decay=0.01),
    # numbers per parameter besides the step count: mu_product; eta and mu
    "nadam": lambda ps: torch.optim.NAdam(ps, lr=1e-2, momentum_decay=0.01),
    "asgd": lambda ps: torch.optim.ASGD(ps, lr=2e-2, t0=1, lambd=0.1),
}
ELEMENTWISE_SAVE_AT = 4  # micro-steps: two optimizer steps


def train_elementwise(
    stage: int,
    seed: int,
    batches: list[dict],
    opt: str,
    *,
    save: Path | None = None,
    load: Path | None = None,
) -> tuple[ORTTrainer, list[float]]:
    """Reordered (blocks in order) with accumulation, clipping and an LR schedule; ``save``:
    a checkpoint (and the schedule's state) after ``ELEMENTWISE_SAVE_AT`` micro-steps;
    ``load``: resume from one there."""
    model = Reordered(seed)
    optimizer = ELEMENTWISE_OPTIMIZERS[opt](model.parameters())
    sched = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.7)
    options = TrainerOptions(
        zero_stage=stage,
        intra_op_threads=1,
        reduce_bucket_mb=0.001,
        max_grad_norm=0.5,
        grad_accumulation_steps=ACCUM,
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (its update runs in eager: said once)
        trainer = ORTTrainer(model, optimizer, options, loss_fn=lambda out, batch: out)
    # as accelerate's wrapping does (Adagrad's state, made with it, took no step)
    optimizer.load_state_dict(optimizer.state_dict())
    start = 0
    if load is not None:
        trainer.load_checkpoint(load / "ckpt")
        sched.load_state_dict(torch.load(load / "sched.pt", weights_only=True))
        start = ELEMENTWISE_SAVE_AT
    losses = []
    for i in range(start, len(batches)):
        losses.append(trainer.train_step(**batches[i]).item())
        if (i + 1) % ACCUM == 0:
            sched.step()
        if save is not None and i + 1 == ELEMENTWISE_SAVE_AT:
            trainer.save_checkpoint(save / "ckpt")
            if trainer.reducer is None or trainer.reducer.comm.rank == 0:  # type: ignore[attr-defined]
                torch.save(sched.state_dict(), save / "sched.pt")
    return trainer, losses


def scenario_elementwise(rank: int, world: int, out: Path) -> dict[str, Any]:
    opt, batches = os.environ["ORTRAIN_TEST_OPT"], reorder_batches(rank, world)
    resume = bool(os.environ.get("ORTRAIN_TEST_RESUME"))
    where = {"load": out} if resume else {"save": out}
    seed = rank + (50 if resume else 0)  # rank 0's is broadcast; a load replaces it
    trainer, losses = train_elementwise(_stage(), seed, batches, opt, **where)  # type: ignore[arg-type]
    whole = whole_params(trainer)
    if rank == 0:
        torch.save(whole, out / f"elementwise{'_resumed' if resume else ''}_params.pt")
    return {"losses": losses, "engine": trainer.program.update}


LANDING_STEPS, LANDING_SAVE_AT = 20, 10  # optimizer steps (no accumulation); a checkpoint
LANDING_LR = 2e-3


def train_landing(
    stage: int, seed: int, batches: list[dict], *, save: Path | None = None, **options: Any
) -> tuple[ORTTrainer, list[float]]:
    """GPT-2 with its tied table, AdamW in two decay groups and a warmup schedule, no
    clipping and no accumulation: under ZeRO-3 each bucket's stretch is updated as it
    lands (``ShardBackwardUpdate``); ``save``: a sharded checkpoint at LANDING_SAVE_AT."""
    model = gpt2(layers=2, hidden=64, vocab=128, seed=seed)
    opt = torch.optim.AdamW(decay_groups(model, 0.01), lr=LANDING_LR, betas=(0.9, 0.98), eps=1e-6)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, warmup)
    trainer = ORTTrainer(
        model,
        opt,
        TrainerOptions(
            zero_stage=stage,
            intra_op_threads=1,
            reduce_bucket_mb=ZERO2_BUCKET_MB,
            segments="blocks",
            **options,
        ),
    )
    losses = []
    for i, batch in enumerate(batches):
        losses.append(trainer.train_step(**batch).item())
        sched.step()
        if save is not None and i + 1 == LANDING_SAVE_AT:
            trainer.save_checkpoint(save)
    return trainer, losses


def landing_batches(rank: int, world: int) -> list[dict[str, torch.Tensor]]:
    combined = lm_batches(LANDING_STEPS, batch=6, vocab=128, seed=13)
    per = 6 // world
    return [{k: v[rank * per : (rank + 1) * per] for k, v in b.items()} for b in combined]


def scenario_landing(rank: int, world: int, out: Path) -> dict[str, Any]:
    engine = os.environ.get("ORTRAIN_TEST_ENGINE", "auto")
    batches = landing_batches(rank, world)
    trainer, losses = train_landing(
        _stage(), rank, batches, save=out / "landing_ckpt", update_engine=engine
    )
    reducer, update = trainer.reducer, trainer.update_engine
    updated = getattr(update, "updated_numel", 0)  # by the last step
    whole = whole_params(trainer)
    if rank == 0:
        torch.save(whole, out / f"landing_{engine}_params.pt")
    # a NaN loss on the last rank alone (every label skipped): every rank refuses the
    # step before its backward, nothing updated
    batch = landing_batches(rank, world)[0]
    if rank == world - 1:
        batch = {**batch, "labels": torch.full_like(batch["labels"], -100)}
    refused = ""
    try:
        trainer.train_step(**batch)
    except Exception as exc:  # the test names the type
        refused = type(exc).__name__
    after = whole_params(trainer)
    return {
        "refused": refused,
        "unchanged_after_nan": all(torch.equal(after[n], whole[n]) for n in whole),
        "losses": losses,
        "engine": update.name,
        "released": getattr(update, "released", False),
        "updated_numel": updated,
        "shard_numel": reducer.config.layout.shard_numel,  # type: ignore[union-attr]
        # the gradient shard is never written after the first update: it reads zeros
        "grad_shard_nonzero": int(reducer.grad_shard.count_nonzero()),  # type: ignore[union-attr]
        "late_reads": sorted(reducer.late_reads),  # type: ignore[union-attr]
        "memory_report": dict(trainer.memory_report().rows()),
    }


def scenario_landing_table(rank: int, world: int, out: Path) -> dict[str, Any]:
    """ZeRO-3 with AdamW and no clipping over a tied table whose head's gradient goes as
    factors: updated as its stretches are summed ("zero-backward"), then again with
    ``max_grad_norm=inf`` (the same kernels after the backward, "zero-torch") from the same
    start on the same batches; each rank's parameters of both."""
    batches = factored_batches(rank, world, world)
    got: dict[str, Any] = {}
    for tag, clip in (("auto", None), ("after", math.inf)):
        model = gpt2(layers=2, hidden=factored_width(world), vocab=FACTORED_VOCAB, seed=rank)
        opt = torch.optim.AdamW(decay_groups(model, 0.01), lr=2e-3)
        trainer = ORTTrainer(
            model,
            opt,
            TrainerOptions(
                zero_stage=3,
                max_grad_norm=clip,
                intra_op_threads=1,
                reduce_bucket_mb=ZERO2_BUCKET_MB,
            ),
        )
        losses = [trainer.train_step(**b).item() for b in batches]
        reducer = trainer.reducer
        got[tag] = {
            "losses": losses,
            "engine": trainer.update_engine.name,
            "routed": list(reducer.routed),  # type: ignore[union-attr]
            "stretches": reducer.routed_stretches,  # type: ignore[union-attr]
            "late_reads": sorted(reducer.late_reads),  # type: ignore[union-attr]
        }
        whole = whole_params(trainer)
        torch.save(whole, out / f"landing_table_{tag}_{rank}.pt")
    return got


class DetachedFirst(torch.nn.Module):
    """A projection called twice: first through its weight detached (its backward reads
    the weight for the input's gradient, and adds none to it), then as usual. The
    weight's gradient is complete after the second call's backward, before the first's."""

    def __init__(self, seed: int):
        super().__init__()
        torch.manual_seed(seed)
        self.inp = torch.nn.Linear(6, 16)
        self.proj = Projection()
        self.mid = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Tanh())
        self.out = torch.nn.Linear(16, 1)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.proj(self.inp(x), detached=True)
        h = self.proj(self.mid(h), detached=False)
        return torch.nn.functional.mse_loss(self.out(h), y)


class Projection(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(16, 16) / 4)

    def forward(self, h: torch.Tensor, detached: bool) -> torch.Tensor:
        w = self.weight.detach() if detached else self.weight
        return torch.tanh(h @ w)


def train_detached(stage: int, seed: int, batches: list[dict]) -> tuple[ORTTrainer, list[float]]:
    model = DetachedFirst(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    options = TrainerOptions(zero_stage=stage, intra_op_threads=1, reduce_bucket_mb=0.001)
    trainer = ORTTrainer(model, opt, options, loss_fn=lambda out, batch: out)
    return trainer, [trainer.train_step(**b).item() for b in batches]


def scenario_detached(rank: int, world: int, out: Path) -> dict[str, Any]:
    trainer, losses = train_detached(_stage(), rank, reorder_batches(rank, world))
    whole = whole_params(trainer)
    if rank == 0:
        torch.save(whole, out / "detached_params.pt")
    return {
        "losses": losses,
        "engine": trainer.update_engine.name,
        "late_reads": sorted(trainer.reducer.late_reads),  # type: ignore[union-attr]
        "released": trainer.update_engine.released,  # type: ignore[attr-defined]
    }


def main() -> None:
    scenario, out = sys.argv[1], Path(sys.argv[2])
    torch.set_num_threads(1)
    torch.distributed.init_process_group("gloo")  # env://, as torchrun sets it up
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    fn = {
        "train": scenario_train,
        "resume": scenario_resume,
        "reshard": scenario_reshard,
        "loop": scenario_loop,
        "overflow": scenario_overflow,
        "segmented": scenario_segmented,
        "zero2": scenario_zero2,
        "factored": scenario_factored,
        "zero2_resume": scenario_zero2_resume,
        "reorder": scenario_reorder,
        "shared": scenario_shared,
        "tempered": scenario_tempered,
        "new_shapes": scenario_new_shapes,
        "bucketed": scenario_bucketed,
        "eager_reads": scenario_eager_reads,
        "rmsprop": scenario_rmsprop,
        "frozen": scenario_frozen,
        "batch_norm": scenario_batch_norm,
        "layer_drop": scenario_layer_drop,
        "t5": scenario_t5,
        "reentrant": scenario_reentrant,
        "elementwise": scenario_elementwise,
        "landing": scenario_landing,
        "landing_table": scenario_landing_table,
        "detached": scenario_detached,
    }[scenario]
    result = fn(rank, world, out)
    (out / f"{scenario}.rank{rank}.json").write_text(json.dumps(result))
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
