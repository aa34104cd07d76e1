"""Folders ortrain trusts and files it writes beside a target (docs/security.md).

ortrain loads code and graphs from folders of its own (the graph cache, the development
build of the CPU op library) and writes checkpoints and artifacts into folders users
choose, sometimes shared ones. Two rules keep another user of the machine out:

1. **Trusted folders.** A folder ortrain reads code or graphs from must be writable by
   this user alone: owned by this user, not group- or other-writable (a sticky bit does
   not help here: another user could still add an entry). Each folder above it must be
   owned by this user or root and, where group- or other-writable, sticky (``/tmp``): else
   its other writers could rename the folder away and put their own in its place.
   ``private_dir`` creates the missing folders 0700 and checks the result;
   ``untrusted_file`` checks an entry opened inside such a folder.
2. **No fixed temporary names.** A file written beside its target goes to a new file of a
   random name made with ``O_CREAT | O_EXCL`` (``tempfile.mkstemp``), never an existing
   path, so a symlink planted at a predictable name (``<name>.tmp``) is never followed;
   it is synced and renamed over the target (``atomic_write``), and removed on any failure.
   A set of files (``write_folder``) goes to a new folder beside their folder first.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import stat
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

from ortrain.core.errors import OrtrainError

_OTHERS_WRITE = stat.S_IWGRP | stat.S_IWOTH


class UntrustedPathError(OrtrainError, PermissionError):
    """A folder or file that another user could write, where ortrain reads code or graphs."""


def _who(st: os.stat_result) -> str:
    return f"mode {stat.S_IMODE(st.st_mode):o}, owner uid {st.st_uid}"


def untrusted_folder(st: os.stat_result) -> str | None:
    """Why a folder with status ``st`` is not this user's alone; None: it is."""
    if not stat.S_ISDIR(st.st_mode):
        return "it is not a folder"
    if st.st_uid != os.getuid():
        return f"another user owns it ({_who(st)})"
    if st.st_mode & _OTHERS_WRITE:
        return f"other users can write it ({_who(st)})"
    return None


def untrusted_file(st: os.stat_result) -> str | None:
    """Why a file with status ``st`` (from ``fstat`` / ``lstat``: a symlink is refused) is
    not this user's alone; None: it is."""
    if not stat.S_ISREG(st.st_mode):
        return "it is not a regular file"
    if st.st_uid != os.getuid():
        return f"another user owns it ({_who(st)})"
    if st.st_mode & _OTHERS_WRITE:
        return f"other users can write it ({_who(st)})"
    return None


def _untrusted_parent(st: os.stat_result) -> str | None:
    """Why a folder above a trusted one lets another user replace what is below it."""
    if st.st_uid not in (os.getuid(), 0):
        return f"another user owns it ({_who(st)})"
    if st.st_mode & _OTHERS_WRITE and not st.st_mode & stat.S_ISVTX:
        return f"other users can write it and it is not sticky ({_who(st)})"
    return None


def check_private_dir(folder: Path) -> None:
    """Raise ``UntrustedPathError`` naming the path and why, unless ``folder`` (an existing
    folder) and every folder above it follow rule 1 of the module docstring: the folders
    above both the path as given and the path its symlinks resolve to (a symlink is
    replaced by whoever may write the folder it sits in)."""
    absolute = Path(os.path.abspath(folder))
    real = absolute.resolve(strict=True)
    why = untrusted_folder(os.stat(real))
    if why is not None:
        raise UntrustedPathError(f"refusing the folder {folder}: {why}")
    above = dict.fromkeys([*absolute.parents, *real.parents])
    for path in [absolute, *above]:
        st = os.lstat(path)
        if stat.S_ISLNK(st.st_mode):  # a link's own mode means nothing: who made it
            why = None if st.st_uid in (os.getuid(), 0) else f"a symlink of uid {st.st_uid}"
        else:
            why = None if path == absolute else _untrusted_parent(st)
        if why is not None:
            where = "" if path == absolute else f"{path} above it: "
            raise UntrustedPathError(f"refusing the folder {folder}: {where}{why}")


def private_dir(folder: Path) -> Path:
    """``folder``, its missing folders created 0700, checked (``check_private_dir``).
    Raises ``UntrustedPathError``, or ``OSError`` where it cannot be created."""
    missing = []
    for d in (folder, *folder.parents):
        if d.exists():
            break
        missing.append(d)
    for d in reversed(missing):
        with contextlib.suppress(FileExistsError):  # another process made it meanwhile
            d.mkdir(mode=0o700)
    if not folder.is_dir():  # a file there: the OSError mkdir would have raised
        raise NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR), str(folder))
    check_private_dir(folder)
    return folder


def umask() -> int:
    """The process's umask, read without changing it (another thread could create a file
    while it is changed); where /proc cannot tell, the usual 022."""
    with contextlib.suppress(OSError, ValueError):
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    return 0o022


def atomic_write(
    path: str | os.PathLike, write: Callable[[BinaryIO], object], *, private: bool = False
) -> None:
    """``write(f)`` into a new temporary file beside ``path``, synced, then renamed over
    ``path`` (rule 2 of the module docstring). The file gets the mode ``open()`` would
    have given it, or 0600 where ``private``. Any failure removes the temporary file and
    re-raises; what was at ``path`` stays as it was."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            if not private:
                os.fchmod(f.fileno(), 0o666 & ~umask())
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def write_folder(out: Path, write: Callable[[Path], object], *, last: str) -> None:
    """``write(folder)`` into a new private folder beside ``out``; then, where ``out`` does
    not exist, that folder renamed to ``out`` (one step); else each of its files renamed
    into ``out``, ``last`` (the file that makes the set usable: a manifest) removed first
    and moved last, so an interrupted swap leaves a set without it rather than a mix. A
    failure before the swap leaves ``out`` as it was; other files in ``out`` stay; a link
    planted at a file's name is replaced, never followed."""
    base = out.resolve().parent if out.exists() else out.parent
    base.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=base, prefix=f".{out.name}.", suffix=".tmp"))
    try:
        write(tmp)
        if not out.exists() and not out.is_symlink():
            tmp.chmod(0o777 & ~umask())  # what mkdir would have made
            os.rename(tmp, out)
            return
        names = sorted(p.name for p in tmp.iterdir() if p.name != last)
        (out / last).unlink(missing_ok=True)
        for name in [*names, last]:
            os.replace(tmp / name, out / name)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
