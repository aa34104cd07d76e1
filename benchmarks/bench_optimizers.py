"""Optimizers ortrain compiles and optimizers whose own step runs in eager (RMSprop,
Adagrad, ...: ``EagerUpdate``), each against eager PyTorch with the same optimizer.

A small GPT-2 (4 layers, 256 wide, vocab 2048), batch 8 x 64 tokens, one process per
(optimizer, backend) with the same thread count: the median step after the warm-up
(ortrain's first step holds its build). For an optimizer ortrain does not compile, its
step is the same Python on both sides; what ortrain saves is the forward and backward.

    PYTHONPATH=. python benchmarks/bench_optimizers.py --steps 12
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

OPTIMIZERS = ("AdamW", "RMSprop", "Adagrad", "NAdam")


def _make(name: str, params):  # type: ignore[no-untyped-def]
    import torch

    lr = {"AdamW": 1e-4, "RMSprop": 1e-4, "Adagrad": 1e-3, "NAdam": 1e-4}[name]
    return getattr(torch.optim, name)(params, lr=lr)


def run_one(name: str, backend: str, steps: int, warmup: int, threads: int) -> dict:
    import torch

    from ortrain import ORTTrainer, TrainerOptions
    from tests.conftest import gpt2

    warnings.simplefilter("ignore")
    torch.set_num_threads(threads)
    g = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, 2048, (8, 64), generator=g) for _ in range(1 + warmup + steps)]
    model = gpt2(layers=4, hidden=256, vocab=2048, seed=0).train()
    opt = _make(name, model.parameters())
    if backend == "torch":

        def step(ids):  # type: ignore[no-untyped-def]
            opt.zero_grad()
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            opt.step()
            return float(loss)
    else:
        options = TrainerOptions(intra_op_threads=threads, build_progress=False)
        trainer = ORTTrainer(model, opt, options)

        def step(ids):  # type: ignore[no-untyped-def]
            return float(trainer.train_step(input_ids=ids, labels=ids))

    times, losses = [], []
    for ids in batches:
        t = time.perf_counter()
        losses.append(step(ids))
        times.append(time.perf_counter() - t)
    out = {"median_ms": 1e3 * statistics.median(times[1 + warmup :]), "last_loss": losses[-1]}
    if backend == "ortrain":
        out["engine"] = trainer.program.update
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--optimizers", default=",".join(OPTIMIZERS))
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--child", nargs=2, metavar=("OPTIMIZER", "BACKEND"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        print(json.dumps(run_one(*args.child, args.steps, args.warmup, args.threads)))
        return 0
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from hardware import cpu_description

    print("| optimizer | ortrain's update | eager ms | ortrain ms | eager / ortrain "
          "| last loss eager / ortrain |")  # fmt: skip
    print("|---|---|---:|---:|---:|---|")
    for name in args.optimizers.split(","):
        row = {}
        for backend in ("torch", "ortrain"):
            cmd = [sys.executable, __file__, "--child", name, backend, "--steps", str(args.steps),
                   "--warmup", str(args.warmup), "--threads", str(args.threads)]  # fmt: skip
            done = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT,
                                  env={**os.environ, "PYTHONPATH": str(ROOT)})  # fmt: skip
            if done.returncode != 0:
                raise SystemExit(f"{name} / {backend}: {done.stderr.strip()[-500:]}")
            row[backend] = json.loads(done.stdout.strip().splitlines()[-1])
        t, o = row["torch"], row["ortrain"]
        print(f"| {name} | {o['engine']} | {t['median_ms']:.1f} | {o['median_ms']:.1f} "
              f"| {t['median_ms'] / o['median_ms']:.2f}x "
              f"| {t['last_loss']:.4f} / {o['last_loss']:.4f} |", flush=True)  # fmt: skip
    print(f"\n{args.steps} timed steps after {args.warmup} warm-up, {args.threads} threads; "
          f"{cpu_description()}")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
