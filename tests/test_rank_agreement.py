"""Ranks that disagree stop at the start (ortrain/distributed/fingerprint.py): a model of
another size, of other shapes but the same size, other options, or a first training graph
that reaches other parameters raise RankMismatchError on every rank, naming the first
difference and the ranks; ranks that agree train.

The two-rank runs start this file as the worker, torchrun-style:
    RANK=r WORLD_SIZE=2 MASTER_ADDR=.. MASTER_PORT=.. python -m tests.test_rank_agreement OUT
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from ortrain import ORTTrainer, TrainerOptions
from ortrain.distributed.fingerprint import (
    RankMismatchError,
    first_difference,
    run_fields,
)
from tests.rank_processes import start_rank

ROOT = Path(__file__).resolve().parent.parent


class _TwoHeads(torch.nn.Module):
    """``head`` (a constant of the batch) picks which head the loss reaches."""

    def __init__(self, width: int = 4) -> None:
        super().__init__()
        self.a = torch.nn.Linear(width, 1, bias=False)
        self.b = torch.nn.Linear(width, 1, bias=False)

    def forward(self, x: torch.Tensor, head: int = 0) -> torch.Tensor:
        return (self.a if head == 0 else self.b)(x).square().mean()


def _trainer(model: torch.nn.Module, **options: Any) -> ORTTrainer:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    options = {"intra_op_threads": 1, "dist_timeout": 60, "graph_cache": False, **options}
    return ORTTrainer(model, opt, TrainerOptions(**options))


# --------------------------------------------------------------------------- the worker
def _scenarios(rank: int) -> dict[str, Any]:
    """name -> what this rank runs (a trainer's construction, then maybe a step)."""
    from tests.conftest import gpt2, lm_batches

    def layers() -> None:  # different sizes: today gloo aborts one rank
        _trainer(gpt2(layers=1 + rank, hidden=32, vocab=64))

    def shape() -> None:  # the same number of elements in other shapes: today trains on
        n_in, n_out = (4, 6) if rank == 0 else (6, 4)
        _trainer(torch.nn.Linear(n_in, n_out, bias=False))

    def options() -> None:  # clipping on one rank only: today ZeRO-1 times out or drifts
        model = gpt2(layers=1, hidden=32, vocab=64)
        _trainer(model, zero_stage=1, max_grad_norm=0.5 if rank else None)

    def graph() -> None:  # the same model, the loss reaching another head on rank 1
        torch.manual_seed(0)
        trainer = _trainer(_TwoHeads())
        trainer.train_step(x=torch.randn(2, 4), head=rank)

    def agree() -> None:  # no false alarm: the same model trains, on lengths of other
        # buckets on the two ranks at the first step (graphs of other shapes: not a mismatch)
        model = gpt2(layers=1, hidden=32, vocab=64, seed=rank)
        trainer = _trainer(model, max_grad_norm=1.0)
        seq = 8 if rank == 0 else 20
        trainer.train_step(**lm_batches(1, batch=2, seq=seq, vocab=64, seed=rank)[0])

    return {"layers": layers, "shape": shape, "options": options, "graph": graph, "agree": agree}


def _abort(rank: int, out: Path) -> None:
    """A collective of different sizes on the two ranks: gloo aborts one of them (SIGABRT);
    the other must say so. (Trainers that agree never run one: this calls the trainer's
    group directly.)"""
    from ortrain import RankFailureError

    comm = _trainer(torch.nn.Linear(4, 4))._ctx.reducer.comm  # type: ignore[union-attr]
    try:
        comm.all_reduce(torch.zeros(1000 if rank == 0 else 10))
        comm.barrier()
        result = {"error": None}
    except RankFailureError as exc:
        result = {"error": str(exc), "ranks": exc.ranks}
    (out / f"abort{rank}.json").write_text(json.dumps(result))


def _worker(out: Path, mode: str) -> None:
    torch.set_num_threads(1)
    torch.distributed.init_process_group("gloo")
    rank = torch.distributed.get_rank()
    if mode == "abort":
        _abort(rank, out)
        return
    result: dict[str, Any] = {}
    for name, run in _scenarios(rank).items():
        start = time.monotonic()
        try:
            run()
            result[name] = {"error": None}
        except RankMismatchError as exc:
            result[name] = {"error": str(exc), "field": exc.field, "ranks": exc.ranks}
        result[name]["seconds"] = time.monotonic() - start
        print(name, result[name], flush=True)
    (out / f"rank{rank}.json").write_text(json.dumps(result))
    torch.distributed.destroy_process_group()


# --------------------------------------------------------------------------- the tests
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(out: Path, mode: str, forked: bool = False) -> list[Any]:
    """Two ranks of this file's worker; ``forked``: from the warm server of
    tests/rank_processes.py (not for a rank that aborts: the survivor reads how it ended
    from its exit record and its unreaped process, and the server reaps its children)."""
    port, procs = str(_free_port()), []
    for rank in range(2):
        env = {
            **os.environ,
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": "2",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": port,
            "PYTHONPATH": str(ROOT),
            "OMP_NUM_THREADS": "1",
            "ORTRAIN_GRAPH_CACHE": "0",
            "TMPDIR": str(out),  # the ranks' exit records (ortrain/distributed/exits.py)
            # builds in the rank itself: one of six runs under load hung in a forked build
            "ORTRAIN_BUILD_IN_PROCESS": "1",
        }
        if forked:
            log_path = out / f"log{rank}"
            procs.append(start_rank("tests.test_rank_agreement", [str(out), mode], env, log_path))
            continue
        log = open(out / f"log{rank}", "w")
        cmd = [sys.executable, "-m", "tests.test_rank_agreement", str(out), mode]
        procs.append(subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=log))
    try:
        for p in procs:
            p.wait(timeout=180)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    return procs


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory) -> list[dict[str, Any]]:
    out = tmp_path_factory.mktemp("agree")
    procs = _launch(out, "agree", forked=True)
    for rank, p in enumerate(procs):
        log = (out / f"log{rank}").read_text()
        assert p.returncode == 0, f"rank {rank} exited {p.returncode}:\n{log[-4000:]}"
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


