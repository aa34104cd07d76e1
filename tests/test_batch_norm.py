"""BatchNorm trains through ORTTrainer as in eager: losses, parameters, running statistics
(the training graph's buffer updates, ortrain/buffer_updates.py) and eval outputs.

The convolutions / linear layers in front of a BatchNorm have no bias: BatchNorm subtracts
the batch mean, so such a bias's exact gradient is zero and the computed one is float32
rounding noise in both implementations, which AdamW normalises to steps of ~lr (the same
reason tests/test_parity.py leaves out attention key biases).
"""

from __future__ import annotations

import copy
import os
import socket
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from ortrain import ORTTrainer, TrainerOptions
from ortrain.core.names import BATCH_STATISTICS
from ortrain.core.roles import Role
from tests.rank_processes import start_rank

pytestmark = pytest.mark.shared_graphs  # many trainers of the same few models

STEPS = 8
LOSS_RTOL = 1e-4
PARAM_RTOL, PARAM_ATOL = 1e-4, 1e-5
STATS_TOL = 1e-6  # one update of the statistics from the same parameters and buffers
CLASSES = 4
ROOT = Path(__file__).resolve().parent.parent


class Net(nn.Module):
    """``body`` -> mean over the spatial axes -> linear head; returns (loss, logits)."""

    def __init__(self, body: nn.Module, width: int):
        super().__init__()
        self.body = body
        self.head = nn.Linear(width, CLASSES)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.body(x)
        if h.dim() > 2:
            h = h.mean(dim=tuple(range(2, h.dim())))
        logits = self.head(h)
        return F.cross_entropy(logits, y), logits


def cnn2d(**bn) -> Net:
    body = nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1, bias=False),
        nn.BatchNorm2d(8, **bn),
        nn.ReLU(),
        nn.Conv2d(8, 6, 3, bias=False),
        nn.BatchNorm2d(6, **bn),
        nn.ReLU(),
    )
    return Net(body, 6)


def mlp(**bn) -> Net:
    body = nn.Sequential(nn.Linear(10, 16, bias=False), nn.BatchNorm1d(16, **bn), nn.ReLU())
    return Net(body, 16)


def conv1d(**bn) -> Net:
    """BatchNorm1d on (N, C, L)."""
    body = nn.Sequential(nn.Conv1d(4, 6, 3, bias=False), nn.BatchNorm1d(6, **bn), nn.ReLU())
    return Net(body, 6)


def cnn3d(**bn) -> Net:
    body = nn.Sequential(
        nn.Conv3d(2, 4, 3, padding=1, bias=False), nn.BatchNorm3d(4, **bn), nn.ReLU()
    )
    return Net(body, 4)


INPUTS: dict[Callable, tuple[int, ...]] = {
    cnn2d: (6, 3, 8, 8),
    mlp: (8, 10),
    conv1d: (6, 4, 9),
    cnn3d: (4, 2, 4, 4, 4),
}


def batches(make: Callable, n: int, seed: int = 1) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    shape = INPUTS[make]
    # mean 0.5, std 2: the running statistics move visibly away from (0, 1)
    return [
        {
            "x": 0.5 + 2 * torch.randn(shape, generator=g),
            "y": torch.randint(0, CLASSES, (shape[0],), generator=g),
        }
        for _ in range(n)
    ]


def adamw(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)


def eager_step(ref: nn.Module, opt: torch.optim.Optimizer, micro: list[dict]) -> list[float]:
    opt.zero_grad()
    losses = []
    for mb in micro:
        loss = ref(**mb)[0]
        (loss / len(micro)).backward()
        losses.append(loss.item())
    opt.step()
    return losses


def assert_buffers_equal(
    got: dict[str, torch.Tensor], ref: nn.Module, rtol: float, atol: float
) -> None:
    """num_batches_tracked exactly, the running statistics within the tolerances."""
    ref_buffers = dict(ref.named_buffers())
    assert sorted(got) == sorted(ref_buffers)
    for name, r in ref_buffers.items():
        b = got[name]
        if b.dtype == torch.int64:
            assert torch.equal(b, r), f"{name}: {b} != {r}"
        else:
            torch.testing.assert_close(
                b, r, rtol=rtol, atol=atol, msg=lambda m, n=name: f"{n}: {m}"
            )


