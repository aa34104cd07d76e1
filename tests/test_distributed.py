"""Data parallel and ZeRO-1 on 2 real gloo processes against one process on the combined
batches (tests/dist_worker.py holds the training loop both run), plus the pieces that
need no processes: the flat layout, the shard's graphs, the failure diagnosis."""

from __future__ import annotations

import itertools
import json
import os
import select
import signal
import socket
import threading
import time
from pathlib import Path

import pytest
import torch

from ortrain import TrainerOptions, UnsupportedOptimizerError
from ortrain.checkpoint import index_names
from ortrain.core.roles import Role
from ortrain.distributed.health import RankHealth
from ortrain.optim import Lamb
from ortrain.optim.from_torch import optimizer_spec
from ortrain.runtime.flat_layout import FlatLayout
from tests.dist_worker import (
    ACCUM,
    CLIP,
    ELEMENTWISE_SAVE_AT,
    FACTORED_SEQ,
    FACTORED_VOCAB,
    LANDING_LR,
    LANDING_SAVE_AT,
    RESUME_AT,
    STEPS,
    ZERO2_TOTAL,
    eager_reads_batches,
    factored_batches,
    landing_batches,
    layer_drop_batches,
    make_factored,
    make_segmented,
    make_trainer,
    make_zero2,
    micro_batches,
    reentrant_batches,
    reorder_batches,
    run,
    t5_batches,
    train_detached,
    train_eager_reads,
    train_elementwise,
    train_frozen,
    train_landing,
    train_layer_drop,
    train_reentrant,
    train_reordered,
    train_rmsprop,
    train_shared,
    train_t5,
    train_tempered,
)
from tests.rank_processes import Rank, start_rank
from tests.test_parity import drop_key_bias

ROOT = Path(__file__).resolve().parent.parent
WORLD = 2
TOL = 1e-5  # relative, fp32
MID, END = RESUME_AT * ACCUM, STEPS * ACCUM


# --------------------------------------------------------------------------- launching
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(
    scenario: str, out: Path, world: int = WORLD, piped: int | None = None, **env: str
) -> list[Rank]:
    """``world`` ranks of tests/dist_worker.py with the environment torchrun would set
    (forked from a warm server: tests/rank_processes.py); the stdout of rank ``piped``
    comes through a pipe (the others' go to log files)."""
    port = str(_free_port())
    procs = []
    for rank in range(world):
        env_r = {
            **os.environ,
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": str(world),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": port,
            "PYTHONPATH": str(ROOT),
            "OMP_NUM_THREADS": "1",
            # the test's own graph cache: the ranks build each graph once (the first to
            # miss it; the others wait and load it), as they would with the user's cache
            "ORTRAIN_GRAPH_CACHE": str(out / "graph-cache"),
            **env,
        }
        log = out / f"{scenario}.log{rank}"
        args = [scenario, str(out)]
        procs.append(start_rank("tests.dist_worker", args, env_r, log, rank == piped))
    return procs


def finish(procs: list[Rank], out: Path, scenario: str) -> list[dict]:
    try:
        for p in procs:
            p.wait(timeout=300)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for rank, p in enumerate(procs):
        log = (out / f"{scenario}.log{rank}").read_text()
        assert p.returncode == 0, f"rank {rank} exited {p.returncode}:\n{log[-4000:]}"
    return [json.loads((out / f"{scenario}.rank{r}.json").read_text()) for r in range(len(procs))]


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> tuple[Path, list[dict]]:
    out = tmp_path_factory.mktemp("dist")
    return out, finish(launch("train", out), out, "train")


@pytest.fixture(scope="module")
def reference():
    """One process, the combined batches, the same options."""
    trainer, sched = make_trainer(0)
    initial = {n: p.detach().clone() for n, p in trainer.module.named_parameters()}
    losses = run(trainer, sched, micro_batches(0, 1), 0, END)
    moved = max((p - initial[n]).abs().max().item() for n, p in trainer.module.named_parameters())
    assert moved > 1e-3  # training moved the weights: comparisons are not of initial values
    return trainer, losses


# --------------------------------------------------------------------------- checks
def rank_mean(results: list[dict], key: str) -> list[float]:
    return [sum(r[key][i] for r in results) / len(results) for i in range(len(results[0][key]))]


def assert_losses(actual: list[float], expected: list[float]) -> None:
    assert len(actual) == len(expected)
    torch.testing.assert_close(torch.tensor(actual), torch.tensor(expected), rtol=TOL, atol=0)


