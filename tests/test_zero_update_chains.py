"""ZeRO's shard update graph cut into chains of at most UPDATE_CHAIN_NUMEL elements
(ortrain/distributed/sharded_state.py): the same update as one chain per parameter piece,
element for element, with no chain longer than the limit."""

from __future__ import annotations

import itertools

import numpy as np
import onnxruntime as ort
import pytest

from ortrain.core.optimizer_spec import GroupSpec, OptimizerSpec
from ortrain.distributed.sharded_state import _chunked_spec, _chunks
from ortrain.graph_passes.infra.serialize import serialize_for_ort
from ortrain.graph_passes.training.zero import build_shard_update_graph
from ortrain.runtime.flat_layout import UPDATE_CHAIN_NUMEL, FlatLayout

N = UPDATE_CHAIN_NUMEL


def _run(spec: OptimizerSpec, numels: dict[str, int], feeds: dict[str, np.ndarray]) -> dict:
    ug = build_shard_update_graph(spec, numels, clip_grad_norm=False)
    data, _ = serialize_for_ort(ug.model)
    sess = ort.InferenceSession(data, providers=["CPUExecutionProvider"])
    names = [o.name for o in sess.get_outputs()]
    wanted = {i.name for i in sess.get_inputs()}
    return dict(zip(names, sess.run(None, {k: v for k, v in feeds.items() if k in wanted})))


@pytest.mark.parametrize("kind", ["adamw", "sgd"])
def test_chunked_shard_update_equals_one_chain_per_piece(kind):
    # rank 1 of 2: a large tensor straddles the shard boundary, a small one sits inside
    shapes = {"emb": (3 * N + 5,), "bias": (7,), "big": (2 * N,)}
    layout = FlatLayout.build(shapes, align=16, world_size=2)
    pieces = layout.pieces(1)
    chunks = _chunks(pieces)
    assert all(0 < c.stop - c.start <= N for c in chunks)
    # the chunks tile each piece exactly, in order
    for pc in pieces:
        mine = [c for c in chunks if c.param == pc.name]
        assert mine[0].start == pc.start and mine[-1].stop == pc.stop
        assert all(a.stop == b.start for a, b in itertools.pairwise(mine))
    assert len(chunks) > len(pieces)  # something was cut
    assert len({c.name for c in chunks}) == len(chunks)

    group = GroupSpec(tuple(shapes), momentum=kind == "sgd")
    spec = OptimizerSpec(kind, (group,))
    chunked = _chunked_spec(spec, chunks)
    assert [n for g in chunked.groups for n in g.params] == [c.name for c in chunks]

    rng = np.random.default_rng(0)
    lo = layout.shard(1)[0]
    flat = {
        what: rng.standard_normal(layout.shard_numel).astype(np.float32)
        for what in ("param", "grad", "exp_avg", "exp_avg_sq", "momentum_buffer")
    }
    flat["exp_avg_sq"] = np.abs(flat["exp_avg_sq"])
    scalars = {
        "step": np.array(3, dtype=np.float32),
        "grad_scale": np.array(0.5, dtype=np.float32),
        "group0.lr": np.array(1e-2, dtype=np.float32),
        "group0.beta1": np.array(0.9, dtype=np.float32),
        "group0.beta2": np.array(0.999, dtype=np.float32),
        "group0.eps": np.array(1e-8, dtype=np.float32),
        "group0.weight_decay": np.array(0.01, dtype=np.float32),
        "group0.momentum": np.array(0.9, dtype=np.float32),
        "group0.dampening": np.array(0.0, dtype=np.float32),
    }

    def feeds(parts: list[tuple[str, int, int]]) -> dict[str, np.ndarray]:
        out = dict(scalars)
        for name, a, b in parts:
            out[name] = flat["param"][a - lo : b - lo]
            out[f"grad:{name}"] = flat["grad"][a - lo : b - lo]
            for s in ("exp_avg", "exp_avg_sq", "momentum_buffer"):
                out[f"{s}:{name}"] = flat[s][a - lo : b - lo]
        return out

    whole = _run(
        spec,
        {pc.name: pc.numel for pc in pieces},
        feeds([(pc.name, pc.start, pc.stop) for pc in pieces]),
    )
    cut = _run(
        chunked,
        {c.name: c.stop - c.start for c in chunks},
        feeds([(c.name, c.start, c.stop) for c in chunks]),
    )
    assert set(whole) >= {f"new:{pc.name}" for pc in pieces}
    for pc in pieces:
        mine = [c.name for c in chunks if c.param == pc.name]
        for out in [k for k in whole if k.endswith(f":{pc.name}") and k.startswith("new:")]:
            prefix = out[: -len(pc.name)]
            joined = np.concatenate([cut[prefix + n] for n in mine])
            np.testing.assert_array_equal(joined, whole[out])
