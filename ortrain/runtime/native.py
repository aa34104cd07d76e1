"""The one loader of ortrain's native libraries (all built by ``CMakeLists.txt``).

``pip install .``, ``pip install -e .`` and ``pip wheel .`` build them (scikit-build-core)
into the package ``ortrain._native``; ``ORTRAIN_NATIVE_DIR`` points the loader at another
folder instead (a ``cmake -S . -B build`` build, say). Every library exports an ABI number
that ``load`` checks before anything else is called, so a stale, foreign or corrupt file
gives one ``NativeLibraryError`` line naming it, never a crash: callers given ``"auto"``
then fall back (with a warning), callers given an explicit option raise it.

The CPU op library comes in one variant per instruction set (``ISAS``); ``cpu_isa()``
picks the widest the running CPU has, once, from its cpuid flags (``/proc/cpuinfo``), or
what ``ORTRAIN_CPU_ISA`` names.
"""

from __future__ import annotations

import ctypes
import functools
import importlib.util
import os
import platform
import struct
from pathlib import Path

from ortrain.core.errors import OrtrainError

PACKAGE = "ortrain._native"
ISAS = ("baseline", "avx2", "avx512")
# The cpuid flags each variant's compiler flags (CMakeLists.txt: ISA_FLAGS_*) assume.
ISA_CPU_FLAGS = {
    "baseline": frozenset(),
    "avx2": frozenset({"avx2", "fma", "f16c"}),
    "avx512": frozenset({"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512dq"}),
}
ISA_ENV = "ORTRAIN_CPU_ISA"
DIR_ENV = "ORTRAIN_NATIVE_DIR"


class NativeLibraryError(OrtrainError):
    """A native library is missing, cannot be loaded or built, has the wrong ABI version,
    or reported a failure."""


# --------------------------------------------------------------------------- the CPU


def _x86() -> bool:
    return platform.machine().lower() in ("x86_64", "amd64")


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The running CPU's feature flags as the kernel reports them (those the OS enabled)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return frozenset(line.partition(":")[2].split())
    except OSError:
        pass
    return frozenset()


def supported_isas() -> list[str]:
    """The variants this CPU can run, narrowest first."""
    if not _x86():
        return ["baseline"]
    flags = cpu_flags()
    return [isa for isa in ISAS if ISA_CPU_FLAGS[isa] <= flags]


def cpu_isa() -> str:
    """The CPU op variant to load: ``$ORTRAIN_CPU_ISA`` where set (one that this CPU cannot
    run is refused: it would die of an illegal instruction), else the widest supported."""
    asked = os.environ.get(ISA_ENV, "").strip().lower()
    supported = supported_isas()
    if not asked or asked == "auto":
        return supported[-1]
    if asked not in ISAS:
        raise NativeLibraryError(f"{ISA_ENV}={asked!r}: use one of auto, {', '.join(ISAS)}")
    if asked not in supported:
        missing = sorted(ISA_CPU_FLAGS[asked] - cpu_flags()) if _x86() else ["x86-64"]
        raise NativeLibraryError(
            f"{ISA_ENV}={asked}: this CPU lacks {', '.join(missing)} (it runs "
            f"{', '.join(supported)})"
        )
    return asked


# --------------------------------------------------------------------------- finding


def installed_dirs() -> list[Path]:
    """The folders of the installed ``ortrain._native`` package (one, or in an editable
    install the build's copy in site-packages); empty when ortrain runs from a source tree
    that was never installed."""
    try:
        spec = importlib.util.find_spec(PACKAGE)
    except (ImportError, ValueError):
        return []
    if spec is None:
        return []
    return [Path(p) for p in spec.submodule_search_locations or []]


def library_dirs() -> list[Path]:
    """Where libraries are looked for: ``$ORTRAIN_NATIVE_DIR`` alone where set, else the
    installed package."""
    override = os.environ.get(DIR_ENV)
    return [Path(override)] if override else installed_dirs()


def find(name: str, dirs: list[Path] | None = None) -> Path | None:
    """The first ``name`` in ``dirs`` (default ``library_dirs()``), or None."""
    for d in library_dirs() if dirs is None else dirs:
        if (d / name).is_file():
            return d / name
    return None


# --------------------------------------------------------------------------- loading


def _first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0]


# ELF header fields by class (1: 32-bit, 2: 64-bit): (header size, where e_phoff and
# e_shoff sit and their format, where e_phentsize..e_shnum sit, a program header's
# p_offset and p_filesz as one struct format)
_ELF = {
    1: (52, 0x1C, "II", 0x2A, "4xI8xI"),
    2: (64, 0x20, "QQ", 0x36, "8xQ16xQ"),
}


def elf_size(data: bytes) -> int | None:
    """The bytes an ELF file needs by its own headers: its header, the ends of its program
    and section header tables and of each program segment's bytes; None where ``data`` is
    no ELF file (the loader's own error then says what it is)."""
    if data[:4] != b"\x7fELF" or len(data) < 6 or data[4] not in _ELF or data[5] not in (1, 2):
        return None
    header, offsets_at, offsets, sizes_at, segment = _ELF[data[4]]
    if len(data) < header:
        return header
    order = "<" if data[5] == 1 else ">"
    phoff, shoff = struct.unpack_from(order + offsets, data, offsets_at)
    phentsize, phnum, shentsize, shnum = struct.unpack_from(order + "HHHH", data, sizes_at)
    table_end = phoff + phentsize * phnum
    need = max(header, table_end, shoff + shentsize * shnum if shnum else 0)
    if table_end <= len(data):
        for i in range(phnum):
            offset, size = struct.unpack_from(order + segment, data, phoff + i * phentsize)
            need = max(need, offset + size)
    return need


def _check_whole(path: Path) -> None:
    """Refuse an ELF file shorter than its own headers say (an interrupted copy, a full
    disk): the loader would map pages past its end, and the first read of one kills the
    process with SIGBUS, no Python error, no message."""
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise NativeLibraryError(f"{path}: cannot be read: {_first_line(exc)}") from None
    need = elf_size(data)
    if need is not None and need > len(data):
        raise NativeLibraryError(
            f"{path}: truncated ({len(data)} bytes, its ELF headers need {need}): an "
            "interrupted copy or a full disk; reinstall ortrain (pip install .) or rebuild it"
        )


def load(path: Path, abi_symbol: str, abi_version: int) -> ctypes.CDLL:
    """Loads ``path`` and checks that ``abi_symbol()`` returns ``abi_version``; raises
    ``NativeLibraryError`` (one line, naming the file) otherwise."""
    _check_whole(path)
    try:
        lib = ctypes.CDLL(str(path))
    except OSError as exc:  # not an ELF file, truncated, a missing dependency
        raise NativeLibraryError(f"{path}: cannot be loaded: {_first_line(exc)}") from None
    try:
        fn = getattr(lib, abi_symbol)
    except AttributeError:
        raise NativeLibraryError(
            f"{path}: not an ortrain library of this version (no {abi_symbol}); reinstall ortrain"
        ) from None
    fn.restype, fn.argtypes = ctypes.c_int, []
    version = fn()
    if version != abi_version:
        raise NativeLibraryError(
            f"{path}: ABI version {version}, expected {abi_version}: a stale build; reinstall "
            "ortrain (pip install .) or rebuild it"
        )
    return lib
