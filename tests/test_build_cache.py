"""The on-disk graph cache and the build's visible stages (ortrain/build_cache.py).

The suite runs with the cache off (tests/conftest.py); these tests turn it on in a
temporary ``XDG_CACHE_HOME``. Run as a script (``python tests/test_build_cache.py CONFIG``)
this file is the fresh process that trains and prints what it saw.
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]


class Net(torch.nn.Module):
    """Embedding, LayerNorm, GELU MLP, cross-entropy over labels (label-row sites)."""

    def __init__(self, hidden: int = 32, vocab: int = 50, scale: float = 1.0):
        super().__init__()
        self.emb = torch.nn.Embedding(vocab, hidden)
        self.ln = torch.nn.LayerNorm(hidden)
        self.fc1 = torch.nn.Linear(hidden, 2 * hidden)
        self.fc2 = torch.nn.Linear(2 * hidden, vocab)
        self.register_buffer("scale", torch.full((hidden,), scale))

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        h = self.ln(self.emb(ids)) * self.scale
        logits = self.fc2(F.gelu(self.fc1(h)))
        return F.cross_entropy(logits.flatten(0, 1), labels.flatten())


def _model(cfg: dict) -> torch.nn.Module:
    torch.manual_seed(cfg.get("seed", 0))
    if cfg.get("model", "mlp") == "gpt2":
        sys.path.insert(0, str(ROOT / "tests"))
        from conftest import gpt2

        return gpt2(layers=2, hidden=64, vocab=128, seed=cfg.get("seed", 0))
    return Net(cfg.get("hidden", 32), scale=cfg.get("scale", 1.0))


def _batches(cfg: dict, n: int = 3) -> list[dict]:
    g = torch.Generator().manual_seed(1)
    b, s = cfg.get("batch", [4, 8])
    vocab = 128 if cfg.get("model", "mlp") == "gpt2" else 50
    out = []
    for _ in range(n):
        ids = torch.randint(0, vocab, (b, s), generator=g)
        key = "input_ids" if cfg.get("model", "mlp") == "gpt2" else "ids"
        out.append({key: ids, "labels": ids.roll(1, 1)})
    return out


def train(cfg: dict) -> dict:
    """Train a few steps (and one eval step) as ``cfg`` says; what the trainer saw."""
    from ortrain import ORTTrainer, TrainerOptions
    from ortrain.build_cache import library_versions

    if "together" in cfg:  # (builds log, ready folder, world): builds that overlap
        _overlapping_builds(*cfg["together"])
    model = _model(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    trainer = ORTTrainer(model, opt, TrainerOptions(**cfg.get("options", {})))
    batches = _batches(cfg)
    losses = [trainer.train_step(**b).item().hex() for b in batches]
    evals = [trainer.eval_step(**batches[0]).loss.item().hex()] if cfg.get("eval") else []
    return {
        "losses": losses,
        "eval": evals,
        "build_count": trainer.build_count,
        "cache_hits": trainer.cache_hits,
        "stages": [[r.graph, r.stage] for r in trainer.build_log],
        "sessions": [r.graph for r in trainer._ctx.graph_cache.session_log],
        "versions": hashlib.sha256(library_versions().encode()).hexdigest(),
        "trainer": trainer,
    }


def _overlapping_builds(log: str, ready: str, world: int) -> None:
    """Each build (in the build's child too) notes itself in ``log`` and takes 2 s more;
    the ``world`` processes start training together (all have said they are ready), so
    their builds overlap unless one waits for the other."""
    import time

    import ortrain.build as build

    real = build.build_train

    def noted(*args, **kwargs):
        with open(log, "a") as f:
            f.write(f"{os.getpid()}\n")
        time.sleep(2.0)
        return real(*args, **kwargs)

    build.build_train = noted
    Path(ready, str(os.getpid())).touch()
    deadline = time.monotonic() + 120
    while len(os.listdir(ready)) < world and time.monotonic() < deadline:
        time.sleep(0.01)


def _env(xdg: Path, cache: str = "1") -> dict[str, str]:
    from ortrain.runtime.cpu_ops import cache_dir

    env = dict(os.environ)
    env.update(
        XDG_CACHE_HOME=str(xdg),
        ORTRAIN_CACHE_DIR=str(cache_dir()),  # the CPU op library already built: not again
        ORTRAIN_GRAPH_CACHE=cache,
        PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")])),
    )
    return env


def _process(xdg: Path, cfg: dict, cache: str = "1") -> dict:
    """``train(cfg)`` in a fresh interpreter."""
    done = subprocess.run(
        [sys.executable, __file__, json.dumps(cfg)],
        env=_env(xdg, cache),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def _cold_then_warm(xdg: Path, cold: dict, warm: dict) -> tuple[dict, dict]:
    """Two processes; once more if ortrain's own source changed between them (the key
    holds it: someone editing the tree meanwhile)."""
    for _ in range(2):
        a, b = _process(xdg, cold), _process(xdg, warm)
        if a["versions"] == b["versions"]:
            break
    return a, b


def _entries(xdg: Path) -> list[Path]:
    return sorted((xdg / "ortrain" / "graphs").rglob("*.pkl"))


@pytest.fixture
def xdg(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The cache on, at its default place under a temporary XDG_CACHE_HOME."""
    from ortrain.runtime.cpu_ops import cache_dir

    monkeypatch.setenv("ORTRAIN_CACHE_DIR", str(cache_dir()))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setenv("ORTRAIN_GRAPH_CACHE", "1")
    return tmp_path


