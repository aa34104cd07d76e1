"""Folders ortrain reads graphs or code from are this user's alone (ortrain/safe_files.py,
docs/security.md): a graph cache folder, or an entry in it, that another user can write or
owns is refused: a folder the user named raises at construction, the default folder warns
and the trainer builds without it; an entry is built again, never unpickled. New folders are
created 0700. The development build of the CPU op library uses the same check
(tests/test_native_loader.py)."""

from __future__ import annotations

import os
import stat
import warnings
from pathlib import Path

import pytest
import torch

from ortrain import ORTTrainer, TrainerOptions
from ortrain.safe_files import UntrustedPathError, check_private_dir, private_dir

OTHER_UID = 4242  # a uid of "another user" for folders chown'ed by a root test run
needs_root = pytest.mark.skipif(os.getuid() != 0, reason="chown to another user needs root")


class Tiny(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x).square().mean()


def _trainer(**options) -> ORTTrainer:
    torch.manual_seed(0)
    model = Tiny()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    return ORTTrainer(model, opt, TrainerOptions(**options))


def _step(trainer: ORTTrainer) -> float:
    return trainer.train_step(torch.ones(2, 4)).item()


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


@pytest.fixture
def cache_on(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """The graph cache on, its default folder under a temporary XDG_CACHE_HOME."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.setenv("ORTRAIN_GRAPH_CACHE", "1")
    return tmp_path / "xdg" / "ortrain" / "graphs"


# --------------------------------------------------------------------------- the rule
def test_private_dir_creates_missing_folders_0700(tmp_path: Path) -> None:
    folder = tmp_path / "a" / "b" / "c"
    assert private_dir(folder) == folder
    for d in (tmp_path / "a", tmp_path / "a" / "b", folder):
        assert _mode(d) == 0o700, d
    (tmp_path / "file").write_text("")
    with pytest.raises(NotADirectoryError):  # as mkdir would say, not "untrusted"
        private_dir(tmp_path / "file")


@pytest.mark.parametrize("mode", [0o777, 0o770, 0o1777, 0o722])
def test_a_folder_others_can_write_is_refused(tmp_path: Path, mode: int) -> None:
    folder = tmp_path / "shared"
    folder.mkdir()
    folder.chmod(mode)
    with pytest.raises(UntrustedPathError, match="other users can write it") as exc:
        check_private_dir(folder)
    assert str(folder) in str(exc.value) and f"mode {mode:o}" in str(exc.value)


def test_a_folder_above_that_others_can_write_is_refused_unless_sticky(tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    folder = shared / "mine"
    folder.mkdir(parents=True)
    shared.chmod(0o777)  # others could rename "mine" away and put theirs in its place
    with pytest.raises(UntrustedPathError, match=f"{shared} above it: other users can write"):
        check_private_dir(folder)
    shared.chmod(0o1777)  # sticky, like /tmp: only the owner renames "mine"
    check_private_dir(folder)


def test_a_symlink_in_a_shared_folder_is_refused(tmp_path: Path) -> None:
    mine = tmp_path / "mine"
    mine.mkdir()
    shared = tmp_path / "shared"
    shared.mkdir()
    (shared / "link").symlink_to(mine)
    check_private_dir(shared / "link")
    shared.chmod(0o777)  # whoever may write it may point the link elsewhere
    with pytest.raises(UntrustedPathError, match="above it: other users can write"):
        check_private_dir(shared / "link")


@needs_root
def test_a_folder_another_user_owns_is_refused(tmp_path: Path) -> None:
    folder = tmp_path / "theirs"
    folder.mkdir(mode=0o700)
    os.chown(folder, OTHER_UID, -1)
    with pytest.raises(UntrustedPathError, match=f"another user owns it .*uid {OTHER_UID}"):
        check_private_dir(folder)
    parent = tmp_path / "their-parent"
    (parent / "mine").mkdir(parents=True, mode=0o700)
    os.chown(parent, OTHER_UID, -1)
    with pytest.raises(UntrustedPathError, match=f"{parent} above it: another user owns it"):
        check_private_dir(parent / "mine")


# --------------------------------------------------------------------------- the graph cache
def test_new_graph_cache_folders_are_private(cache_on: Path) -> None:
    trainer = _trainer()
    _step(trainer)
    entries = sorted(cache_on.rglob("*.pkl"))
    assert entries
    for d in [cache_on, cache_on.parent, cache_on.parent.parent, *{e.parent for e in entries}]:
        assert _mode(d) == 0o700, d
    assert all(_mode(e) == 0o600 for e in entries)


@pytest.mark.parametrize("how", ["option", "environment"])
def test_a_graph_cache_folder_others_can_write_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, how: str
) -> None:
    """A folder the user named: one line naming it, at construction; nothing written."""
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    monkeypatch.setenv("ORTRAIN_GRAPH_CACHE", "1")  # the suite's default is off
    if how == "option":
        options = {"graph_cache": str(shared)}
    else:
        monkeypatch.setenv("ORTRAIN_GRAPH_CACHE", str(shared))
        options = {}
    with pytest.raises(UntrustedPathError, match="other users can write it") as exc:
        _trainer(**options)
    assert str(shared) in str(exc.value) and "\n" not in str(exc.value)
    assert not list(shared.iterdir())


@needs_root
def test_a_graph_cache_folder_another_user_owns_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ORTRAIN_GRAPH_CACHE", "1")
    theirs = tmp_path / "theirs"
    theirs.mkdir(mode=0o700)
    os.chown(theirs, OTHER_UID, -1)
    with pytest.raises(UntrustedPathError, match="another user owns it"):
        _trainer(graph_cache=str(theirs))


def test_a_default_graph_cache_folder_others_can_write_warns_and_trains(cache_on: Path) -> None:
    """The folder nobody chose: training goes on, without the cache, and says so."""
    cache_on.mkdir(parents=True)
    cache_on.chmod(0o777)
    refused = f"without the graph cache: .*{cache_on}: other users can write"
    with pytest.warns(UserWarning, match=refused):
        trainer = _trainer()
    loss = _step(trainer)
    assert not list(cache_on.iterdir())
    cache_on.chmod(0o700)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        assert _step(_trainer()) == loss  # the same graph, built (and now kept)
    assert list(cache_on.rglob("*.pkl"))


@pytest.mark.parametrize("how", ["group-writable", "symlink", "another-owner"])
def test_a_graph_cache_entry_others_could_have_written_is_built_again(
    cache_on: Path, tmp_path: Path, how: str
) -> None:
    """An entry with a valid content hash that another user wrote or could have written is
    never unpickled: the graph is built again, the entry replaced by this user's."""
    if how == "another-owner" and os.getuid() != 0:
        pytest.skip("chown to another user needs root")
    loss = _step(_trainer())
    entries = sorted(cache_on.rglob("*.pkl"))
    for entry in entries:
        if how == "group-writable":
            entry.chmod(0o664)
        elif how == "another-owner":
            os.chown(entry, OTHER_UID, -1)
        else:
            elsewhere = tmp_path / entry.name
            entry.rename(elsewhere)
            entry.symlink_to(elsewhere)
    with pytest.warns(UserWarning, match="graph cache entry .* is not trusted") as warned:
        trainer = _trainer()
        assert _step(trainer) == loss
    assert trainer.cache_hits == 0
    assert str(entries[0]) in str(warned[0].message) or str(entries[1]) in str(warned[0].message)
    for entry in entries:  # rewritten by this user: trusted again
        assert not entry.is_symlink() and entry.stat().st_uid == os.getuid()
        assert _mode(entry) == 0o600
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        trainer = _trainer()
        _step(trainer)
    assert trainer.cache_hits == 1