MISMATCHES = [
    # scenario, first differing field, what each rank's message shows
    ("layers", "parameter transformer.h.1.attn.c_attn.bias", ["rank 0: <absent>", "rank 1: [96]"]),
    ("shape", "parameter weight", ["rank 0: [6, 4] float32", "rank 1: [4, 6] float32"]),
    ("options", "TrainerOptions.max_grad_norm", ["rank 0: None", "rank 1: 0.5"]),
    ("graph", "parameters with gradients", ["rank 0: a.weight", "rank 1: b.weight"]),
]


@pytest.mark.slow
@pytest.mark.parametrize("scenario,field,shown", MISMATCHES, ids=[m[0] for m in MISMATCHES])
def test_disagreeing_ranks_stop_with_one_error(two_ranks, scenario, field, shown):
    for rank, result in enumerate(two_ranks):
        r = result[scenario]
        assert r["error"] is not None, f"rank {rank} trained on in scenario {scenario}"
        assert r["field"] == field and r["ranks"] == [1], r
        for part in shown:
            assert part in r["error"], r["error"]
        assert f"rank {rank}: the ranks'" in r["error"]


@pytest.mark.slow
def test_agreeing_ranks_train(two_ranks):
    assert [r["agree"]["error"] for r in two_ranks] == [None, None]


@pytest.mark.slow
def test_rank_aborted_by_gloo_is_reported_as_aborted(tmp_path):
    """Gloo aborts a rank whose collective does not match (SIGABRT, no Python runs there):
    the survivor's RankFailureError names it and says it was aborted, not only that it
    stopped responding."""
    procs = _launch(tmp_path, "abort")
    codes = [p.returncode for p in procs]
    assert sorted(codes) == [-signal.SIGABRT, 0], codes
    dead, alive = codes.index(-signal.SIGABRT), codes.index(0)
    result = json.loads((tmp_path / f"abort{alive}.json").read_text())
    assert result["error"] is not None and result["ranks"] == [dead], result
    assert f"rank {dead} was aborted by SIGABRT" in result["error"], result["error"]


