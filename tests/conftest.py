"""Small HF models and batches shared by the end-to-end tests (built from configs)."""

from __future__ import annotations

import gc
import inspect
import json
import os
import re
import resource
import shutil
import subprocess
import tempfile
import time
import warnings
from pathlib import Path

import pytest
import torch
from hypothesis import settings
from hypothesis.configuration import set_hypothesis_home_dir

from ortrain.forked import CHILD_GC_THRESHOLD0
from tests import rank_processes

ROOT = Path(__file__).resolve().parents[1]

warnings.filterwarnings("ignore", category=UserWarning)

# Hypothesis keeps no example database and its other files (by default .hypothesis/ in the
# checkout) in the temporary folder: the tests write nothing into the repository. A failing
# example is still printed with what reproduces it.
settings.register_profile("ortrain", database=None)
settings.load_profile("ortrain")
set_hypothesis_home_dir(Path(tempfile.gettempdir()) / f"ortrain-hypothesis-{os.getuid()}")


def _quiet_transformers() -> None:
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()


def gpt2(layers: int = 4, hidden: int = 256, vocab: int = 512, dropout: float = 0.0, seed: int = 0):
    from transformers import GPT2Config, GPT2LMHeadModel

    _quiet_transformers()
    torch.manual_seed(seed)
    cfg = GPT2Config(
        n_layer=layers,
        n_embd=hidden,
        n_head=4,
        vocab_size=vocab,
        n_positions=64,
        resid_pdrop=dropout,
        embd_pdrop=dropout,
        attn_pdrop=dropout,
        attn_implementation="eager",
        bos_token_id=0,
        eos_token_id=0,
    )
    return GPT2LMHeadModel(cfg)


def bert_config(vocab: int = 512, hidden: int = 128, layers: int = 2, dropout: float = 0.0):
    from transformers import BertConfig

    _quiet_transformers()
    return BertConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        intermediate_size=hidden * 4,
        max_position_embeddings=64,
        hidden_dropout_prob=dropout,
        attention_probs_dropout_prob=dropout,
        attn_implementation="eager",
        pad_token_id=0,
    )


def bert_mlm(seed: int = 0, **kw):
    from transformers import BertForMaskedLM

    torch.manual_seed(seed)
    return BertForMaskedLM(bert_config(**kw))


def bert_pretraining(seed: int = 0, **kw):
    from transformers import BertForPreTraining

    torch.manual_seed(seed)
    return BertForPreTraining(bert_config(**kw))


