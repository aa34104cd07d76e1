"""The onnxruntime-gpu handoff (scripts/device/): chunk -> transfer -> join -> verify ->
install, rehearsed with a small stand-in wheel into a scratch prefix; a missing or a
corrupted chunk stops the install with a message naming it."""

from __future__ import annotations

import base64
import hashlib
import os
import shutil
import subprocess
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DEVICE = ROOT / "scripts" / "device"
MODULE = "h6_standin"


def _wheel(where: Path) -> tuple[Path, bytes]:
    """A pure-Python wheel pip installs with --no-index; ~12 KiB of incompressible
    payload so that 4 KiB chunks make several."""
    payload = os.urandom(12 * 1024)
    files = {
        f"{MODULE}/__init__.py": b"from pathlib import Path\n"
        b"DATA = (Path(__file__).parent / 'payload.bin').read_bytes()\n",
        f"{MODULE}/payload.bin": payload,
        f"{MODULE}-0.1.dist-info/METADATA": b"Metadata-Version: 2.1\nName: h6-standin\n"
        b"Version: 0.1\n",
        f"{MODULE}-0.1.dist-info/WHEEL": b"Wheel-Version: 1.0\nGenerator: test\n"
        b"Root-Is-Purelib: true\nTag: py3-none-any\n",
    }
    record = []
    for name, data in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        record.append(f"{name},sha256={digest},{len(data)}")
    record.append(f"{MODULE}-0.1.dist-info/RECORD,,")
    files[f"{MODULE}-0.1.dist-info/RECORD"] = ("\n".join(record) + "\n").encode()
    path = where / f"{MODULE}-0.1-py3-none-any.whl"
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as z:
        for name, data in files.items():
            z.writestr(name, data)
    return path, payload


def _run(cmd: list[str], cwd: Path, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        cmd, cwd=cwd, env={**os.environ, **env}, capture_output=True, text=True, timeout=300
    )


@pytest.fixture
def prepared(tmp_path):
    """The stand-in wheel prepared in 4 KiB chunks, as prepare-ort-gpu.sh leaves them."""
    wheel, payload = _wheel(tmp_path)
    project = tmp_path / "project"
    project.mkdir()
    done = _run(
        ["bash", str(DEVICE / "prepare-ort-gpu.sh")],
        project,
        ORTGPU_WHEEL=str(wheel),
        ORTGPU_CHUNK="4k",
    )
    assert done.returncode == 0, done.stderr
    return project / ".ortgpu", wheel, payload, done.stdout


def _transfer(chunks: Path, to: Path, skip: int | None = None) -> None:
    """What each transfer does on the GPU machine: its part and MANIFEST into ``to``."""
    to.mkdir(exist_ok=True)
    for folder in sorted(p for p in chunks.iterdir() if p.is_dir()):
        if int(folder.name) == skip:
            continue
        for f in folder.iterdir():
            if f.name.startswith("part_") or f.name == "MANIFEST":
                shutil.copyfile(f, to / f.name)


def _install(chunks: Path, received: Path, prefix: Path) -> subprocess.CompletedProcess:
    last = max(int(p.name) for p in chunks.iterdir() if p.is_dir())
    return _run(
        ["bash", str(chunks / str(last) / "install-ort-gpu.sh")],
        received,
        ORTGPU_CHUNKS=str(received),
        ORTGPU_PREFIX=str(prefix),
        ORTGPU_CHECK=f"import:{MODULE}",
    )


