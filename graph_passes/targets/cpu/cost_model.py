"""The CPU target's cost model: every tuned threshold of the ``ortrain.cpu`` / ``ortrain.blas``
lowerings in one frozen record, and the machine facts it is built from.

A lowering decides from a ``CpuCostModel`` and from what the graph states (shapes, dtypes,
constants, the tags of ``infra/tags.py``), never from a guess about what a tensor is. The
thresholds were picked by measuring on a few CPUs (``docs/benchmarks``); they are starting
points, not facts about every CPU, so:

1. ``CpuCostModel.for_machine(facts=None)`` is the one constructor. Without ``facts`` it
   reads this machine's (``CpuFacts.read``: ISA level, vector width, L1 / L2 sizes, the
   cores this process may run on; safe defaults where the system does not say).
2. A value that follows from a fact is computed from it (``aliasing_stride``: the L1 way
   size), not written down.
3. ``ORTRAIN_CPU_COST="field=value,..."`` overrides thresholds by name (retuning on another
   CPU without editing code; the builds of a forked child see it too). An unknown field or
   a bad value is an error naming it.

Not here: kernel ABI limits (what the C kernels accept: ``elementwise.MAX_SUM``,
``split_concat.MAX_PARTS``, ``update_in_backward.MAX_AFTER``) stay next to the lowering
that meets the kernel's contract; they are not tuning.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from pathlib import Path

__all__ = ["COST_ENV", "CpuCostModel", "CpuFacts", "cost_or_default"]

COST_ENV = "ORTRAIN_CPU_COST"
_CACHE = Path("/sys/devices/system/cpu/cpu0/cache")
_CPUINFO = Path("/proc/cpuinfo")
# (ISA level, vector bytes), best first: the first whose flags the CPU has
_ISA = (("avx512", ("avx512f",), 64), ("avx2", ("avx2", "fma"), 32), ("avx", ("avx",), 32))


@dataclasses.dataclass(frozen=True)
class CpuFacts:
    """What the machine is, as read from it (or given, to model another machine)."""

    isa: str = "sse"  # widest vector ISA the CPU reports: "avx512", "avx2", "avx", "sse"
    vector_bytes: int = 16  # bytes of one vector register of that ISA
    l1d_bytes: int = 32 * 1024  # level-1 data cache of one core
    l1d_ways: int = 8  # its associativity
    l2_bytes: int = 1024 * 1024  # level-2 cache of one core
    cores: int = 1  # CPUs this process may run on (its affinity mask)

    @staticmethod
    @functools.cache
    def read() -> CpuFacts:
        """This machine's facts; a default stands wherever the system does not say."""
        default = CpuFacts()
        isa, vector = _isa(_cpu_flags())
        l1d, ways, l2 = _caches()
        return CpuFacts(
            isa=isa or default.isa,
            vector_bytes=vector or default.vector_bytes,
            l1d_bytes=l1d or default.l1d_bytes,
            l1d_ways=ways or default.l1d_ways,
            l2_bytes=l2 or default.l2_bytes,
            cores=_cores() or default.cores,
        )