@torch.no_grad()
def eager_statistics(trainer: ORTTrainer, micro_batch: dict) -> nn.Module:
    """An eager copy of the trainer's current parameters and buffers after one training
    mode forward on ``micro_batch``: the statistics the trainer's step must write."""
    shadow = copy.deepcopy(trainer.sync_to_module()).train()
    shadow(**micro_batch)
    return shadow


def assert_params_close(model: nn.Module, ref: nn.Module) -> None:
    for (name, p), (_, q) in zip(model.named_parameters(), ref.named_parameters(), strict=True):
        torch.testing.assert_close(
            p, q, rtol=PARAM_RTOL, atol=PARAM_ATOL, msg=lambda m, n=name: f"{n}: {m}"
        )


def train_both(make: Callable, bn: dict, accum: int = 1, eval_every: int = 0):
    """Eager and ORTTrainer side by side, STEPS optimizer steps; returns both models and
    the trainer (after sync_to_module). ``eval_every``: an eval step between steps that
    must leave the buffers alone."""
    torch.manual_seed(0)
    ref = make(**bn)
    model = copy.deepcopy(ref)
    initial = [p.detach().clone() for p in ref.parameters()]
    opt_ref = adamw(ref)
    # fallback "off": a graph that disagrees with eager must fail here, not train as
    # segments (BatchNorm(affine=False) did, unnoticed, once ONNX Runtime merged its
    # zero bias with its zero mean placeholder)
    options = TrainerOptions(grad_accumulation_steps=accum, fallback="off")
    trainer = ORTTrainer(model, adamw(model), options)
    data = batches(make, STEPS * accum + 1)
    for step in range(STEPS):
        micro = data[step * accum : (step + 1) * accum]
        losses_ref = eager_step(ref, opt_ref, micro)
        losses = []
        for mb in micro:
            expected = eager_statistics(trainer, mb)
            losses.append(trainer.train_step(**mb).item())
            assert_buffers_equal(trainer.buffers, expected, STATS_TOL, STATS_TOL)
        torch.testing.assert_close(
            torch.tensor(losses), torch.tensor(losses_ref), rtol=LOSS_RTOL, atol=0
        )
        if eval_every and step % eval_every == 0:
            before = {n: b.clone() for n, b in trainer.buffers.items()}
            trainer.eval_step(**data[-1])
            for n, b in trainer.buffers.items():
                assert torch.equal(b, before[n]), f"eval_step changed {n}"
    trainer.sync_to_module()
    assert trainer.segments is None  # one training graph
    moved = max((p - q).abs().max().item() for p, q in zip(model.parameters(), initial))
    assert moved > 1e-3  # the comparisons are not of initial values
    return ref, model, trainer, data[-1]


def check_against_eager(make: Callable, bn: dict, accum: int = 1, eval_every: int = 0):
    ref, model, trainer, held_out = train_both(make, bn, accum, eval_every)
    assert_params_close(model, ref)
    # the statistics of activations of parameters that agree within PARAM_RTOL
    assert_buffers_equal(dict(model.named_buffers()), ref, PARAM_RTOL, PARAM_ATOL)
    if bn.get("track_running_stats", True):
        tracked = [b for n, b in model.named_buffers() if n.endswith("num_batches_tracked")]
        assert tracked and all(int(t) == STEPS * accum for t in tracked)
    # after training, eval mode reads the running statistics
    ref.eval()
    out = trainer.eval_step(**held_out)
    loss_ref, logits_ref = ref(**held_out)
    torch.testing.assert_close(out["output_1"], logits_ref.detach(), rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(out["loss"], loss_ref.detach(), rtol=1e-4, atol=0)
    return trainer


CASES = [
    (cnn2d, {}),
    (cnn2d, {"affine": False}),
    (cnn2d, {"momentum": None}),
    (cnn2d, {"affine": False, "momentum": None}),
    (cnn2d, {"track_running_stats": False}),
    (mlp, {}),
    (mlp, {"affine": False, "momentum": None}),
    (conv1d, {"momentum": None}),
    (cnn3d, {}),
    (cnn3d, {"affine": False, "momentum": None}),
]


def _id(case: tuple) -> str:
    make, bn = case
    return "-".join([make.__name__, *(f"{k}={v}" for k, v in bn.items())])


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES, ids=[_id(c) for c in CASES])
def test_trains_like_eager(case: tuple) -> None:
    make, bn = case
    trainer = check_against_eager(make, bn)
    if make is not conv1d:  # marked for the fused backward (batch_norm_training.py)
        (graph,) = trainer.train_graphs
        marks = [n.metadata_props.get(BATCH_STATISTICS) for n in graph.graph]
        assert any(marks)