def test_prepare_writes_chunk_folders_with_a_manifest(prepared):
    chunks, wheel, _, stdout = prepared
    folders = sorted(int(p.name) for p in chunks.iterdir() if p.is_dir())
    size = wheel.stat().st_size
    n = -(-size // 4096)
    assert folders == list(range(1, n + 1)) and f"chunks: {n} " in stdout
    manifest = (chunks / "MANIFEST").read_text().splitlines()
    assert manifest[:4] == [
        f"name {wheel.name}",
        f"size {size}",
        f"sha256 {hashlib.sha256(wheel.read_bytes()).hexdigest()}",
        f"chunks {n}",
    ]
    joined = b""
    for k, line in zip(folders, manifest[4:], strict=True):
        _, part, psize, sha = line.split()
        data = (chunks / str(k) / part).read_bytes()
        assert (len(data), hashlib.sha256(data).hexdigest()) == (int(psize), sha)
        assert {p.name for p in (chunks / str(k)).iterdir()} == {
            part,
            "MANIFEST",
            "install-ort-gpu.sh",
        }
        joined += data
    assert joined == wheel.read_bytes()


def test_default_parts_fit_one_transfer_beside_the_working_tree(tmp_path):
    """Without ORTGPU_CHUNK, a chunk folder (part, MANIFEST, install script) plus the
    working tree that travels with every call fits the transfer limit (scaled down here:
    a 64 KiB limit, a 20 KiB tree), and the parts are as large as that allows."""
    wheel, _ = _wheel(tmp_path)  # ~12 KiB: pad it so that it needs several parts
    with wheel.open("ab") as f:
        f.write(os.urandom(150 * 1024))
    project = tmp_path / "project"
    project.mkdir()
    subprocess.run(["git", "init", "-q", str(project)], check=True)
    (project / "tracked.bin").write_bytes(os.urandom(12 * 1024))
    (project / "untracked.bin").write_bytes(os.urandom(8 * 1024))  # travels too
    (project / ".gitignore").write_text("/.ortgpu/\n")
    subprocess.run(["git", "-C", str(project), "add", "tracked.bin"], check=True)
    limit = 64 * 1024
    done = _run(
        ["bash", str(DEVICE / "prepare-ort-gpu.sh")],
        project,
        ORTGPU_WHEEL=str(wheel),
        ORTGPU_LIMIT=str(limit),
    )
    assert done.returncode == 0, done.stderr
    tree = sum(p.stat().st_size for p in project.iterdir() if p.is_file())
    folders = [p for p in (project / ".ortgpu").iterdir() if p.is_dir()]
    sizes = [sum(f.stat().st_size for f in d.iterdir()) for d in folders]
    parts = [f.stat().st_size for d in folders for f in d.glob("part_*")]
    script = (DEVICE / "install-ort-gpu.sh").stat().st_size
    # the limit less the tree, the script, the MANIFEST's allowance and 1/256 to spare
    assert max(parts) == limit - tree - script - 4096 - limit // 256
    assert len(parts) == len(folders) == -(-wheel.stat().st_size // max(parts))
    assert all(tree + size < limit for size in sizes), (tree, sizes)
    # a tree that leaves no room is refused, naming the sizes
    (project / "untracked.bin").write_bytes(os.urandom(64 * 1024))
    done = _run(
        ["bash", str(DEVICE / "prepare-ort-gpu.sh")],
        project,
        ORTGPU_WHEEL=str(wheel),
        ORTGPU_LIMIT=str(limit),
    )
    assert done.returncode == 2 and "leaves no room for a part" in done.stderr


def test_join_verify_install_into_a_scratch_prefix(prepared, tmp_path):
    chunks, _, payload, _ = prepared
    received, prefix = tmp_path / "received", tmp_path / "site"
    _transfer(chunks, received)
    done = _install(chunks, received, prefix)
    assert done.returncode == 0, done.stderr
    assert f"{MODULE} imports from {prefix}" in done.stdout
    assert (prefix / MODULE / "payload.bin").read_bytes() == payload


def test_a_missing_chunk_is_named(prepared, tmp_path):
    chunks, _, _, _ = prepared
    received = tmp_path / "received"
    _transfer(chunks, received, skip=2)
    done = _install(chunks, received, tmp_path / "site")
    assert done.returncode == 3
    assert "missing chunk(s) part_01 in" in done.stderr and "1 of " in done.stderr
    assert not (tmp_path / "site").exists()


def test_a_corrupted_chunk_is_named(prepared, tmp_path):
    chunks, _, _, _ = prepared
    received = tmp_path / "received"
    _transfer(chunks, received)
    part = received / "part_02"
    data = bytearray(part.read_bytes())
    data[100] ^= 0xFF
    part.write_bytes(bytes(data))
    done = _install(chunks, received, tmp_path / "site")
    assert done.returncode == 4
    assert "corrupted chunk(s)" in done.stderr and "part_02 (4096 of 4096 bytes)" in done.stderr
    assert not (tmp_path / "site").exists()


def test_a_truncated_chunk_is_named(prepared, tmp_path):
    chunks, _, _, _ = prepared
    received = tmp_path / "received"
    _transfer(chunks, received)
    part = received / "part_00"
    part.write_bytes(part.read_bytes()[:1000])
    done = _install(chunks, received, tmp_path / "site")
    assert done.returncode == 4 and "part_00 (1000 of 4096 bytes)" in done.stderr
