"""Memory benchmark: peak RSS of a train step and the largest batch under a memory cap,
ortrain (memory plan on / off) vs PyTorch eager.

Every measurement is one subprocess (this script re-invoked with ``--probe``) so that its
RSS belongs to one backend at one batch size. A probe builds the model, optimizer and
batches (``benchmarks/bench_train.py``'s workloads, AdamW, 2 threads), records the RSS
just before the training loop, runs the first step (ortrain: export + graph build +
session) and one warm-up step, resets the kernel's peak-RSS counter (``VmHWM``, through
``/proc/self/clear_refs``) and runs ``--steps`` steady steps. It reports

  steady peak   VmHWM over the steady steps: the whole process, libraries included
                (each process carries ~0.4-0.5 GB of torch / ONNX Runtime code and data);
  increment     steady peak minus the RSS just before the training loop: what training
                adds (gradients, optimizer state, activations; for ortrain also the
                exporter's and the sessions' memory);
  process peak  ru_maxrss over the whole run, first step (export) included.

(a) equal batch: each backend at ``--batches`` (default 8 and 32);
(b) memory cap: the largest batch (a multiple of ``--granularity``) whose process peak
    stays under ``--cap-mib``; the search starts at the batch that (a)'s two points
    predict (peaks grow linearly in the batch) and steps up or down from there.

Usage::

    PYTHONPATH=. python benchmarks/bench_memory.py                      # both parts
    PYTHONPATH=. python benchmarks/bench_memory.py --workloads gpt2-tiny --cap-mib 1536
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import resource
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import psutil
import torch

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from benchmarks.bench_train import WORKLOADS  # noqa: E402
from benchmarks.hardware import cpu_description  # noqa: E402

BACKENDS = ("torch", "ortrain-noplan", "ortrain")  # ortrain = memory plan on


# --------------------------------------------------------------------------- one probe
def _rss_mib() -> float:
    return psutil.Process().memory_info().rss / 2**20


def _hwm_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def _reset_hwm() -> None:
    with open("/proc/self/clear_refs", "w") as f:  # "5": reset the peak RSS (Linux >= 4.0)
        f.write("5")


def _ortrain_options(threads: int, memory_plan: bool) -> Any:
    from ortrain import TrainerOptions

    return TrainerOptions(intra_op_threads=threads, memory_plan=memory_plan)


def probe(backend: str, workload: str, batch: int, steps: int, threads: int) -> dict[str, Any]:
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    torch.set_num_threads(threads)
    w = dataclasses.replace(WORKLOADS[workload], batch=batch)
    torch.manual_seed(0)
    model = w.build(w, 0.0)  # bench_train's default: no dropout
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01)
    g = torch.Generator().manual_seed(1)
    batches = [w.make_batch(w, g) for _ in range(2)]
    if backend == "torch":
        model.train()

        def step(b: dict[str, torch.Tensor]) -> float:
            opt.zero_grad(set_to_none=True)
            loss = model(**b).loss
            loss.backward()
            opt.step()
            return loss.item()
    else:
        from ortrain import ORTTrainer

        trainer = ORTTrainer(model, opt, _ortrain_options(threads, backend == "ortrain"))

        def step(b: dict[str, torch.Tensor]) -> float:
            return float(trainer.train_step(**b))

    rss_before = _rss_mib()
    t0 = time.perf_counter()
    first_loss = step(batches[0])
    first_s = time.perf_counter() - t0
    step(batches[1])
    _reset_hwm()
    times = []
    for i in range(steps):
        t0 = time.perf_counter()
        step(batches[i % 2])
        times.append(time.perf_counter() - t0)
    steady = _hwm_mib()
    out = {
        "backend": backend,
        "workload": workload,
        "batch": batch,
        "rss_before_mib": rss_before,
        "steady_peak_mib": steady,
        "increment_mib": steady - rss_before,
        "process_peak_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "step_s": min(times),
        "first_step_s": first_s,
        "first_loss": first_loss,
    }
    if backend != "torch":
        report = trainer.memory_report().graph
        out["kept_mib"] = report.kept_bytes / 2**20
        out["planned_peak_mib"] = report.planned_peak_bytes / 2**20
        out["recomputed_nodes"] = report.recomputed_nodes
    return out


# --------------------------------------------------------------------------- driver
def run_probe(args: argparse.Namespace, backend: str, workload: str, batch: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "r.json"
        cmd = [
            sys.executable, str(Path(__file__).resolve()), "--probe", backend, workload,
            str(batch), "--json", str(out), "--steps", str(args.steps),
            "--threads", str(args.threads),
        ]  # fmt: skip
        env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if proc.returncode != 0 or not out.exists():
            tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
            return {"backend": backend, "workload": workload, "batch": batch, "error": tail}
        result = json.loads(out.read_text())
    print(
        f"  {workload:<10} {backend:<15} batch {batch:>4}: steady peak "
        f"{result['steady_peak_mib']:7.0f} MiB (+{result['increment_mib']:6.0f}), process "
        f"peak {result['process_peak_mib']:7.0f} MiB, {result['step_s']:.2f} s/step",
        flush=True,
    )
    return result


def fits(r: dict, cap: float) -> bool:
    return "error" not in r and r["process_peak_mib"] <= cap


def largest_batch(
    args: argparse.Namespace, backend: str, workload: str, points: list[dict]
) -> tuple[int, bool, int]:
    """(largest multiple of ``granularity`` seen fitting under the cap, whether the next
    multiple was seen not to fit, probes run), searching from the linear prediction."""
    cap, step = args.cap_mib, args.granularity
    good = sorted((p for p in points if "error" not in p), key=lambda p: p["batch"])
    guess = 8.0
    if len(good) >= 2:
        a, b = good[0], good[-1]
        slope = (b["process_peak_mib"] - a["process_peak_mib"]) / (b["batch"] - a["batch"])
        guess = b["batch"] + (cap - b["process_peak_mib"]) / max(slope, 1e-6)
    results: dict[int, dict] = {p["batch"]: p for p in points}
    probes = 0
    batch = max(step, int(guess) // step * step)
    direction = 0
    while probes < args.max_probes:
        if batch not in results:
            results[batch] = run_probe(args, backend, workload, batch)
            probes += 1
        ok = fits(results[batch], cap)
        if direction == 0:
            direction = 1 if ok else -1
        elif ok != (direction == 1):
            break  # crossed the cap
        batch += direction * step
        if batch < step:
            break
    fitting = [b for b, r in results.items() if fits(r, cap)]
    best = max(fitting, default=0)
    nxt = results.get(best + step)
    return best, nxt is not None and not fits(nxt, cap), probes


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--probe", nargs=3, metavar=("BACKEND", "WORKLOAD", "BATCH"))
    ap.add_argument("--json", type=Path)
    ap.add_argument("--workloads", default="gpt2-tiny,bert-tiny")
    ap.add_argument("--backends", default=",".join(BACKENDS))
    ap.add_argument("--batches", default="8,32", help="equal-batch points (two: the fit)")
    ap.add_argument("--cap-mib", type=float, default=2048.0, help="process peak RSS cap")
    ap.add_argument("--granularity", type=int, default=8)
    ap.add_argument("--max-probes", type=int, default=4, help="per backend in the cap search")
    ap.add_argument("--steps", type=int, default=2, help="steady steps per probe")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--no-cap", action="store_true", help="equal-batch part only")
    args = ap.parse_args()
    if args.probe:
        backend, workload, batch = args.probe
        result = probe(backend, workload, int(batch), args.steps, args.threads)
        args.json.write_text(json.dumps(result))
        return

    t_start = time.perf_counter()
    backends = args.backends.split(",")
    equal: dict[tuple[str, str], list[dict]] = {}
    cap_rows = []
    for workload in args.workloads.split(","):
        print(f"{workload}: equal batch", flush=True)
        for backend in backends:
            equal[workload, backend] = [
                run_probe(args, backend, workload, int(b)) for b in args.batches.split(",")
            ]
        if args.no_cap:
            continue
        print(f"{workload}: largest batch under {args.cap_mib:.0f} MiB", flush=True)
        for backend in backends:
            best, bounded, probes = largest_batch(args, backend, workload, equal[workload, backend])
            cap_rows.append((workload, backend, best, bounded, probes))

    lines = [
        "| workload | batch | backend | steady peak MiB | increment MiB | process peak MiB "
        "| vs eager (peak / incr.) | kept for bw MiB | s/step |",
        "|---|---:|---|---:|---:|---:|---:|---:|---:|",
    ]
    for (workload, backend), results in equal.items():
        for r in results:
            if "error" in r:
                lines.append(f"| {workload} | {r['batch']} | {backend} | error: {r['error']} |")
                continue
            ref = next(
                (x for x in equal.get((workload, "torch"), []) if x["batch"] == r["batch"]), None
            )
            ratio = (
                f"{r['steady_peak_mib'] / ref['steady_peak_mib']:.2f} / "
                f"{r['increment_mib'] / ref['increment_mib']:.2f}"
                if ref and "error" not in ref
                else "-"
            )
            kept = f"{r['kept_mib']:.1f}" if "kept_mib" in r else "-"
            lines.append(
                f"| {workload} | {r['batch']} | {backend} | {r['steady_peak_mib']:.0f} | "
                f"{r['increment_mib']:.0f} | {r['process_peak_mib']:.0f} | {ratio} | {kept} | "
                f"{r['step_s']:.2f} |"
            )
    if cap_rows:
        lines += [
            "",
            f"Largest batch (multiple of {args.granularity}) with process peak RSS <= "
            f"{args.cap_mib:.0f} MiB:",
            "",
            "| workload | backend | largest batch | vs eager | next batch over the cap? | probes |",
            "|---|---|---:|---:|---|---:|",
        ]
        eager = {w: b for w, be, b, _, _ in cap_rows if be == "torch"}
        for workload, backend, best, bounded, n in cap_rows:
            ratio = f"{best / eager[workload]:.2f}x" if eager.get(workload) else "-"
            seen = "yes" if bounded else "not probed (probe limit)"
            lines.append(f"| {workload} | {backend} | {best} | {ratio} | {seen} | {n} |")
    print()
    print("\n".join(lines))
    print(
        f"\ntorch {torch.__version__}, {cpu_description()}, {args.threads} threads, "
        f"{math.ceil(time.perf_counter() - t_start)} s"
    )
    print("command: PYTHONPATH=. python benchmarks/bench_memory.py " + shlex.join(sys.argv[1:]))


if __name__ == "__main__":
    main()
