"""Gradient-graph run time with each training fusion on and off.

For one benchmark workload (``bench_train.WORKLOADS``), the model is exported once; each
variant copies the export, runs the training build (``build_pipeline``) with a chosen
subset of ``ortrain.graph_passes.fusions.FUSIONS`` inserted (forward fusions after ``fuse_gelu``,
backward passes after ``lower_cross_entropy``), and gets its own ONNX Runtime session
made like the trainer's (``ortrain.runtime.session.make_session``). Every variant must
produce the baseline's loss and gradients (element-wise, rtol 1e-4 / atol 1e-5 x max,
on a one-thread session).

Timing: ``--rounds`` rounds, each running every variant once in a fresh random order
(after ``--warmup`` untimed runs each), so drift and other processes hit all variants
alike. Reported: median ms per variant and the median of the per-round ratios to the
baseline (the paired comparison), in wall time over all rounds and over the rounds in
which other processes kept fewer than ``--quiet-cpus`` CPUs busy, and in process CPU time
(both ONNX Runtime threads; less sensitive to other processes than wall time on a shared
machine, as spinning is off in the trainer's sessions).

Usage::

    PYTHONPATH=. python benchmarks/bench_fusions.py --workload gpt2-tiny
    PYTHONPATH=. python benchmarks/bench_fusions.py --workload bert-tiny --mode minus
"""

from __future__ import annotations

import argparse
import collections
import random
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import onnx_ir as ir
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_train import WORKLOADS, _quiet_transformers, busy_cpu_seconds, wait_quiet

from ortrain.core.build_config import BuildConfig, BuildInputs
from ortrain.export import export_forward
from ortrain.graph_passes.fusions import FUSIONS, training_fusions
from ortrain.graph_passes.infra.pipeline import run_pipeline
from ortrain.graph_passes.training_pipeline import BuildProducts, build_pipeline
from ortrain.runtime.session import make_session


def _copy(model: ir.Model) -> ir.Model:
    return ir.serde.deserialize_model(ir.serde.serialize_model(model))


def build_variant(fwd: ir.Model, loss: str, wrt: list[str], names: list[str]):
    model = _copy(fwd)
    products = BuildProducts()
    config = BuildConfig(fusions=tuple(names))
    records = run_pipeline(model, build_pipeline(config, BuildInputs(loss, tuple(wrt)), products))
    return model, products.grad_outputs(), records


