"""The training loop the recipes share: ``run``, ``timed_step`` and ``evaluate``.

A recipe builds its data, model and optimizer and hands them over as a ``Task``; ``run``
then does, top to bottom:

1. backend: ``OrtrainBackend`` (``ORTTrainer``) or ``EagerBackend`` (PyTorch eager, with
   DDP / ``ZeroRedundancyOptimizer`` under torchrun) -- same weights, batches and schedule;
2. resume (``--resume``): trainer/optimizer state, LR scheduler, step (= data position:
   batches are a pure function of the step) and RNG state, after checking that the
   checkpoint's tokenizer fingerprint is the one in use;
3. the loop: ``timed_step`` (forward, backward, update: the only code inside the timer)
   then logging, evaluation every ``eval_interval`` and checkpoints every
   ``ckpt_interval`` steps;
4. the end: final evaluation and checkpoint, ``loss.png``, ``summary.json`` and one
   summary line with tokens/s and the fraction of peak FLOP/s.

Output folder: ``config.json``, ``tokenizer.json``, ``metrics.jsonl`` (one JSON record per
train step and per evaluation), ``loss.png``, ``summary.json`` and
``checkpoints/step_NNNNNN/`` (``trainer.pt``: the backend's state -- a directory under
ZeRO-1; ``recipe.pt``: step, scheduler, tokenizer fingerprint, config; ``rng<rank>.pt``)
with ``checkpoints/latest`` naming the newest complete one (written last).

The pieces live beside it: ``config`` (``TrainConfig``, flags, ``cli``), ``processes``
(``Env``, ``setup``), ``task`` (``Task``, ``Batch``), ``backends``, ``checkpoints`` and
``metrics`` (``metrics.jsonl``, ``loss.png``, peak FLOP/s, ``summarize``).
"""

from __future__ import annotations

import dataclasses
import json
import math
import shutil
import sys
import time
from typing import Any

import torch
import torch.distributed as dist

from ortrain.recipes.backends import Backend, make_backend
from ortrain.recipes.checkpoints import find_checkpoint, load_checkpoint, save_checkpoint
from ortrain.recipes.config import TrainConfig
from ortrain.recipes.metrics import Metrics, Timing, plot, summarize
from ortrain.recipes.processes import Env
from ortrain.recipes.task import Batch, Task


def timed_step(backend: Backend, micro_batches: list[Batch]) -> tuple[float, float | None]:
    """One optimizer step: forward + backward per micro-batch, then the update. Returns
    (mean micro-batch loss, gradient norm before clipping or None)."""
    losses = [backend.micro_step(b) for b in micro_batches]
    norm = backend.finish_step()
    return sum(losses) / len(losses), norm


def evaluate(backend: Backend, task: Task, env: Env) -> dict[str, float]:
    """Mean of ``task.eval_metrics`` over the held-out batches (split over the ranks)."""
    totals = torch.zeros(len(task.eval_keys), dtype=torch.float64)
    for batch in task.eval_batches[env.rank :: env.world]:
        values = task.eval_metrics(backend.evaluate(batch), batch)
        totals += torch.tensor([values[k] for k in task.eval_keys], dtype=torch.float64)
    if env.world > 1:
        dist.all_reduce(totals)
    return {k: float(v) / len(task.eval_batches) for k, v in zip(task.eval_keys, totals)}


def _rank_mean(value: float, env: Env) -> float:
    if env.world == 1:
        return value
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t)
    return float(t) / env.world


