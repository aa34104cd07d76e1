"""Profile one of ortrain's compiled graphs with ONNX Runtime's profiler.

Workload mode builds the benchmark workload's model, runs one ``ORTTrainer.train_step``
with ``save_graphs_dir`` set, and profiles the saved gradient graph (the last
``train.*.onnx`` stage, with the trainer's ``RemoveUnusedNodesPass`` applied again) or
``update.onnx``, fed with the trainer's real parameters, batch, gradients and optimizer
state. File mode (``--onnx PATH``) profiles any ONNX file with random inputs.

The session is built like ortrain's (ORT_ENABLE_ALL, ``EliminateDropout`` disabled,
``--threads`` intra-op threads, 1 inter-op thread). The first ``--warmup-runs`` runs are
left out of the aggregates (ONNX Runtime plans its memory pattern in the first two).

Usage::

    PYTHONPATH=. python benchmarks/profile_graph.py --workload gpt2-tiny
    PYTHONPATH=. python benchmarks/profile_graph.py --workload gpt2-tiny --graph update
    PYTHONPATH=. python benchmarks/profile_graph.py --onnx graphs/train.03.autodiff.onnx
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import shlex
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import onnx_ir as ir
import onnx_ir.passes.common
import onnxruntime as ort
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_train import WORKLOADS, _quiet_transformers, busy_cpu_seconds

from ortrain.core.names import BLAS_DOMAIN, CPU_DOMAIN
from ortrain.graph_passes.infra.serialize import serialize_for_ort
from ortrain.runtime import cpu_ops
from ortrain.runtime.session import DISABLED_OPTIMIZERS, RECOMPUTE_DISABLED


# --------------------------------------------------------------------------- inputs
def _np(t: torch.Tensor) -> np.ndarray:
    return t.detach().contiguous().numpy()


def workload_graph(
    name: str,
    graph: str,
    save_dir: Path,
    threads: int,
    seed: int,
    cpu_gemm: str = "auto",
    cpu_kernels: str = "auto",
    dropout: float = 0.0,
) -> tuple[Path, dict[str, np.ndarray], int]:
    """Run one train step of workload ``name``.

    Returns the graph file, real feeds, and the node count of the graph the trainer runs.
    """
    from ortrain import ORTTrainer, TrainerOptions

    w = WORKLOADS[name]
    torch.set_num_threads(threads)
    _quiet_transformers()
    torch.manual_seed(seed)
    model = w.build(w, dropout)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01)
    trainer = ORTTrainer(
        model,
        opt,
        TrainerOptions(
            intra_op_threads=threads,
            save_graphs_dir=save_dir,
            cpu_gemm=cpu_gemm,
            cpu_kernels=cpu_kernels,
        ),
    )
    batch = w.make_batch(w, torch.Generator().manual_seed(seed + 1))
    trainer.train_step(**batch)
    feeds: dict[str, torch.Tensor] = {**trainer.params, **trainer.buffers}
    if graph == "train":
        path = sorted(save_dir.glob("train.*.onnx"))[-1]
        feeds.update(batch)
        nodes = len(trainer.train_graphs[0].graph)
    else:
        path = save_dir / "update.onnx"
        feeds.update(trainer.opt_state)
        feeds.update(trainer.update_engine.hyper)  # type: ignore[attr-defined]
        feeds.update(trainer.state.scalars)
        feeds.update({f"grad:{p}": g for p, g in trainer.grads.items()})
        feeds["step"] = trainer.step_tensor
        assert trainer.update_graph is not None
        nodes = len(trainer.update_graph.graph)
    return path, {k: _np(v) for k, v in feeds.items()}, nodes


_ORT_TYPES = {
    "tensor(float)": np.float32,
    "tensor(double)": np.float64,
    "tensor(float16)": np.float16,
    "tensor(int64)": np.int64,
    "tensor(int32)": np.int32,
    "tensor(bool)": np.bool_,
}


def random_feeds(
    sess: ort.InferenceSession, known: dict[str, np.ndarray], int_high: int, seed: int
) -> dict[str, np.ndarray]:
    """``known`` values where given, random ones of the right shape/dtype elsewhere."""
    rng = np.random.default_rng(seed)
    feeds = {}
    for i in sess.get_inputs():
        if i.name in known:
            feeds[i.name] = known[i.name]
            continue
        shape = [d if isinstance(d, int) else 1 for d in i.shape]
        dtype = _ORT_TYPES[i.type]
        if np.issubdtype(dtype, np.floating):
            feeds[i.name] = (rng.standard_normal(shape) * 0.02).astype(dtype)
        elif dtype is np.bool_:
            feeds[i.name] = rng.integers(0, 2, shape).astype(np.bool_)
        else:
            feeds[i.name] = rng.integers(0, int_high, shape).astype(dtype)
    return feeds


# --------------------------------------------------------------------------- profiling
def load_graph(path: Path, remove_unused: bool) -> tuple[bytes, int, bool]:
    """The graph serialized as ortrain hands it to ONNX Runtime (node order included: it
    decides which buffers ONNX Runtime reuses in place), its node count, and whether it
    has recomputed copies (ONNX Runtime's CSE then stays off, as in ortrain)."""
    model = ir.load(path)
    if remove_unused:
        ir.passes.common.RemoveUnusedNodesPass()(model)
    data, recomputes = serialize_for_ort(model)
    return data, len(model.graph), recomputes


def profile(
    data: bytes,
    known: dict[str, np.ndarray],
    *,
    threads: int,
    runs: int,
    warmup_runs: int,
    int_high: int,
    seed: int,
    prefix: str,
    recomputes: bool = False,
) -> tuple[list[dict[str, Any]], float]:
    """Run the graph ``warmup_runs + runs`` times under the profiler.

    Returns the profiler's events and the CPUs that other processes kept busy meanwhile.
    """
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    so.intra_op_num_threads = threads
    so.inter_op_num_threads = 1
    so.log_severity_level = 3
    so.enable_mem_pattern = False  # ortrain's session settings (runtime/session.py)
    so.add_session_config_entry("session.intra_op.allow_spinning", "0")
    so.enable_profiling = True
    so.profile_file_prefix = prefix
    if (
        BLAS_DOMAIN.encode() in data
    ):  # ortrain.blas.Gemm nodes (graph_passes/targets/cpu/blas_gemm.py)
        so.register_custom_ops_library(str(cpu_ops.blas_library_path()))
    elif CPU_DOMAIN.encode() in data:  # ortrain.cpu fused backward kernels
        so.register_custom_ops_library(str(cpu_ops.library_path()))
    disabled = DISABLED_OPTIMIZERS + (RECOMPUTE_DISABLED if recomputes else [])
    sess = ort.InferenceSession(
        data, so, providers=["CPUExecutionProvider"], disabled_optimizers=disabled
    )
    feeds = random_feeds(sess, known, int_high, seed)
    for _ in range(warmup_runs):
        sess.run(None, feeds)
    busy0, cpu0, wall0 = busy_cpu_seconds(), time.process_time(), time.perf_counter()
    for _ in range(runs):
        sess.run(None, feeds)
    own, wall = time.process_time() - cpu0, time.perf_counter() - wall0
    others = max(busy_cpu_seconds() - busy0 - own, 0.0) / wall
    trace = Path(sess.end_profiling())
    events = json.loads(trace.read_text())
    trace.unlink()
    return events, others


@dataclasses.dataclass
class OpStat:
    total_us: float = 0.0
    calls: int = 0


def aggregate(events: list[dict[str, Any]], warmup_runs: int) -> dict[str, Any]:
    """Per-op-type and per-node kernel times over the measured runs (mean per run)."""
    model_runs = sorted(
        (e for e in events if e.get("cat") == "Session" and e.get("name") == "model_run"),
        key=lambda e: e["ts"],
    )
    measured = model_runs[warmup_runs:]
    if not measured:
        raise SystemExit("no measured runs in the profile")
    t_start = measured[0]["ts"]
    n = len(measured)
    by_op: dict[str, OpStat] = collections.defaultdict(OpStat)
    by_node: dict[str, dict[str, Any]] = {}
    for e in events:
        if e.get("cat") != "Node" or not e["name"].endswith("_kernel_time") or e["ts"] < t_start:
            continue
        args = e.get("args", {})
        op = args.get("op_name", "?")
        by_op[op].total_us += e["dur"]
        by_op[op].calls += 1
        node = by_node.setdefault(
            e["name"][: -len("_kernel_time")],
            {"op": op, "total_us": 0.0, "inputs": args.get("input_type_shape", []),
             "outputs": args.get("output_type_shape", [])},
        )  # fmt: skip
        node["total_us"] += e["dur"]
    kernel_ms = sum(s.total_us for s in by_op.values()) / n / 1e3
    run_ms = sum(e["dur"] for e in measured) / n / 1e3
    ops = sorted(
        (
            {"op": op, "ms_per_run": s.total_us / n / 1e3, "calls_per_run": s.calls / n,
             "pct": 100 * s.total_us / n / 1e3 / kernel_ms}
            for op, s in by_op.items()
        ),
        key=lambda r: -r["ms_per_run"],
    )  # fmt: skip
    nodes = sorted(
        ({"node": k, **v, "ms_per_run": v.pop("total_us") / n / 1e3} for k, v in by_node.items()),
        key=lambda r: -r["ms_per_run"],
    )
    return {
        "runs": n,
        "run_ms": run_ms,
        "kernel_ms": kernel_ms,
        "nodes_executed": len(by_node),
        "ops": ops,
        "nodes": nodes,
    }


def _shapes(items: list[dict[str, list[int]]]) -> str:
    out = []
    for item in items:
        for dtype, shape in item.items():
            out.append(f"{dtype}{shape}".replace(" ", ""))
    return " ".join(out)


def report(agg: dict[str, Any], top_ops: int, top_nodes: int, title: str) -> str:
    lines = [
        f"### {title}",
        "",
        f"{agg['runs']} measured runs: {agg['run_ms']:.1f} ms per run (model_run), kernels "
        f"{agg['kernel_ms']:.1f} ms ({100 * agg['kernel_ms'] / agg['run_ms']:.0f}%), "
        f"{agg['nodes_executed']} nodes executed; other processes kept "
        f"{agg['other_cpus']:.2f} CPUs busy meanwhile"
        + (" (CONTENDED: timings inflated)" if agg["other_cpus"] > 0.25 else ""),
        "",
        "| # | op type | ms/run | % kernel time | calls/run | ms/call |",
        "|---:|---|---:|---:|---:|---:|",
    ]
    for i, r in enumerate(agg["ops"][:top_ops], 1):
        lines.append(
            f"| {i} | {r['op']} | {r['ms_per_run']:.2f} | {r['pct']:.1f} "
            f"| {r['calls_per_run']:.0f} | {r['ms_per_run'] / r['calls_per_run']:.3f} |"
        )
    rest = agg["ops"][top_ops:]
    if rest:
        lines.append(
            f"| | ({len(rest)} other op types) | {sum(r['ms_per_run'] for r in rest):.2f} "
            f"| {sum(r['pct'] for r in rest):.1f} | {sum(r['calls_per_run'] for r in rest):.0f} | |"
        )
    lines += [
        "",
        "| # | node | op type | ms/run | inputs | outputs |",
        "|---:|---|---|---:|---|---|",
    ]
    for i, r in enumerate(agg["nodes"][:top_nodes], 1):
        lines.append(
            f"| {i} | {r['node']} | {r['op']} | {r['ms_per_run']:.2f} | {_shapes(r['inputs'])} "
            f"| {_shapes(r['outputs'])} |"
        )
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    src = p.add_mutually_exclusive_group()
    src.add_argument("--workload", choices=sorted(WORKLOADS), default="gpt2-tiny")
    src.add_argument("--onnx", type=Path, help="profile this ONNX file (random inputs)")
    p.add_argument("--graph", choices=["train", "update"], default="train")
    p.add_argument("--save-dir", type=Path, help="keep the trainer's saved graphs here")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument(
        "--cpu-gemm", choices=["auto", "blas", "onnxruntime"], default="auto",
        help="TrainerOptions.cpu_gemm of the workload's trainer",
    )  # fmt: skip
    p.add_argument(
        "--cpu-kernels", choices=["auto", "ortrain", "onnxruntime"], default="auto",
        help="TrainerOptions.cpu_kernels of the workload's trainer",
    )  # fmt: skip
    p.add_argument("--dropout", type=float, default=0.0, help="the workload's dropout")
    p.add_argument("--runs", type=int, default=5, help="measured runs")
    p.add_argument("--warmup-runs", type=int, default=2, help="runs left out of the aggregate")
    p.add_argument("--top", type=int, default=15, help="op types to list")
    p.add_argument("--nodes", type=int, default=10, help="slowest nodes to list")
    p.add_argument("--int-high", type=int, default=2, help="random ints in [0, N) (file mode)")
    p.add_argument("--no-remove-unused", action="store_true", help="profile the file as saved")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, help="write the aggregates as JSON")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        known: dict[str, np.ndarray] = {}
        expected = None
        if args.onnx is not None:
            path = args.onnx
        else:
            save_dir = args.save_dir or Path(tmp) / "graphs"
            path, known, expected = workload_graph(
                args.workload,
                args.graph,
                save_dir,
                args.threads,
                args.seed,
                args.cpu_gemm,
                args.cpu_kernels,
                args.dropout,
            )
        # The trainer runs RemoveUnusedNodesPass on the gradient graph after saving it.
        remove = not args.no_remove_unused and path.name.startswith("train.")
        data, n_nodes, recomputes = load_graph(path, remove)
        if expected is not None and n_nodes != expected:
            print(
                f"WARNING: {path.name} has {n_nodes} nodes, the trainer's session graph "
                f"{expected}: the profile may not match what the trainer runs",
                file=sys.stderr,
            )
        events, others = profile(
            data,
            known,
            threads=args.threads,
            runs=args.runs,
            warmup_runs=args.warmup_runs,
            int_high=args.int_high,
            seed=args.seed,
            prefix=str(Path(tmp) / "ort_profile"),
            recomputes=recomputes,
        )
    agg = aggregate(events, args.warmup_runs)
    agg["other_cpus"] = others
    title = f"{path.name} ({args.onnx or args.workload}, {args.threads} threads)"
    print(report(agg, args.top, args.nodes, title))
    print(f"\ncommand: PYTHONPATH=. python {shlex.join(sys.argv)}")
    if args.json:
        args.json.write_text(json.dumps({"graph": str(path), **agg}, indent=1))


if __name__ == "__main__":
    main()
