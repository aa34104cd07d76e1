"""Step time of ortrain against eager PyTorch on models of the zoo (tests/zoo.py).

Each (model, backend) runs in its own process with the same thread count: build, a few
warm-up steps (ortrain's first step includes its export and build), then timed AdamW
steps on batches of one shape. The table gives the median step of each backend and
eager / ortrain (above 1: ortrain is faster), with the CPU it ran on.

    PYTHONPATH=. python benchmarks/bench_zoo.py --models mlp_relu,lstm_lm --steps 20
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
DEFAULT = ("mlp_activations,normalize_cosine,topk_router,torch_transformer,cnn_batchnorm,"
           "cnn_groupnorm,cnn_pooling,lstm_lm,gru_classifier,embedding_bag_sum,mistral,"
           "gpt_neox,mobilebert,swin,mixtral,nanogpt")  # fmt: skip


def run_one(name: str, backend: str, steps: int, warmup: int, threads: int) -> dict:
    import torch

    from ortrain import ORTTrainer, TrainerOptions
    from ortrain.export import find_loss
    from tests.test_model_zoo import _call, _call_trainer
    from tests.zoo import ZOO

    warnings.simplefilter("ignore")
    torch.set_num_threads(threads)
    entry = ZOO[name]
    torch.manual_seed(0)
    model = entry.build().train()
    g = torch.Generator().manual_seed(1)
    batches = [entry.batch(g) for _ in range(warmup + steps)]
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    if backend == "torch":

        def step(batch):
            opt.zero_grad()
            loss = find_loss(_call(model, batch))
            loss.backward()
            opt.step()
            return loss.item()
    else:
        trainer = ORTTrainer(model, opt, TrainerOptions(intra_op_threads=threads))

        def step(batch):
            return _call_trainer(trainer, batch).item()

    times = []
    for batch in batches:
        t = time.perf_counter()
        step(batch)
        times.append(time.perf_counter() - t)
    return {"first_s": times[0], "median_ms": 1e3 * statistics.median(times[warmup:])}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default=DEFAULT, help="comma-separated zoo names")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--json", type=Path, help="also write the results here")
    p.add_argument("--child", nargs=2, metavar=("MODEL", "BACKEND"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        result = run_one(*args.child, args.steps, args.warmup, args.threads)
        print(json.dumps(result))
        return 0
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from hardware import cpu_description

    rows = []
    for name in args.models.split(","):
        row = {"model": name}
        for backend in ("torch", "ortrain"):
            cmd = [
                sys.executable,
                __file__,
                "--child",
                name,
                backend,
                "--steps",
                str(args.steps),
                "--warmup",
                str(args.warmup),
                "--threads",
                str(args.threads),
            ]
            done = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT,
                                  env={**os.environ, "PYTHONPATH": str(ROOT)})  # fmt: skip
            if done.returncode != 0:
                row[backend] = {"error": done.stderr.strip().splitlines()[-1][:120]}
            else:
                row[backend] = json.loads(done.stdout.strip().splitlines()[-1])
        rows.append(row)
        print(_line(row), flush=True)
    print(f"\n{args.steps} timed steps after {args.warmup} warm-up, {args.threads} threads; "
          f"{cpu_description()}")  # fmt: skip
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return 0


def _line(row: dict) -> str:
    t, o = row["torch"], row["ortrain"]
    if "error" in t or "error" in o:
        return f"| {row['model']} | {t.get('error', '')} | {o.get('error', '')} | | |"
    ratio = t["median_ms"] / o["median_ms"]
    return (f"| {row['model']} | {t['median_ms']:.2f} | {o['median_ms']:.2f} | {ratio:.2f}x "
            f"| {o['first_s']:.1f} s |")  # fmt: skip


if __name__ == "__main__":
    raise SystemExit(main())