def run(cfg: TrainConfig, env: Env, task: Task) -> dict[str, Any]:
    """Train ``task`` for ``cfg.steps`` steps; returns the summary (also summary.json)."""
    from tqdm import tqdm

    for line in task.header:
        env.print(line)
    backend = make_backend(task, cfg, env)
    scheduler = torch.optim.lr_scheduler.LambdaLR(backend.optimizer, task.schedule)
    start = 0
    if cfg.resume is not None:
        folder = find_checkpoint(cfg.resume, env.out)
        start = load_checkpoint(folder, env, backend, task, cfg, scheduler)
        env.print(f"resumed from {folder} at step {start}")
    elif env.is_main and (env.out / "checkpoints").exists():
        env.print(f"starting afresh: removing {env.out / 'checkpoints'} (--resume continues)")
        shutil.rmtree(env.out / "checkpoints")
    if env.is_main:
        (env.out / "config.json").write_text(json.dumps(dataclasses.asdict(cfg), indent=2) + "\n")
        (env.out / "tokenizer.json").write_text(task.tokenizer_json)
    metrics = Metrics(
        env.out / "metrics.jsonl", env.is_main, start if cfg.resume is not None else None
    )
    end = cfg.stop_at if cfg.stop_at is not None else cfg.steps

    def run_eval(step: int) -> None:
        t = time.perf_counter()
        values = evaluate(backend, task, env)
        ppl = math.exp(min(values[task.ppl_key], 50.0))
        metrics.log(step=step, split="eval", **values, ppl=ppl)
        shown = "  ".join(f"{k} {v:.4f}" for k, v in values.items())
        env.print(f"step {step:5d} | eval {shown}  ppl {ppl:.2f}  ({time.perf_counter() - t:.1f}s)")

    if start == 0:
        run_eval(0)
    seen_shapes: set[tuple] = set()
    timing = Timing()
    last_ckpt = start
    bar = tqdm(
        total=cfg.steps,
        initial=start,
        unit="step",
        dynamic_ncols=True,
        disable=not (env.is_main and cfg.progress),
        file=sys.stderr,
    )
    step = start
    try:
        while step < end:
            micro = [task.batch(step, m) for m in range(cfg.grad_accum)]
            shape = tuple(micro[0]["input_ids"].shape)
            tokens = sum(b["input_ids"].numel() for b in micro) * env.world
            lr = float(backend.optimizer.param_groups[0]["lr"])
            t = time.perf_counter()
            loss, norm = timed_step(backend, micro)
            dt = time.perf_counter() - t
            scheduler.step()
            if shape in seen_shapes:
                timing.seconds += dt
                timing.tokens += tokens
                timing.flops += tokens * task.flops_per_token(shape[1])
            else:
                seen_shapes.add(shape)
                if timing.first_step_s is None:
                    timing.first_step_s = dt
                why = "graph build" if backend.name == "ortrain" else "warm-up"
                env.print(f"step {step + 1:5d} took {dt:.1f}s (first at {shape}: {why})")
            step += 1
            loss = _rank_mean(loss, env)
            metrics.log(
                step=step, split="train", loss=loss, lr=lr, grad_norm=norm,
                seq_len=shape[1], tokens=tokens, time_s=dt,
            )  # fmt: skip
            rate = timing.tokens / timing.seconds if timing.seconds else tokens / dt
            bar.set_postfix_str(f"loss {loss:.4f} | {rate:,.0f} tok/s", refresh=False)
            bar.update(1)
            if (cfg.eval_interval and step % cfg.eval_interval == 0) or step == cfg.steps:
                run_eval(step)
            if (cfg.ckpt_interval and step % cfg.ckpt_interval == 0) or step == cfg.steps:
                save_checkpoint(env, backend, task, cfg, scheduler, step)
                last_ckpt = step
                if env.is_main and step < end:
                    plot(metrics.records, env.out / "loss.png", _title(task, cfg))
    except KeyboardInterrupt:
        bar.close()
        env.print(f"interrupted after step {step}; the last checkpoint is at step {last_ckpt}")
        raise
    bar.close()
    if env.is_main:
        plot(metrics.records, env.out / "loss.png", _title(task, cfg))
    return summarize(cfg, env, task, backend, metrics, (start, step), timing)


def _title(task: Task, cfg: TrainConfig) -> str:
    return f"{task.name} {cfg.preset} ({cfg.backend})"