def variants(mode: str, only: list[str] | None) -> dict[str, list[str]]:
    names = only or list(FUSIONS)
    out: dict[str, list[str]] = {"baseline": []}
    if mode in ("alone", "both"):
        out.update({f"+{n}": [n] for n in names})
    out["all"] = list(names)
    plan = training_fusions()
    out["proposed"] = [p.name for p in (*plan.before_autodiff, *plan.after_autodiff)]
    if mode in ("minus", "both"):
        out.update({f"all-{n}": [m for m in names if m != n] for n in names})
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workload", choices=sorted(WORKLOADS), default="gpt2-tiny")
    p.add_argument("--mode", choices=["alone", "minus", "both"], default="alone")
    p.add_argument("--only", help="comma-separated fusion names (default: all)")
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quiet-cpus", type=float, default=0.3, help="a round is quiet below this")
    p.add_argument(
        "--wait-quiet",
        type=float,
        default=0.0,
        metavar="S",
        help="before each round wait up to S seconds for the CPUs to be < 25%% busy",
    )
    args = p.parse_args(argv)

    w = WORKLOADS[args.workload]
    torch.set_num_threads(args.threads)
    _quiet_transformers()
    torch.manual_seed(args.seed)
    module = w.build(w, 0.0)
    batch = w.make_batch(w, torch.Generator().manual_seed(args.seed + 1))
    ex = export_forward(module, batch, train=True)
    inputs = {v.name for v in ex.model.graph.inputs}
    wrt = [n for n, _ in module.named_parameters() if n in inputs]
    feeds = {n: t.detach().contiguous().numpy() for n, t in module.named_parameters()}
    feeds.update({n: t.contiguous().numpy() for n, t in module.named_buffers()})
    feeds.update({k: v.numpy() for k, v in batch.items()})
    feeds = {k: v for k, v in feeds.items() if k in inputs}

    only = args.only.split(",") if args.only else None
    runs: dict[str, tuple] = {}
    reference: dict[str, np.ndarray] | None = None
    for label, names in variants(args.mode, only).items():
        model, grads, records = build_variant(ex.model, ex.output_names[0], wrt, names)
        outs = [ex.output_names[0], *grads.values()]
        # Checked on one thread: onnxruntime's CPU ScatterND(reduction="add") races on
        # duplicate indices with more (embedding gradients of a 2-row token-type table).
        checker = make_session(model, threads=1)
        result = dict(zip(outs, checker.run(outs, feeds), strict=True))
        del checker
        sess = make_session(model, threads=args.threads)
        if reference is None:
            reference = result
        # Gradients zero in exact arithmetic (attention key biases) are rounding noise.
        floor = 1e-6 * max(float(np.abs(v).max()) for v in reference.values())
        for k, ref in reference.items():
            got, scale = result[k], float(np.abs(ref).max())
            if scale < floor:
                assert float(np.abs(got).max()) < floor, (label, k)
                continue
            np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-5 * scale, err_msg=label)
        ops = collections.Counter(n.op_type for n in model.graph)
        changed = {r.name: r.op_delta for r in records if r.name in names and r.op_delta}
        print(f"{label:<28} nodes {len(model.graph):5d}  {dict(changed)}", flush=True)
        runs[label] = (sess, outs, ops)

    for sess, outs, _ in runs.values():
        for _ in range(args.warmup):
            sess.run(outs, feeds)
    wall: dict[str, list[float]] = {k: [] for k in runs}
    cpu: dict[str, list[float]] = {k: [] for k in runs}
    busy: list[float] = []  # CPUs other processes kept busy, per round
    order = list(runs)
    rng = random.Random(args.seed)
    for _ in range(args.rounds):
        if args.wait_quiet:
            wait_quiet(args.wait_quiet)
        rng.shuffle(order)
        b0, c0, w0 = busy_cpu_seconds(), time.process_time(), time.perf_counter()
        for label in order:
            sess, outs, _ = runs[label]
            t, c = time.perf_counter(), time.process_time()
            sess.run(outs, feeds)
            wall[label].append(time.perf_counter() - t)
            cpu[label].append(time.process_time() - c)
        own, span = time.process_time() - c0, time.perf_counter() - w0
        busy.append(max(busy_cpu_seconds() - b0 - own, 0.0) / span)
    quiet = [i for i, b in enumerate(busy) if b < args.quiet_cpus]

    def ratio(ts: list[float], base: list[float], rounds: list[int]) -> str:
        if not rounds:
            return "-"
        return f"{statistics.median(ts[i] / base[i] for i in rounds):.3f}"

    every = list(range(args.rounds))
    print(f"\n{args.workload}, {args.threads} threads, {args.rounds} rounds; other processes "
          f"kept {statistics.median(busy):.2f} CPUs busy (median per round); "
          f"{len(quiet)} quiet rounds (< {args.quiet_cpus} CPUs)")  # fmt: skip
    print("| variant | wall ms (median) | wall ratio | wall ratio, quiet rounds | "
          "CPU ms (median) | CPU-time ratio |")  # fmt: skip
    print("|---|---:|---:|---:|---:|---:|")
    for label in runs:
        w, c, bw, bc = wall[label], cpu[label], wall["baseline"], cpu["baseline"]
        cells = [
            label,
            f"{statistics.median(w) * 1e3:.1f}",
            ratio(w, bw, every),
            ratio(w, bw, quiet),
            f"{statistics.median(c) * 1e3:.1f}",
            ratio(c, bc, every),
        ]
        print("| " + " | ".join(cells) + " |")
    print(f"\ncommand: PYTHONPATH=. python {' '.join(sys.argv)}")


if __name__ == "__main__":
    main()
