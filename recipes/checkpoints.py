"""Checkpoints in ``<out>/checkpoints/step_NNNNNN/``: ``trainer.pt`` (the backend's state
-- a directory under ZeRO-1), ``rng<rank>.pt`` and ``recipe.pt`` (step, scheduler,
tokenizer fingerprint, config), with ``checkpoints/latest`` naming the newest complete one
(written last). ``save_checkpoint`` writes and prunes, ``find_checkpoint`` resolves
``--resume``, ``load_checkpoint`` restores and checks the tokenizer fingerprint.
"""

from __future__ import annotations

import dataclasses
import random
import shutil
from pathlib import Path
from typing import Any

import torch

from ortrain.recipes import RecipeError
from ortrain.recipes.backends import Backend
from ortrain.recipes.config import TrainConfig
from ortrain.recipes.processes import Env
from ortrain.recipes.task import Task
from ortrain.safe_files import atomic_write


def _checkpoint_dir(env: Env, step: int) -> Path:
    return env.out / "checkpoints" / f"step_{step:06d}"


def save_checkpoint(
    env: Env,
    backend: Backend,
    task: Task,
    cfg: TrainConfig,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    step: int,
) -> Path:
    """trainer.pt, rng<rank>.pt, recipe.pt, then ``latest`` (the commit); old ones pruned."""
    folder = _checkpoint_dir(env, step)
    if env.is_main:
        if folder.exists():
            shutil.rmtree(folder)
        folder.mkdir(parents=True)
    env.barrier()
    backend.save(folder / "trainer.pt")
    rng: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        rng["cuda"] = torch.cuda.get_rng_state_all()
    torch.save(rng, folder / f"rng{env.rank}.pt")
    env.barrier()
    if env.is_main:
        recipe = {
            "recipe": task.name,
            "step": step,
            "backend": backend.name,
            "world_size": env.world,
            "scheduler": scheduler.state_dict(),
            "tokenizer_fingerprint": task.tokenizer_fingerprint,
            "config": dataclasses.asdict(cfg),
        }
        torch.save(recipe, folder / "recipe.pt")
        latest = folder.parent / "latest"
        atomic_write(latest, lambda f: f.write(folder.name.encode()))  # the commit
        done = sorted(p for p in folder.parent.glob("step_*") if p.is_dir())
        for old in done[: -cfg.keep_checkpoints]:
            shutil.rmtree(old, ignore_errors=True)
    env.barrier()
    return folder


def find_checkpoint(resume: str, out: Path) -> Path:
    """``latest`` in ``out``; or PATH: a step folder, or a run folder (its latest)."""
    base = out if resume == "latest" else Path(resume)
    if (base / "recipe.pt").is_file():
        return base
    for latest in (base / "checkpoints" / "latest", base / "latest"):
        if latest.is_file():
            return latest.parent / latest.read_text().strip()
    raise RecipeError(f"no checkpoint to resume from in {base}")


# Settings that may change on resume without changing what the run computes.
_FREE_ON_RESUME = {
    "out", "resume", "stop_at", "progress", "eval_interval", "ckpt_interval",
    "keep_checkpoints", "peak_tflops", "threads", "tokenizer",
}  # fmt: skip


def load_checkpoint(
    folder: Path,
    env: Env,
    backend: Backend,
    task: Task,
    cfg: TrainConfig,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
) -> int:
    """Restores everything ``save_checkpoint`` wrote; returns the step to continue at."""
    try:
        recipe = torch.load(folder / "recipe.pt", weights_only=True)
    except Exception as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise RecipeError(f"cannot read checkpoint {folder / 'recipe.pt'}: {first}") from exc
    if recipe["recipe"] != task.name:
        raise RecipeError(f"checkpoint {folder} is from the {recipe['recipe']} recipe")
    if recipe["backend"] != backend.name:
        raise RecipeError(
            f"checkpoint {folder} was written by --backend {recipe['backend']}; resume it with "
            "the same backend"
        )
    if recipe["tokenizer_fingerprint"] != task.tokenizer_fingerprint:
        raise RecipeError(
            f"the tokenizer in use (fingerprint {task.tokenizer_fingerprint}) does not match "
            f"checkpoint {folder} (fingerprint {recipe['tokenizer_fingerprint']}); pass "
            f"--tokenizer {folder.parent.parent / 'tokenizer.json'} and the same --data"
        )
    backend.load(folder / "trainer.pt")
    scheduler.load_state_dict(recipe["scheduler"])
    rng_file = folder / f"rng{env.rank}.pt"
    if rng_file.is_file():  # (absent when resuming at a larger world size)
        rng = torch.load(rng_file, weights_only=True)
        torch.set_rng_state(rng["torch"])
        random.setstate(rng["python"])
        if "cuda" in rng and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(rng["cuda"])
    changed = [
        f"{k} {v!r} -> {getattr(cfg, k)!r}"
        for k, v in recipe["config"].items()
        if k not in _FREE_ON_RESUME and getattr(cfg, k, v) != v
    ]
    if changed:
        env.print(f"note: resuming with changed settings: {', '.join(changed)}")
    return int(recipe["step"])
