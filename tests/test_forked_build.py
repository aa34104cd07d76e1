"""Build jobs in a forked child (ortrain/forked.py): results, errors, warnings, fallbacks."""

from __future__ import annotations

import os
import subprocess
import sys
import warnings

import pytest

from ortrain.forked import (
    CHILD_GC_THRESHOLD0,
    PRELOAD_WHILE_WAITING,
    ForkedJob,
    call_forked,
    can_fork,
    run_here,
)

pytestmark = pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork (POSIX)")


def test_result_comes_back_from_the_child():
    parent = os.getpid()
    pid, value = call_forked(lambda: (os.getpid(), [1, 2, 3]), what="test job")
    assert pid != parent and value == [1, 2, 3]


def test_the_child_collects_young_objects_rarely_and_this_process_as_before():
    """A build child's young collections are ``CHILD_GC_THRESHOLD0`` allocations apart
    (its export's objects are not promoted and scanned over and over); the training
    process keeps its own settings."""
    import gc

    before = gc.get_threshold()
    gc.set_threshold(700, 10, 10)
    try:
        child = call_forked(gc.get_threshold, what="test job")
        assert child == (CHILD_GC_THRESHOLD0, 10, 10)
        assert gc.get_threshold() == (700, 10, 10)
    finally:
        gc.set_threshold(*before)


def test_a_job_run_here_collects_as_a_child_would_and_the_setting_comes_back():
    """Where a build cannot fork (CUDA, ``ORTRAIN_BUILD_IN_PROCESS``) it runs here with a
    child's collections; the process's own setting is back after it, raised or not."""
    import gc

    before = gc.get_threshold()
    gc.set_threshold(700, 10, 10)
    try:
        assert run_here(gc.get_threshold) == (CHILD_GC_THRESHOLD0, 10, 10)
        assert gc.get_threshold() == (700, 10, 10)

        def fails() -> None:
            raise ValueError("boom")

        with pytest.raises(ValueError, match="boom"):
            run_here(fails)
        assert gc.get_threshold() == (700, 10, 10)
    finally:
        gc.set_threshold(*before)


def test_a_build_in_this_process_exports_with_a_child_s_collections(monkeypatch):
    import gc

    import torch

    import ortrain.build
    from ortrain import ORTTrainer
    from tests.conftest import gpt2, lm_batches

    seen = []
    real = ortrain.build.export_here

    def recording(*args, **kwargs):
        seen.append(gc.get_threshold()[0])
        return real(*args, **kwargs)

    monkeypatch.setattr(ortrain.build, "export_here", recording)
    monkeypatch.setenv("ORTRAIN_BUILD_IN_PROCESS", "1")
    before = gc.get_threshold()
    gc.set_threshold(700, 10, 10)
    try:
        model = gpt2(layers=1, hidden=32, vocab=64)
        trainer = ORTTrainer(model, torch.optim.SGD(model.parameters(), lr=0.1))
        trainer.train_step(**lm_batches(1, vocab=64, batch=2, seq=8)[0])
        assert seen and set(seen) == {CHILD_GC_THRESHOLD0}
        assert gc.get_threshold() == (700, 10, 10)
    finally:
        gc.set_threshold(*before)


def test_a_started_job_is_polled_without_waiting():
    """``done()`` answers at once while the child works (a large result, more than a pipe
    holds, read as it comes), then the result; ``cancel`` stops a child not wanted."""
    read_fd, write_fd = os.pipe()

    def job() -> bytes:
        os.read(read_fd, 1)  # until the parent lets it finish
        return b"x" * (1 << 20)

    running = ForkedJob(job, what="test job")
    assert not running.done()
    os.write(write_fd, b"g")
    running.result_ready()
    assert running.done() and running.result() == b"x" * (1 << 20)
    stuck = ForkedJob(lambda: os.read(read_fd, 1), what="test job")
    assert not stuck.done()
    stuck.cancel()
    assert stuck.done() and stuck.status is not None
    os.close(read_fd)
    os.close(write_fd)