# --------------------------------------------------------------------------- no processes
def test_first_difference_in_rank0_order_then_missing_fields():
    r0 = [("a", "1"), ("b", "2"), ("c", "3")]
    assert first_difference([r0, list(r0), list(r0)]) is None
    assert first_difference([r0, [("a", "1"), ("b", "9"), ("c", "0")], r0]) == (
        "b",
        ["2", "9", "2"],
        [1],
    )
    assert first_difference([r0, [*r0, ("d", "4")]]) == ("d", ["<absent>", "4"], [1])
    assert first_difference([r0, r0[:1]]) == ("b", ["2", "<absent>"], [1])


def _fields(trainer: ORTTrainer) -> list[tuple[str, str]]:
    return run_fields(trainer.state, trainer.options)


def test_fields_hold_shapes_optimizer_and_options():
    torch.manual_seed(0)
    a = _fields(_trainer(torch.nn.Linear(4, 6, bias=False)))
    b = _fields(_trainer(torch.nn.Linear(6, 4, bias=False)))
    assert first_difference([a, b])[0] == "parameter weight"
    c = _fields(_trainer(torch.nn.Linear(4, 6, bias=False), grad_accumulation_steps=2))
    assert first_difference([a, c])[:2] == (
        "TrainerOptions.grad_accumulation_steps",
        ["1", "2"],
    )
    model = torch.nn.Linear(4, 6, bias=False)
    opt = torch.optim.AdamW(model.parameters(), lr=5e-4)
    d = _fields(ORTTrainer(model, opt, TrainerOptions(graph_cache=False)))
    assert first_difference([a, d])[:2] == ("optimizer group 0 lr", ["0.001", "0.0005"])


_CHILD = """
import os, signal, sys
from pathlib import Path
from ortrain.distributed.exits import ExitRecorder
ExitRecorder(1, Path(sys.argv[1]))
print("ready", flush=True)
how = sys.argv[2]
if how == "abort":
    os.abort()
elif how == "exit":
    sys.exit(0)
else:
    os.kill(os.getpid(), getattr(signal, how))
    signal.pause()  # not reached: killed, or stopped until the test kills it
"""


@pytest.mark.slow
@pytest.mark.parametrize(
    "how,told",
    [
        ("abort", "rank 1 was aborted by SIGABRT"),
        ("SIGKILL", "rank 1's process (pid {pid}) was killed by SIGKILL"),
        ("SIGSTOP", "rank 1's process (pid {pid}) is stopped"),
        ("exit", None),  # a clean exit leaves no record: nothing to add
    ],
)
def test_exit_records_tell_how_a_peer_ended(tmp_path, how, told):
    """A rank's record (ortrain/distributed/exits.py) lets a peer on the same host say that
    it was aborted (its faulthandler file), killed (a zombie's wait status) or stopped."""
    from ortrain.distributed.exits import ExitRecorder

    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("PYTHONFAULTHANDLER", None)
    cmd = [sys.executable, "-c", _CHILD, str(tmp_path), how]
    child = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    try:
        assert child.stdout is not None and child.stdout.readline() == b"ready\n"
        # until it has ended or stopped, leaving it unreaped (a zombie) for the record
        guard = threading.Timer(60, child.kill)  # a child that does neither: fails below
        guard.start()
        os.waitid(os.P_PID, child.pid, os.WEXITED | os.WSTOPPED | os.WNOWAIT)
        guard.cancel()
        me = ExitRecorder(0, tmp_path)
        said = me.how_ended(1)
        me.close()
    finally:
        if child.poll() is None:
            child.kill()
        child.wait()
    if told is None:
        assert said is None
    else:
        assert said is not None and told.format(pid=child.pid) in said, said


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    _worker(Path(sys.argv[1]), sys.argv[2])
