"""cuda_kernels/: the CPU reference against torch, the CUDA build, the CUDA kernels against
the CPU reference.

The libraries are built once per session with CMake into temporary folders: the CPU
reference alone (seconds), and CPU + CUDA where nvcc exists (the compile test; what CI can
check without a GPU). GPU tests skip without ``torch.cuda.is_available()``.

Tolerances are fp32's, element by element: 1e-6 relative, plus an absolute 1e-6 of the
tensor's largest magnitude, for elements that cancel towards zero (torch's vectorised
CPU code rounds some steps differently: fused multiply-adds). Flags, skipped steps and
half copies are compared bit for bit.
"""

from __future__ import annotations

import ctypes
import os
import re
import shutil
from pathlib import Path

import pytest
import torch

from ortrain.optim import Lamb
from ortrain.runtime import kernels, native
from tests.conftest import cmake_build as _cmake_build

ROOT = Path(__file__).resolve().parents[1]
NVCC = shutil.which("nvcc") or os.environ.get("CUDACXX")
HAVE_CUDA = torch.cuda.is_available()
needs_gpu = pytest.mark.skipif(not HAVE_CUDA, reason="needs a CUDA GPU (torch.cuda)")

SIZES = [1, 1000, 4099]  # 4099: no multiple of any block or chunk size
HP = dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1)
GRAD_SCALE = 0.37  # not a power of two: the in-kernel unscale rounds
GRAD_DTYPES, GRAD_IDS = [torch.float32, torch.float16, torch.bfloat16], ["g32", "g16", "gbf16"]


@pytest.fixture(scope="session")
def cuda_build(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, float]:
    """A folder with both kernel libraries, the CUDA one compiled by nvcc: the install's,
    where its build found nvcc (``scripts/setup.sh``: CI's fresh install compiles every
    kernel there), else built here (seconds: this build's, 0 for the install's)."""
    if NVCC is None:
        pytest.skip("nvcc not found (PATH, CUDACXX): the CUDA library cannot be built")
    inputs = [*(ROOT / "cuda_kernels").rglob("*"), *(ROOT / "ortrain" / "runtime").glob("*.h")]
    sources = max(f.stat().st_mtime for f in inputs if f.is_file())
    for installed in native.library_dirs():
        built = [installed / name for name in kernels.LIBRARY_NAMES.values()]
        if all(f.is_file() and f.stat().st_mtime > sources for f in built):  # not stale
            return installed, 0.0
    dest = tmp_path_factory.mktemp("kernels_cuda")
    return dest, _cmake_build(dest)