# ----------------------------------------------------------------------- across processes
_FINGERPRINTS = """
import sys
sys.path.insert(0, {tests!r})
from conftest import bert_mlm, gpt2
from ortrain.build_cache import model_fingerprint
print(model_fingerprint(gpt2(layers=2, hidden=64), None), model_fingerprint(bert_mlm(), None))
"""


@pytest.mark.slow
def test_fingerprints_are_the_same_in_another_process(tmp_path: Path):
    """Nothing of one process (hash seeds, addresses) gets into the key: HF models carry
    per-process values (a config's ``hash()``) that must be left out."""
    code = _FINGERPRINTS.format(tests=str(ROOT / "tests"))
    runs = [
        subprocess.Popen(
            [sys.executable, "-c", code],
            env={**_env(tmp_path), "PYTHONHASHSEED": seed},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for seed in ("1", "2")
    ]
    outs = [r.communicate(timeout=300) for r in runs]
    assert all(r.returncode == 0 for r in runs), outs[0][1][-3000:]
    first, second = (out.split() for out, _ in outs)
    assert len(first) == 2 and first == second


@pytest.mark.slow
def test_a_second_process_takes_its_graphs_from_disk(xdg: Path):
    cfg = {"eval": True}
    cold, warm = _cold_then_warm(xdg, cfg, cfg)
    assert (cold["cache_hits"], cold["build_count"]) == (0, 2)
    # one export: the eval graph is built from the training export (and checked)
    assert ["train", "export"] in cold["stages"] and ["eval", "export"] not in cold["stages"]
    # forward, training graph, eval graph
    assert len(_entries(xdg)) == 3
    assert (warm["cache_hits"], warm["build_count"]) == (2, 2)
    assert warm["stages"] == [["train", "cache"], ["eval", "cache"]]
    assert warm["sessions"] == cold["sessions"] == ["train", "eval"]
    assert warm["losses"] == cold["losses"] and warm["eval"] == cold["eval"]  # bit for bit


@pytest.mark.slow
def test_processes_missing_the_same_graph_build_it_once(xdg: Path):
    """Ranks of one machine start together and miss the same entries: one builds, the
    others wait for its lock and load what it wrote (bit for bit the same training)."""
    log, ready = xdg / "builds.log", xdg / "ready"
    ready.mkdir()
    cfg = {"together": [str(log), str(ready), 3]}
    runs = [
        subprocess.Popen(
            [sys.executable, __file__, json.dumps(cfg)],
            env=_env(xdg),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(3)
    ]
    outs = [r.communicate(timeout=600) for r in runs]
    assert all(r.returncode == 0 for r in runs), [err[-2000:] for _, err in outs]
    got = [json.loads(out.strip().splitlines()[-1]) for out, _ in outs]
    assert len(log.read_text().split()) == 1  # one build in all three processes
    assert sorted(g["cache_hits"] for g in got) == [0, 1, 1]
    assert len({tuple(g["losses"]) for g in got}) == 1
    assert len(_entries(xdg)) == 2  # the forward and the training graph


@pytest.mark.slow
def test_weights_and_buffers_are_not_in_the_key(xdg: Path):
    """Other weights and buffer values hit the same entries and train exactly as a build
    of their own: the graphs take them as inputs."""
    other = {"seed": 7, "scale": 0.5}
    _, hit = _cold_then_warm(xdg, {}, other)
    built = _process(xdg, other, cache="0")
    assert hit["cache_hits"] == 1 and built["cache_hits"] == 0
    assert hit["losses"] == built["losses"]
    assert len(_entries(xdg)) == 2


@pytest.mark.slow
def test_gpt2_warm_process_matches_cold(xdg: Path):
    cfg = {"model": "gpt2", "batch": [2, 16]}
    cold, warm = _cold_then_warm(xdg, cfg, cfg)
    assert cold["cache_hits"] == 0 and warm["cache_hits"] == 1
    assert warm["build_count"] == cold["build_count"] == 1
    assert warm["losses"] == cold["losses"]


# ----------------------------------------------------------------------- in one process
def test_parameters_and_buffers_are_graph_inputs(xdg: Path):
    got = train({})
    trainer = got["trainer"]
    (compiled,) = trainer._graphs.train.values()
    model = compiled.model
    inputs = {v.name for v in model.graph.inputs}
    names = set(trainer.params) | set(trainer.buffers)
    assert names <= inputs
    assert not names & set(model.graph.initializers)
    # no initializer holds a weight under another name either
    shapes = {tuple(t.shape) for t in [*trainer.params.values(), *trainer.buffers.values()]}
    big = [v for v in model.graph.initializers.values() if tuple(v.shape or ()) in shapes]
    assert all(v.const_value is None or v.const_value.size <= 1 for v in big)


def test_same_process_new_trainer_hits_then_options_and_shapes_miss(xdg: Path):
    first = train({})
    again = train({})
    assert again["cache_hits"] == 1 and again["losses"] == first["losses"]
    # a build option: the passes run again, on the cached export of the forward
    got = train({"options": {"memory_plan": False}})
    assert got["cache_hits"] == 0
    assert ["train", "export"] not in got["stages"] and ["train", "autodiff"] in got["stages"]
    for changed in ({"hidden": 16}, {"batch": [2, 8]}):  # the model's shapes, the batch's
        got = train(changed)
        assert got["cache_hits"] == 0 and ["train", "export"] in got["stages"], changed
    assert train({"options": {"memory_plan": False}})["cache_hits"] == 1


def test_another_cpu_cost_model_misses(xdg: Path, monkeypatch: pytest.MonkeyPatch):
    # a graph lowered with other thresholds (ORTRAIN_CPU_COST, another machine's caches)
    # is another graph
    from ortrain.graph_passes.targets.cpu.cost_model import COST_ENV

    assert train({})["cache_hits"] == 0
    assert train({})["cache_hits"] == 1
    monkeypatch.setenv(COST_ENV, "elementwise_min_elements=1")
    assert train({})["cache_hits"] == 0


def test_damaged_entries_are_rebuilt_with_a_warning(xdg: Path):
    first = train({})
    entries = _entries(xdg)
    assert len(entries) == 2
    for path in entries:
        data = bytearray(path.read_bytes())
        data[-10] ^= 0xFF
        path.write_bytes(bytes(data))
    with pytest.warns(UserWarning, match="graph cache entry .* is damaged"):
        rebuilt = train({})
    assert rebuilt["cache_hits"] == 0 and rebuilt["losses"] == first["losses"]
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # rewritten whole: no warning now
        assert train({})["cache_hits"] == 1


def test_cache_off_writes_nothing(xdg: Path, monkeypatch: pytest.MonkeyPatch):
    train({"options": {"graph_cache": False}})
    monkeypatch.setenv("ORTRAIN_GRAPH_CACHE", "0")
    train({})
    assert not (xdg / "ortrain" / "graphs").exists()


def test_a_changed_loss_fn_misses(xdg: Path):
    from ortrain import ORTTrainer, TrainerOptions

    def run(loss_fn) -> int:
        model = torch.nn.Linear(4, 3)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        trainer = ORTTrainer(model, opt, TrainerOptions(), loss_fn=loss_fn)
        x, y = torch.randn(5, 4), torch.randn(5, 3)
        trainer.train_step(x, target=y)
        return trainer.cache_hits

    def mse(out, batch):
        return F.mse_loss(out, batch["target"])

    def l1(out, batch):
        return F.l1_loss(out, batch["target"])

    assert [run(mse), run(mse), run(l1)] == [0, 1, 0]


@pytest.mark.slow
def test_a_refused_update_in_the_backward_is_remembered(xdg: Path, monkeypatch):
    """update_engine="auto" builds again without the update in the backward where the
    graph cannot run it; the next trainer skips the refused build (no export at all)."""
    import ortrain.build
    import ortrain.graph_passes.targets.cpu.update_in_backward as uib

    # fc2's weight is read by fc1's input gradient: one reader to order the update after,
    # more than this allows
    monkeypatch.setattr(uib, "MAX_AFTER", 0)
    monkeypatch.setenv("ORTRAIN_BUILD_IN_PROCESS", "1")  # builds counted here
    builds = []
    build_train = ortrain.build.build_train

    def counted(*args, **kwargs):
        builds.append(args[3].update_groups != ())  # settings: in the backward or not
        return build_train(*args, **kwargs)

    monkeypatch.setattr(ortrain.build, "build_train", counted)

    def run() -> dict:
        builds.clear()
        with pytest.warns(UserWarning, match="update runs after the session"):
            return train({})

    first = run()
    assert builds == [True, False]  # refused, then built without
    assert first["cache_hits"] == 0 and not first["trainer"]._in_backward
    second = run()
    assert builds == []
    assert second["cache_hits"] == 1 and not second["trainer"]._in_backward
    assert second["stages"] == [["train", "cache"]]
    assert second["losses"] == first["losses"]


# ----------------------------------------------------------------------- keys and entries
def test_model_fingerprint_follows_structure_not_weights():
    from ortrain.build_cache import model_fingerprint

    def fp(model: torch.nn.Module, loss_fn=None) -> str:
        return model_fingerprint(model, loss_fn)

    base = fp(Net())
    assert fp(Net()) == base
    torch.manual_seed(3)
    assert fp(Net(scale=2.0)) == base  # weights and buffer values: inputs
    net = Net()
    net.ln.eps = 1e-3  # an attribute the export bakes in
    assert fp(net) != base
    net = Net()
    net.fc1.weight.requires_grad_(False)
    assert fp(net) != base
    net = Net()
    net.extra = torch.zeros(3)  # a tensor attribute: a graph constant, by value
    other = Net()
    other.extra = torch.ones(3)
    assert fp(net) != fp(other) != base
    net = Net()
    net.register_forward_hook(lambda m, i, o: o * 2)
    assert fp(net) != base
    factor = 2.0

    def loss(out, batch):
        return out * factor

    with_two = fp(Net(), loss)
    factor = 3.0
    assert fp(Net(), loss) != with_two  # the closure's value
    # tensors of any dtype and rank hash by value (a 0-d float32 scale crashed the key)
    keys = set()
    for value in (torch.tensor(2.0), torch.tensor(3.0), torch.tensor(2.0, dtype=torch.bfloat16),
                  torch.tensor([True, False]), torch.tensor(1.0, dtype=torch.float64)):  # fmt: skip

        def scaled(out, batch, value=value):
            return out * value

        keys.add(fp(Net(), scaled))
        assert fp(Net(), scaled) == fp(Net(), scaled)
    assert len(keys) == 5


_NOTEBOOK = """
import torch

def helper(x):
    return x * {factor}

class Cell(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(3, 3)

    def forward(self, x):
        return helper(self.fc(x)){tail}
"""


def test_fingerprint_of_code_without_a_file():
    """A model defined in a notebook cell (no source file): its methods' code and the
    helpers they call are hashed."""
    import types

    from ortrain.build_cache import model_fingerprint

    def cell(factor: str, tail: str = "") -> str:
        name = f"_notebook_{abs(hash((factor, tail)))}"
        mod = types.ModuleType(name)
        sys.modules[name] = mod
        try:
            exec(_NOTEBOOK.format(factor=factor, tail=tail), mod.__dict__)
            torch.manual_seed(0)
            return model_fingerprint(mod.Cell(), None)
        finally:
            del sys.modules[name]

    base = cell("2")
    assert cell("2") == base
    assert cell("3") != base  # the helper's code
    assert cell("2", ".relu()") != base  # the forward's code


def test_fingerprint_of_a_class_without_a_module():
    """An object of a class made at run time with no module (``__module__`` None) that the
    forward reads: the model is keyed (its methods' code hashed), not a crash that stops
    training with the graph cache on."""
    from ortrain.build_cache import model_fingerprint

    def make(scale: float) -> torch.nn.Module:
        def apply(self, x):
            return x * scale

        kind = type("_Scaler", (), {"apply": apply})
        kind.__module__ = None
        net = Net()
        net.scaler = kind()
        return net

    base = model_fingerprint(make(2.0), None)
    assert model_fingerprint(make(2.0), None) == base
    assert model_fingerprint(make(3.0), None) != base  # what its method reads


class _Handle:
    """An object that will not say what it is (a handle whose ``repr`` raises once closed)."""

    __slots__ = ()

    def __repr__(self) -> str:
        raise RuntimeError("a handle with no state of its own")


class _Proxy:
    """An object whose attributes will not be listed (a proxy whose ``__dict__`` raises)."""

    @property
    def __dict__(self):  # type: ignore[override]
        raise RuntimeError("a proxy with no state of its own")


@pytest.mark.parametrize("kind", [_Handle, _Proxy], ids=["handle", "proxy"])
def test_a_model_that_cannot_be_keyed_trains_uncached_with_a_warning(xdg: Path, kind: type):
    """The graph cache is optional: a model whose key cannot be made trains as eager does,
    its graphs built and not kept, with one warning naming why; nothing is written."""
    from ortrain import ORTTrainer

    torch.manual_seed(0)
    model, ref = Net(), Net()
    ref.load_state_dict(model.state_dict())
    model.other = kind()
    trainer = ORTTrainer(model, torch.optim.SGD(model.parameters(), lr=0.1))
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for b in _batches({}, n=2):
            opt.zero_grad()
            want = ref(**b)
            want.backward()
            opt.step()
            torch.testing.assert_close(trainer.train_step(**b), want.detach(), rtol=1e-5, atol=0)
    said = [str(w.message) for w in caught if "graph cache is off" in str(w.message)]
    assert len(said) == 1 and "RuntimeError: a" in said[0] and "no state of its own" in said[0]
    assert trainer.build_count == 1 and trainer.cache_hits == 0
    assert _entries(xdg) == []


def test_fingerprint_is_stable_across_an_eager_forward():
    from ortrain.build_cache import model_fingerprint

    net = Net()
    before = model_fingerprint(net, None)
    net(torch.zeros(2, 3, dtype=torch.long), torch.zeros(2, 3, dtype=torch.long)).backward()
    assert model_fingerprint(net, None) == before


def test_entries_are_checked_before_they_are_unpickled(tmp_path: Path):
    from ortrain.build import StageRecord
    from ortrain.build_cache import MAGIC, DamagedEntry, read_entry, write_entry

    path = tmp_path / "e.pkl"
    record = StageRecord("train", "export", 1.5, 0, 3)
    write_entry(path, "k", record)
    assert read_entry(path, "k") == record
    with pytest.raises(DamagedEntry, match="another key"):
        read_entry(path, "other")
    path.write_bytes(path.read_bytes()[:-1])
    with pytest.raises(DamagedEntry, match="hash"):
        read_entry(path, "k")
    path.write_bytes(b"garbage")
    with pytest.raises(DamagedEntry, match="not a graph cache entry"):
        read_entry(path, "k")
    # a well-formed entry holding something else than build records is refused unrun
    data = pickle.dumps(("k", os.system))
    path.write_bytes(MAGIC + hashlib.sha256(data).hexdigest().encode() + b"\n" + data)
    with pytest.raises(DamagedEntry, match=r"unexpected posix\.system"):
        read_entry(path, "k")
    assert [p.name for p in tmp_path.iterdir()] == ["e.pkl"]  # no temporary file left


def test_cache_dir(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    from ortrain.build_cache import cache_dir

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setenv("ORTRAIN_GRAPH_CACHE", "1")
    assert cache_dir(True) == tmp_path / "ortrain" / "graphs"
    assert cache_dir(False) is None
    assert cache_dir(tmp_path / "x") == tmp_path / "x"
    monkeypatch.setenv("ORTRAIN_GRAPH_CACHE", str(tmp_path / "y"))
    assert cache_dir(True) == tmp_path / "y"
    monkeypatch.setenv("ORTRAIN_GRAPH_CACHE", "off")
    assert cache_dir(True) is None and cache_dir(tmp_path / "x") is None
    monkeypatch.delenv("ORTRAIN_GRAPH_CACHE")
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert cache_dir(True) == Path.home() / ".cache" / "ortrain" / "graphs"


# ----------------------------------------------------------------------- visible stages
def test_progress_prints_each_stage_once(capsys: pytest.CaptureFixture):
    from ortrain.build_progress import BuildProgress

    progress = BuildProgress("Net training graph", enabled=True, after=0.0)
    with progress.running():
        progress.stage("export")
        progress.stage("export")
        progress.stage("passes")
    progress.done()
    lines = capsys.readouterr().err.splitlines()
    assert [line.split(": ")[2].split("...")[0] for line in lines[:2]] == ["export", "passes"]
    assert len(lines) == 3 and "ready in" in lines[2]
    quiet = BuildProgress("Net training graph", enabled=False, after=0.0)
    with quiet.running():
        quiet.stage("export")
    quiet.done()
    slow = BuildProgress("Net training graph", enabled=True, after=60.0)
    with slow.running():
        slow.stage("export")
    slow.done()
    assert capsys.readouterr().err == ""


def test_a_long_build_says_its_stages(capfd: pytest.CaptureFixture, monkeypatch):
    """With the threshold at 0 every build is long: one line per stage (the export and
    the passes from the build's child process), then how long it took."""
    import ortrain.build_progress as build_progress

    monkeypatch.setattr(build_progress, "PROGRESS_AFTER_S", 0.0)
    train({"options": {"graph_cache": False}})
    err = capfd.readouterr().err
    said = [line for line in err.splitlines() if line.startswith("ortrain: Net training graph")]
    assert [s.split(": ")[2].split("...")[0] for s in said[:3]] == ["export", "passes", "session"]
    assert len(said) == 4 and "ready in" in said[3]
    train({"options": {"graph_cache": False, "build_progress": False}})
    assert "ortrain: Net" not in capfd.readouterr().err


if __name__ == "__main__":  # a fresh process of the tests above
    torch.set_num_threads(2)
    result = train(json.loads(sys.argv[1]))
    del result["trainer"]
    print(json.dumps(result))