@dataclasses.dataclass(frozen=True)
class CpuCostModel:
    """Every tuned threshold of the CPU lowerings, and the facts they were derived for."""

    facts: CpuFacts = CpuFacts()
    # products of fewer flops (2 M N K) stay on ONNX Runtime's GEMM: the BLAS op's gain is
    # smaller than what waking its own thread team costs the ops around the product
    gemm_min_flops: float = 1e8
    # the same trade for one batched product (all its matrices' flops together), whose
    # operand transposes folding into the op pays below the plain GEMM's threshold
    batch_matmul_min_flops: float = 1e7
    # element-wise outputs smaller than this stay on ONNX Runtime's inline loop: handing
    # them to the kernels' thread team costs more than the loop
    elementwise_min_elements: int = 1 << 16
    # a loss head's dense Softmax moves to ortrain's kernel from this row length: shorter
    # rows run faster on ONNX Runtime's exp, longer ones are memory-bound on both and gain
    # from running on the products' threads
    softmax_loss_min_row: int = 4096
    # a weight gradient of this many rows or more is made transposed (dW^T) for its update:
    # the faster product orientation pays for the transposed read only on tall gradients
    transposed_grad_min_rows: int = 16384

    @property
    def aliasing_stride(self) -> int:
        """Bytes apart at which rows map to the same L1 set (its way size): a product
        reading rows a multiple of this apart evicts its own panels."""
        return max(self.facts.l1d_bytes // max(self.facts.l1d_ways, 1), 1)

    def key(self) -> str:
        """What the lowerings read (the thresholds and the aliasing stride), for the graph
        cache's key: facts no lowering reads (the core count, the ISA) change no graph."""
        thresholds = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        del thresholds["facts"]
        return repr(sorted({**thresholds, "aliasing_stride": self.aliasing_stride}.items()))

    @classmethod
    def for_machine(cls, facts: CpuFacts | None = None) -> CpuCostModel:
        """The model for ``facts`` (None: this machine's), with ``ORTRAIN_CPU_COST``'s
        overrides applied."""
        model = cls(facts=facts if facts is not None else CpuFacts.read())
        return dataclasses.replace(model, **_overrides(os.environ.get(COST_ENV, "")))


def cost_or_default(cost: CpuCostModel | None) -> CpuCostModel:
    """``cost``, or this machine's model where a lowering was given none."""
    return cost if cost is not None else CpuCostModel.for_machine()


def _overrides(spec: str) -> dict[str, float | int]:
    """``"field=value,..."`` -> {field: value of the field's type}."""
    fields = {f.name: f for f in dataclasses.fields(CpuCostModel) if f.name != "facts"}
    out: dict[str, float | int] = {}
    for item in filter(None, (s.strip() for s in spec.split(","))):
        name, _, text = item.partition("=")
        name = name.strip()
        if name not in fields:
            raise ValueError(
                f"{COST_ENV}: unknown threshold {name!r} (known: {', '.join(sorted(fields))})"
            )
        kind = int if fields[name].type in (int, "int") else float
        try:
            number = float(text)
        except ValueError:
            raise ValueError(f"{COST_ENV}: {name}={text.strip()!r} is not a number") from None
        if kind is int and not number.is_integer():
            raise ValueError(f"{COST_ENV}: {name}={text.strip()!r} is not a whole number")
        value = kind(number)
        if value < 0:
            raise ValueError(f"{COST_ENV}: {name}={text.strip()!r} is negative")
        out[name] = value
    return out


def _cpu_flags() -> set[str]:
    try:
        text = _CPUINFO.read_text()
    except OSError:
        return set()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "flags":
            return set(value.split())
    return set()


def _isa(flags: set[str]) -> tuple[str | None, int | None]:
    for name, needed, vector in _ISA:
        if all(f in flags for f in needed):
            return name, vector
    return None, None


def _size(text: str) -> int | None:
    """sysfs cache sizes: "48K", "1024K", "32M"."""
    text = text.strip()
    scale = {"K": 1024, "M": 1024 * 1024, "G": 1024**3}.get(text[-1:].upper(), 1)
    digits = text[:-1] if scale != 1 else text
    return int(digits) * scale if digits.isdigit() else None


def _caches() -> tuple[int | None, int | None, int | None]:
    """(L1 data bytes, L1 data ways, L2 bytes) of cpu0, None where sysfs does not say."""
    l1d = ways = l2 = None
    try:
        entries = sorted(_CACHE.glob("index*"))
    except OSError:
        return None, None, None
    for entry in entries:
        try:
            level = int((entry / "level").read_text())
            kind = (entry / "type").read_text().strip()
            size = _size((entry / "size").read_text())
            assoc = (entry / "ways_of_associativity").read_text().strip()
        except (OSError, ValueError):
            continue
        if level == 1 and kind in ("Data", "Unified"):
            l1d, ways = size, int(assoc) if assoc.isdigit() and int(assoc) > 0 else None
        elif level == 2 and kind in ("Data", "Unified"):
            l2 = size
    return l1d, ways, l2


def _cores() -> int | None:
    try:
        return len(os.sched_getaffinity(0)) or None
    except (AttributeError, OSError):
        return os.cpu_count()