_CHILD_CUDA = """
import torch
from ortrain.forked import call_forked
torch.cuda.is_available()  # the device count: on a GPU machine this poisons forks
child = call_forked(lambda: (torch.cuda.is_available(), torch.cuda.is_available.__module__),
                    what="test job")
print(*child, torch.cuda.is_available.__module__)
"""


@pytest.mark.slow
def test_the_child_sees_no_cuda_so_export_does_not_start_it():
    """torch.export saves the CUDA RNG state when CUDA is available; in a child forked
    after the parent asked for the device count that raised (seen on an H100 machine).
    A fresh interpreter: CUDA must not be started yet (then builds run in process)."""
    out = subprocess.run(
        [sys.executable, "-c", _CHILD_CUDA], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    # the child's is_available is ortrain's (False even on a GPU machine); the parent's is
    # untouched
    assert out.stdout.split() == ["False", "ortrain.forked", "torch.cuda"]


class _Custom(Exception):
    pass


class _Unpicklable(Exception):
    def __init__(self, text: str, handle: object):
        super().__init__(text)
        self.handle = handle

    def __reduce__(self):
        raise TypeError("no pickling")


def _raise(exc: BaseException):
    def job():
        raise exc

    return job


def test_errors_keep_their_type_and_carry_the_child_traceback():
    with pytest.raises(_Custom, match="bad shape") as info:
        call_forked(_raise(_Custom("bad shape")), what="test job")
    assert any("in ortrain's build process" in n for n in info.value.__notes__)
    with pytest.raises(RuntimeError, match="_Unpicklable: cannot send"):
        call_forked(_raise(_Unpicklable("cannot send", object())), what="test job")


def test_unpicklable_result_is_an_error_not_a_hang():
    with pytest.raises(RuntimeError, match="not picklable"):
        call_forked(lambda: lambda: None, what="test job")


def test_child_warnings_are_reissued_here():
    def job() -> int:
        warnings.warn("from the child", UserWarning, stacklevel=1)
        return 7

    with pytest.warns(UserWarning, match="from the child"):
        assert call_forked(job, what="test job") == 7


def test_a_child_that_dies_falls_back_to_this_process():
    parent = os.getpid()

    def job() -> int:
        if os.getpid() != parent:
            os._exit(3)  # the child dies without answering
        return os.getpid()

    with pytest.warns(UserWarning, match="test job in a child process failed"):
        assert call_forked(job, what="test job") == parent


def test_a_child_killed_from_outside_raises_and_is_not_rerun_here():
    """SIGKILL not sent by the job's own timeout (the out-of-memory killer's): the same
    job in this process would kill it too, so it raises instead, naming the cause."""
    import signal

    from ortrain.core.errors import BuildKilledError

    parent, ran_here = os.getpid(), []

    def job() -> int:
        if os.getpid() != parent:
            os.kill(os.getpid(), signal.SIGKILL)
        ran_here.append(True)
        return 1

    with pytest.raises(BuildKilledError, match=r"killed by signal SIGKILL.*out-of-memory"):
        call_forked(job, what="test job")
    assert not ran_here
    assert issubclass(BuildKilledError, MemoryError)


_STUCK_AT_FORK = """
import os, sys, time
import ortrain.forked as forked
forked.START_TIMEOUT_S = 2.0
flag = sys.argv[1]

def stuck_once():  # the first child hangs inside os.fork (as CPython gh-112275 can)
    if os.path.exists(flag):
        os.remove(flag)
        time.sleep(600)

os.register_at_fork(after_in_child=stuck_once)
parent = os.getpid()
start = time.monotonic()
pid, value = forked.call_forked(lambda: (os.getpid(), 42), what="test job")
print(pid != parent, value, round(time.monotonic() - start))
"""


@pytest.mark.slow
def test_a_child_stuck_inside_the_fork_is_forked_again(tmp_path):
    """A child that never says it started is killed after START_TIMEOUT_S and the job
    forked again (not waited on for the build's half hour, nor run in this process)."""
    flag = tmp_path / "first"
    flag.touch()
    out = subprocess.run(
        [sys.executable, "-c", _STUCK_AT_FORK, str(flag)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    in_child, value, seconds = out.stdout.split()
    assert (in_child, value) == ("True", "42") and not flag.exists()
    assert 2 <= int(seconds) < 30
    assert "running it in this process" not in out.stderr


@pytest.mark.skipif(not os.path.exists("/proc/self/stat"), reason="needs /proc (Linux)")
def test_a_child_asleep_on_a_lock_nobody_holds_is_run_here(monkeypatch):
    """A lock a thread of this process held at the fork stays held in the child forever:
    the job is killed once it made no progress for STALL_S and runs here (whose thread
    let go of the lock meanwhile), not after the build's whole timeout."""
    import threading
    import time

    import ortrain.forked as forked

    monkeypatch.setattr(forked, "STALL_S", 2.0)
    monkeypatch.setattr(forked, "POLL_S", 0.2)
    lock, held, release = threading.Lock(), threading.Event(), threading.Event()

    def holder() -> None:
        with lock:
            held.set()
            release.wait()

    thread = threading.Thread(target=holder)
    thread.start()
    held.wait()

    def job() -> int:
        with lock:
            return os.getpid()

    began = time.monotonic()
    running = ForkedJob(job, what="test job")
    release.set()
    thread.join()
    with pytest.warns(UserWarning, match="made no progress for 2 s"):
        pid = running.result()
    assert pid == os.getpid()
    assert 2.0 <= time.monotonic() - began < 20
    assert running.stalled and running.status is not None


@pytest.mark.skipif(not os.path.exists("/proc/self/stat"), reason="needs /proc (Linux)")
def test_a_child_that_computes_or_waits_on_its_own_process_is_not_stalled(monkeypatch):
    """Progress is CPU time, a state other than asleep, or a process of the child's
    still running (a compiler it started): neither job is taken for stuck."""
    import time

    import ortrain.forked as forked

    monkeypatch.setattr(forked, "STALL_S", 0.5)
    monkeypatch.setattr(forked, "POLL_S", 0.1)

    def compute() -> int:
        end = time.monotonic() + 2.0
        while time.monotonic() < end:
            pass
        return os.getpid()

    def wait_on_own_process() -> int:
        subprocess.run(["sleep", "2"], check=True)
        return os.getpid()

    for job in (compute, wait_on_own_process):
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # no "running it in this process"
            pid = call_forked(job, what="test job")
        assert pid != os.getpid(), job.__name__


def test_can_fork_respects_the_switches(monkeypatch):
    import torch

    # once this process started CUDA (GPU tests before this one) jobs run in process
    assert can_fork([torch.zeros(2)]) == (not torch.cuda.is_initialized())
    assert not can_fork([torch.zeros(2, device="meta")])
    monkeypatch.setenv("ORTRAIN_BUILD_IN_PROCESS", "1")
    assert not can_fork([torch.zeros(2)])


_TRAIN_AND_EVAL = """
import sys, torch
from ortrain import ORTTrainer
from tests.conftest import gpt2, lm_batches

model = gpt2(layers=1, hidden=32, vocab=64)
trainer = ORTTrainer(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
batch = lm_batches(1, vocab=64, batch=2, seq=8)[0]
with torch.no_grad():
    eager = model(**batch).loss.item()  # dropout is off in these models
loss = trainer.train_step(**batch).item()
out = trainer.eval_step(**batch)
heavy = sorted(m for m in sys.modules if m.split(".")[0] in ("onnx", "onnx_ir", "onnxscript"))
print("LOSS", eager, loss, float(out.loss))
print("HEAVY", ",".join(heavy) or "-")
from ortrain.forked import PRELOAD_WHILE_WAITING
print("PRELOADED", ",".join(m for m in PRELOAD_WHILE_WAITING if m in sys.modules) or "-")
"""


@pytest.mark.slow
def test_training_process_never_imports_the_graph_libraries():
    # Export and every pass run in the child: the process that trains loads only the
    # ONNX Runtime session and the small interface module (tens of MB less resident).
    from tests.conftest import ROOT

    env = {k: v for k, v in os.environ.items() if not k.endswith("_IN_PROCESS")}
    proc = subprocess.run([sys.executable, "-c", _TRAIN_AND_EVAL], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = dict(line.split(" ", 1) for line in proc.stdout.splitlines() if " " in line)
    eager, train_loss, eval_loss = map(float, lines["LOSS"].split())
    assert train_loss == pytest.approx(eager, rel=1e-5)
    assert eval_loss < train_loss  # evaluated after one AdamW step on the same batch
    assert lines["HEAVY"] == "-", lines["HEAVY"]
    # what it imported while it waited for the first build, for the children after it
    assert lines["PRELOADED"] == ",".join(PRELOAD_WHILE_WAITING), lines["PRELOADED"]


_COMPILED_SUBMODULE = """
import copy, os, warnings
import torch
import torch._inductor.config as inductor_config
import ortrain
from ortrain.forked import call_forked

inductor_config.fx_graph_cache = False  # compile for real, not from a disk cache
inductor_config.compile_threads = 2  # its thread pool, whatever the machine's cores
torch.manual_seed(0)


class Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Linear(16, 32)
        block = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.GELU(),
                                    torch.nn.LayerNorm(32))
        self.block = torch.compile(block)
        self.head = torch.nn.Linear(32, 4)

    def forward(self, x, y=None):
        return self.head(self.block(self.emb(x)))


model = Model()
reference = copy.deepcopy(model)
with torch.no_grad():  # the user ran it before: inductor's compile pool has its threads
    model(torch.randn(3, 16))
import torch._inductor.async_compile as async_compile
print("POOL", async_compile.AsyncCompile.pool.cache_info().currsize)

# a job in a forked child that compiles again (another rank of input)
parent = os.getpid()
wide = torch.randn(2, 5, 32)
pid, out = call_forked(lambda: (os.getpid(), model.block(wide).detach()), what="test job")
print("CHILD", pid != parent, torch.equal(out, model.block(wide).detach()))

# the first step's eager check runs the model (so its compiled module) in a child
x, y = torch.randn(8, 16), torch.randint(0, 4, (8,))
def loss_fn(out, batch):
    return torch.nn.functional.cross_entropy(out, batch["y"])
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    trainer = ortrain.ORTTrainer(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                 loss_fn=loss_fn)
    losses = [trainer.train_step(x=x, y=y).item() for _ in range(3)]
optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
eager = []
for _ in range(3):
    optimizer.zero_grad()
    loss = torch.nn.functional.cross_entropy(reference(x), y)
    loss.backward()
    optimizer.step()
    eager.append(loss.item())
trainer.sync_to_module()
worst = max((a - b).abs().max().item() / (b.abs().max().item() + 1e-12)
            for a, b in zip(model.parameters(), reference.parameters()))
print("LOSSES", *losses)
print("EAGER", *eager)
print("PARAMS", worst)
print("FAILED", sum("child process failed" in str(w.message) for w in caught))
"""


@pytest.mark.slow
def test_a_model_holding_a_compiled_module_builds_in_a_child_without_hanging(tmp_path):
    """A ``torch.compile``'d module compiles again in a forked child (the first step's
    eager reference, a new shape); inductor's compile thread pool from the parent has
    no threads there, so that compile waited forever until the job's timeout."""
    from tests.conftest import ROOT

    env = {k: v for k, v in os.environ.items() if not k.endswith("_IN_PROCESS")}
    env["TORCHINDUCTOR_CACHE_DIR"] = str(tmp_path / "inductor")
    env["ORTRAIN_EXPORT_TIMEOUT"] = "120"  # a hang comes back as a fallback, not 30 min
    proc = subprocess.run([sys.executable, "-c", _COMPILED_SUBMODULE], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=900)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = dict(line.split(" ", 1) for line in proc.stdout.splitlines() if " " in line)
    assert lines["POOL"] == "1"  # the case this is about: the parent's pool exists
    assert lines["CHILD"] == "True True"  # ran in the child, same values as here
    assert lines["FAILED"] == "0", proc.stderr[-3000:]
    losses = [float(v) for v in lines["LOSSES"].split()]
    eager = [float(v) for v in lines["EAGER"].split()]
    assert losses == pytest.approx(eager, rel=1e-5)
    assert float(lines["PARAMS"]) < 1e-5
