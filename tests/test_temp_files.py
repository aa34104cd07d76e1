"""Every file ortrain writes beside a target goes through a new temporary file of a random
name (``ortrain/safe_files.py``: ``mkstemp``, ``O_CREAT | O_EXCL``), then a rename: a symlink
planted at a name ortrain used to write (``<name>.tmp`` in a shared folder) is never
followed, so the file it points to is never overwritten. One test per writer, each planting
a link to a victim file at the old fixed name, writing, and checking that the victim is
unchanged and the target was written whole."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ortrain import ORTTrainer, TrainerOptions

ROOT = Path(__file__).resolve().parents[1]
PRECIOUS = b"another user's file, which ortrain must never write\n"


def _victim(tmp_path: Path) -> Path:
    victim = tmp_path / "victim"
    victim.write_bytes(PRECIOUS)
    return victim


def _plant(link: Path, victim: Path) -> Path:
    link.parent.mkdir(parents=True, exist_ok=True)
    link.symlink_to(victim)
    return link


def _untouched(victim: Path, *links: Path) -> None:
    assert victim.read_bytes() == PRECIOUS
    for link in links:  # ortrain neither followed nor removed another user's link
        assert link.is_symlink() and link.resolve() == victim.resolve()


class Tiny(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x).square().mean()


def _trained(**options) -> ORTTrainer:
    torch.manual_seed(0)
    model = Tiny()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    trainer = ORTTrainer(model, opt, TrainerOptions(**options))
    trainer.train_step(torch.ones(2, 4))
    return trainer


def test_checkpoint_never_follows_a_link_at_its_temporary_name(tmp_path: Path) -> None:
    victim = _victim(tmp_path)
    shared = tmp_path / "shared"
    link = _plant(shared / "ck.pt.tmp", victim)
    trainer = _trained()
    trainer.save_checkpoint(shared / "ck.pt")
    _untouched(victim, link)
    fresh = _trained()
    fresh.load_checkpoint(shared / "ck.pt")
    assert torch.equal(fresh.params["fc.weight"], trainer.params["fc.weight"])
    assert sorted(p.name for p in shared.iterdir()) == ["ck.pt", "ck.pt.tmp"]  # none left
    mode = stat.S_IMODE((shared / "ck.pt").stat().st_mode)
    assert mode == 0o666 & ~_umask()  # what open() gave it before: shareable as it was


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


@pytest.fixture
def world_of_one(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """ZeRO-1 over a gloo group of one process: sharded checkpoints without torchrun."""
    import torch.distributed as dist

    import ortrain.program_context as context_mod
    from ortrain.distributed import make_reducer
    from ortrain.distributed.comm import Comm

    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    monkeypatch.setattr(
        context_mod,
        "join_process_group",
        lambda s, o: make_reducer(s, o, Comm(None, 60.0, s.device)),
    )
    yield
    dist.destroy_process_group()


def test_sharded_checkpoint_never_follows_a_link_at_its_manifests_temporary_name(
    tmp_path: Path, world_of_one: None
) -> None:
    victim = _victim(tmp_path)
    folder = tmp_path / "sharded"
    link = _plant(folder / "manifest.json.tmp", victim)
    trainer = _trained(zero_stage=1)
    trainer.save_checkpoint(folder)
    _untouched(victim, link)
    fresh = _trained(zero_stage=1)
    fresh.load_checkpoint(folder)
    assert torch.equal(fresh.params["fc.weight"], trainer.params["fc.weight"])
    assert not [p.name for p in folder.iterdir() if p.name.endswith(".tmp") and p != link]


_EXIT_RECORD = """
from ortrain.distributed.exits import ExitRecorder
ExitRecorder.for_rank(0)
print("recorded", flush=True)
"""


def test_exit_records_never_follow_links_in_a_shared_temporary_folder(tmp_path: Path) -> None:
    """A rank's record and fault file live under the temporary folder: another user who
    made the job's folder first (``MASTER_ADDR``/``MASTER_PORT`` are no secret) and planted
    links there gets nothing written through them."""
    victim = _victim(tmp_path)
    tmp = tmp_path / "tmp"
    tmp.mkdir(mode=0o1777)
    tmp.chmod(0o1777)  # like /tmp
    links = []
    for root in ("ortrain-ranks", f"ortrain-ranks-{os.getuid()}"):  # the old name, the new
        job = tmp / root / "127.0.0.1-29999-job"
        for name in ("rank0.fault", "rank0.json"):
            links.append(_plant(job / name, victim))
        for d in (job, job.parent):
            d.chmod(0o777)
    env = {**os.environ, "TMPDIR": str(tmp), "PYTHONPATH": str(ROOT)}
    env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29999", TORCHELASTIC_RUN_ID="job")
    env.pop("PYTHONFAULTHANDLER", None)  # the recorder then opens the fault file itself
    done = subprocess.run(
        [sys.executable, "-c", _EXIT_RECORD], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    _untouched(victim, *links)
    assert "other users can write it" in done.stderr  # said why there is no record


def test_exit_records_go_to_a_private_folder(tmp_path: Path, monkeypatch) -> None:
    import tempfile

    from ortrain.distributed.exits import ExitRecorder

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29998")
    recorder = ExitRecorder.for_rank(0)
    try:
        assert recorder.folder is not None and (recorder.folder / "rank0.json").is_file()
        for d in (recorder.folder, recorder.folder.parent):
            assert d.parent.is_relative_to(tmp_path)
            assert stat.S_IMODE(d.stat().st_mode) == 0o700, d
    finally:
        recorder.close()


# --------------------------------------------------------------------------- recipes
def test_recipe_checkpoint_pointer_never_follows_a_link(tmp_path: Path) -> None:
    import types

    from ortrain.recipes.checkpoints import save_checkpoint
    from ortrain.recipes.config import TrainConfig

    victim = _victim(tmp_path)
    out = tmp_path / "run"
    link = _plant(out / "checkpoints" / "latest.tmp", victim)
    env = types.SimpleNamespace(out=out, is_main=True, rank=0, world=1, barrier=lambda: None)
    backend = types.SimpleNamespace(name="ortrain", save=lambda path: torch.save({}, path))
    task = types.SimpleNamespace(name="gpt2", tokenizer_fingerprint="x")
    model = torch.nn.Linear(2, 2)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        torch.optim.SGD(model.parameters(), lr=0.1), lambda s: 1.0
    )
    folder = save_checkpoint(env, backend, task, TrainConfig(), scheduler, 5)
    _untouched(victim, link)
    assert (out / "checkpoints" / "latest").read_text() == folder.name


def test_recipe_caches_never_follow_links(tmp_path: Path) -> None:
    from ortrain.recipes import data

    victim = _victim(tmp_path)
    texts = ["def f(x):\n    return x + 1\n"] * 20
    corpus = data.Corpus(texts, "test", "ab" * 32)
    cache = tmp_path / "cache"
    pid = os.getpid()
    name = f"bpe-300-{corpus.digest[:16]}.json"
    links = [_plant(cache / "tokenizers" / f".{name}.{pid}.tmp", victim)]
    tok, _ = data.get_tokenizer(None, corpus, "bpe", 300, cache)
    key = f"{data.fingerprint(tok)}-{corpus.digest[:16]}.npz"
    links.append(_plant(cache / "tokens" / f".{key}.{pid}.tmp", victim))
    stream = data.encode(tok, corpus, cache)
    _untouched(victim, *links)
    assert data.fingerprint(data.get_tokenizer(None, corpus, "bpe", 300, cache)[0]) == (
        data.fingerprint(tok)
    )
    assert (data.encode(tok, corpus, cache).ids == stream.ids).all()


def test_recipe_plot_never_follows_a_link(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    from ortrain.recipes.metrics import plot

    victim = _victim(tmp_path)
    link = _plant(tmp_path / "plots" / ".loss.png.tmp.png", victim)
    records = [
        {"step": 1, "loss": 2.0, "split": "train"},
        {"step": 2, "loss": 1.5, "split": "eval"},
    ]
    plot(records, tmp_path / "plots" / "loss.png", "loss")
    _untouched(victim, link)
    assert (tmp_path / "plots" / "loss.png").read_bytes().startswith(b"\x89PNG")


def test_atomic_write_leaves_the_target_on_failure(tmp_path: Path) -> None:
    from ortrain.safe_files import atomic_write

    target = tmp_path / "t"
    target.write_bytes(b"old")

    def fail(f) -> None:
        f.write(b"half")
        raise RuntimeError("disk full")

    with pytest.raises(RuntimeError, match="disk full"):
        atomic_write(target, fail)
    assert target.read_bytes() == b"old" and [p.name for p in tmp_path.iterdir()] == ["t"]
    atomic_write(target, lambda f: f.write(b"new"), private=True)
    assert target.read_bytes() == b"new" and stat.S_IMODE(target.stat().st_mode) == 0o600