def test_training_graph_writes_the_statistics_and_eval_graph_reads_them() -> None:
    trainer = check_against_eager(cnn2d, {}, eval_every=3)
    (compiled,) = trainer._graphs.train.values()
    norms = [n for n in compiled.model.graph if n.op_type == "BatchNormalization"]
    # never the buffers: ONNX Runtime's training-mode kernel would write into them
    # (ortrain/buffer_updates.py). Inference-mode, fed the batch statistics; on CPU with
    # ortrain's kernels marked for one BatchNormGrad as backward
    # (targets/cpu/batch_norm_training.py).
    assert len(norms) == 2
    kernels = trainer._ctx.settings().cpu_kernels
    for n in norms:
        assert n.attributes.get_int("training_mode", 0) == 0
        assert not any(v.is_graph_input() or v.const_value is not None for v in n.inputs[3:])
        assert bool(n.metadata_props.get(BATCH_STATISTICS)) == kernels
    grads = [n for n in compiled.model.graph if n.op_type == "BatchNormGrad"]
    assert len(grads) == (2 if kernels else 0)
    updated = {r.of for r in compiled.graph.io if r.role is Role.UPDATED_BUFFER}
    assert updated == {n for n, _ in trainer.module.named_buffers()}
    (ev,) = trainer._graphs.eval.values()
    reads = {v.name for n in ev.model.graph if n.op_type == "BatchNormalization" for v in n.inputs}
    assert {n for n in updated if not n.endswith("num_batches_tracked")} <= reads
    assert not [r for r in ev.graph.io if r.role is Role.UPDATED_BUFFER]


def test_gradient_accumulation_updates_statistics_every_micro_batch() -> None:
    check_against_eager(cnn2d, {"momentum": None}, accum=2)