@pytest.fixture
def gpu_kernels(cuda_build: tuple[Path, float], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ORTRAIN_KERNELS_DIR", str(cuda_build[0]))  # holds both libraries
    if not HAVE_CUDA:
        return
    try:  # a toolkit newer than the driver builds fine but cannot run
        kernels.all_finite_sq_norm(torch.ones(1, device="cuda"))
    except kernels.KernelLibraryError as e:
        if "InsufficientDriver" in str(e):
            pytest.skip(f"the driver is older than nvcc's CUDA runtime: {e}")
        raise


def assert_fp32_close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    scale = expected.abs().max().item() if expected.numel() else 0.0
    torch.testing.assert_close(actual, expected, rtol=1e-6, atol=1e-6 * scale)


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _grads(n: int, steps: int, dtype: torch.dtype, seed: int = 1) -> list[torch.Tensor]:
    g = _gen(seed)
    return [torch.randn(n, generator=g).to(dtype) for _ in range(steps)]


# --------------------------------------------------------------------------- Adam / AdamW


def _torch_adam(p0, grads, decoupled, grad_scale=GRAD_SCALE, **hp):
    """torch.optim.AdamW/Adam (single-tensor) on the unscaled gradients."""
    p = p0.clone().requires_grad_()
    cls = torch.optim.AdamW if decoupled else torch.optim.Adam
    opt = cls(
        [p], lr=hp["lr"], betas=(hp["beta1"], hp["beta2"]), eps=hp["eps"],
        weight_decay=hp["weight_decay"], foreach=False,
    )  # fmt: skip
    for g in grads:
        p.grad = g.float() * grad_scale
        opt.step()
    state = opt.state[p]
    return p.detach(), state["exp_avg"], state["exp_avg_sq"]


def _kernel_adam(p0, grads, decoupled, device="cpu", grad_scale=GRAD_SCALE, half=None, **hp):
    p = p0.clone().to(device)
    m, v = torch.zeros_like(p), torch.zeros_like(p)
    half_param = None if half is None else torch.empty(p.numel(), dtype=half, device=device)
    for t, g in enumerate(grads, start=1):
        kernels.adamw_(
            p, g.to(device), m, v, **hp, step=t, grad_scale=grad_scale, half_param=half_param,
            decoupled=decoupled,
        )  # fmt: skip
    return p, m, v, half_param


@pytest.mark.parametrize("decoupled", [True, False], ids=["adamw", "adam_l2"])
@pytest.mark.parametrize("grad_dtype", GRAD_DTYPES[:2], ids=GRAD_IDS[:2])
@pytest.mark.parametrize("n", SIZES)
def test_adam_matches_torch(cpu_kernels, n, grad_dtype, decoupled):
    p0 = torch.randn(n, generator=_gen(0))
    grads = _grads(n, steps=4, dtype=grad_dtype)
    expected = _torch_adam(p0, grads, decoupled, **HP)
    actual = _kernel_adam(p0, grads, decoupled, **HP)[:3]
    for a, e in zip(actual, expected):
        assert_fp32_close(a, e)


def test_adam_bf16_grads_and_large_betas(cpu_kernels):
    """bf16 gradients; beta1 <= 0.5 takes torch's other lerp formula."""
    p0 = torch.randn(1000, generator=_gen(0))
    grads = _grads(1000, steps=3, dtype=torch.bfloat16)
    hp = {**HP, "beta1": 0.3, "beta2": 0.6}
    for a, e in zip(_kernel_adam(p0, grads, True, **hp)[:3], _torch_adam(p0, grads, True, **hp)):
        assert_fp32_close(a, e)


def test_adam_on_a_shard_starting_mid_tensor(cpu_kernels):
    """The shard is a view into a flat buffer; elements outside it are not touched."""
    flat = torch.randn(5000, generator=_gen(0))
    lo, hi = 1234, 1234 + 2049
    grads = _grads(5000, steps=3, dtype=torch.float32)
    p, m, v = flat.clone(), torch.zeros(5000), torch.zeros(5000)
    for t, g in enumerate(grads, start=1):
        kernels.adamw_(p[lo:hi], g[lo:hi], m[lo:hi], v[lo:hi], **HP, step=t, grad_scale=GRAD_SCALE)
    expected = _torch_adam(flat[lo:hi], [g[lo:hi] for g in grads], True, **HP)
    for a, e in zip((p[lo:hi], m[lo:hi], v[lo:hi]), expected):
        assert_fp32_close(a, e)
    outside = torch.cat([torch.arange(lo), torch.arange(hi, 5000)])
    assert torch.equal(p[outside], flat[outside])
    assert not m[outside].any() and not v[outside].any()


def test_adam_grad_scale_as_a_tensor_equals_the_float(cpu_kernels):
    p0 = torch.randn(1000, generator=_gen(0))
    grads = _grads(1000, steps=2, dtype=torch.float16)
    a = _kernel_adam(p0, grads, True, **HP)
    b = _kernel_adam(p0, grads, True, grad_scale=torch.tensor(GRAD_SCALE), **HP)
    for x, y in zip(a[:3], b[:3]):
        assert torch.equal(x, y)


@pytest.mark.parametrize("decoupled", [True, False], ids=["adamw", "adam_l2"])
def test_adam_skips_on_found_inf_bit_for_bit(cpu_kernels, decoupled):
    p, m, v, half = _kernel_adam(
        torch.randn(4099, generator=_gen(0)), _grads(4099, 2, torch.float32), decoupled,
        half=torch.float16, **HP,
    )  # fmt: skip
    before = [t.clone() for t in (p, m, v, half)]
    bad = torch.randn(4099, generator=_gen(5)).half()
    bad[17] = float("inf")
    for flag in (torch.ones(1), torch.tensor(float("nan"))):  # any non-zero value skips
        kernels.adamw_(
            p, bad, m, v, **HP, step=3, found_inf=flag, half_param=half, decoupled=decoupled
        )
        for after, b in zip((p, m, v, half), before):
            assert torch.equal(after, b)
    kernels.adamw_(p, bad, m, v, **HP, step=3, found_inf=torch.zeros(1), decoupled=decoupled)
    assert not torch.equal(p, before[0])  # a zero flag updates (and the inf spreads)


def _conversion_edge_cases() -> torch.Tensor:
    """fp16/bf16 rounding: ties, overflow to inf, subnormals, over a wide range."""
    special = [65504.0, 65519.0, 65520.0, 7e4, 6.1e-5, 6e-8, 2.9e-8, 3e-8, 1e-9, 1.00048828125,
               1.0009765625 + 2**-11, 3.0e38, 1 + 2**-8, 1 + 3 * 2**-8, float("inf")]  # fmt: skip
    g = _gen(3)
    exponents = torch.empty(4000).uniform_(-10, 6, generator=g)
    wide = torch.randn(4000, generator=g) * torch.pow(10.0, exponents)
    both = torch.tensor(special + [-x for x in special])
    return torch.cat([both, wide])


@pytest.mark.parametrize("half", [torch.float16, torch.bfloat16], ids=["h16", "hbf16"])
def test_adam_half_copy_out_equals_torch_conversion(cpu_kernels, half):
    p0 = _conversion_edge_cases()
    hp = {**HP, "lr": 0.0, "weight_decay": 0.0}  # the parameters keep their edge values
    p, _, _, half_param = _kernel_adam(
        p0, _grads(p0.numel(), 1, torch.float32), True, half=half, **hp
    )
    assert torch.equal(p, p0)
    assert torch.equal(half_param, p.to(half))
    p, _, _, half_param = _kernel_adam(
        p0, _grads(p0.numel(), 2, torch.float32), True, half=half, **HP
    )
    assert torch.equal(half_param, p.to(half))


# --------------------------------------------------------------------------- LAMB

SHAPES = [(7,), (33, 17), (1,), (4099,), (64, 3)]  # sizes 1 .. 4099, one tensor starts at 0


def _lamb_params(zero_tensor: bool = True) -> list[torch.Tensor]:
    g = _gen(0)
    ps = [torch.randn(s, generator=g) for s in SHAPES]
    if zero_tensor:
        ps[2].zero_()  # ||p|| == 0: trust ratio 1
    return ps


def _torch_lamb(params, grads, bias_correction=True, **hp):
    ps = [p.clone().requires_grad_() for p in params]
    opt = Lamb(
        ps, lr=hp["lr"], betas=(hp["beta1"], hp["beta2"]), eps=hp["eps"],
        weight_decay=hp["weight_decay"], bias_correction=bias_correction,
    )  # fmt: skip
    for step_grads in grads:
        for p, g in zip(ps, step_grads):
            p.grad = g.float().view_as(p) * GRAD_SCALE
        opt.step()
    flat = lambda ts: torch.cat([t.reshape(-1) for t in ts])  # noqa: E731
    return (
        flat([p.detach() for p in ps]),
        flat([opt.state[p]["exp_avg"] for p in ps]),
        flat([opt.state[p]["exp_avg_sq"] for p in ps]),
    )


def _lamb_grads(grad_dtype, steps=3):
    n = sum(torch.Size(s).numel() for s in SHAPES)
    return [g.split([torch.Size(s).numel() for s in SHAPES]) for g in _grads(n, steps, grad_dtype)]


@pytest.mark.parametrize("bias_correction", [True, False], ids=["bc", "no_bc"])
@pytest.mark.parametrize("grad_dtype", GRAD_DTYPES[:2], ids=GRAD_IDS[:2])
def test_lamb_matches_torch_per_tensor_trust(cpu_kernels, grad_dtype, bias_correction):
    params, grads = _lamb_params(), _lamb_grads(grad_dtype)
    lengths = [p.numel() for p in params]
    p = torch.cat([t.reshape(-1) for t in params])
    m, v = torch.zeros_like(p), torch.zeros_like(p)
    for t, step_grads in enumerate(grads, start=1):
        g = torch.cat([x.reshape(-1) for x in step_grads])
        kernels.lamb_(
            p, g, m, v, kernels.segment_offsets(lengths), **HP, step=t,
            bias_correction=bias_correction, grad_scale=GRAD_SCALE,
        )  # fmt: skip
    expected = _torch_lamb(params, grads, bias_correction, **HP)
    for a, e in zip((p, m, v), expected):
        assert_fp32_close(a, e)


def _sharded_lamb(p, g, m, v, lengths, cut, step, device="cpu"):
    """Two shards split mid-tensor; the partial norms of the split tensor are summed the
    way an all-reduce would, then both shards apply phase 2."""
    bounds = [0, *torch.tensor(lengths).cumsum(0).tolist()]
    k = next(i for i in range(len(lengths)) if bounds[i] < cut < bounds[i + 1])
    shards = [(0, cut, [*lengths[:k], cut - bounds[k]]),
              (cut, p.numel(), [bounds[k + 1] - cut, *lengths[k + 1 :]])]  # fmt: skip
    updates, norms = [], []
    for lo, hi, seg in shards:
        u = torch.empty(hi - lo, device=device)
        offs = kernels.segment_offsets(seg, device)
        norms.append(kernels.lamb_phase1_(
            p[lo:hi], g[lo:hi], m[lo:hi], v[lo:hi], u, offs, beta1=HP["beta1"],
            beta2=HP["beta2"], eps=HP["eps"], weight_decay=HP["weight_decay"], step=step,
            grad_scale=GRAD_SCALE,
        ))  # fmt: skip
        updates.append(u)
    (p0, u0), (p1, u1) = norms
    whole = p0[-1] + p1[0], u0[-1] + u1[0]  # the split tensor: sum of both partials
    p0[-1], p1[0], u0[-1], u1[0] = whole[0], whole[0], whole[1], whole[1]
    for (lo, hi, seg), u, (ps, us) in zip(shards, updates, norms):
        offs = kernels.segment_offsets(seg, device)
        kernels.lamb_phase2_(p[lo:hi], u, offs, ps, us, lr=HP["lr"])


def test_lamb_sharded_mid_tensor_matches_torch(cpu_kernels):
    params, grads = _lamb_params(), _lamb_grads(torch.float32)
    lengths = [p.numel() for p in params]
    p = torch.cat([t.reshape(-1) for t in params])
    m, v = torch.zeros_like(p), torch.zeros_like(p)
    cut = lengths[0] + lengths[1] + lengths[2] + 1000  # inside the (4099,) tensor
    for t, step_grads in enumerate(grads, start=1):
        _sharded_lamb(p, torch.cat(step_grads), m, v, lengths, cut, t)
    for a, e in zip((p, m, v), _torch_lamb(params, grads, **HP)):
        assert_fp32_close(a, e)


def test_lamb_phase1_norms_and_skip(cpu_kernels):
    params, grads = _lamb_params(zero_tensor=False), _lamb_grads(torch.float32, steps=1)
    lengths = [p.numel() for p in params]
    p = torch.cat([t.reshape(-1) for t in params])
    g = torch.cat(grads[0])
    m, v, u = torch.zeros_like(p), torch.zeros_like(p), torch.empty_like(p)
    offs = kernels.segment_offsets(lengths)
    hp = {k: HP[k] for k in ("beta1", "beta2", "eps", "weight_decay")}
    p_sq, u_sq = kernels.lamb_phase1_(p, g, m, v, u, offs, **hp, step=1, grad_scale=GRAD_SCALE)
    for k, (ps, us) in enumerate(zip(p.split(lengths), u.split(lengths))):
        assert_fp32_close(p_sq[k], ps.double().square().sum().float())
        assert_fp32_close(u_sq[k], us.double().square().sum().float())
    half = p.half()
    before = [t.clone() for t in (p, m, v, u, half)]
    flag = torch.ones(1)
    p_sq, u_sq = kernels.lamb_phase1_(p, g, m, v, u, offs, **hp, step=2, found_inf=flag)
    assert not p_sq.any() and not u_sq.any()
    kernels.lamb_phase2_(p, u, offs, p_sq, u_sq, lr=0.1, found_inf=flag, half_param=half)
    for after, b in zip((p, m, v, u, half), before):
        assert torch.equal(after, b)


@pytest.mark.parametrize("half", [torch.float16, torch.bfloat16], ids=["h16", "hbf16"])
def test_lamb_half_copy_out(cpu_kernels, half):
    params, grads = _lamb_params(), _lamb_grads(torch.float32, steps=1)
    p = torch.cat([t.reshape(-1) for t in params])
    m, v = torch.zeros_like(p), torch.zeros_like(p)
    half_param = torch.empty(p.numel(), dtype=half)
    offsets = [0, *torch.tensor([x.numel() for x in params]).cumsum(0).tolist()]  # a list works
    kernels.lamb_(p, torch.cat(grads[0]), m, v, offsets, **HP, step=1, half_param=half_param)
    assert torch.equal(half_param, p.to(half))


# --------------------------------------------------------------------------- norm


@pytest.mark.parametrize("dtype", GRAD_DTYPES, ids=GRAD_IDS)
@pytest.mark.parametrize("n", [*SIZES, 100_003])
def test_all_finite_sq_norm_matches_torch(cpu_kernels, n, dtype):
    x = (torch.randn(n, generator=_gen(n)) * 3).to(dtype)
    sq, found = kernels.all_finite_sq_norm(x)
    assert sq.dtype == found.dtype == torch.float32 and sq.shape == found.shape == ()
    torch.testing.assert_close(sq, x.double().square().sum().float(), rtol=1e-6, atol=0)
    assert found.item() == 0.0


@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan")])
@pytest.mark.parametrize("dtype", GRAD_DTYPES[:2], ids=GRAD_IDS[:2])
def test_all_finite_sq_norm_flags_non_finite(cpu_kernels, bad, dtype):
    x = torch.randn(4099, generator=_gen(0)).to(dtype)
    x[4098] = bad
    assert kernels.all_finite_sq_norm(x)[1].item() == 1.0
    # written in place into given buffers, the flag reset by a clean pass
    sq, found = torch.empty(()), torch.empty(1)
    kernels.all_finite_sq_norm(x[:4098], sq_norm=sq, found_inf=found)
    assert found.item() == 0.0
    torch.testing.assert_close(sq, x[:4098].double().square().sum().float(), rtol=1e-6, atol=0)


def test_all_finite_sq_norm_over_a_list_and_overflowing_sum(cpu_kernels):
    g = _gen(0)
    ts = [torch.randn(s, generator=g) for s in [(3, 5), (0,), (1,), (4099,), (2, 2, 2)]]
    sq, found = kernels.all_finite_sq_norm(ts)
    whole = torch.cat([t.reshape(-1) for t in ts])
    torch.testing.assert_close(sq, whole.double().square().sum().float(), rtol=1e-6, atol=0)
    assert found.item() == 0.0
    huge = torch.full((4,), 3e19)  # finite elements whose squares overflow fp32
    sq, found = kernels.all_finite_sq_norm(huge)
    assert sq.item() == float("inf") and found.item() == 1.0


# --------------------------------------------------------------------------- errors


def test_arguments_are_validated_by_name(cpu_kernels):
    p, g = torch.zeros(8), torch.zeros(8)
    kw = dict(**HP, step=1)
    with pytest.raises(TypeError, match=re.escape("exp_avg must be torch.float32")):
        kernels.adamw_(p, g, torch.zeros(8, dtype=torch.float16), torch.zeros(8), **kw)
    with pytest.raises(ValueError, match="exp_avg_sq has 7 elements, param has 8"):
        kernels.adamw_(p, g, torch.zeros(8), torch.zeros(7), **kw)
    with pytest.raises(ValueError, match="grad must be 1-D and contiguous"):
        kernels.adamw_(p, torch.zeros(16)[::2], torch.zeros(8), torch.zeros(8), **kw)
    with pytest.raises(TypeError, match="found_inf must be a one-element float32"):
        kernels.adamw_(p, g, torch.zeros(8), torch.zeros(8), **kw, found_inf=torch.zeros(2))
    with pytest.raises(
        TypeError, match=re.escape("half_param must be torch.float16 or torch.bfloat16")
    ):
        kernels.adamw_(p, g, torch.zeros(8), torch.zeros(8), **kw, half_param=torch.zeros(8))
    with pytest.raises(ValueError, match="step is the 1-based step"):
        kernels.adamw_(p, g, torch.zeros(8), torch.zeros(8), **{**kw, "step": 0})
    with pytest.raises(ValueError, match="param is on meta"):
        kernels.adamw_(torch.zeros(8, device="meta"), g, torch.zeros(8), torch.zeros(8), **kw)
    with pytest.raises(
        ValueError, match=re.escape("segment_offsets must ascend from 0 to param.numel")
    ):
        kernels.lamb_(p, g, torch.zeros(8), torch.zeros(8), [0, 5, 4, 8], **kw)
    with pytest.raises(TypeError, match=r"tensors\[1\] is torch.float16"):
        kernels.all_finite_sq_norm([p, g.half()])


def test_c_errors_report_file_and_line(cpu_kernels):
    lib = kernels.library("cpu")
    x = torch.zeros(4)
    ptr = x.data_ptr()
    rc = lib.ortrain_adam(ptr, ptr, 7, ptr, ptr, 4, *[0.1] * 6, 1, 1.0, None, None, None, 0, None)
    assert rc != 0
    assert "adam.cpp:" in lib.ortrain_last_error().decode()
    offsets = torch.tensor([0, 4])
    rc = lib.ortrain_lamb_phase2(
        ptr, ptr, 4, offsets.data_ptr(), 1, ptr, ptr, 0.1, None, ptr, 5, None
    )
    assert rc != 0
    assert re.search(r"lamb\.cpp:\d+: .*dtype code 5", lib.ortrain_last_error().decode())


def test_missing_library_says_how_to_build(monkeypatch, tmp_path):
    monkeypatch.setattr(kernels, "search_dirs", lambda: [tmp_path])
    with pytest.raises(kernels.KernelLibraryError, match=re.escape("cmake -S . -B build")):
        kernels.library("cuda")


# --------------------------------------------------------------------------- CUDA


@pytest.mark.slow
def test_cuda_library_builds_with_nvcc(cuda_build, gpu_kernels):
    """What CI can check without a GPU: nvcc compiles every kernel and the library loads
    (the CUDA runtime is linked statically and only touches the driver when called)."""
    lib_dir, seconds = cuda_build
    print(f"\nCMake + nvcc build of cuda_kernels/: {seconds:.1f} s")
    lib = kernels.library("cuda")
    assert lib.ortrain_kernels_device() == b"cuda"
    assert Path(lib._name).parent == lib_dir
    assert lib.ortrain_lamb_workspace_floats(5000, 3) > 0
    exported = ctypes.CDLL(str(lib_dir / kernels.LIBRARY_NAMES["cuda"]))
    assert not hasattr(exported, "cudaLaunchKernel")  # torch's libcudart is never shadowed


def _both(fn, *args, **kw):
    """``fn(device)`` on the CPU reference and on CUDA; the CUDA results copied back."""
    cpu = fn("cpu", *args, **kw)
    cuda = fn("cuda", *args, **kw)
    return cpu, tuple(t.cpu() for t in cuda)


@needs_gpu
@pytest.mark.parametrize("half", [None, torch.float16, torch.bfloat16], ids=["", "h16", "hbf16"])
@pytest.mark.parametrize("decoupled", [True, False], ids=["adamw", "adam_l2"])
@pytest.mark.parametrize("grad_dtype", GRAD_DTYPES, ids=GRAD_IDS)
@pytest.mark.parametrize("n", [*SIZES, 1_000_003])
def test_gpu_adam_matches_cpu_reference(gpu_kernels, n, grad_dtype, decoupled, half):
    p0 = torch.randn(n, generator=_gen(0))
    grads = _grads(n, steps=3, dtype=grad_dtype)

    def run(device):
        out = _kernel_adam(p0, grads, decoupled, device=device, half=half, **HP)
        return tuple(t for t in out if t is not None)

    cpu, cuda = _both(run)
    for a, e in zip(cuda[:3], cpu[:3]):
        assert_fp32_close(a, e)
    if half is not None:
        assert torch.equal(cuda[3], cuda[0].to(half))  # the GPU's own param, rounded


@needs_gpu
def test_gpu_adam_skip_and_device_grad_scale(gpu_kernels):
    p, m, v = (
        torch.randn(4099, device="cuda"),
        torch.rand(4099, device="cuda"),
        torch.rand(4099, device="cuda"),
    )
    half = p.half()
    before = [t.clone() for t in (p, m, v, half)]
    g = torch.randn(4099, device="cuda")
    kernels.adamw_(
        p, g, m, v, **HP, step=2, found_inf=torch.ones(1, device="cuda"), half_param=half
    )
    for after, b in zip((p, m, v, half), before):
        assert torch.equal(after, b)
    scale = torch.tensor(GRAD_SCALE, device="cuda")
    kernels.adamw_(p, g, m, v, **HP, step=2, grad_scale=scale)
    ref = [t.cpu() for t in before[:3]]
    kernels.adamw_(*ref[:1], g.cpu(), *ref[1:], **HP, step=2, grad_scale=GRAD_SCALE)
    for a, e in zip((p, m, v), ref):
        assert_fp32_close(a.cpu(), e)


def _segment_lengths() -> list[int]:
    """Empty segments, segments far below and above the 4096-element chunk, and one
    segment spanning many chunks."""
    return [5, 0, 4096, 1, 0, 3, 50_000, 700, *([17] * 300), 4095, 9000, 0]


@needs_gpu
@pytest.mark.parametrize("grad_dtype", GRAD_DTYPES, ids=GRAD_IDS)
def test_gpu_lamb_matches_cpu_reference(gpu_kernels, grad_dtype):
    lengths = _segment_lengths()
    n = sum(lengths)
    p0 = torch.randn(n, generator=_gen(0))
    p0[:5] = 0  # a zero tensor: trust 1
    grads = _grads(n, 3, grad_dtype)

    def run(device):
        p = p0.clone().to(device)  # the CPU run must not update p0 in place
        m, v = torch.zeros_like(p), torch.zeros_like(p)
        half = torch.empty(n, dtype=torch.bfloat16, device=device)
        offs = kernels.segment_offsets(lengths, device)
        for t, g in enumerate(grads, start=1):
            kernels.lamb_(p, g.to(device), m, v, offs, **HP, step=t, grad_scale=GRAD_SCALE,
                          half_param=half)  # fmt: skip
        u = torch.empty_like(p)
        hp = {k: HP[k] for k in ("beta1", "beta2", "eps", "weight_decay")}
        norms = kernels.lamb_phase1_(p, grads[0].to(device), m.clone(), v.clone(), u, offs,
                                     **hp, step=4)  # fmt: skip
        return (p, m, v, *norms, half)

    cpu, cuda = _both(run)
    for a, e in zip(cuda[:5], cpu[:5]):
        assert_fp32_close(a, e)
    assert torch.equal(cuda[5], cuda[0].bfloat16())


@needs_gpu
def test_gpu_lamb_sharded_mid_tensor(gpu_kernels):
    params, grads = _lamb_params(), _lamb_grads(torch.float32)
    lengths = [p.numel() for p in params]
    p = torch.cat([t.reshape(-1) for t in params]).cuda()
    m, v = torch.zeros_like(p), torch.zeros_like(p)
    cut = lengths[0] + lengths[1] + lengths[2] + 1000
    for t, step_grads in enumerate(grads, start=1):
        _sharded_lamb(p, torch.cat(step_grads).cuda(), m, v, lengths, cut, t, device="cuda")
    for a, e in zip((p, m, v), _torch_lamb(params, grads, **HP)):
        assert_fp32_close(a.cpu(), e)


@needs_gpu
@pytest.mark.parametrize("dtype", GRAD_DTYPES, ids=GRAD_IDS)
def test_gpu_all_finite_sq_norm(gpu_kernels, dtype):
    g = _gen(0)
    big = torch.randn(5_000_000, generator=g).to(dtype)  # > 1024 blocks x 4096: grid-stride
    many = [
        torch.randn(int(s), generator=g).to(dtype)
        for s in torch.randint(0, 3000, (150,), generator=g)
    ]
    for ts in (big, [big[:1]], many):
        cpu = kernels.all_finite_sq_norm(ts)
        cuda = kernels.all_finite_sq_norm(
            ts.cuda() if isinstance(ts, torch.Tensor) else [t.cuda() for t in ts]
        )
        torch.testing.assert_close(cuda[0].cpu(), cpu[0], rtol=1e-5, atol=0)
        assert cuda[1].item() == cpu[1].item() == 0.0
    for bad in (float("inf"), float("nan")):
        x = many[-1].cuda().clone()
        x[-1] = bad
        assert kernels.all_finite_sq_norm([*[t.cuda() for t in many[:-1]], x])[1].item() == 1.0
