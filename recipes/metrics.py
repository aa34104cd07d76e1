"""What a run reports: ``Metrics`` (``metrics.jsonl``), ``plot`` (``loss.png``), ``Timing``
(the timed steps), ``measure_peak_flops`` and ``summarize`` (``summary.json`` and the
summary line with tokens/s and the fraction of peak FLOP/s).
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ortrain.recipes.backends import Backend
from ortrain.recipes.config import TrainConfig
from ortrain.recipes.processes import Env
from ortrain.recipes.task import Task
from ortrain.safe_files import atomic_write


class Metrics:
    """``metrics.jsonl`` (rank 0): one record per train step and per evaluation."""

    def __init__(self, path: Path, enabled: bool, resume_step: int | None):
        self.path, self.enabled = path, enabled
        self.records: list[dict[str, Any]] = []
        if not enabled:
            return
        if resume_step is not None and path.is_file():  # drop what came after the checkpoint
            for line in path.read_text().splitlines():
                rec = json.loads(line)
                if rec["step"] <= resume_step:  # (an eval at resume_step preceded the save)
                    self.records.append(rec)
        path.write_text("".join(json.dumps(r) + "\n" for r in self.records))

    def log(self, **record: Any) -> None:
        if self.enabled:
            self.records.append(record)
            with self.path.open("a") as f:
                f.write(json.dumps(record) + "\n")


def plot(records: list[dict[str, Any]], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    train = [(r["step"], r["loss"]) for r in records if r["split"] == "train"]
    evals = [(r["step"], r["loss"]) for r in records if r["split"] == "eval"]
    fig, ax = plt.subplots(figsize=(7, 4))
    if train:
        ax.plot(*zip(*train), lw=0.8, alpha=0.6, label="train loss")
    if evals:
        ax.plot(*zip(*evals), "o-", label="eval loss")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("loss")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    atomic_write(path, lambda f: fig.savefig(f, format="png", dpi=100))
    plt.close(fig)


# ----------------------------------------------------------------------------- peak FLOP/s
def measure_peak_flops(
    threads: int | None, device: str = "cpu", n: int = 2048, reps: int = 3
) -> tuple[float, str]:
    """Best fp32 n³ matmul rate of torch and of ONNX Runtime (MLAS) on this machine; on a
    CUDA device, of torch there (bf16, 8192³)."""
    import numpy as np
    import onnx
    import onnxruntime as ort
    from onnx import TensorProto, helper

    if device.startswith("cuda"):
        n = 8192
        a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
        b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
        rates = []
        for _ in range(reps + 1):
            torch.cuda.synchronize(device)
            t = time.perf_counter()
            a @ b
            torch.cuda.synchronize(device)
            rates.append(2 * n**3 / (time.perf_counter() - t))
        name = torch.cuda.get_device_name(device)
        return max(rates), f"measured: best {n}³ bf16 matmul, torch on {name}"
    a = torch.randn(n, n)
    b = torch.randn(n, n)

    def best(fn: Callable[[], Any]) -> float:
        fn()
        times = []
        for _ in range(reps):
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
        return 2 * n**3 / min(times)

    torch_rate = best(lambda: a @ b)
    x = helper.make_tensor_value_info("a", TensorProto.FLOAT, [n, n])
    y = helper.make_tensor_value_info("b", TensorProto.FLOAT, [n, n])
    z = helper.make_tensor_value_info("c", TensorProto.FLOAT, [n, n])
    graph = helper.make_graph([helper.make_node("MatMul", ["a", "b"], ["c"])], "mm", [x, y], [z])
    opts = ort.SessionOptions()
    if threads:
        opts.intra_op_num_threads = threads
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = min(model.ir_version, onnx.IR_VERSION, 10)
    sess = ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])
    feeds = {"a": a.numpy(), "b": b.numpy().astype(np.float32)}
    ort_rate = best(lambda: sess.run(None, feeds))
    how = (
        f"measured: best {n}³ fp32 matmul, torch {torch_rate / 1e9:.0f} / ONNX Runtime "
        f"{ort_rate / 1e9:.0f} GFLOP/s, {threads or torch.get_num_threads()} threads"
    )
    return max(torch_rate, ort_rate), how


@dataclasses.dataclass
class Timing:
    """What the timed steps did. Steps that built a graph (ortrain) or warmed up (eager) --
    the first at each batch shape -- are left out."""

    seconds: float = 0.0
    tokens: float = 0.0
    flops: float = 0.0
    first_step_s: float | None = None


def summarize(
    cfg: TrainConfig,
    env: Env,
    task: Task,
    backend: Backend,
    metrics: Metrics,
    steps: tuple[int, int],
    timing: Timing,
) -> dict[str, Any]:
    """summary.json and the summary line: eval loss, tokens/s, fraction of peak FLOP/s."""
    evals = [r for r in metrics.records if r["split"] == "eval"]
    t = timing.seconds
    start, step = steps
    summary: dict[str, Any] = {
        "recipe": task.name,
        "preset": cfg.preset,
        "backend": backend.name,
        "world_size": env.world,
        "steps": step,
        "steps_this_run": step - start,
        "first_step_s": timing.first_step_s,
        "timed_steps_s": t,
        "tokens_per_s": timing.tokens / t if t else None,
        "model_tflops_per_s": timing.flops / t / 1e12 if t else None,
    }
    if evals:
        summary["eval_loss_first"], summary["eval_loss_last"] = evals[0]["loss"], evals[-1]["loss"]
        summary["eval_ppl_last"] = evals[-1]["ppl"]
    if t:
        if cfg.peak_tflops is not None:
            peak, how = cfg.peak_tflops * 1e12, "given by --peak-tflops"
        else:
            peak, how = measure_peak_flops(cfg.threads, cfg.device)
        peak *= env.world  # all processes together (each measured its own, concurrently)
        summary.update(
            peak_tflops=peak / 1e12, peak_source=how, fraction_of_peak=timing.flops / t / peak
        )
    if env.is_main:
        (env.out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
        line = f"summary: {task.name} {cfg.preset} on {backend.name}, {step} steps"
        if evals:
            line += (
                f", eval loss {evals[0]['loss']:.4f} -> {evals[-1]['loss']:.4f} "
                f"(ppl {evals[-1]['ppl']:.2f})"
            )
        if t:
            line += (
                f", {summary['tokens_per_s']:,.0f} tokens/s, "
                f"{100 * summary['fraction_of_peak']:.2f}% of peak "
                f"{summary['peak_tflops'] * 1e3:.0f} GFLOP/s ({summary['peak_source']}; "
                f"model FLOPs 6·params·tokens + attention, graph-build steps excluded)"
            )
        env.print(line)
        env.print(f"wrote {env.out}/: metrics.jsonl, loss.png, checkpoints/, summary.json")
    if env.owns_group:
        dist.destroy_process_group()
    return summary