class Tracker(nn.Module):
    """In-place buffer updates besides BatchNorm's: a counter, an average of the input, and
    a scale that the backward must read before its update (x * scale, then scale halves)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(5, 3)
        self.register_buffer("steps", torch.zeros((), dtype=torch.int64))
        self.register_buffer("average", torch.zeros(5))
        self.register_buffer("scale", torch.full((5,), 2.0))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.training:
            self.steps.add_(1)
            self.average.mul_(0.75).add_(0.25 * x.detach().mean(0))
        h = x * self.scale
        if self.training:
            self.scale.mul_(0.5)
        logits = self.lin(h)
        return F.cross_entropy(logits, y), logits


def test_any_buffer_update_is_written_back() -> None:
    torch.manual_seed(0)
    ref = Tracker()
    model = copy.deepcopy(ref)
    opt_ref = adamw(ref)
    trainer = ORTTrainer(model, adamw(model))
    g = torch.Generator().manual_seed(3)
    for _ in range(STEPS):
        b = {"x": torch.randn(8, 5, generator=g), "y": torch.randint(0, 3, (8,), generator=g)}
        loss_ref = eager_step(ref, opt_ref, [b])
        loss = trainer.train_step(**b).item()
        torch.testing.assert_close(loss, loss_ref[0], rtol=LOSS_RTOL, atol=0)
    trainer.sync_to_module()
    assert_params_close(model, ref)
    assert_buffers_equal(dict(model.named_buffers()), ref, STATS_TOL, STATS_TOL)
    assert int(model.steps) == STEPS


# --------------------------------------------------------------------------- data parallel
WORLD = 2


def _worker(out: Path, zero_stage: int) -> None:
    """One rank: data parallel (or ZeRO-1) on its own batches, buffers not broadcast (DDP's
    ``broadcast_buffers=False``; the default, rank 0's after each update, is checked beside
    torch's DDP in tests/test_distributed.py); saves its losses, parameters, buffers."""
    torch.distributed.init_process_group("gloo")
    rank = torch.distributed.get_rank()
    torch.manual_seed(0)
    model = cnn2d()
    options = TrainerOptions(intra_op_threads=1, zero_stage=zero_stage, broadcast_buffers=False)
    trainer = ORTTrainer(model, adamw(model), options)
    losses = [trainer.train_step(**b).item() for b in batches(cnn2d, STEPS, seed=10 + rank)]
    trainer.sync_to_module()
    torch.save({"losses": losses, "state": model.state_dict()}, out / f"rank{rank}.pt")
    torch.distributed.destroy_process_group()


def _launch(out: Path, zero_stage: int) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    procs = []
    for rank in range(WORLD):
        env = {
            **os.environ,
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": str(WORLD),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": port,
            "PYTHONPATH": str(ROOT),
            "OMP_NUM_THREADS": "1",
            "ORTRAIN_GRAPH_CACHE": str(out / "graph-cache"),  # each graph built by one rank
        }
        args = [str(out), str(zero_stage)]
        procs.append(start_rank("tests.test_batch_norm", args, env, out / f"log{rank}"))
    try:
        for p in procs:
            p.wait(timeout=300)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for rank, p in enumerate(procs):
        assert p.returncode == 0, (out / f"log{rank}").read_text()[-4000:]


def _eager_data_parallel() -> tuple[list[nn.Module], list[list[float]]]:
    """Per-rank eager replicas (DDP without buffer broadcast): each rank's forward on its
    own batch and statistics, the gradients averaged over ranks, the same AdamW step."""
    torch.manual_seed(0)
    first = cnn2d()
    replicas = [first] + [copy.deepcopy(first) for _ in range(WORLD - 1)]
    opts = [adamw(m) for m in replicas]
    data = [batches(cnn2d, STEPS, seed=10 + r) for r in range(WORLD)]
    losses: list[list[float]] = [[] for _ in range(WORLD)]
    for step in range(STEPS):
        for r, m in enumerate(replicas):
            opts[r].zero_grad()
            loss = m(**data[r][step])[0]
            loss.backward()
            losses[r].append(loss.item())
        for ps in zip(*(m.parameters() for m in replicas), strict=True):
            mean = sum(p.grad for p in ps) / WORLD
            for p in ps:
                p.grad = mean.clone()
        for o in opts:
            o.step()
    return replicas, losses


@pytest.mark.slow
@pytest.mark.parametrize("zero_stage", [0, 1], ids=["data_parallel", "zero1"])
def test_unbroadcast_buffers_keep_per_rank_statistics(tmp_path: Path, zero_stage: int) -> None:
    _launch(tmp_path, zero_stage)
    replicas, losses_ref = _eager_data_parallel()
    stats = []
    for rank in range(WORLD):
        got = torch.load(tmp_path / f"rank{rank}.pt")
        torch.testing.assert_close(
            torch.tensor(got["losses"]), torch.tensor(losses_ref[rank]), rtol=LOSS_RTOL, atol=0
        )
        model = cnn2d()
        model.load_state_dict(got["state"])
        assert_params_close(model, replicas[rank])
        assert_buffers_equal(dict(model.named_buffers()), replicas[rank], PARAM_RTOL, PARAM_ATOL)
        stats.append(got["state"]["body.1.running_mean"])
    assert not torch.equal(stats[0], stats[1])  # each rank's own statistics


if __name__ == "__main__":  # a rank of test_unbroadcast_buffers_keep_per_rank_statistics
    _worker(Path(sys.argv[1]), int(sys.argv[2]))


@pytest.mark.parametrize("momentum", [0.1, None])
def test_instance_norm_tracking_running_stats_trains_like_eager(momentum):
    """Eager updates InstanceNorm's running statistics in training inside instance_norm
    (the batch's B copies of each channel's update averaged); the export dropped that
    update: written out during the export, they train as eager (unbatched input too)."""
    from ortrain import ORTTrainer

    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Conv1d(3, 4, 3),
        torch.nn.InstanceNorm1d(4, affine=True, track_running_stats=True, momentum=momentum),
    )
    ref = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    opt_ref = torch.optim.SGD(ref.parameters(), lr=0.1)
    trainer = ORTTrainer(model, opt, TrainerOptions(fallback="off"), loss_fn=_sum_loss)
    g = torch.Generator().manual_seed(1)
    for step, shape in enumerate([(2, 3, 9), (2, 3, 9), (3, 9), (3, 9)]):  # then unbatched
        x = 1.5 * torch.randn(shape, generator=g) + 0.5
        got = float(trainer.train_step(x))
        opt_ref.zero_grad()
        want = _sum_loss(ref(x), None)
        want.backward()
        opt_ref.step()
        assert got == pytest.approx(float(want.detach()), rel=1e-5), step
    assert trainer.segments is None
    trainer.sync_to_module()
    for (name, b), c in zip(model.named_buffers(), ref.buffers()):
        torch.testing.assert_close(b, c, rtol=1e-5, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")
    if momentum is not None:  # the statistics moved
        assert not torch.equal(ref[1].running_var, torch.ones(4))


class _OwnInstanceNorm(torch.nn.InstanceNorm2d):
    def _apply_instance_norm(self, input):
        return super()._apply_instance_norm(input) * 2.0


def test_instance_norm_with_its_own_tracking_code_is_refused_not_left_at_zero():
    from ortrain import ORTTrainer
    from ortrain.core.errors import ExportError

    model = torch.nn.Sequential(
        torch.nn.Conv2d(3, 4, 3), _OwnInstanceNorm(4, track_running_stats=True)
    )
    before = {k: v.clone() for k, v in model.state_dict().items()}
    # fallback="off": the refusal itself (with "auto" the layer trains in eager)
    trainer = ORTTrainer(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        TrainerOptions(fallback="off"),
        loss_fn=_sum_loss,
    )
    with pytest.raises(ExportError, match=r"_OwnInstanceNorm '1' tracks running statistics"):
        trainer.train_step(torch.randn(2, 3, 8, 8))
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k


def _sum_loss(outputs, batch):
    return outputs.pow(2).mean()


def _mobilenet_v1(layers: int) -> nn.Module:
    """transformers' MobileNetV1 at 64 px, cut after ``layers`` of its conv layers."""
    import transformers

    cfg = transformers.MobileNetV1Config(
        image_size=64, depth_multiplier=0.25, min_depth=4, num_labels=3
    )
    torch.manual_seed(0)
    base = transformers.MobileNetV1Model(cfg, add_pooling_layer=False)

    class Cut(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.stem, self.layers = base.conv_stem, nn.ModuleList(base.layer[:layers])
            self.head = nn.Linear(self.layers[-1].convolution.out_channels, 3)

        def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            h = self.stem(x)
            for layer in self.layers:
                h = layer(h)
            return F.cross_entropy(self.head(h.mean((2, 3))), y)

    return Cut()


@pytest.mark.slow
def test_a_deep_depthwise_stack_trains_as_precisely_as_eager() -> None:
    """MobileNetV1's 17th layer (a depthwise 3x3 on 4x4 maps whose channels' variance is
    far below eps) made every gradient of the first layers 1-4% off, whole graph and
    segments alike, where eager float32 agrees with float64 to 2e-6: ONNX Runtime's
    training-mode BatchNormalization (whose forward the fused backward used) loses digits
    to cancellation. Now the forward is the exporter's two-pass one."""
    g = torch.Generator().manual_seed(4)
    x, y = torch.randn(4, 3, 64, 64, generator=g), torch.randint(0, 3, (4,), generator=g)
    model = _mobilenet_v1(17)
    exact, eager = copy.deepcopy(model).double(), copy.deepcopy(model)
    exact(x.double(), y).backward()
    eager(x, y).backward()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    trainer = ORTTrainer(
        model, torch.optim.SGD(model.parameters(), lr=1.0), TrainerOptions(fallback="off")
    )
    trainer.train_step(x, y)
    trainer.sync_to_module()
    assert trainer.segments is None
    worst = {}
    for n, p in model.named_parameters():
        want = exact.get_parameter(n).grad
        scale = want.abs().max().item()
        got = ((before[n] - p.detach()).double() - want).abs().max().item() / scale
        own = (eager.get_parameter(n).grad.double() - want).abs().max().item() / scale
        worst[n] = (got, own)
    assert all(got <= 4 * own + 2e-5 for got, own in worst.values()), max(
        worst.items(), key=lambda kv: kv[1][0]
    )
