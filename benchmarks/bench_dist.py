"""Distributed training benchmark: 2 CPU ranks on gloo, per-rank memory and step time.

Backends, each run as its own group of rank processes (this script re-invoked
torchrun-style with ``--rank-of BACKEND --json PATH`` and RANK/WORLD_SIZE/MASTER_* set):

  ortrain-dp     ORTTrainer(zero_stage=0): whole state per rank, all-reduced gradients
  ortrain-zero1  ORTTrainer(zero_stage=1): optimizer state sharded over the ranks
  ortrain-zero2  ORTTrainer(zero_stage=2): gradients sharded too, reduced block by block
  ortrain-zero3  ORTTrainer(zero_stage=3): parameters sharded too, gathered per segment
  torch-ddp      DistributedDataParallel + torch.optim.AdamW
  torch-zero     DistributedDataParallel + torch.distributed.optim.ZeroRedundancyOptimizer
  torch-fsdp2    fully_shard (FSDP2) on each GPT-2 block and the model + torch.optim.AdamW:
                 parameters, gradients and optimizer state sharded (ZeRO-3's layout)

Same workload for all: a GPT-2 built from one seed, AdamW(lr=1e-4, weight_decay=0.01),
per-rank synthetic batches (rank r draws its own), ``--threads`` threads per rank. Per
rank: the first step (ortrain: export + compile), ``--warmup`` untimed steps, ``--steps``
timed steps (each reads the loss back); the median is the step time. Peak RSS is
``ru_maxrss`` of the rank process; steady RSS is its RSS after the timed steps;
optimizer state counts the bytes of the state tensors the rank holds.

Usage::

    PYTHONPATH=. python benchmarks/bench_dist.py                      # gpt2-27m
    PYTHONPATH=. python benchmarks/bench_dist.py --workload gpt2-tiny --steps 5
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import resource
import shlex
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import psutil
import torch
import torch.distributed as dist

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from benchmarks.hardware import cpu_description  # noqa: E402

BACKENDS = (
    "ortrain-dp", "ortrain-zero1", "ortrain-zero2", "ortrain-zero3", "torch-ddp", "torch-zero",
    "torch-fsdp2",
)  # fmt: skip
STAGES = {"ortrain-dp": 0, "ortrain-zero1": 1, "ortrain-zero2": 2, "ortrain-zero3": 3}
WORLD = 2


@dataclasses.dataclass(frozen=True)
class Workload:
    name: str
    layers: int
    hidden: int
    vocab: int
    batch: int  # sequences per rank
    seq: int


WORKLOADS = {
    w.name: w
    for w in [
        Workload("gpt2-tiny", 4, 256, 8192, 4, 128),
        Workload("gpt2-27m", 6, 512, 16384, 4, 128),
        # GPT-2 small's shape (124M parameters): the speed comparison of the stages
        Workload("gpt2-small", 12, 768, 50257, 2, 128),
        # GPT-2 medium's shape (355M parameters): model states dominate the memory
        Workload("gpt2-medium", 24, 1024, 50257, 1, 64),
        # GPT-2 large's (774M): fp32 Adam states of 12.4 GB per data-parallel rank
        Workload("gpt2-large", 36, 1280, 50257, 1, 64),
    ]
}


def build_model(w: Workload) -> torch.nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    torch.manual_seed(0)
    cfg = GPT2Config(
        n_layer=w.layers,
        n_embd=w.hidden,
        n_head=8 if w.hidden < 768 else w.hidden // 64,
        vocab_size=w.vocab,
        n_positions=w.seq,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        attn_implementation="eager",
        bos_token_id=0,
        eos_token_id=0,
    )
    return GPT2LMHeadModel(cfg)


def batches(w: Workload, rank: int, n: int) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(1000 + rank)
    out = []
    for _ in range(n):
        ids = torch.randint(0, w.vocab, (w.batch, w.seq), generator=g)
        out.append({"input_ids": ids, "labels": ids})
    return out


def state_bytes(tensors: Any) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))


# --------------------------------------------------------------------------- one rank
class RssSampler:
    """The process's RSS sampled every few milliseconds in a thread: the peak of each
    phase (``take_peak`` starts the next), which ``ru_maxrss`` cannot split."""

    def __init__(self, every_s: float = 0.005):
        self._proc = psutil.Process()
        self._peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(every_s,), daemon=True)
        self._thread.start()

    def now(self) -> int:
        return self._proc.memory_info().rss

    def _run(self, every_s: float) -> None:
        while not self._stop.wait(every_s):
            self._peak = max(self._peak, self.now())

    def take_peak(self) -> int:
        peak, self._peak = max(self._peak, self.now()), 0
        return peak

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def run_rank(backend: str, w: Workload, args: argparse.Namespace) -> dict[str, Any]:
    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    model = build_model(w)
    params = sum(p.numel() for p in model.parameters())  # before ZeRO-3 empties them
    data = batches(w, rank, 1 if args.same_batch else 4)

    if backend.startswith("ortrain"):
        from ortrain import ORTTrainer, TrainerOptions

        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01)
        options = TrainerOptions(
            zero_stage=STAGES[backend], intra_op_threads=args.threads, verify=not args.no_verify
        )
        start = time.perf_counter()
        trainer = ORTTrainer(model, opt, options)
        start_s = time.perf_counter() - start

        def step(b: dict[str, torch.Tensor]) -> float:
            return float(trainer.train_step(**b))

        def held_state() -> int:
            return state_bytes(trainer.opt_state.values())

        def held_grads() -> int:
            shards = trainer.state.shard_grads
            return state_bytes([*trainer.grads.values(), *shards])

        def held_params() -> int:
            return trainer.state_bytes().parameters
    elif backend == "torch-fsdp2":
        from torch.distributed.fsdp import fully_shard

        for block in model.transformer.h:  # one gather unit per block, as ortrain's segments
            fully_shard(block)
        fully_shard(model)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01)
        start_s = 0.0
        model.train()

        def step(b: dict[str, torch.Tensor]) -> float:
            opt.zero_grad(set_to_none=True)
            loss = model(**b).loss
            loss.backward()
            opt.step()
            return loss.item()

        def local(t: torch.Tensor) -> torch.Tensor:
            return t.to_local() if hasattr(t, "to_local") else t

        def held_state() -> int:
            return sum(state_bytes([local(v) for v in s.values()]) for s in opt.state.values())

        def held_grads() -> int:
            return sum(local(p.grad).numel() * 4 for p in model.parameters() if p.grad is not None)

        def held_params() -> int:
            return sum(local(p).numel() * 4 for p in model.parameters())
    else:
        from torch.distributed.optim import ZeroRedundancyOptimizer
        from torch.nn.parallel import DistributedDataParallel

        start = time.perf_counter()
        ddp = DistributedDataParallel(model)
        start_s = time.perf_counter() - start
        if backend == "torch-zero":
            opt = ZeroRedundancyOptimizer(
                ddp.parameters(), optimizer_class=torch.optim.AdamW, lr=1e-4, weight_decay=0.01
            )
        else:
            opt = torch.optim.AdamW(ddp.parameters(), lr=1e-4, weight_decay=0.01)
        ddp.train()

        def step(b: dict[str, torch.Tensor]) -> float:
            opt.zero_grad(set_to_none=True)
            loss = ddp(**b).loss
            loss.backward()
            opt.step()
            return loss.item()

        def held_state() -> int:
            inner = opt.optim if backend == "torch-zero" else opt  # this rank's shard
            return sum(state_bytes(s.values()) for s in inner.state.values())

        def held_grads() -> int:
            return sum(p.numel() * 4 for p in model.parameters())  # DDP's buckets

        def held_params() -> int:
            return sum(p.numel() * 4 for p in model.parameters())

    rss = RssSampler()
    built_rss = rss.now()
    t = time.perf_counter()
    first_loss = step(data[0])
    first_s = time.perf_counter() - t
    first_peak = rss.take_peak()
    for i in range(args.warmup):
        step(data[(1 + i) % len(data)])
    reducer = getattr(trainer, "reducer", None) if backend.startswith("ortrain") else None

    def waited() -> tuple[float, float]:
        return (getattr(reducer, "gather_seconds", 0.0), getattr(reducer, "reduce_seconds", 0.0))

    waited_before = waited()
    usage_before = resource.getrusage(resource.RUSAGE_SELF)
    times, losses = [], []
    for i in range(args.steps):
        b = data[(1 + args.warmup + i) % len(data)]
        t = time.perf_counter()
        losses.append(step(b))
        times.append(time.perf_counter() - t)
    steady_peak = rss.take_peak()
    usage = resource.getrusage(resource.RUSAGE_SELF)
    gathers, reduces = (b - a for a, b in zip(waited_before, waited(), strict=True))
    rss.stop()
    classes = {}
    if backend.startswith("ortrain"):
        rep = trainer.memory_report()
        classes = {k: v / 2**20 for k, v in rep.rows()}
    build_s = build_seconds(trainer) if backend.startswith("ortrain") else 0.0
    # Mean over ranks of the first loss: the same number for every backend.
    mean_first = torch.tensor([first_loss])
    dist.all_reduce(mean_first)
    result = {
        "rank": rank,
        "start_s": start_s,
        "first_step_s": first_s,
        "build_s": build_s,
        "median_step_s": statistics.median(times),
        "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**10,
        "steady_rss_mib": psutil.Process().memory_info().rss / 2**20,
        "built_rss_mib": built_rss / 2**20,
        "first_step_peak_mib": first_peak / 2**20,
        "steps_peak_mib": steady_peak / 2**20,
        "memory_report_mib": classes,
        "gather_ms_per_step": 1e3 * gathers / max(1, args.steps),
        "reduce_ms_per_step": 1e3 * reduces / max(1, args.steps),
        # the kernel's share of a step: pages faulted in (fresh allocations) and its time
        "faults_per_step": (usage.ru_minflt - usage_before.ru_minflt) / max(1, args.steps),
        "sys_ms_per_step": 1e3 * (usage.ru_stime - usage_before.ru_stime) / max(1, args.steps),
        "opt_state_mib": held_state() / 2**20,
        "grads_mib": held_grads() / 2**20,
        "params_mib": held_params() / 2**20,
        "losses": losses,
        "first_loss_mean": mean_first.item() / dist.get_world_size(),
        "params": params,
    }
    dist.destroy_process_group()
    return result


# --------------------------------------------------------------------------- driver
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_backend(backend: str, args: argparse.Namespace) -> list[dict[str, Any]]:
    repo = str(Path(__file__).resolve().parents[1])
    port = str(_free_port())
    with tempfile.TemporaryDirectory() as tmp:
        procs, outs = [], []
        for rank in range(WORLD):
            out = Path(tmp) / f"rank{rank}.json"
            outs.append(out)
            env = {
                **os.environ,
                "RANK": str(rank),
                "LOCAL_RANK": str(rank),
                "WORLD_SIZE": str(WORLD),
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": port,
                "OMP_NUM_THREADS": str(args.threads),
                "PYTHONPATH": os.pathsep.join(filter(None, [repo, os.environ.get("PYTHONPATH")])),
            }
            cmd = [
                sys.executable, str(Path(__file__).resolve()), "--rank-of", backend,
                "--json", str(out), "--workload", args.workload, "--threads", str(args.threads),
                "--warmup", str(args.warmup), "--steps", str(args.steps),
            ] + (["--no-verify"] if args.no_verify else []) + (
                ["--same-batch"] if args.same_batch else []) + (
                ["--rank-memory-gib", str(args.rank_memory_gib)]
                if args.rank_memory_gib is not None else [])  # fmt: skip
            procs.append(
                subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
            )
        logs = [p.communicate()[0].decode(errors="replace") for p in procs]
        results = []
        for rank, (p, log, out) in enumerate(zip(procs, logs, outs)):
            if p.returncode != 0 and args.rank_memory_gib is not None:  # killed by its limit
                last = log.strip().splitlines()[-1] if log.strip() else ""
                results.append({"rank": rank, "stopped": f"exited {p.returncode}: {last}"})
            elif p.returncode != 0:
                sys.stderr.write(log[-4000:])
                raise SystemExit(f"{backend}: a rank exited {p.returncode}")
            else:
                results.append(json.loads(out.read_text()))
        return results


def report(results: dict[str, list[dict[str, Any]]], w: Workload, command: str) -> str:
    ran = [r for ranks in results.values() for r in ranks if "stopped" not in r]
    params = ran[0]["params"] if ran else sum(p.numel() for p in build_model(w).parameters())
    lines = [
        f"{w.name}: GPT-2 {w.layers} layers, hidden {w.hidden}, vocab {w.vocab}, "
        f"{params / 1e6:.1f}M parameters; {WORLD} ranks x {w.batch}x{w.seq} tokens; AdamW",
        "",
        "| backend | rank | ms/step | waits ms/step | page faults k / sys ms per step "
        "| start s | first step s (build s) | peak RSS MiB "
        "| built / first step / steps peak MiB | steady RSS MiB "
        "| parameters MiB | optimizer state MiB | gradients MiB | peak / data parallel "
        "| first loss (rank mean) | later losses |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    dp = results.get("ortrain-dp") or results.get("torch-ddp")
    if dp and any("stopped" in r for r in dp):
        dp = None
    for b, ranks in results.items():
        for r in ranks:
            if "stopped" in r:
                lines.append(f"| {b} | {r['rank']} | stopped: {r['stopped']} |" + " - |" * 13)
                continue
            lines.append(
                f"| {b} | {r['rank']} | {r['median_step_s'] * 1e3:.0f} | {waits(r)} "
                f"| {r.get('faults_per_step', 0) / 1e3:.1f} / {r.get('sys_ms_per_step', 0):.0f} "
                f"| {r.get('start_s', 0.0):.1f} "
                f"| {r['first_step_s']:.1f} ({r.get('build_s', 0.0):.1f}) "
                f"| {r['peak_rss_mib']:.0f} | {phases(r)} | {r['steady_rss_mib']:.0f} "
                f"| {r.get('params_mib', 0):.1f} | {r['opt_state_mib']:.1f} "
                f"| {r.get('grads_mib', 0):.1f} | {ratio(r, dp)} | {r['first_loss_mean']:.6f} "
                f"| {', '.join(f'{x:.4f}' for x in r.get('losses', []))} |"
            )
    lines += memory_table(results)
    lines += [
        "",
        "ms/step: median of the timed steps (rank processes share the machine's CPUs); waits: "
        "per timed step, the time spent waiting on ZeRO-3's parameter gathers / on ZeRO-2/3's "
        "gradient-bucket reduces; page faults / sys: per timed step, the minor page faults "
        "(pages of fresh allocations touched) and the kernel's CPU time; "
        "start: the trainer's (or DDP's) construction (ZeRO lays out and broadcasts the "
        "parameters there); first step (build): the first step's wall time, and of it the "
        "time before its own "
        "compute (the segments' recording forward, builds and checks against eager; a whole "
        "graph's export, passes, session and check); "
        "peak RSS: ru_maxrss (for ortrain it includes the one-off export); built / first "
        "step / steps peak: RSS once the model and trainer exist, the sampled peak during the "
        "first step (export, builds, checks) and during the timed steps; steady RSS: RSS "
        "after the timed steps; optimizer state / gradients: bytes of the state and gradient "
        "tensors this rank keeps between steps; peak / data parallel: this rank's peak RSS "
        "over the same rank's under ortrain-dp (torch-ddp without it).",
        f"torch {torch.__version__}, python {platform.python_version()}, {cpu_description()}",
        f"command: {command}",
    ]
    return "\n".join(lines)


def memory_table(results: dict[str, list[dict[str, Any]]]) -> list[str]:
    """``trainer.memory_report()`` of each ortrain rank: its classes against its peak."""
    rows = [(b, r) for b, ranks in results.items() for r in ranks if r.get("memory_report_mib")]
    if not rows:
        return []
    keys = list(rows[0][1]["memory_report_mib"])
    lines = [
        "",
        "memory_report() per rank, MiB (total: the classes' sum; measured peak: ru_maxrss):",
        "",
        "| backend | rank | " + " | ".join(keys) + " | total / measured peak |",
        "|---|---:|" + "---:|" * (len(keys) + 1),
    ]
    for b, r in rows:
        m = r["memory_report_mib"]
        share = m["total"] / m["measured peak"]
        cells = " | ".join(f"{m[k]:.0f}" for k in keys)
        lines.append(f"| {b} | {r['rank']} | {cells} | {share:.2f} |")
    return lines


def build_seconds(trainer: Any) -> float:
    """What the trainer's first step spent before its own compute."""
    if trainer.segments is not None:  # ZeRO-2/3: segments cut at the blocks
        return trainer.segments.plan_seconds
    stages = sum(r.seconds for r in trainer.build_log)
    return stages + trainer.session_seconds + trainer.verify_seconds


