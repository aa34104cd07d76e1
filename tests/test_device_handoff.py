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


def test_default_chunks_are_61_mib_four_for_the_wheel():
    """A ~250 MB wheel in four transfers under 64 MiB each, not five of 58 MiB."""
    script = (DEVICE / "prepare-ort-gpu.sh").read_text()
    assert "chunk=${ORTGPU_CHUNK:-61m}" in script
    wheel = 250_000_000
    assert -(-wheel // (61 * 2**20)) == 4 and 61 * 2**20 + 64 * 1024 < 64 * 2**20


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
