"""save_checkpoint -> new process -> load_checkpoint continues bit-identically."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

WORKER = textwrap.dedent(
    """
    import json, sys, torch
    sys.path.insert(0, {root!r})
    from tests.conftest import gpt2, lm_batches
    from ortrain import ORTTrainer, TrainerOptions
    mode, path = sys.argv[1], sys.argv[2]
    torch.set_num_threads(2)
    model = gpt2(layers=2, hidden=64, vocab=128, seed=3)
    opt = torch.optim.AdamW(
        [{{"params": [p for p in model.parameters() if p.ndim >= 2], "weight_decay": 0.1}},
         {{"params": [p for p in model.parameters() if p.ndim < 2], "weight_decay": 0.0}}],
        lr=2e-3)
    trainer = ORTTrainer(model, opt, TrainerOptions(max_grad_norm=1.0, intra_op_threads=2))
    batches = lm_batches(10, vocab=128, seed=5)
    losses = []
    if mode == "full":
        losses = [trainer.train_step(**b).item() for b in batches]
    elif mode == "first":
        losses = [trainer.train_step(**b).item() for b in batches[:5]]
        trainer.save_checkpoint(path)
    else:
        trainer.load_checkpoint(path)
        losses = [trainer.train_step(**b).item() for b in batches[5:]]
    print("LOSSES" + json.dumps(losses))
    """
)


def _run(tmp_path: Path, mode: str) -> list[float]:
    script = tmp_path / "worker.py"
    root = str(Path(__file__).resolve().parent.parent)
    script.write_text(WORKER.format(root=root))
    env = {**os.environ, "PYTHONPATH": root}
    out = subprocess.run(
        [sys.executable, str(script), mode, str(tmp_path / "ckpt" / "trainer.pt")],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    line = next(ln for ln in out.stdout.splitlines() if ln.startswith("LOSSES"))
    return json.loads(line[len("LOSSES") :])


@pytest.mark.slow
def test_resume_in_new_process_is_identical(tmp_path):
    full = _run(tmp_path, "full")
    first = _run(tmp_path, "first")
    assert first == full[:5]
    assert (tmp_path / "ckpt" / "trainer.pt").is_file()
    assert not (tmp_path / "ckpt" / "trainer.pt.tmp").exists()
    resumed = _run(tmp_path, "resume")
    assert resumed == full[5:]


def test_load_checkpoint_errors(tmp_path):
    import torch

    from ortrain import CheckpointError, ORTTrainer
    from tests.conftest import gpt2

    model = gpt2(layers=1, hidden=32, vocab=64)
    trainer = ORTTrainer(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    with pytest.raises(CheckpointError, match="no checkpoint"):
        trainer.load_checkpoint(tmp_path / "missing.pt")
    bad = tmp_path / "bad.pt"
    bad.write_bytes(b"not a checkpoint")
    with pytest.raises(CheckpointError, match="cannot read"):
        trainer.load_checkpoint(bad)
    trainer.save_checkpoint(tmp_path / "ok.pt")
    sgd_trainer = ORTTrainer(model, torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(CheckpointError, match="adamw optimizer state"):
        sgd_trainer.load_checkpoint(tmp_path / "ok.pt")
