"""Build hook for the fused kernels; the package metadata lives in pyproject.toml.

``ORTRAIN_BUILD_CUDA=1 pip install .`` also runs CMake on ``CMakeLists.txt`` (a CUDA
toolkit is then required) and ships ``libortrain_kernels_{cpu,cuda}.so`` in
``ortrain/runtime/``, where ``ortrain.runtime.kernels`` finds them. An editable install
(``pip install -e .``) leaves them in ``<repo>/build/``, which the loader also searches.
Without the variable this file adds nothing to a plain install.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py
from setuptools.dist import Distribution

ROOT = Path(__file__).resolve().parent
BUILD_DIR = ROOT / "build"  # the loader's fallback folder, so editable installs find it
LIBRARIES = ("libortrain_kernels_cpu.so", "libortrain_kernels_cuda.so")


def _wanted() -> bool:
    return os.environ.get("ORTRAIN_BUILD_CUDA", "") == "1"


def build_kernels() -> list[Path]:
    cmake = shutil.which("cmake")
    if cmake is None:
        raise RuntimeError("ORTRAIN_BUILD_CUDA=1 needs cmake (>= 3.18) on PATH")
    subprocess.run(
        [cmake, "-S", str(ROOT), "-B", str(BUILD_DIR), "-DCMAKE_BUILD_TYPE=Release"], check=True
    )
    subprocess.run([cmake, "--build", str(BUILD_DIR), "--parallel"], check=True)
    if not (BUILD_DIR / LIBRARIES[1]).is_file():
        raise RuntimeError(
            "ORTRAIN_BUILD_CUDA=1 but CMake found no CUDA toolkit: put nvcc on PATH "
            "(or set CUDACXX) and reinstall"
        )
    return [BUILD_DIR / name for name in LIBRARIES]


class BuildPyWithKernels(build_py):
    def run(self) -> None:
        super().run()
        if not _wanted():
            return
        libraries = build_kernels()
        if not self.editable_mode:  # a wheel: the libraries go inside the package
            dest = Path(self.build_lib) / "ortrain" / "runtime"
            for lib in libraries:
                shutil.copy2(lib, dest / lib.name)


class KernelDistribution(Distribution):
    def has_ext_modules(self) -> bool:  # a wheel holding the .so files is platform-specific
        return _wanted()


setup(cmdclass={"build_py": BuildPyWithKernels}, distclass=KernelDistribution)