def assert_tensor(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    """Element-wise within TOL relative, with an absolute floor of TOL of the tensor's
    largest magnitude (rounding differences of near-zero elements)."""
    torch.testing.assert_close(
        actual, expected, rtol=TOL, atol=TOL * expected.abs().max().item(), msg=lambda m: what + m
    )


def assert_params(params: dict[str, torch.Tensor], ref_model: torch.nn.Module) -> None:
    """Final parameters; attention key biases left out (see drop_key_bias)."""
    assert sorted(params) == sorted(n for n, _ in ref_model.named_parameters())
    for name, q in ref_model.named_parameters():
        p = params[name]
        assert_tensor(drop_key_bias(name, p, ref_model), drop_key_bias(name, q, ref_model), name)


@pytest.mark.slow
@pytest.mark.parametrize("stage", ["dp", "zero"])
def test_matches_single_process_on_combined_batch(trained, reference, stage):
    """Per micro-step, the mean of the ranks' losses is the single process's loss (with
    clipping active and 2-step accumulation); so are the final parameters."""
    out, results = trained
    ref_trainer, ref_losses = reference
    assert_losses(rank_mean(results, f"{stage}_losses"), ref_losses)
    # The ranks' own losses differ (different batches): this is not one rank's copy.
    assert results[0][f"{stage}_losses"] != results[1][f"{stage}_losses"]
    norms = [r[f"{stage}_grad_norm"] for r in results]
    assert norms[0] == norms[1] and norms[0] > CLIP  # every rank clipped alike
    assert norms[0] == pytest.approx(ref_trainer.last_grad_norm, rel=TOL)
    assert_params(torch.load(out / f"{stage}_params.pt"), ref_trainer.module)


@pytest.mark.slow
def test_segmented_model_matches_single_process_on_combined_batch(tmp_path):
    """A model trained as compiled segments inside eager PyTorch (ortrain/segments): data
    parallel and ZeRO-1 on 2 gloo ranks train as one process on the combined batches."""
    results = finish(launch("segmented", tmp_path), tmp_path, "segmented")
    for stage in (0, 1):
        single = make_segmented(stage)
        losses = run(single, None, micro_batches(0, 1), 0, 2 * ACCUM)
        assert single.segments is not None
        assert all(r[f"segments{stage}"] == sorted(single.segments.model.compiled) for r in results)
        assert_losses(rank_mean(results, f"stage{stage}"), losses)
        assert_params(torch.load(tmp_path / f"segmented{stage}_params.pt"), single.module)


@pytest.fixture(scope="module")
def zero2_reference():
    """One process on the combined batches, the same options: the whole model as one
    training graph ("auto") and as segments cut at its blocks, as ZeRO-2 trains it."""
    out = {}
    for segments in ("auto", "blocks"):
        trainer, sched = make_zero2(0, segments=segments)
        losses = run(trainer, sched, micro_batches(0, 1, ZERO2_TOTAL), 0, END)
        out[segments] = (trainer, losses)
    assert out["auto"][0].segments is None and out["blocks"][0].segments is not None
    return out


@pytest.mark.slow
@pytest.mark.parametrize(
    "stage,world",
    [(2, 2), (2, 3), (3, 2), (3, 3)],
    ids=["zero2-2", "zero2-3", "zero3-2", "zero3-3"],
)
def test_zero2_and_3_match_single_process_and_hold_no_whole_gradients(
    tmp_path, zero2_reference, stage, world
):
    """ZeRO-2 and ZeRO-3 on 2 and 3 gloo ranks (clipping, 2-step accumulation, tied
    embedding and head, an LR schedule) train as one process on the combined batches,
    whole graph or cut at its blocks: per-step losses, the clipped norm, final parameters
    and optimizer state, an evaluation. No rank holds whole gradients (its shard of them
    and the buckets in flight); under ZeRO-3 no rank holds whole parameters between
    steps either. The sharded checkpoint resumes bit for bit and loads into one process."""
    tag = f"zero{stage}_{world}"
    env = {"ORTRAIN_TEST_STAGE": str(stage)}
    results = finish(launch("zero2", tmp_path, world=world, **env), tmp_path, "zero2")
    blocks = zero2_reference["blocks"][0]
    for trainer, losses in zero2_reference.values():
        assert_losses(rank_mean(results, "losses"), losses)
        assert all(
            r["grad_norm"] == pytest.approx(trainer.last_grad_norm, rel=TOL) for r in results
        )
        assert_params(torch.load(tmp_path / f"{tag}_params.pt"), trainer.module)
    assert results[0]["grad_norm"] > CLIP  # clipping was active
    assert len({tuple(r["losses"]) for r in results}) == world  # each rank its own batches

    assert blocks.segments is not None and blocks.segments.model is not None
    compiled = sorted(blocks.segments.model.compiled)
    assert "transformer.h.0" in compiled and "transformer.h.1" in compiled
    assert (sum(r["gathers_reused"] for r in results) > 0) == (stage == 3)
    for r in results:
        assert r["engine"] == "zero-torch"  # torch's kernels over the shard
        assert r["compiled"] == compiled
        assert r["builds"] == blocks.segments.model.builds == len(compiled) - 1  # one block graph
        assert r["whole_grads"] == 0 and not r["flat_grads"]
        assert r["grad_shard"] == r["shard_numel"] == r["numel"] // world
        assert len(r["buckets"]) >= 4 and sum(r["buckets"]) == r["numel"]
        # open or in flight at most: the buckets of one block's gradients (its backward
        # graph writes them there at once; they end at its edges) and the one before on
        # its way (with a buffer for the other ranks' stretches of it that its owner
        # receives, one at a time), or the tied table's own bucket and the one before;
        # never all of them
        block = sum(p.numel() for p in blocks.module.transformer.h[0].parameters())
        table = blocks.module.transformer.wte.weight.numel()
        assert r["peak_open"] <= max(block, table) + 2 * max(r["buckets"])
        assert r["peak_open"] < r["numel"]
        # ZeRO-2's buckets (and ZeRO-3's gathers) of a step are the memory of the step
        # before's; ZeRO-3 keeps no bucket from one backward to the next (they would sit
        # idle through the forward's gathers, its peak)
        assert r["outputs_reused"] > 0
        if stage == 2:
            assert r["buckets_reused"] > 0 and r["buckets_kept"] > 0
            # a block's bucket is reused (autograd still holds the views its gradients
            # were written into when it lands: it waits in the pool until they go); at 3
            # ranks the table's bucket, made between two blocks', takes its place in a pool
            # that keeps no more than its peak
            block_bucket = max(r["buckets"])
            taken = END * r["buckets"].count(block_bucket)
            if world == 2:
                assert r["buckets_made"][str(block_bucket)] < taken
        else:
            assert r["buckets_kept"] == 0
        # the tied embedding's rows went into the head's gradient of it on every micro-step
        # (96 tokens a rank against a 128 x 64 table: its product's factors are larger,
        # so the table is not routed to the reducer in pieces; the test below routes it)
        assert r["tied_rows_added"] == END and r["routed"] == []
        # ZeRO-3: a gather within the rank's own stretch makes views of its shard (rank
        # 0's holds the tied table, at the layout's start), the others take pooled buffers
        if stage == 3 and r is results[0]:
            assert r["gathers_in_place"] > 0
        elif stage == 2:
            assert r["gathers_in_place"] == 0
        # ZeRO-3: the tied table is dropped after the head's backward, its last reader (the
        # embedding's backward adds rows and reads no parameter): never whole while the
        # blocks' backwards and the embedding's run
        held = r["table_held_in_backward"]
        assert (len(held) > 0) == (stage == 3) and not any(held)
        # nor while the blocks' forwards run: gathered for the embedding's forward and again
        # for the head's (whose backward keeps it), never for the embedding's backward
        held = r["table_held_in_forward"]
        assert (len(held) > 0) == (stage == 3) and not any(held)
        if stage == 3:
            assert r["table_gathers"] == 2 * r["micro_steps_mid"]
        # the blocks' backward graphs write their gradients into the buckets: every block
        # parameter's, every micro-step (a copy made for none of them)
        n_block = len(list(blocks.module.transformer.h.parameters()))
        assert r["written_in_place"] >= n_block * END

    # what each rank holds, measured from its tensors' storages, is what
    # ortrain.estimate_memory predicted before the run (up to the layout's alignment)
    for r in results:
        held, est, pad = r["state_bytes"], r["estimate"], 4 * r["padding"]
        assert held["zero_stage"] == est["zero_stage"] == stage
        assert est["parameters"] <= held["parameters"] <= est["parameters"] + pad
        assert est["gradients"] <= held["gradients"] <= est["gradients"] + pad
        assert est["optimizer_state"] <= held["optimizer_state"] <= est["optimizer_state"] + 2 * pad
        assert held["gradients"] * world <= r["numel"] * 4  # 1/N of them
        if stage == 2:
            assert 0 < held["in_flight"] <= est["in_flight"]
        else:  # parameters: a shard each, and whole only while a segment runs
            assert r["param_shard"] == r["shard_numel"] and r["numel_between_steps"] == 0
            assert 4 * (r["peak_open"] + r["training_gathered"]) <= est["in_flight"]
            assert 0 < r["training_gathered"] < r["numel"]  # never the whole model
            # from the second micro-step on, each segment's gather starts while the one
            # before it computes
            assert r["prefetched"] > 0
        # memory_report(): the states as measured, the reducer's peaks in bytes, the saved
        # activations of the segments, and no more than the process's measured peak
        m = r["memory_report"]
        assert m["states_match"] and m["gradients"] == held["gradients"]
        assert m["gradient buckets"] == 4 * r["peak_open"] > 0
        assert m["gathered parameters"] == (4 * r["training_gathered"] if stage == 3 else 0)
        whole_beyond_shard = 4 * (r["numel"] - r["shard_numel"]) if stage == 3 else 0
        assert m["whole parameters (first step)"] == whole_beyond_shard
        assert m["activations"] > 0 and m["runtime"] > 0
        assert m["total"] <= m["measured peak"]
    # every rank evaluates the combined first batch as the single process does
    want = float(blocks.eval_step(**micro_batches(0, 1, ZERO2_TOTAL)[0]).loss)
    assert all(r["eval_loss"] == pytest.approx(want, rel=TOL) for r in results)
    # the consolidated state dict: the single process's, moments included
    ours, ref = torch.load(tmp_path / f"{tag}_state.pt"), blocks.state_dict()
    assert ours["ortrain"] == ref["ortrain"] == {"step": STEPS, "micro_step": 0}
    names = index_names(blocks.state)
    for idx, entry in ref["optimizer"]["state"].items():
        for s, t in entry.items():
            mine = ours["optimizer"]["state"][idx][s]
            name = f"{s} of {names[idx]}"
            if s == "step":
                assert torch.equal(mine, t), name
            else:
                m = blocks.module
                assert_tensor(
                    drop_key_bias(names[idx], mine, m), drop_key_bias(names[idx], t, m), name
                )

    resumed = finish(launch("zero2_resume", tmp_path, world=world, **env), tmp_path, "zero2_resume")
    for r in range(world):
        assert resumed[r]["losses"] == results[r]["losses"][MID:]
    final = torch.load(tmp_path / f"{tag}_params.pt")
    again = torch.load(tmp_path / f"{tag}_resumed_params.pt")
    for name, t in final.items():
        assert torch.equal(again[name], t), name

    single, _ = make_zero2(0)  # the shards, loaded into one process, give the same state
    single.load_checkpoint(tmp_path / tag)
    mid_state = single.state_dict()
    assert mid_state["ortrain"] == {"step": RESUME_AT, "micro_step": 0}


@pytest.mark.slow
@pytest.mark.parametrize("stage,world", [(3, 3)], ids=["zero3-3"])
def test_a_tied_head_with_few_tokens_goes_as_factors(tmp_path, stage, world):
    """A 4096-token tied table against 16 tokens per rank: the head's gradient of it goes
    to the reducer as its product's factors (every rank's, far smaller than the table),
    the embedding's as rows, and each rank multiplies out only its shard's rows: no
    bucket ever holds the table's gradient, and training equals one process on the
    combined batches (SGD with momentum, clipping, accumulation; at 3 ranks the shards'
    edges fall inside the table). ZeRO-3, which gathers the table for the head and
    reduces the rest as ZeRO-2 does (the pieces are ZeRO-2's code; ZeRO-2 alone at 2 ranks
    passed it too, left out for the suite's time). AdamW with whole gradients: the test
    above."""
    env = {"ORTRAIN_TEST_STAGE": str(stage)}
    results = finish(launch("factored", tmp_path, world=world, **env), tmp_path, "factored")
    ref, sched = make_factored(0, world=world)
    losses = run(ref, sched, factored_batches(0, 1, world), 0, END)
    assert_losses(rank_mean(results, "losses"), losses)
    norms = [r["grad_norm"] for r in results]
    assert norms == pytest.approx([ref.last_grad_norm] * world, rel=TOL), ref.last_grad_norm
    assert_params(torch.load(tmp_path / f"factored{stage}_{world}_params.pt"), ref.module)
    table = "transformer.wte.weight"
    for r in results:
        assert r["routed"] == [table]
        assert r["factors_gathered"] == r["rows_gathered"] == END
        assert 0 < r["peak_open"] < r["table_numel"]
        # the embedding's forward takes only the rows the ranks' tokens read (fewer than
        # half the table; at 3 ranks some cut by the shards' edges), the head the whole
        # table: one whole gather of it a micro-step
        tokens = world * FACTORED_SEQ  # at most as many distinct rows per lookup
        width = r["table_numel"] // FACTORED_VOCAB
        assert 0 < r["embedding_rows"] <= 2 * END * tokens * width  # wte's and wpe's
        assert r["table_gathers"] == END


@pytest.mark.slow
def test_zero3_prefetch_follows_a_changing_block_order(tmp_path):
    """ZeRO-3 prefetches each segment's gather along the order recorded on an earlier
    micro-step; where the blocks run in another order (every third micro-step here) the
    ranks stop prefetching alike and record afresh: the training equals one process."""
    trainer, losses = train_reordered(0, 0, reorder_batches(0, 1))
    results = finish(launch("reorder", tmp_path), tmp_path, "reorder")
    assert_losses(rank_mean(results, "losses"), losses)
    assert_params(torch.load(tmp_path / "reorder_params.pt"), trainer.module)
    assert all(r["prefetched"] > 0 for r in results)
    # the last micro-step ran the blocks reversed: the order was recorded afresh
    forward = ["inp", "blocks.2", "blocks.1", "blocks.0", "out"]
    assert all(r["trace"][:5] == forward for r in results), results[0]["trace"]


@pytest.mark.slow
def test_zero3_batches_of_a_new_length_after_the_first_step_train_as_one_process(tmp_path):
    """A length first seen after the first step is a new call signature of the compiled
    blocks: each plans it with the module's own forward (not the gathering one, whose
    collectives and gathers ran inside the export's trace and left a meta tensor in the
    parameter: the step raised). Losses and parameters equal one process."""
    from tests.dist_worker import new_shape_batches, train_new_shapes

    trainer, losses = train_new_shapes(0, new_shape_batches(0, 1))
    results = finish(launch("new_shapes", tmp_path), tmp_path, "new_shapes")
    assert_losses(rank_mean(results, "losses"), losses)
    assert_params(torch.load(tmp_path / "new_shapes_params.pt"), trainer.module)
    for r in results:
        assert {"blocks.0", "blocks.1"} <= set(r["compiled"]), r["compiled"]


@pytest.mark.slow
@pytest.mark.parametrize("stage", [0, 2, 3], ids=["dp", "zero2", "zero3"])
def test_bucketing_pads_each_ranks_lengths(tmp_path, stage):
    """Ranks whose batches have other lengths each micro-step (3 to 20, no mask, targets
    with names bucketing learns): after a rank's first length, batches are padded to 16
    and 32 (three lengths compiled, not eight), each rank building at steps of its own.
    Under data parallel a graph's build and first-step check is voted each micro-step
    (the check's vote ran on the building rank alone: gloo's sizes mismatched and the
    process aborted); under ZeRO-2/3 the ranks agree on which tables' gradients go as
    rows (rank 1's embedding has a second call signature a step before rank 0's: its
    rows were routed and gathered there alone, and the ranks hung);
    under ZeRO-3 a rank holds shards, so bucketing's eager runs gather every parameter
    on every rank where any rank needs them. Each rank's loss equals eager's on its own
    batch, and the parameters eager's trained on the mean of the ranks' losses."""
    from tests.dist_worker import BUCKETED_LENGTHS, TokenBlocks, bucketed_batches

    model = TokenBlocks(0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    expected = []
    for per in bucketed_batches(WORLD):
        opt.zero_grad()
        losses = [model(**b) for b in per]
        (sum(losses) / len(losses)).backward()
        opt.step()
        expected.append([loss.item() for loss in losses])
    env = {"ORTRAIN_TEST_STAGE": str(stage)}
    results = finish(launch("bucketed", tmp_path, **env), tmp_path, "bucketed")
    for rank, r in enumerate(results):
        assert_losses(r["losses"], [e[rank] for e in expected])
        assert r["verdicts"] == [True], r["verdicts"]
        assert len({n[rank] for n in BUCKETED_LENGTHS}) >= 7
        assert r["compiled"] == 3, r  # its first length as given, then 16 and 32
    assert_params(torch.load(tmp_path / f"bucketed{stage}_params.pt"), model)


@pytest.mark.slow
@pytest.mark.parametrize("stage", [3], ids=["zero3"])
def test_a_block_called_twice_trains_as_one_process(tmp_path, stage):
    """A block applied twice in a forward, apart (weight sharing): its segment's backward
    runs twice a micro-step. The first writes its gradients into their buckets, the
    second's are added (one view of a bucket per parameter and micro-step: ZeRO-2's
    reducer, which ZeRO-3 runs on); under ZeRO-3 its parameters are gathered for each
    call. Losses and final parameters equal one process on the combined batches."""
    trainer, losses = train_shared(0, 0, reorder_batches(0, 1))
    env = {"ORTRAIN_TEST_STAGE": str(stage)}
    results = finish(launch("shared", tmp_path, **env), tmp_path, "shared")
    assert_losses(rank_mean(results, "losses"), losses)
    assert_params(torch.load(tmp_path / f"shared{stage}_params.pt"), trainer.module)
    m = trainer.module
    once = sum(len(list(c.parameters())) for c in (m.inp, m.blocks[1], m.out))
    shared = len(list(m.blocks[0].parameters()))
    for r in results:
        assert r["compiled"] == ["blocks.0", "blocks.1", "inp", "out"], r["compiled"]
        # the modules called once land in place every micro-step; the shared block's sum
        # of two gradients lands wherever autograd added them (in its bucket or copied)
        assert once * len(losses) <= r["written_in_place"] <= (once + shared) * len(losses)


@pytest.mark.slow
@pytest.mark.parametrize("stage", [2, 3], ids=["zero2", "zero3"])
def test_t5s_table_read_three_times_trains_as_one_process(tmp_path, stage):
    """T5's one embedding table is read by the encoder, the decoder and the tied head:
    the decoder embedding's rows go into the head's gradient (a bucket's view), to which
    autograd then adds the encoder's, into a new tensor. Before, the check that the rows
    were not lost took that for a loss and stopped the step. Losses and parameters equal
    one process on the combined batches."""
    trainer, losses = train_t5(0, t5_batches(0, 1))
    env = {"ORTRAIN_TEST_STAGE": str(stage)}
    results = finish(launch("t5", tmp_path, **env), tmp_path, "t5")
    assert_losses(rank_mean(results, "losses"), losses)
    assert_params(torch.load(tmp_path / f"t5_{stage}_params.pt"), trainer.module)
    assert all(r["added_in_place"] >= len(losses) for r in results), results
    # the cache off in the decoder's config too: its blocks take no cache object and
    # compile whole (before, each split down to its layers' pieces)
    for r in results:
        assert any(n.startswith("decoder") for n in r["compiled"]), r["compiled"]
        assert not any(".layer." in n for n in r["compiled"]), r["compiled"]


def test_reentrant_checkpoints_compile_their_blocks_under_zero2(tmp_path):
    """Blocks inside reentrant activation checkpoints, cut into segments by ZeRO-2. The
    check of a block took eager's gradients with ``backward()`` (``.grad()`` is refused
    there), and ZeRO-2's hook took them into its buckets: the check saw none, and each
    block split down to its layers. Now the blocks compile whole, and losses and
    parameters equal one process on the combined batches."""
    trainer, losses = train_reentrant(0, reentrant_batches(0, 1))
    results = finish(launch("reentrant", tmp_path), tmp_path, "reentrant")
    assert_losses(rank_mean(results, "losses"), losses)
    assert_params(torch.load(tmp_path / "reentrant_params.pt"), trainer.module)
    for r in results:
        assert {"blocks.0", "blocks.1"} <= set(r["compiled"]), r["compiled"]
        assert not any(n.startswith("blocks.0.") for n in r["compiled"]), r["compiled"]


@pytest.mark.slow
def test_zero3_follows_python_values_the_loop_changes(tmp_path):
    """A Python value the compiled blocks read, changed by the loop mid-run: under ZeRO-3
    every rank gathers the parameters whole and plans the segments afresh, as at the
    first step (the blocks built again with the new value), and shards them again.
    Losses and final parameters equal one process on the combined batches; before, the
    change raised ``BatchError``. (A value changed at a second step too sends the modules
    reading it to eager; the plan is the same step.)"""
    trainer, losses, before = train_tempered(0, 0, reorder_batches(0, 1))
    results = finish(launch("tempered", tmp_path), tmp_path, "tempered")
    assert_losses(rank_mean(results, "losses"), losses)
    assert_params(torch.load(tmp_path / "tempered_params.pt"), trainer.module)
    assert trainer.segments is not None and trainer.segments.model is not None
    blocks = [f"blocks.{k}" for k in range(3)]
    for r in results:
        # the blocks compiled before the change and again after it (with the new value:
        # the losses say so), the parameters sharded again
        assert r["before"] == before and set(blocks) <= set(before), r["before"]
        assert r["compiled"] == sorted(trainer.segments.model.compiled) == before
        assert r["sharded"]


@pytest.mark.slow
@pytest.mark.parametrize("clip", [1.0, None], ids=["clipped", "landing"])
def test_zero3_keeps_whole_the_parameters_eager_code_reads(tmp_path, clip):
    """ZeRO-3 of a model whose eager code reads parameters (the root's own, one of a module
    that falls back to eager, an embedding tied by hand as the output projection): those
    stay whole on every rank, the rest are sharded, and the training equals one process
    on the combined batches (losses, final parameters, an evaluation). A compiled block
    whose call runs in eager on some micro-steps keeps its gathered parameters for its
    backward; the first micro-step's gathers are prefetched along the recorded forward.
    Without clipping the update runs as the buckets land, in the backward: the whole
    parameters' shards change there, and their whole copies once the step is done."""
    trainer, losses = train_eager_reads(0, 0, eager_reads_batches(0, 1), clip)
    env = {"ORTRAIN_TEST_CLIP": "none"} if clip is None else {}
    results = finish(launch("eager_reads", tmp_path, **env), tmp_path, "eager_reads")
    assert_losses(rank_mean(results, "losses"), losses)
    assert_params(torch.load(tmp_path / "eager_reads_params.pt"), trainer.module)
    whole = ["embed.weight", "gate.w", "scale"]
    assert trainer.segments is not None and trainer.segments.model is not None
    for r in results:
        assert r["engine"] == ("zero-torch" if clip else "zero-backward")
        assert r["whole"] == whole
        said = [w for w in r["warnings"] if "ZeRO-3 keeps 3 parameter(s) whole" in w]
        assert len(said) == 1 and "embed.weight, gate.w, scale" in said[0], r["warnings"]
        assert "blocks.0" in r["compiled"] and "gate" not in r["compiled"]
        assert r["compiled"] == sorted(trainer.segments.model.compiled)
        # the first sharded micro-step prefetches along the recorded forward (no trace yet)
        assert r["first_prefetched"] > 0
        # between steps a rank holds whole only what eager code reads
        sizes = {n: p.numel() for n, p in trainer.module.named_parameters()}
        assert {n for n, k in r["held"].items() if k} == set(whole)
        assert all(r["held"][n] == sizes[n] for n in whole)
    want = float(trainer.eval_step(**eager_reads_batches(0, 1)[0]).loss)
    assert all(r["eval_loss"] == pytest.approx(want, rel=TOL) for r in results)


@pytest.mark.slow
def test_data_parallel_with_an_optimizer_ortrain_does_not_compile(tmp_path):
    """RMSprop (centered, momentum) under data parallel: its own step runs in eager over
    the all-reduced, clipped gradients, on every rank alike; equal to one process on the
    combined batches."""
    trainer, losses = train_rmsprop(0, reorder_batches(0, 1))
    results = finish(launch("rmsprop", tmp_path), tmp_path, "rmsprop")
    assert all(r["engine"] == "eager" for r in results)
    assert_losses(rank_mean(results, "losses"), losses)
    assert_params(torch.load(tmp_path / "rmsprop_params.pt"), trainer.module)


@pytest.mark.parametrize(
    ("stage", "opt"),
    [
        pytest.param(1, "adagrad", marks=pytest.mark.slow),
        (2, "rmsprop"),
        pytest.param(3, "amsgrad", marks=pytest.mark.slow),
        pytest.param(3, "nadam", marks=pytest.mark.slow),
        pytest.param(1, "asgd", marks=pytest.mark.slow),
    ],
)
def test_zero_runs_an_elementwise_optimizer_s_own_step_on_its_shard(tmp_path, stage, opt):
    """Adagrad, RMSprop (centered, momentum), Adam with amsgrad, NAdam and ASGD (numbers
    per parameter besides the step count) under ZeRO-1/2/3: their own step on each rank's
    pieces, with accumulation, clipping and an LR schedule, equal to
    one process on the combined batches; the sharded checkpoint the ranks wrote resumes in
    one process (torch's format, into the optimizer's own state) to the same end."""
    batches = reorder_batches(0, 1)
    trainer, losses = train_elementwise(0, 0, batches, opt)
    assert trainer.program.update == "eager"
    env = {"ORTRAIN_TEST_STAGE": str(stage), "ORTRAIN_TEST_OPT": opt}
    results = finish(launch("elementwise", tmp_path, **env), tmp_path, "elementwise")
    assert all(r["engine"] == "zero-eager" for r in results)
    assert_losses(rank_mean(results, "losses"), losses)
    assert_params(torch.load(tmp_path / "elementwise_params.pt"), trainer.module)
    resumed, rest = train_elementwise(0, 7, batches, opt, load=tmp_path)
    assert_losses(rest, losses[ELEMENTWISE_SAVE_AT:])
    assert_params({n: p.detach() for n, p in resumed.module.named_parameters()}, trainer.module)
    # and under ZeRO on 3 ranks (the shards' state laid out anew, the step counts lent)
    env["ORTRAIN_TEST_RESUME"] = "1"
    results = finish(launch("elementwise", tmp_path, 3, **env), tmp_path, "elementwise")
    assert_losses(rank_mean(results, "losses"), losses[ELEMENTWISE_SAVE_AT:])
    assert_params(torch.load(tmp_path / "elementwise_resumed_params.pt"), trainer.module)


@pytest.mark.slow
def test_data_parallel_with_layers_frozen_and_thawed_between_steps(tmp_path):
    """Layers frozen and thawed mid-run on every rank at the same step: each rank lays
    its graphs and update out anew, as one process on the combined batches does (its
    per-parameter step counts included: the thawed layer's lag)."""
    trainer, losses = train_frozen(reorder_batches(0, 1))
    results = finish(launch("frozen", tmp_path), tmp_path, "frozen")
    assert all(r["builds"] == trainer.build_count == 3 for r in results)
    assert_losses(rank_mean(results, "losses"), losses)
    assert_params(torch.load(tmp_path / "frozen_params.pt"), trainer.module)


@pytest.mark.slow
def test_data_parallel_of_a_model_that_skips_blocks_at_random(tmp_path):
    """LayerDrop under data parallel: the ranks agree on the parameters any of them reached
    (first layout included), and the update moves to the optimizer's own step on every
    rank. Same coins on every rank (one seed, as transformers' Trainer sets it): equal to
    one process on the combined batches. Each rank its own coins (their first steps reach
    different blocks): the replicas stay equal."""
    trainer, losses = train_layer_drop(5, layer_drop_batches(0, 1))
    results = finish(launch("layer_drop", tmp_path), tmp_path, "layer_drop")
    assert all(r["engine"] == "eager" and r["other_engine"] == "eager" for r in results)
    assert_losses(rank_mean(results, "losses"), losses)
    assert_params(torch.load(tmp_path / "layer_drop_params.pt"), trainer.module)
    assert results[0]["other_coins"][0] != results[1]["other_coins"][0]
    assert results[0]["other_sum"] == results[1]["other_sum"]


@pytest.mark.slow
def test_one_rank_overflowing_makes_every_rank_skip_the_update(tmp_path):
    """Loss scaling across ranks: the overflow check reads the all-reduced gradients (data
    parallel) or the all-reduced sum of squares (ZeRO-1), so one rank's Inf makes every
    rank skip, and the replicas stay identical."""
    results = finish(launch("overflow", tmp_path), tmp_path, "overflow")
    for stage in ("stage0", "stage1"):
        ranks = [r[stage] for r in results]
        assert all(r["step"] == 1 and r["skipped"] == 1 and r["unchanged"] for r in ranks)
        assert ranks[0]["checksum"] == ranks[1]["checksum"]


@pytest.mark.slow
def test_zero1_optimizer_state_is_sharded(trained, reference):
    """The optimizer state the shard's update reads (torch's kernels over its pieces)
    holds 1/N of the single-process state (plus alignment padding): each element's
    moments live on exactly one rank."""
    _, results = trained
    ref_trainer, _ = reference
    single = sum(t.numel() * t.element_size() for t in ref_trainer.opt_state.values())
    n_states = 2  # AdamW: exp_avg, exp_avg_sq
    padding = n_states * results[0]["layout"]["padding"] * 4
    for r in results:
        held = r["zero_state_bytes"]
        assert not held["overlap"]
        assert held["bound"] <= single / WORLD + padding
        assert held["storage"] <= single / WORLD + padding
    assert sum(r["zero_state_bytes"]["bound"] for r in results) == single


@pytest.mark.slow
def test_zero1_consolidated_state_dict_equals_single_process(trained, reference):
    out, _ = trained
    ref_trainer, _ = reference
    ours, ref = torch.load(out / "zero_state_dict.pt"), ref_trainer.state_dict()
    assert ours["ortrain"] == ref["ortrain"] == {"step": STEPS, "micro_step": 0}
    assert ours["optimizer"]["param_groups"] == ref["optimizer"]["param_groups"]
    assert sorted(ours["model"]) == sorted(ref["model"])
    for k, v in ref["model"].items():
        assert_tensor(
            drop_key_bias(k, ours["model"][k], ref_trainer.module),
            drop_key_bias(k, v, ref_trainer.module),
            k,
        )
    names = index_names(ref_trainer.state)
    assert sorted(ours["optimizer"]["state"]) == sorted(ref["optimizer"]["state"])
    for idx, entry in ref["optimizer"]["state"].items():
        assert sorted(ours["optimizer"]["state"][idx]) == sorted(entry)
        for s, t in entry.items():
            mine = ours["optimizer"]["state"][idx][s]
            if s == "step":
                assert torch.equal(mine, t)
            else:
                name = names[idx]
                assert_tensor(
                    drop_key_bias(name, mine, ref_trainer.module),
                    drop_key_bias(name, t, ref_trainer.module),
                    f"{s} of {name}",
                )


@pytest.mark.slow
def test_zero1_sharded_checkpoint_resumes_identically(trained):
    """Save at step RESUME_AT, start both processes afresh, load: the same losses, bit for bit."""
    out, results = trained
    manifest = json.loads((out / "sharded" / "manifest.json").read_text())
    assert manifest["world_size"] == WORLD and manifest["step"] == RESUME_AT
    assert len(list((out / "sharded").glob("*.rank*-of-*.pt"))) == WORLD
    assert not list((out / "sharded").glob("*.tmp"))
    resumed = finish(launch("resume", out), out, "resume")
    for r in range(WORLD):
        assert resumed[r]["losses"] == results[r]["zero_losses"][MID:]
    final, again = torch.load(out / "zero_params.pt"), torch.load(out / "resumed_params.pt")
    for name, t in final.items():
        assert torch.equal(again[name], t), name


@pytest.mark.slow
def test_two_rank_checkpoints_load_into_one_process(trained):
    """The consolidated state dict and the sharded directory both load into one rank,
    which then continues like the two ranks did."""
    out, results = trained
    consolidated = torch.load(out / "consolidated_mid.pt")
    trainer, sched = make_trainer(0)
    trainer.load_state_dict(consolidated)
    sched.load_state_dict(torch.load(out / "sched_mid.pt"))
    losses = run(trainer, sched, micro_batches(0, 1), MID, END)
    assert_losses(losses, rank_mean(results, "zero_losses")[MID:])
    final = torch.load(out / "zero_params.pt")
    for name, p in trainer.module.named_parameters():
        m = trainer.module
        assert_tensor(drop_key_bias(name, p, m), drop_key_bias(name, final[name], m), name)

    trainer.load_checkpoint(out / "sharded")  # the directory of shards, re-sharded to 1
    assert_same_state(trainer.state_dict(), consolidated)


@pytest.mark.slow
def test_sharded_checkpoint_loads_into_three_ranks(trained):
    """3 ranks (a process group passed in) load the 2-rank shards: consolidated again on
    rank 0, the state is exactly the 2-rank one."""
    out, trained_results = trained
    results = finish(launch("reshard", out, world=3), out, "reshard")
    assert [r["empty"] for r in results] == [False, True, True]
    two_rank_shard = trained_results[0]["layout"]["numel"] // 2
    assert results[0]["shard_numel"] < two_rank_shard  # really re-sharded, into thirds
    assert_same_state(torch.load(out / "resharded3.pt"), torch.load(out / "consolidated_mid.pt"))


def assert_same_state(loaded: dict, expected: dict) -> None:
    assert loaded["ortrain"] == expected["ortrain"]
    assert loaded["optimizer"]["param_groups"] == expected["optimizer"]["param_groups"]
    assert sorted(loaded["model"]) == sorted(expected["model"])
    for k, v in expected["model"].items():
        assert torch.equal(loaded["model"][k], v), k
    assert sorted(loaded["optimizer"]["state"]) == sorted(expected["optimizer"]["state"])
    for idx, entry in expected["optimizer"]["state"].items():
        assert sorted(loaded["optimizer"]["state"][idx]) == sorted(entry)
        for s, t in entry.items():
            assert torch.equal(loaded["optimizer"]["state"][idx][s], t), (idx, s)


@pytest.mark.slow
@pytest.mark.parametrize(
    "fault,sig,timeout,stage",
    [
        pytest.param("killed", signal.SIGKILL, 20.0, 0, id="killed"),
        pytest.param("hung", signal.SIGSTOP, 4.0, 0, id="hung"),
        pytest.param("killed", signal.SIGKILL, 20.0, 3, id="killed-zero3"),
        pytest.param("hung", signal.SIGSTOP, 4.0, 2, id="hung-zero2"),
    ],
)
def test_failed_rank_fails_the_other_within_timeout(tmp_path, fault, sig, timeout, stage):
    """A killed rank is noticed at once (its connections close); a stopped one when the
    collective times out. Either way rank 0 raises RankFailureError naming rank 1: data
    parallel, and ZeRO-2 and ZeRO-3, whose collectives run inside the forward (gathers)
    and the backward (reduce-scatters)."""
    procs = launch(
        "loop", tmp_path, piped=1, ORTRAIN_TEST_TIMEOUT=str(timeout), ORTRAIN_TEST_STAGE=str(stage)
    )
    try:
        said, deadline, fd = b"", time.monotonic() + 120, procs[1].stdout.fileno()
        while b"STEP 3\n" not in said:  # rank 1's own word that it is training
            ready, _, _ = select.select([fd], [], [], max(0.0, deadline - time.monotonic()))
            chunk = os.read(fd, 4096) if ready else b""  # b"": it ended, or the deadline
            assert chunk, f"rank 1 said {said!r}:\n{(tmp_path / 'loop.log1').read_text()}"
            said += chunk
        start = time.time()
        procs[1].send_signal(sig)
        rc = procs[0].wait(timeout=timeout + 30)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()  # also ends a stopped process
                p.wait()
    log0 = (tmp_path / "loop.log0").read_text()
    assert rc == 3, log0[-3000:]
    failure = next(ln for ln in log0.splitlines() if ln.startswith("FAILED"))
    assert "ranks=[1]" in failure and "rank 1 stopped responding" in failure, failure
    assert f"dist_timeout={timeout:g} s" in failure
    elapsed = float(failure.split()[2]) - start  # "FAILED at <time.time()> ..."
    if fault == "killed":
        assert elapsed < timeout, f"rank 0 needed {elapsed:.1f} s to fail"
    else:  # waited for the timeout, then the diagnosis (3 heartbeat intervals)
        assert timeout <= elapsed < timeout + 4, f"rank 0 failed after {elapsed:.1f} s"


# --------------------------------------------------------------------------- no processes
def test_flat_layout_aligns_pads_and_splits_into_pieces():
    shapes = {"a": (3, 5), "b": (7,), "c": (2, 2, 3), "d": (1,)}
    layout = FlatLayout.build(shapes, align=4, world_size=3)
    assert [e.offset for e in layout.entries] == [0, 16, 24, 36]
    assert layout.numel == 48 and layout.shard_numel == 16  # padded to 3 * 4
    assert layout.padding == 48 - (15 + 7 + 12 + 1)
    covered = {n: [] for n in shapes}
    for rank in range(3):
        lo, hi = layout.shard(rank)
        assert lo % 4 == 0
        for pc in layout.pieces(rank):
            assert lo <= pc.start < pc.stop <= hi
            covered[pc.name].append((pc.start, pc.stop))
    # every element of every tensor in exactly one piece; "c" straddles shards 1 and 2
    for e in layout.entries:
        pieces = sorted(covered[e.name])
        assert pieces[0][0] == e.offset and pieces[-1][1] == e.stop
        assert all(a[1] == b[0] for a, b in itertools.pairwise(pieces))
    assert len(covered["c"]) == 2
    flat = torch.arange(48, dtype=torch.float32)
    views = layout.views(flat)
    assert views["b"].tolist() == list(range(16, 23)) and views["c"].shape == (2, 2, 3)
    assert FlatLayout.from_json(json.loads(json.dumps(layout.to_json()))) == layout


def test_shard_graphs_take_the_global_norm_and_hold_pieces():
    from ortrain.graph_passes.training.zero import build_shard_update_graph

    model = torch.nn.Linear(4, 3)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    spec = optimizer_spec(opt, {id(p): n for n, p in model.named_parameters()})
    ug = build_shard_update_graph(spec, {"weight": 5}, clip_grad_norm=True)
    inputs = {v.name: v for v in ug.model.graph.inputs}
    assert "global_sq_norm" in inputs and "bias" not in inputs
    for name in ("weight", "grad:weight", "exp_avg:weight", "exp_avg_sq:weight"):
        assert list(inputs[name].shape.dims) == [5]
    assert [io.name for io in ug.io if io.role is Role.OPTIMIZER_STATE] == [
        "exp_avg:weight",
        "exp_avg_sq:weight",
    ]
    # the norm comes in: no local reduction over the shard's gradients
    assert not any(n.op_type == "ReduceSumSquare" for n in ug.model.graph)

    lamb = optimizer_spec(Lamb(model.parameters()), {id(p): n for n, p in model.named_parameters()})
    with pytest.raises(UnsupportedOptimizerError, match=r"ZeRO-1 .* lamb optimizer"):
        build_shard_update_graph(lamb, {"weight": 5}, clip_grad_norm=False)


def test_zero3_shard_cut_hands_back_the_pages_around_the_stretch():
    """ZeRO-3 on CPU keeps the flat parameters in a private mapping: cutting the shard
    leaves the stretch in place (no copy) and hands the pages around it back, so the
    process's resident memory drops by them while the stretch keeps its values."""
    import mmap

    from ortrain.distributed.sharded_params import _release_outside

    def resident() -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * mmap.PAGESIZE

    n = 16 * 2**20  # 64 MiB of float32
    mapping = mmap.mmap(-1, 4 * n, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    flat = torch.frombuffer(mapping, dtype=torch.float32, count=n)
    flat.copy_(torch.arange(n, dtype=torch.float32))
    lo, hi = n // 4 + 3, n // 2 + 5  # not on page boundaries
    before = resident()
    _release_outside(mapping, 4 * lo, 4 * hi)
    dropped = before - resident()
    assert dropped >= 4 * (n - (hi - lo)) - 2 * mmap.PAGESIZE - 2**20, dropped
    assert torch.equal(flat[lo:hi], torch.arange(lo, hi, dtype=torch.float32))
    assert float(flat[0]) == 0.0 and float(flat[-1]) == 0.0  # handed back: reads as zeros


def test_shard_norm_sums_per_tensor_as_torch_clips():
    """A shard's squared gradient norm, summed over the ranks' shards, is the model's as
    torch's ``get_total_norm`` (``clip_grad_norm_``) takes it: a norm per tensor, then of
    those. Tensors of a million elements each, cut mid-tensor by the shards: one float
    reduction over a whole shard is off by far more (its accumulators add millions of
    elements each), which moved every ZeRO run's clipping coefficient."""
    from ortrain.distributed.shard_config import ShardConfig
    from ortrain.distributed.sharded_state import shard_sq_norm

    g = torch.Generator().manual_seed(0)
    shapes = {f"w{i}": (1000, 1000 + 7 * i) for i in range(6)} | {"b": (333,)}
    grads = {n: torch.randn(*s, generator=g) * 0.01 for n, s in shapes.items()}
    exact = sum(float(t.double().square().sum()) for t in grads.values())
    torch_total = float(torch.nn.utils.get_total_norm(list(grads.values()))) ** 2
    for world in (1, 2, 3):
        configs = [ShardConfig.build(_sgd_spec(shapes), shapes, r, world) for r in range(world)]
        flat = torch.zeros(configs[0].layout.numel)
        for name, view in configs[0].layout.views(flat).items():
            view.copy_(grads[name])
        total = sum(float(shard_sq_norm(flat[c.shard], c)) for c in configs)
        assert total == pytest.approx(torch_total, rel=2e-6), world
        assert total == pytest.approx(exact, rel=1e-4), world
        one_reduction = float(torch.linalg.vector_norm(flat).square())
        assert abs(one_reduction - exact) > 10 * abs(total - exact), (one_reduction, total)


def _sgd_spec(shapes: dict[str, tuple[int, ...]]):
    params = {n: torch.nn.Parameter(torch.zeros(s)) for n, s in shapes.items()}
    opt = torch.optim.SGD(params.values(), lr=0.1)
    return optimizer_spec(opt, {id(p): n for n, p in params.items()})


def test_rank_health_names_dead_missing_and_lagging_ranks():
    import torch.distributed as dist

    store = dist.HashStore()
    me = RankHealth(store, rank=0, interval=0.05)
    me.seq = 7
    peers = dist.PrefixStore("ortrain/health/", store)
    peers.set("1", "5 7")  # beat once, then nothing: dead or stopped
    stop, beating = threading.Event(), threading.Event()

    def lagging() -> None:  # rank 2 beats on (each interval) but sits at collective #6
        beats = 0
        while not stop.is_set():
            peers.set("2", f"{beats} 6")
            beats += 1
            beating.set()
            stop.wait(me.interval / 2)

    t = threading.Thread(target=lagging, daemon=True)
    t.start()
    try:
        assert beating.wait(30)
        blamed, why = me.diagnose([1, 2, 3])  # rank 3 never beat at all
    finally:
        stop.set()
        me.stop()
        t.join()
    assert blamed == [1, 3, 2]
    assert "ranks 1, 3 stopped responding" in why
    assert "rank 2 still alive but never reached collective #7" in why


def test_options_validate_distributed_fields():
    with pytest.raises(ValueError, match="zero_stage"):
        TrainerOptions(zero_stage=4)
    with pytest.raises(ValueError, match="dist_timeout"):
        TrainerOptions(dist_timeout=0)


@pytest.mark.slow
@pytest.mark.parametrize(
    "stage,broadcast", [(0, True), (3, True), (0, False)], ids=["dp", "zero3", "dp-own"]
)
def test_batch_norm_statistics_follow_ddp_broadcast_buffers(tmp_path, stage, broadcast):
    """BatchNorm's running statistics, from each rank's own batches (scaled apart), as
    torch's DDP in the same group keeps them: with ``broadcast_buffers`` every rank
    evaluates with rank 0's, as DDP's evaluation forward (after its broadcast) does; without
    it each rank keeps its own, as DDP(broadcast_buffers=False). The training losses and
    parameters equal DDP's either way (training mode normalizes by the batch)."""
    env = {"ORTRAIN_TEST_STAGE": str(stage), "ORTRAIN_TEST_BROADCAST": str(int(broadcast))}
    results = finish(launch("batch_norm", tmp_path, **env), tmp_path, "batch_norm")
    for r in results:
        assert r["losses"] == pytest.approx(r["ref_losses"], rel=1e-5, abs=1e-6)
        assert r["param_diff"] < 1e-5
        assert r["buffer_diff"] < 1e-5
        assert r["eval"] == pytest.approx(r["ref_eval"], rel=1e-5)
    means = [r["running_mean"] for r in results]
    assert (means[0] == means[1]) == broadcast  # the ranks' own statistics differ


@pytest.fixture(scope="module")
def landing_reference():
    """One process on the combined batches: the 20 steps, and the last 10 of them resumed
    from the ZeRO-3 ranks' checkpoint (``check``)."""
    return train_landing(0, 0, landing_batches(0, 1))


@pytest.mark.slow
@pytest.mark.parametrize(
    "stage,world", [(2, 2), (3, 2), (3, 3)], ids=["zero2-2", "zero3-2", "zero3-3"]
)
def test_zero_updates_each_bucket_as_it_lands_as_one_process(
    tmp_path, landing_reference, stage, world
):
    """ZeRO-2/3 without clipping, scaling or accumulation updates each gradient bucket's
    stretch of a rank's shard as its reduce lands, inside the backward
    (``ShardBackwardUpdate``): 20 AdamW steps (two decay groups, a warmup schedule, GPT-2's
    tied table) end with losses and parameters equal to one process on the combined
    batches; after the first update the gradient shard is handed back and never written
    again (it reads zeros); the checkpoint taken halfway resumes in one process to the
    same end. A NaN loss on one rank stops the step on every rank, nothing updated."""
    env = {"ORTRAIN_TEST_STAGE": str(stage)}
    results = finish(launch("landing", tmp_path, world=world, **env), tmp_path, "landing")
    ref, losses = landing_reference
    assert_losses(rank_mean(results, "losses"), losses)
    assert_params(torch.load(tmp_path / "landing_auto_params.pt"), ref.module)
    for r in results:
        assert r["engine"] == "zero-backward"
        assert r["late_reads"] == []
        assert r["released"] and r["grad_shard_nonzero"] == 0
        # the last rank's NaN loss stops the step on every rank before its backward
        assert r["refused"] == "NonFiniteLossError" and r["unchanged_after_nan"]
        # the last step updated every element of the rank's pieces (the engine raises
        # otherwise): at least its padded shard's parameters less the layout's gaps
        assert 0 < r["updated_numel"] <= r["shard_numel"]
    resumed, _ = train_landing(0, 0, [])
    resumed.load_checkpoint(tmp_path / "landing_ckpt")
    for group in resumed.optimizer.param_groups:
        group["lr"] = LANDING_LR  # the warmup (5 steps) is over by the checkpoint
    for batch in landing_batches(0, 1)[LANDING_SAVE_AT:]:
        resumed.train_step(**batch)
    assert int(resumed.state.step_tensor) == len(losses)
    assert_params({n: p.detach() for n, p in resumed.module.named_parameters()}, ref.module)


@pytest.mark.slow
def test_zero3_updates_a_factored_table_stretch_by_stretch(tmp_path):
    """A 4096-token tied table whose head's gradient goes as factors, at 3 ranks (the
    shards' edges inside the table): under the update in the backward each rank sums its
    stretch of the table a bucket's worth of rows at a time and updates it before the next
    (no table-sized buffer); losses and every rank's parameters equal the update after the
    backward (the same kernels, ``max_grad_norm=inf``) from the same start."""
    world = 3
    results = finish(launch("landing_table", tmp_path, world=world), tmp_path, "landing_table")
    table = "transformer.wte.weight"
    for rank, r in enumerate(results):
        auto, after = r["auto"], r["after"]
        assert (auto["engine"], after["engine"]) == ("zero-backward", "zero-torch")
        assert auto["routed"] == after["routed"] == [table]
        assert after["stretches"] == 0
        assert_losses(auto["losses"], after["losses"])
        a = torch.load(tmp_path / f"landing_table_auto_{rank}.pt")
        b = torch.load(tmp_path / f"landing_table_after_{rank}.pt")
        for name in b:
            assert_tensor(a[name], b[name], name)
    # rank 0's stretch starts with the table: several stretches of it a step from the
    # second on (the first updates after its backward)
    assert results[0]["auto"]["stretches"] >= 2 * (STEPS * ACCUM - 1)


@pytest.mark.slow
@pytest.mark.parametrize("stage", [2, 3], ids=["zero2", "zero3"])
def test_zero_a_weight_read_after_its_gradient_keeps_the_update_after_the_backward(tmp_path, stage):
    """A backward graph that reads a weight whose gradient arrived already (a projection
    called first through its weight detached, then as usual): the first step sees it, and
    the update runs after the backward (updated in the backward, the detached call's
    backward would read the new weight). Parameters equal one process's."""
    env = {"ORTRAIN_TEST_STAGE": str(stage)}
    results = finish(launch("detached", tmp_path, **env), tmp_path, "detached")
    ref, losses = train_detached(0, 0, reorder_batches(0, 1))
    assert_losses(rank_mean(results, "losses"), losses)
    assert_params(torch.load(tmp_path / "detached_params.pt"), ref.module)
    for r in results:
        assert r["engine"] == "zero-backward"
        assert r["late_reads"] == ["proj.weight"]
        assert not r["released"]