def waits(r: dict[str, Any]) -> str:
    """ZeRO-3's parameter gathers / ZeRO-2/3's bucket reduces, ms per timed step."""
    if "gather_ms_per_step" not in r:
        return "-"
    return f"{r['gather_ms_per_step']:.0f} / {r['reduce_ms_per_step']:.0f}"


def phases(r: dict[str, Any]) -> str:
    keys = ("built_rss_mib", "first_step_peak_mib", "steps_peak_mib")
    return " / ".join(f"{r[k]:.0f}" if k in r else "-" for k in keys)


def ratio(r: dict[str, Any], dp: list[dict[str, Any]] | None) -> str:
    if not dp:
        return "-"
    return f"{r['peak_rss_mib'] / dp[r['rank']]['peak_rss_mib']:.2f}x"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workload", choices=sorted(WORKLOADS), default="gpt2-27m")
    p.add_argument("--backend", action="append", choices=BACKENDS, help="repeatable; all")
    p.add_argument("--threads", type=int, default=1, help="threads per rank")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument(
        "--no-verify",
        action="store_true",
        help="TrainerOptions(verify=False): no first-step check against eager (it runs in a "
        "forked child per rank, outside the rank's own peak RSS, but in the machine's memory)",
    )
    p.add_argument(
        "--same-batch",
        action="store_true",
        help="every step on one batch per rank (random tokens: the loss falls only as the "
        "model learns that batch, a check that the updates train)",
    )
    p.add_argument(
        "--rank-memory-gib",
        type=float,
        help="limit each rank's private memory (RLIMIT_DATA) to this many GiB; a rank that "
        "runs out (or whose peer did) is reported as stopped, with its error",
    )
    p.add_argument("--rank-of", choices=BACKENDS, help=argparse.SUPPRESS)  # child mode
    p.add_argument("--json", metavar="PATH", help="write the results as JSON")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    w = WORKLOADS[args.workload]
    if args.rank_of is not None:
        if args.rank_memory_gib is None:
            Path(args.json).write_text(json.dumps(run_rank(args.rank_of, w, args)))
            return
        limit = int(args.rank_memory_gib * 2**30)
        resource.setrlimit(resource.RLIMIT_DATA, (limit, limit))
        try:
            result = run_rank(args.rank_of, w, args)
        except Exception as exc:  # out of memory here, or a peer that ran out
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
            result = {"rank": int(os.environ["RANK"]), "stopped": f"{type(exc).__name__}: {first}"}
            Path(args.json).write_text(json.dumps(result))
            sys.stdout.flush()
            os._exit(0)  # no teardown of a process group a peer left
        Path(args.json).write_text(json.dumps(result))
        return
    command = "PYTHONPATH=. python " + shlex.join(sys.argv)
    results = {b: run_backend(b, args) for b in (args.backend or BACKENDS)}
    print(report(results, w, command))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
