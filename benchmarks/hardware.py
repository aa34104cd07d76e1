"""What CPU a benchmark ran on, for its footer: ratios against PyTorch depend on it.

The machine kind behind this project has been an AMD EPYC with AVX2 only, one with
AVX-512, and an Intel Xeon with AVX-512 and AMX; ONNX Runtime's GEMMs (MLAS) and
torch's (MKL / oneDNN) gain differently from each, so a speedup is only comparable
with one measured on the same CPU model.
"""

from __future__ import annotations

import os
import platform

_FEATURES = ("avx2", "avx512f", "avx512_bf16", "avx512_fp16", "amx_tile")


def cpu_description() -> str:
    """'Intel(R) Xeon(R) Processor, 2 CPUs, avx2 avx512f amx_tile' (Linux), or what
    ``platform`` knows elsewhere."""
    name, flags = platform.processor() or platform.machine(), set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip()
                if key == "model name":
                    name = value.strip()
                elif key == "flags":
                    flags = set(value.split())
                    break
    except OSError:
        pass
    have = " ".join(f for f in _FEATURES if f in flags) or "no AVX2"
    return f"{name}, {os.cpu_count()} CPUs, {have}"
