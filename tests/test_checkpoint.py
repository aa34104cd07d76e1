"""save_checkpoint -> new process -> load_checkpoint continues bit-identically."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.rank_processes import start_rank

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
    # the speed trial's choice after its timed steps depends on the machine's load (two
    # runs agree to float rounding where it falls differently): one route, bit for bit
    trainer = ORTTrainer(model, opt, TrainerOptions(max_grad_norm=1.0, intra_op_threads=2,
                                                    eager_if_faster=False))
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
    """The worker in a new process (forked from the warm server of tests/rank_processes.py:
    nothing of this process, nor of the runs before it, is in it)."""
    script = tmp_path / "worker.py"
    root = str(Path(__file__).resolve().parent.parent)
    script.write_text(WORKER.format(root=root))
    env = {**os.environ, "PYTHONPATH": root}
    log = tmp_path / f"{mode}.log"
    argv = [mode, str(tmp_path / "ckpt" / "trainer.pt")]
    proc = start_rank(str(script), argv, env, log)
    assert proc.wait(timeout=600) == 0, log.read_text()[-3000:]
    line = next(ln for ln in log.read_text().splitlines() if ln.startswith("LOSSES"))
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
    (tmp_path / "folder").mkdir()
    with pytest.raises(CheckpointError, match=r"folder\b.*not a sharded checkpoint"):
        trainer.load_checkpoint(tmp_path / "folder")
    bad = tmp_path / "bad.pt"
    bad.write_bytes(b"not a checkpoint")
    with pytest.raises(CheckpointError, match="cannot read"):
        trainer.load_checkpoint(bad)
    trainer.save_checkpoint(tmp_path / "ok.pt")
    sgd_trainer = ORTTrainer(model, torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(CheckpointError, match="adamw optimizer state"):
        sgd_trainer.load_checkpoint(tmp_path / "ok.pt")


# ---------------------------------------------------------------------------------------
# Issue 35, items 3-4: a full disk, damaged files, tied weights, missing metadata.

FULL_DISK_WORKER = textwrap.dedent(
    """
    import hashlib, json, resource, signal, sys, torch
    sys.path.insert(0, {root!r})
    from tests.conftest import gpt2
    from ortrain import CheckpointError, ORTTrainer
    folder = sys.argv[1]
    model = gpt2(layers=1, hidden=32, vocab=64, seed=1)
    trainer = ORTTrainer(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    old = {{k: v.clone() for k, v in model.state_dict().items()}}
    trainer.save_checkpoint(folder + "/a.pt")
    size = len(open(folder + "/a.pt", "rb").read())
    digest = hashlib.sha256(open(folder + "/a.pt", "rb").read()).hexdigest()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    # The disk fills up half way: writes past the limit fail (EFBIG) instead of killing us.
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (size // 2, hard))
    errors = []
    for name in ("a.pt", "b.pt"):  # over the old checkpoint, then under another name
        try:
            trainer.save_checkpoint(folder + "/" + name)
            errors.append(None)
        except CheckpointError as exc:
            errors.append(str(exc))
    resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    unchanged = hashlib.sha256(open(folder + "/a.pt", "rb").read()).hexdigest() == digest
    trainer.save_checkpoint(folder + "/c.pt")  # space is back: nothing was left behind
    trainer.load_checkpoint(folder + "/a.pt")
    same = all(torch.equal(v, old[k]) for k, v in model.state_dict().items())
    print("RESULT" + json.dumps({{"errors": errors, "unchanged": unchanged, "loaded": same}}))
    """
)


@pytest.mark.slow
def test_save_onto_a_full_disk_leaves_the_old_checkpoint(tmp_path):
    """A write that runs out of room (a file-size limit) raises CheckpointError saying so,
    removes its partial file, and leaves the previous checkpoint as it was."""
    script = tmp_path / "worker.py"
    root = str(Path(__file__).resolve().parent.parent)
    script.write_text(FULL_DISK_WORKER.format(root=root))
    folder = tmp_path / "ckpt"
    folder.mkdir()
    out = subprocess.run(
        [sys.executable, str(script), str(folder)],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": root},
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    line = next(ln for ln in out.stdout.splitlines() if ln.startswith("RESULT"))
    result = json.loads(line[len("RESULT") :])
    over, other = result["errors"]
    assert over is not None and other is not None
    assert "File too large" in over and "partial file was removed" in over
    assert f"previous checkpoint at {folder / 'a.pt'} is intact" in over
    assert f"nothing was written at {folder / 'b.pt'}" in other
    assert result["unchanged"] and result["loaded"]
    assert sorted(f.name for f in folder.iterdir()) == ["a.pt", "c.pt"]


def _tiny_trainer(seed: int = 0):
    import torch

    from ortrain import ORTTrainer
    from tests.conftest import gpt2

    model = gpt2(layers=1, hidden=32, vocab=64, seed=seed)
    return ORTTrainer(model, torch.optim.AdamW(model.parameters(), lr=1e-3))


def test_space_is_checked_before_writing(tmp_path, monkeypatch):
    import shutil

    from ortrain import CheckpointError, checkpoint

    trainer = _tiny_trainer()
    trainer.save_checkpoint(tmp_path / "a.pt")
    before = (tmp_path / "a.pt").read_bytes()
    usage = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(
        checkpoint.shutil, "disk_usage", lambda _: usage._replace(free=len(before) // 2)
    )
    with pytest.raises(CheckpointError, match=r"not enough space .* are free; the previous"):
        trainer.save_checkpoint(tmp_path / "a.pt")
    assert (tmp_path / "a.pt").read_bytes() == before
    assert sorted(f.name for f in tmp_path.iterdir()) == ["a.pt"]


def _same(a, b) -> bool:
    """Equal nested checkpoint contents: types, keys in order, tensors bit for bit."""
    import torch

    if isinstance(a, torch.Tensor):
        return (
            isinstance(b, torch.Tensor)
            and (a.dtype, a.shape) == (b.dtype, b.shape)
            and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))
        )
    if isinstance(a, dict):
        return isinstance(b, dict) and list(a) == list(b) and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(map(_same, a, b))
    return type(a) is type(b) and a == b


@pytest.fixture(scope="module")
def trained_checkpoint(tmp_path_factory):
    """A checkpoint with optimizer state (one AdamW step of a tiny tied GPT-2)."""
    from tests.conftest import lm_batches

    trainer = _tiny_trainer()
    trainer.train_step(**lm_batches(1, vocab=64, seq=16)[0])
    path = tmp_path_factory.mktemp("ckpt") / "trained.pt"
    trainer.save_checkpoint(path)
    return trainer, path


@pytest.mark.slow
def test_flipped_byte_is_detected(trained_checkpoint, tmp_path):
    """A bit flipped in a tensor's bytes names the tensor; one flipped anywhere else in the
    file either fails to load or changes nothing that is read."""
    import random

    import torch

    from ortrain import CheckpointError, checkpoint

    trainer, path = trained_checkpoint
    data = path.read_bytes()
    name = "transformer.h.0.attn.c_attn.weight"
    at = data.find(trainer.module.state_dict()[name].numpy().tobytes())
    assert at > 0
    damaged = bytearray(data)
    damaged[at + 100] ^= 0x04
    (tmp_path / "bad.pt").write_bytes(damaged)
    with pytest.raises(CheckpointError, match=f"damaged: tensor 'state/model/{name}' does not"):
        trainer.load_checkpoint(tmp_path / "bad.pt")

    intact = torch.load(path, weights_only=True)
    intact.pop(checkpoint.CHECKSUMS)
    rng = random.Random(0)
    outcomes = {"detected": 0, "harmless": 0}
    for pos in rng.sample(range(len(data)), 300):
        damaged = bytearray(data)
        damaged[pos] ^= 1 << rng.randrange(8)
        (tmp_path / "fuzz.pt").write_bytes(damaged)
        try:
            loaded = checkpoint.read_file(tmp_path / "fuzz.pt", checkpoint.PAYLOAD_KEYS)
        except CheckpointError:
            outcomes["detected"] += 1
            continue
        assert _same(loaded, intact), f"a flip at byte {pos} loaded silently"
        outcomes["harmless"] += 1  # zip padding, or a duplicate header torch does not read
    assert outcomes["detected"] > outcomes["harmless"], outcomes


def _old_format(trainer, path, checksums: bool = False) -> dict:
    """What ortrain wrote before checksums: every tensor its own clone, no checksums
    (``checksums``: but with this file's, to compare the tensors alone)."""
    import torch

    from ortrain import checkpoint

    payload = torch.load(path, weights_only=True)
    if not checksums:
        payload.pop(checkpoint.CHECKSUMS)
    state = payload["state"]
    state["model"] = {k: v.clone() for k, v in state["model"].items()}
    return payload


def test_tied_weights_are_stored_once_and_load_into_eager(trained_checkpoint, tmp_path):
    import torch

    from tests.conftest import gpt2

    trainer, path = trained_checkpoint
    module = trainer.module
    assert module.lm_head.weight is module.transformer.wte.weight
    table = module.transformer.wte.weight.nbytes
    # (Same file names: torch.save names each zip record after the file.)
    twice, old = tmp_path / "twice" / path.name, tmp_path / "old" / path.name
    twice.parent.mkdir()
    old.parent.mkdir()
    torch.save(_old_format(trainer, path, checksums=True), twice)
    saved = twice.stat().st_size - path.stat().st_size
    assert table <= saved <= table + 256, (saved, table)  # the table and its record headers
    # The file this replaces had no checksums (a few bytes per tensor): still smaller.
    torch.save(_old_format(trainer, path), old)
    assert old.stat().st_size > path.stat().st_size

    state = torch.load(path, weights_only=True)["state"]["model"]
    wte, head = state["transformer.wte.weight"], state["lm_head.weight"]
    assert wte.untyped_storage().data_ptr() == head.untyped_storage().data_ptr()
    eager = gpt2(layers=1, hidden=32, vocab=64, seed=9)  # other weights, then the checkpoint's
    eager.load_state_dict(state)
    assert eager.lm_head.weight is eager.transformer.wte.weight
    for (name, p), q in zip(eager.state_dict().items(), module.state_dict().values()):
        assert torch.equal(p, q), name


def test_old_checkpoint_loads_with_a_warning(trained_checkpoint, tmp_path):
    import torch

    trainer, path = trained_checkpoint
    torch.save(_old_format(trainer, path), tmp_path / "old.pt")
    fresh = _tiny_trainer(seed=5)
    with pytest.warns(UserWarning, match="no checksums .*cannot be verified"):
        fresh.load_checkpoint(tmp_path / "old.pt")
    expected = trainer.module.state_dict()
    for name, p in fresh.module.state_dict().items():
        assert torch.equal(p, expected[name]), name
    assert fresh.step == trainer.step


def test_missing_metadata_is_a_checkpoint_error(trained_checkpoint, tmp_path):
    import warnings

    import torch

    from ortrain import CheckpointError, checkpoint

    trainer, path = trained_checkpoint
    payload = _old_format(trainer, path)
    del payload["optimizer_kind"]
    torch.save(payload, tmp_path / "old.pt")
    checkpoint.write_file(payload, tmp_path / "new.pt")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the old file's "no checksums"
        with pytest.raises(CheckpointError, match="lacks 'optimizer_kind'"):
            trainer.load_checkpoint(tmp_path / "old.pt")
    with pytest.raises(CheckpointError, match="lacks 'optimizer_kind'"):
        trainer.load_checkpoint(tmp_path / "new.pt")
    state = trainer.state_dict()
    with pytest.raises(CheckpointError, match="'state' and 'param_groups'"):
        trainer.load_state_dict({"model": state["model"], "optimizer": {"state": {}}})


def test_sharded_checkpoint_parts_are_verified(tmp_path):
    """The manifest's own checksum and the shard files' checksums (the two-rank save and
    load themselves run in tests/test_distributed.py)."""
    import types

    import torch

    from ortrain import CheckpointError, checkpoint
    from ortrain.distributed import sharded_checkpoint as sc

    trainer = types.SimpleNamespace(spec=types.SimpleNamespace(kind="adamw"))
    manifest = {"format": sc.FORMAT, "optimizer_kind": "adamw", "world_size": 2, "step": 3}
    manifest.update(layout={}, state_names=["exp_avg"], index_names=[], state_of={})
    manifest.update(model="m.pt", shards=["s0.pt", "s1.pt"])
    (tmp_path / sc.MANIFEST).write_text(json.dumps({**manifest, "sha256": sc._digest(manifest)}))
    assert sc.read_manifest(trainer, tmp_path) == manifest
    damaged = {**manifest, "step": 4, "sha256": sc._digest(manifest)}
    (tmp_path / sc.MANIFEST).write_text(json.dumps(damaged))
    with pytest.raises(CheckpointError, match=r"manifest\.json fails its checksum"):
        sc.read_manifest(trainer, tmp_path)

    shard = {"rank": 1, "state": {"exp_avg": torch.arange(64, dtype=torch.float32)}}
    checkpoint.write_file(shard, tmp_path / "s1.pt")
    assert torch.equal(
        sc._load(tmp_path / "s1.pt", sc.SHARD_KEYS)["state"]["exp_avg"], shard["state"]["exp_avg"]
    )
    data = bytearray((tmp_path / "s1.pt").read_bytes())
    data[data.find(shard["state"]["exp_avg"].numpy().tobytes()) + 9] ^= 0x10
    (tmp_path / "s1.pt").write_bytes(data)
    with pytest.raises(CheckpointError, match="tensor 'state/exp_avg' does not match"):
        sc._load(tmp_path / "s1.pt", sc.SHARD_KEYS)