def lm_batches(n: int, batch: int = 4, seq: int = 32, vocab: int = 512, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        ids = torch.randint(0, vocab, (batch, seq), generator=g)
        out.append({"input_ids": ids, "labels": ids})
    return out


def bert_batches(
    n: int, batch: int = 4, seq: int = 32, vocab: int = 512, nsp: bool = False, seed: int = 2
):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        ids = torch.randint(1, vocab, (batch, seq), generator=g)
        mask = torch.ones(batch, seq, dtype=torch.long)
        for b in range(batch):  # right padding of varying length
            pad = int(torch.randint(0, seq // 2, (1,), generator=g))
            if pad:
                mask[b, seq - pad :] = 0
                ids[b, seq - pad :] = 0
        types = torch.zeros(batch, seq, dtype=torch.long)
        types[:, seq // 2 :] = 1
        labels = torch.full((batch, seq), -100)
        pick = (torch.rand(batch, seq, generator=g) < 0.15) & (mask == 1)
        pick[:, 1] = True  # at least one label per row
        labels[pick] = ids[pick]
        item = {"input_ids": ids, "attention_mask": mask, "token_type_ids": types, "labels": labels}
        if nsp:
            item["next_sentence_label"] = torch.randint(0, 2, (batch,), generator=g)
        out.append(item)
    return out


def decay_groups(model: torch.nn.Module, wd: float = 0.01) -> list[dict]:
    """The usual transformer split: no weight decay for biases and LayerNorm weights."""
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        (no_decay if p.ndim < 2 or "LayerNorm" in name or "ln_" in name else decay).append(p)
    return [{"params": decay, "weight_decay": wd}, {"params": no_decay, "weight_decay": 0.0}]


# ---------------------------------------------------------------------------- test kinds
# Each test gets exactly one kind, from facts rather than by hand (pyproject.toml registers
# them; tests/test_markers.py checks the result):
#   e2e  - marked ``slow``: end-to-end runs (model training, several processes, a CLI),
#          the tests the fast lane (``-m "not slow"``) leaves out;
#   gpu  - in a CUDA test module (test_cuda_*.py) or with a skip mark saying it needs CUDA;
#   unit - everything else.
KINDS = ("unit", "e2e", "gpu")
_NEEDS_CUDA = re.compile(r"\bneeds?\b.*\b(CUDA|GPU)\b", re.IGNORECASE)


def kind_of(item: pytest.Item) -> str:
    if item.get_closest_marker("slow") is not None:
        return "e2e"
    if item.path.name.startswith("test_cuda_"):
        return "gpu"
    for mark in item.iter_markers("skipif"):
        if _NEEDS_CUDA.search(str(mark.kwargs.get("reason", ""))):
            return "gpu"
    return "unit"


# ------------------------------------------------------ parallel workers (pytest-xdist)
# scripts/test.sh runs the suite on one worker per core (``-n``, ``--dist loadgroup``). Each
# worker then gets its share of the cores for torch's and ONNX Runtime's threads, so that two
# workers on two cores do not fight over them (ONNX Runtime's default is every core, per
# session); a single process keeps 2 threads, as before.
WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0)) or 1
    except (AttributeError, OSError):
        return os.cpu_count() or 1


THREADS = max(1, _cores() // WORKERS) if WORKERS > 1 else 2
if WORKERS > 1:  # what the processes the tests start inherit (torch's OpenMP team)
    os.environ.setdefault("OMP_NUM_THREADS", str(THREADS))


@pytest.fixture(autouse=True)
def _threads():
    torch.set_num_threads(THREADS)
    yield


WARM_FROM_TESTS = 100


def pytest_collection_finish(session: pytest.Session) -> None:
    """Each process that runs end-to-end tests makes, before any test (no test's budget
    pays it), what a first build makes (the exporter's translation table, the modules and
    caches of a first export): every build's forked child inherits it instead of making it
    again (``ortrain/build_warmup.py``). Not for a collection only, or a run of a few
    tests (one test file, the guards' tiny suites): the warm-up costs about as much as
    a few builds save."""
    config = session.config
    if config.getoption("numprocesses", None) and not hasattr(config, "workerinput"):
        return  # xdist's controller runs no test
    if config.option.collectonly or len(session.items) < WARM_FROM_TESTS:
        return
    from ortrain.build_warmup import warm_builds

    warm_builds()


@pytest.fixture(scope="session", autouse=True)
def _ort_threads_per_worker():
    """ONNX Runtime sessions made without an explicit thread count (TrainerOptions'
    ``intra_op_threads=None``) get this worker's share of the cores."""
    if WORKERS == 1:
        yield
        return
    import ortrain.offline
    import ortrain.program_context
    from ortrain.runtime import session

    real = session.make_session

    def per_worker(model, *, threads, **kw):
        return real(model, threads=THREADS if threads is None else threads, **kw)

    patch = pytest.MonkeyPatch()
    for module in (session, ortrain.program_context, ortrain.offline):
        patch.setattr(module, "make_session", per_worker)
    yield
    patch.undo()


def _shared_fixture(item: pytest.Item) -> str | None:
    """The group of a test that uses a fixture built once for several tests (module-scoped
    in its module, session-scoped in conftest.py): the module, or the fixture's name."""
    info = getattr(item, "_fixtureinfo", None)
    if info is None:
        return None
    for name in item.fixturenames:
        for fdef in info.name2fixturedefs.get(name, ()):
            code = getattr(fdef.func, "__code__", None)
            where = Path(code.co_filename) if code is not None else None
            if fdef.scope == "function" or where is None or where.parent != ROOT / "tests":
                continue
            if where.name != "conftest.py":
                return where.stem  # the module's (autouse ones too: the module's tests)
            if not getattr(fdef, "_autouse", False):  # (an autouse one here: every test's)
                return name
    return None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Each test's kind; on an xdist worker, the groups of tests that share a built fixture
    (for the scheduler below), and end-to-end tests first, so that the long ones are handed
    out before the quick ones that fill in."""
    for item in items:
        # A kind already marked by hand is kept, so that tests/test_markers.py sees a wrong
        # one instead of this hook hiding it under a second kind.
        if not any(item.get_closest_marker(k) for k in KINDS):
            item.add_marker(kind_of(item))
    # every collected test and its markers, before -m / -k deselect any (this hook runs
    # before the mark plugin's): tests/test_markers.py checks them without collecting again
    config.ortrain_collected = {i.nodeid: {m.name for m in i.iter_markers()} for i in items}  # type: ignore[attr-defined]
    groups_file = getattr(config, "workerinput", {}).get("ortrain_groups")
    if groups_file is None:
        return
    groups = {item.nodeid: g for item in items if (g := _shared_fixture(item)) is not None}
    tmp = Path(f"{groups_file}.{os.getpid()}")
    tmp.write_text(json.dumps(groups))
    os.replace(tmp, groups_file)  # every worker writes the same: one whole file
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)  # stable


# pytest-xdist's own ``--dist loadgroup`` puts a group in each test id, which pytest 9.2's
# ids no longer take (every test ran alone), so the controller schedules by the groups the
# workers found: one unit of work per group, one per test otherwise.
@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node) -> None:
    node.workerinput["ortrain_groups"] = str(_groups_file(node.config))


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log):
    if config.getoption("dist", None) != "loadgroup":
        return None
    from xdist.scheduler import LoadScopeScheduling

    path = _groups_file(config)

    class SharedFixtureScheduling(LoadScopeScheduling):
        _groups: dict[str, str] | None = None

        def _split_scope(self, nodeid: str) -> str:
            if self._groups is None:  # written by the workers before they report
                self._groups = json.loads(path.read_text()) if path.is_file() else {}
            return self._groups.get(nodeid, nodeid)

    return SharedFixtureScheduling(config, log)


def _groups_file(config: pytest.Config) -> Path:
    if _GROUPS not in config.stash:
        folder = Path(tempfile.mkdtemp(prefix="ortrain-xdist-"))
        config.add_cleanup(lambda: shutil.rmtree(folder, ignore_errors=True))
        config.stash[_GROUPS] = folder / "groups.json"
    return config.stash[_GROUPS]


_GROUPS = pytest.StashKey[Path]()


# ------------------------------------------------------------------- per-test time budget
# No single test may take more than BUDGET_CPU_S seconds of CPU time: its setup (module and
# session fixtures it is the first to use included) and its call, in this process
# and in the processes it started and waited for (forked builds, ranks, CLIs). CPU time, not
# wall time, so that the budget holds on a loaded machine; a wall-clock ceiling of
# BUDGET_WALL_S catches a test that waits instead (no test may sleep). docs/development.md
# names both; ORTRAIN_TEST_BUDGET_S sets the CPU budget (0: off, e.g. under a debugger) and
# the ceiling with it.
BUDGET_CPU_S = float(os.environ.get("ORTRAIN_TEST_BUDGET_S", "240"))
BUDGET_WALL_S = 4 * BUDGET_CPU_S
_STARTED = pytest.StashKey[tuple[float, float]]()  # (wall clock, CPU seconds) at setup


def _cpu_s() -> float:
    me, children = (
        resource.getrusage(resource.RUSAGE_SELF),
        resource.getrusage(resource.RUSAGE_CHILDREN),
    )
    own = me.ru_utime + me.ru_stime + children.ru_utime + children.ru_stime
    return own + rank_processes.CHARGED[0]


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    item.stash[_STARTED] = (time.perf_counter(), _cpu_s())


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    outcome = yield
    report = outcome.get_result()
    started = item.stash.get(_STARTED, None)
    if BUDGET_CPU_S <= 0 or started is None or report.when != "call" or report.failed:
        return
    wall, cpu = time.perf_counter() - started[0], _cpu_s() - started[1]
    report.user_properties.append(("cost_s", (cpu, wall)))  # for the summary, also via xdist
    if cpu > BUDGET_CPU_S or wall > BUDGET_WALL_S:
        report.outcome = "failed"
        report.longrepr = (
            f"{item.nodeid} took {cpu:.0f} s of CPU time and {wall:.0f} s of wall time, over "
            f"the budget of {BUDGET_CPU_S:.0f} s of CPU time (and {BUDGET_WALL_S:.0f} s of wall "
            "time) for any single test (tests/conftest.py, docs/development.md): make it "
            "cheaper (a smaller model, a shared fixture) or split it"
        )


_COSTS: dict[str, tuple[float, float]] = {}  # test id -> (CPU s, wall s), where reported


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    for key, value in report.user_properties:
        if key == "cost_s":
            _COSTS[report.nodeid] = value


def pytest_terminal_summary(terminalreporter) -> None:
    if not _COSTS:
        return
    top = sorted(_COSTS.items(), key=lambda kv: -kv[1][0])[:10]
    terminalreporter.section(
        f"most CPU time per test (budget {BUDGET_CPU_S:.0f} s CPU, {BUDGET_WALL_S:.0f} s wall)"
    )
    for nodeid, (cpu, wall) in top:
        terminalreporter.write_line(f"{cpu:7.1f} s CPU {wall:7.1f} s wall  {nodeid}")
    if path := os.environ.get("ORTRAIN_TEST_COSTS"):  # every test's, as JSON
        Path(path).write_text(json.dumps(_COSTS, indent=0))


def pytest_configure(config: pytest.Config) -> None:
    """Nothing in a test run reads or writes the user's graph cache (~/.cache/ortrain/graphs):
    not the tests (``_graph_cache``), nor a module or session fixture that builds before
    them, nor a process they start. (Here, not at import: scripts the tests run import
    this module for its models.)"""
    os.environ["ORTRAIN_GRAPH_CACHE"] = "0"
    # A worker makes and drops hundreds of models, trainers and graphs: young collections
    # as rare as in a build child (ortrain/forked.py), not a full collection over all
    # that it holds every few tests.
    gc.set_threshold(CHILD_GC_THRESHOLD0, *gc.get_threshold()[1:])


@pytest.fixture(scope="session")
def _run_graph_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One graph cache for the run, shared by pytest-xdist's workers (their temporary
    folders sit in one folder of the run)."""
    base = tmp_path_factory.getbasetemp()
    path = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "graph-cache"
    path.mkdir(exist_ok=True)
    return path


@pytest.fixture(autouse=True)
def _graph_cache(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """A test (and the processes it starts) builds its own graphs, but for the tests of a
    module marked ``shared_graphs`` (many trainers of the same few models) that do not
    patch anything: those share the run's graph cache, as a user's runs share theirs; a
    hit is checked against eager at its first step like a build. tests/test_build_cache.py
    turns the cache on in folders of its own."""
    shared = request.node.get_closest_marker("shared_graphs") is not None
    if shared and "monkeypatch" not in inspect.signature(request.function).parameters:
        monkeypatch.setenv("ORTRAIN_GRAPH_CACHE", str(request.getfixturevalue("_run_graph_cache")))
    else:
        monkeypatch.setenv("ORTRAIN_GRAPH_CACHE", "0")


@pytest.fixture(autouse=True)
def _build_child_timeout(monkeypatch: pytest.MonkeyPatch) -> None:
    """A forked build child that hangs (seen once: freeing an inherited ONNX Runtime
    session) is killed and the build rerun in process after minutes, not the default
    half hour; a test's builds take seconds."""
    if "ORTRAIN_EXPORT_TIMEOUT" not in os.environ:
        monkeypatch.setenv("ORTRAIN_EXPORT_TIMEOUT", "600")


# ----------------------------------------------------------- kernel libraries (cuda_kernels/)
def cmake_build(dest: Path, *flags: str) -> float:
    """Configures and builds into ``dest``; returns the seconds it took."""
    if shutil.which("cmake") is None:
        pytest.skip("cmake not found: the kernel libraries cannot be built")
    if not any(shutil.which(c) for c in ("c++", "g++", "clang++")):
        pytest.skip("no C++ compiler found: the kernel libraries cannot be built")
    start = time.perf_counter()
    for cmd in (
        ["cmake", "-S", str(ROOT), "-B", str(dest), "-DCMAKE_BUILD_TYPE=Release", *flags],
        ["cmake", "--build", str(dest), "-j", str(os.cpu_count() or 2)],
    ):
        done = subprocess.run(cmd, capture_output=True, text=True)
        assert done.returncode == 0, f"{' '.join(cmd)} failed:\n{done.stdout}\n{done.stderr}"
    return time.perf_counter() - start


@pytest.fixture(scope="session")
def cpu_lib_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    dest = tmp_path_factory.mktemp("kernels_cpu")
    cmake_build(dest, "-DORTRAIN_KERNELS_CUDA=OFF")
    return dest


@pytest.fixture
def cpu_kernels(cpu_lib_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ORTRAIN_KERNELS_DIR", str(cpu_lib_dir))


class _Call(torch.nn.Module):
    """``call(model, **inputs)`` as a module with positional inputs, for torch.onnx.export."""

    def __init__(self, model: torch.nn.Module, call, names: list[str]) -> None:
        super().__init__()
        self.model, self.call, self.names = model, call, names

    def forward(self, *args):
        return self.call(self.model, **dict(zip(self.names, args)))


def export_dynamic(model, call, inputs: dict, path: Path, output: str, optimize: bool = True):
    """Export ``call(model, **inputs)`` as users export a model: each input's first two
    axes symbolic, named ``batch`` and ``seq``; returns ``path``."""
    axes = {0: "batch", 1: "seq"}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(
            _Call(model, call, list(inputs)),
            tuple(inputs.values()),
            str(path),
            dynamo=True,
            optimize=optimize,
            input_names=list(inputs),
            output_names=[output],
            dynamic_shapes=(tuple(axes for _ in inputs),),  # one entry: forward(*args)
        )
    return path
