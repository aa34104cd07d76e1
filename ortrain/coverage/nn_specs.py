"""The specs of every ``torch.nn`` module class: layers, losses, and each constructor
option that changes the math; ``NOT_A_LAYER``: the classes that cannot be a trainable
layer, each with the reason.

``tests/test_nn_coverage.py`` fails when a class of ``vars(torch.nn)`` has neither. Shapes
are tiny (a few ms of eager compute); the batch axis is 2 to 4.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from ortrain.coverage.spec import Data, Float, Fresh, Spec, labelled, module_specs, v


# --------------------------------------------------------------------------- inputs
def x(*shape: int, then=None) -> Float:
    return Float(tuple(shape), then)


def ints(high: int, *shape: int, low: int = 0, ensure: dict[tuple, int] | None = None) -> Data:
    """Integers in [low, high); ``ensure`` sets entries (an ignored class, a padding index)
    so the option they test is exercised in every batch."""

    def sample(g: torch.Generator) -> torch.Tensor:
        t = torch.randint(low, high, shape, generator=g)
        for where, value in (ensure or {}).items():
            t[where] = value
        return t

    return Data(sample)


def floats(*shape: int) -> Data:
    return Data(lambda g: torch.randn(shape, generator=g))


def probs(*shape: int) -> Data:
    return Data(lambda g: torch.rand(shape, generator=g))


def binary(*shape: int) -> Data:
    return Data(lambda g: torch.randint(0, 2, shape, generator=g).float())


def signs(*shape: int) -> Data:
    return Data(lambda g: torch.randint(0, 2, shape, generator=g).float() * 2 - 1)


def const(value: torch.Tensor) -> Data:
    return Data(lambda g: value.clone())


def soft_labels(*shape: int, dim: int = 1) -> Data:
    return Data(lambda g: torch.randn(shape, generator=g).softmax(dim))


def padding_mask(n: int, s: int) -> Data:
    """A key padding mask: True (padded) at the end of some rows, never a whole row."""

    def sample(g: torch.Generator) -> torch.Tensor:
        lengths = torch.randint(1, s + 1, (n,), generator=g)
        lengths[0] = s - 1
        return torch.arange(s)[None, :] >= lengths[:, None]

    return Data(sample)


def log_softmax(dim: int):
    return labelled(functools.partial(F.log_softmax, dim=dim), f"log_softmax({dim})")


def positive(t: torch.Tensor) -> torch.Tensor:
    return F.softplus(t) + 0.1


def causal(n: int) -> torch.Tensor:
    return torch.ones(n, n, dtype=torch.bool).triu(1)


# ------------------------------------------------------------------------ what is not a layer
NOT_A_LAYER: dict[str, str] = {
    "Module": "the base class of every module: each subclass has its own spec",
    "Container": "deprecated base container (no forward); Sequential is the container with one",
    "ModuleList": "a container without forward: the modules it holds are called by their owner",
    "ModuleDict": "a container without forward: the modules it holds are called by their owner",
    "ParameterList": "a container of parameters without forward: its owner reads them",
    "ParameterDict": "a container of parameters without forward: its owner reads them",
    "RNNBase": "the base of RNN, LSTM and GRU (their specs); its forward is theirs",
    "RNNCellBase": "the base of RNNCell, LSTMCell and GRUCell (their specs); no forward",
    "SyncBatchNorm": "needs an initialized process group and runs on CUDA only "
    "(BatchNorm's math otherwise: the BatchNorm specs)",
}

_REDUCTIONS = (v(reduction="sum"), v(reduction="none"))


# --------------------------------------------------------------------------- activations
def _activations() -> list[Spec]:
    ms = module_specs
    a = (x(3, 8),)
    ip = v(inplace=True)
    return [
        *ms(nn.CELU, (), a, [v(alpha=0.6), ip]),
        *ms(nn.ELU, (), a, [v(alpha=0.6), ip]),
        *ms(nn.GELU, (), a, [v(approximate="tanh")]),
        *ms(nn.GLU, (), a, [v(dim=0, inputs=[x(4, 6)])]),
        *ms(nn.Hardshrink, (), a, [v(lambd=0.3)]),
        *ms(nn.Hardsigmoid, (), a, [ip]),
        *ms(nn.Hardswish, (), a, [ip]),
        *ms(nn.Hardtanh, (), a, [v(min_val=-0.5, max_val=0.3), ip]),
        *ms(nn.LeakyReLU, (), a, [v(negative_slope=0.2), ip]),
        *ms(nn.LogSigmoid, (), a),
        *ms(nn.LogSoftmax, (), a, [v(dim=0)], base={"dim": 1}, note="dim=1"),
        *ms(nn.Mish, (), a, [ip]),
        *ms(nn.PReLU, (), a, [v(num_parameters=4, init=0.1, inputs=[x(3, 4, 5)])]),
        *ms(nn.ReLU, (), a, [ip]),
        *ms(nn.ReLU6, (), a, [ip]),
        *ms(nn.RReLU, (), a, [v(lower=0.1, upper=0.2), ip], random=True),
        *ms(nn.SELU, (), a, [ip]),
        *ms(nn.SiLU, (), a, [ip]),
        *ms(nn.Sigmoid, (), a),
        *ms(nn.Softmax, (), a, [v(dim=0)], base={"dim": 1}, note="dim=1"),
        *ms(nn.Softmax2d, (), (x(2, 3, 4, 4),)),
        *ms(nn.Softmin, (), a, base={"dim": 1}, note="dim=1"),
        *ms(nn.Softplus, (), a, [v(beta=2.0, threshold=1.0)]),
        *ms(nn.Softshrink, (), a, [v(lambd=0.3)]),
        *ms(nn.Softsign, (), a),
        *ms(nn.Tanh, (), a),
        *ms(nn.Tanhshrink, (), a),
        *ms(nn.Threshold, (0.1, 20.0), a, [ip], note="threshold=0.1, value=20.0"),
    ]


def _dropouts() -> list[Spec]:
    ms = module_specs
    ip = v(inplace=True)
    return [
        *ms(nn.Dropout, (), (x(3, 8),), [v(p=0.2), ip], random=True),
        *ms(nn.Dropout1d, (), (x(2, 3, 5),), [ip], random=True),
        *ms(nn.Dropout2d, (), (x(2, 3, 4, 4),), [ip], random=True),
        *ms(nn.Dropout3d, (), (x(2, 3, 2, 3, 3),), [ip], random=True),
        *ms(nn.AlphaDropout, (), (x(3, 8),), [v(p=0.2)], random=True),
        *ms(nn.FeatureAlphaDropout, (), (x(2, 3, 4, 4),), [v(p=0.2)], random=True),
    ]


# --------------------------------------------------------------------------- linear, shape
def _linear_and_shape() -> list[Spec]:
    ms = module_specs
    return [
        *ms(nn.Identity, (), (x(3, 8),)),
        *ms(nn.Linear, (8, 5), (x(3, 8),),
            [v(bias=False), v("input (2, 3, 8)", inputs=[x(2, 3, 8)])]),
        *ms(nn.LazyLinear, (5,), (x(3, 8),), [v(bias=False)]),
        *ms(nn.Bilinear, (8, 6, 5), (x(3, 8), x(3, 6)), [v(bias=False)]),
        *ms(nn.Flatten, (), (x(3, 2, 4),), [v(start_dim=0, end_dim=1)]),
        *ms(nn.Unflatten, (1, (2, 4)), (x(3, 8),)),
        # factories: the modules they hold are built with the harness, one set per harness
        *ms(lambda: nn.Sequential(nn.Linear(8, 6), nn.ReLU(), nn.Linear(6, 4)), (), (x(3, 8),),
            name="Sequential", note="Linear, ReLU, Linear"),
        *ms(lambda: nn.DataParallel(nn.Linear(8, 4)), (), (x(3, 8),), name="DataParallel",
            note="of a Linear; without GPUs it calls the module"),
        *ms(nn.ChannelShuffle, (2,), (x(2, 4, 3, 3),)),
        *ms(nn.PixelShuffle, (2,), (x(2, 8, 3, 3),)),
        *ms(nn.PixelUnshuffle, (2,), (x(2, 2, 4, 4),)),
        *ms(nn.Fold, ((4, 5), 2), (x(2, 12, 12),), [
            v(stride=2, args=((4, 6), 2), inputs=[x(2, 12, 6)]),
            v(padding=1, dilation=2, inputs=[x(2, 12, 20)]),
        ], note="output_size=(4, 5), kernel_size=2"),
        *ms(nn.Unfold, (2,), (x(2, 3, 4, 5),), [v(dilation=2, padding=1), v(stride=2)],
            note="kernel_size=2"),
        *ms(nn.CosineSimilarity, (), (x(3, 8), x(3, 8)), [v(dim=0, eps=0.5)]),
        *ms(nn.PairwiseDistance, (), (x(3, 8), x(3, 8)),
            [v(p=1.0), v(p=3.0, eps=0.1), v(keepdim=True), v(p=float("inf"))]),
    ]  # fmt: skip


# --------------------------------------------------------------------------- convolutions
def _convolutions() -> list[Spec]:
    ms = module_specs
    c1, c2, c3 = (x(2, 3, 8),), (x(2, 3, 6, 6),), (x(2, 2, 4, 4, 4),)
    modes = [v(padding=1, padding_mode=m) for m in ("reflect", "replicate", "circular")]
    options = [
        v(stride=2, padding=1), v(dilation=2), v(bias=False), v(padding="same"), *modes,
    ]  # fmt: skip
    t_options = [v(stride=2, output_padding=1), v(padding=1, dilation=2), v(bias=False)]
    return [
        *ms(nn.Conv1d, (3, 4, 3), c1,
            [*options, v(groups=2, args=(4, 6, 3), inputs=[x(2, 4, 8)])]),
        *ms(nn.Conv2d, (3, 4, 3), c2,
            [*options, v(groups=2, args=(4, 6, 3), inputs=[x(2, 4, 6, 6)])]),
        *ms(nn.Conv3d, (2, 3, 2), c3, [v(stride=2), v(padding=1, padding_mode="circular"),
                                       v(groups=2, args=(2, 4, 2))]),
        *ms(nn.ConvTranspose1d, (3, 4, 3), (x(2, 3, 5),),
            [*t_options, v(groups=2, args=(4, 6, 3), inputs=[x(2, 4, 5)])]),
        *ms(nn.ConvTranspose2d, (3, 4, 3), (x(2, 3, 4, 4),),
            [*t_options, v(groups=2, args=(4, 6, 3), inputs=[x(2, 4, 4, 4)])]),
        *ms(nn.ConvTranspose3d, (2, 3, 2), (x(2, 2, 3, 3, 3),), [v(stride=2, output_padding=1)]),
        *ms(nn.LazyConv1d, (4, 3), c1),
        *ms(nn.LazyConv2d, (4, 3), c2),
        *ms(nn.LazyConv3d, (3, 2), c3),
        *ms(nn.LazyConvTranspose1d, (4, 3), c1),
        *ms(nn.LazyConvTranspose2d, (4, 3), (x(2, 3, 4, 4),)),
        *ms(nn.LazyConvTranspose3d, (3, 2), (x(2, 2, 3, 3, 3),)),
    ]  # fmt: skip


# --------------------------------------------------------------------------- pooling
def _unpool(pool):
    """MaxUnpool's call: the unit undoes ``pool``'s indices."""

    def call(unit, h):
        return unit(*pool(h))

    return call


def _pooling() -> list[Spec]:
    ms = module_specs
    c1, c2, c3 = (x(2, 3, 8),), (x(2, 3, 7, 7),), (x(2, 2, 5, 5, 5),)
    ri = v(return_indices=True)
    rs2 = Fresh((2, 3, 2), 0.0, 1.0)
    rs3 = Fresh((2, 2, 3), 0.0, 1.0)
    return [
        *ms(nn.AvgPool1d, (3, 2, 1), c1, [v(ceil_mode=True), v(count_include_pad=False)],
            note="kernel_size=3, stride=2, padding=1"),
        *ms(nn.AvgPool2d, (3, 2, 1), c2,
            [v(ceil_mode=True), v(count_include_pad=False), v(divisor_override=4),
             v(ceil_mode=True, divisor_override=5)],
            note="kernel_size=3, stride=2, padding=1"),
        *ms(nn.AvgPool3d, (3, 2, 1), c3,
            [v(ceil_mode=True), v(count_include_pad=False), v(divisor_override=4)],
            note="kernel_size=3, stride=2, padding=1"),
        *ms(nn.MaxPool1d, (3, 2, 1), c1, [v(dilation=2), v(ceil_mode=True), ri],
            note="kernel_size=3, stride=2, padding=1"),
        *ms(nn.MaxPool2d, (3, 2, 1), c2, [v(dilation=2), v(ceil_mode=True), ri],
            note="kernel_size=3, stride=2, padding=1"),
        *ms(nn.MaxPool3d, (3, 2, 1), c3, [v(ceil_mode=True), ri],
            note="kernel_size=3, stride=2, padding=1"),
        *ms(nn.AdaptiveAvgPool1d, (3,), c1),
        *ms(nn.AdaptiveAvgPool2d, ((3, 2),), c2, [v("output_size=(None, 3)", args=((None, 3),))],
            note="output_size=(3, 2)"),
        *ms(nn.AdaptiveAvgPool3d, ((2, 3, 2),), c3),
        *ms(nn.AdaptiveMaxPool1d, (3,), c1, [ri]),
        *ms(nn.AdaptiveMaxPool2d, ((3, 2),), c2, [ri]),
        *ms(nn.AdaptiveMaxPool3d, ((2, 3, 2),), c3, [ri]),
        *ms(nn.FractionalMaxPool2d, (2,), (x(2, 3, 7, 7),),
            [v(output_size=None, output_ratio=0.5), ri], base={"output_size": 3},
            note="output_size=3", random=True),
        *ms(nn.FractionalMaxPool2d, (2,), (x(2, 3, 7, 7),),
            [v("_random_samples fixed", return_indices=True)],
            base={"output_size": 3, "_random_samples": rs2},
            note="output_size=3, _random_samples fixed"),
        *ms(nn.FractionalMaxPool3d, (2,), (x(2, 2, 5, 5, 5),), [ri],
            base={"output_size": 2}, note="output_size=2", random=True),
        *ms(nn.FractionalMaxPool3d, (2,), (x(2, 2, 5, 5, 5),),
            base={"output_size": 2, "_random_samples": rs3},
            note="output_size=2, _random_samples fixed"),
        *ms(nn.LPPool1d, (2, 3), c1, [
            v("norm_type=1.5, positive input", args=(1.5, 3), inputs=[x(2, 3, 8, then=positive)]),
            v(stride=1), v(ceil_mode=True),
        ], note="norm_type=2, kernel_size=3"),
        *ms(nn.LPPool2d, (2, 2), c2, [
            v("norm_type=3, positive input", args=(3, 2), inputs=[x(2, 3, 7, 7, then=positive)]),
            v(ceil_mode=True),
        ], note="norm_type=2, kernel_size=2"),
        *ms(nn.LPPool3d, (2, 2), c3, note="norm_type=2, kernel_size=2"),
        *ms(nn.MaxUnpool1d, (2,), (x(2, 3, 8),), [
            v("output_size given", call=lambda u, h: u(*F.max_pool1d(
                h[..., :7], 2, return_indices=True), output_size=[7])),
        ], call=_unpool(functools.partial(F.max_pool1d, kernel_size=2, return_indices=True)),
            note="of max_pool1d(2)'s indices"),
        *ms(nn.MaxUnpool2d, (2,), (x(2, 3, 4, 4),),
            call=_unpool(functools.partial(F.max_pool2d, kernel_size=2, return_indices=True)),
            note="of max_pool2d(2)'s indices"),
        *ms(nn.MaxUnpool3d, (2,), (x(2, 2, 4, 4, 4),),
            call=_unpool(functools.partial(F.max_pool3d, kernel_size=2, return_indices=True)),
            note="of max_pool3d(2)'s indices"),
    ]  # fmt: skip


# --------------------------------------------------------------------------- padding
def _padding() -> list[Spec]:
    ms = module_specs
    out: list[Spec] = []
    shapes = {1: x(2, 3, 5), 2: x(2, 2, 4, 5), 3: x(2, 2, 3, 4, 4)}
    pads = {1: (1, 2), 2: (1, 2, 2, 0), 3: (1, 0, 2, 1, 0, 1)}
    for d in (1, 2, 3):
        inp = (shapes[d],)
        out += ms(getattr(nn, f"CircularPad{d}d"), (pads[d],), inp, note=f"padding={pads[d]}")
        out += ms(getattr(nn, f"ConstantPad{d}d"), (pads[d], 0.5), inp,
                  note=f"padding={pads[d]}, value=0.5")  # fmt: skip
        out += ms(getattr(nn, f"ReflectionPad{d}d"), (pads[d],), inp, note=f"padding={pads[d]}")
        out += ms(getattr(nn, f"ReplicationPad{d}d"), (pads[d],), inp, note=f"padding={pads[d]}")
        out += ms(getattr(nn, f"ZeroPad{d}d"), (pads[d],), inp, note=f"padding={pads[d]}")
    out += ms(nn.ZeroPad2d, ((-1, 1, 0, 2),), (shapes[2],), note="padding=(-1, 1, 0, 2): crops")
    return out


# --------------------------------------------------------------------------- resampling
def _resampling() -> list[Spec]:
    ms = module_specs
    s1, s2, s3 = (x(2, 3, 4),), (x(2, 2, 3, 4),), (x(2, 2, 2, 3, 3),)
    return [
        # [1:]: Upsample() without a size or a scale is no spec; each variant names one
        *ms(nn.Upsample, (), s2, [
            v(scale_factor=2),
            v(scale_factor=2, mode="nearest-exact"),
            v(size=(5, 7), mode="nearest"),
            v(scale_factor=2, mode="linear", inputs=s1),
            v(scale_factor=2, mode="linear", align_corners=True, inputs=s1),
            v(scale_factor=2, mode="bilinear"),
            v(scale_factor=2, mode="bilinear", align_corners=True),
            v(scale_factor=1.5, mode="bilinear", recompute_scale_factor=True),
            v(size=(5, 7), mode="bicubic"),
            v(scale_factor=2, mode="bicubic", align_corners=True),
            v(scale_factor=2, mode="trilinear", inputs=s3),
            v(scale_factor=2, mode="trilinear", align_corners=True, inputs=s3),
            v("input (N, C, L)", scale_factor=2, inputs=s1),
            v("input (N, C, D, H, W)", scale_factor=2, inputs=s3),
        ])[1:],
        *ms(nn.UpsamplingBilinear2d, (), s2, base={"scale_factor": 2}, note="scale_factor=2"),
        *ms(nn.UpsamplingNearest2d, (), s2, base={"scale_factor": 2}, note="scale_factor=2"),
    ]  # fmt: skip


# --------------------------------------------------------------------------- normalization
def _normalization() -> list[Spec]:
    ms = module_specs
    b1, b2, b3 = (x(4, 3),), (x(3, 3, 4, 4),), (x(2, 2, 3, 3, 3),)
    no_stats = v(track_running_stats=False)
    return [
        *ms(nn.BatchNorm1d, (3,), b1, [
            v("input (N, C, L)", inputs=[x(3, 3, 5)]), v(affine=False), no_stats,
            v(momentum=None), v(momentum=0.5, eps=0.1),
        ]),
        *ms(nn.BatchNorm2d, (3,), b2, [v(affine=False), no_stats]),
        *ms(nn.BatchNorm3d, (2,), b3, [v(affine=False)]),
        *ms(nn.LazyBatchNorm1d, (), b1),
        *ms(nn.LazyBatchNorm2d, (), b2),
        *ms(nn.LazyBatchNorm3d, (), b3),
        *ms(nn.GroupNorm, (2, 4), (x(3, 4, 5),), [v(affine=False), v(eps=0.1)],
            note="num_groups=2, num_channels=4"),
        *ms(nn.InstanceNorm1d, (3,), (x(2, 3, 6),), [
            v(affine=True), v(track_running_stats=True),
            v(affine=True, track_running_stats=True),
        ]),
        *ms(nn.InstanceNorm2d, (3,), (x(2, 3, 4, 4),),
            [v(affine=True), v(track_running_stats=True)]),
        *ms(nn.InstanceNorm3d, (2,), (x(2, 2, 3, 3, 3),), [v(affine=True)]),
        *ms(nn.LazyInstanceNorm1d, (), (x(2, 3, 6),), base={"affine": True}, note="affine=True"),
        *ms(nn.LazyInstanceNorm2d, (), (x(2, 3, 4, 4),), base={"affine": True}, note="affine=True"),
        *ms(nn.LazyInstanceNorm3d, (), (x(2, 2, 3, 3, 3),), base={"affine": True},
            note="affine=True"),
        *ms(nn.LayerNorm, (8,), (x(3, 8),), [
            v(elementwise_affine=False), v(bias=False), v(eps=0.1),
            v(args=((4, 8),), inputs=[x(3, 4, 8)], note="normalized_shape=(4, 8)"),
        ]),
        *ms(nn.RMSNorm, (8,), (x(3, 8),), [
            v(eps=0.1), v(elementwise_affine=False),
            v(args=((4, 8),), inputs=[x(3, 4, 8)], note="normalized_shape=(4, 8)"),
        ]),
        *ms(nn.LocalResponseNorm, (3,), (x(2, 5, 3, 3),), [v(alpha=0.1, beta=0.5, k=2.0),
            v("input (N, C, L)", inputs=[x(2, 5, 4)])], note="size=3"),
        *ms(nn.CrossMapLRN2d, (3,), (x(2, 5, 3, 3),), [v(alpha=0.1, beta=0.5, k=2.0)],
            note="size=3"),
    ]  # fmt: skip


# --------------------------------------------------------------------------- embeddings
def _embeddings() -> list[Spec]:
    ms = module_specs
    ids = (ints(10, 3, 5, ensure={(0, 0): 0, (1, 2): 0, (2, 1): 3, (2, 3): 3}),)
    bag_ids = (ints(10, 3, 4, ensure={(0, 0): 0, (1, 1): 0}),)
    flat_ids = ints(10, 8, ensure={(0,): 0})
    offsets = const(torch.tensor([0, 3, 5]))
    return [
        *ms(nn.Embedding, (10, 4), ids, [
            v(padding_idx=0), v(max_norm=1.0), v(max_norm=1.0, norm_type=1.0),
            v(scale_grad_by_freq=True), v(sparse=True),
        ]),
        *ms(nn.EmbeddingBag, (10, 4), bag_ids, [
            v(mode="sum"), v(mode="max"), v(padding_idx=0), v(max_norm=1.0),
            v(scale_grad_by_freq=True, mode="sum"),
            v("offsets", inputs=[flat_ids, offsets]),
            v("offsets", mode="max", inputs=[flat_ids, offsets]),
            v("offsets", include_last_offset=True,
              inputs=[flat_ids, const(torch.tensor([0, 3, 5, 8]))]),
            v("per_sample_weights", mode="sum", inputs=[*bag_ids, x(3, 4)],
              call=lambda u, i, w: u(i, per_sample_weights=w)),
        ], note="mode='mean'"),
    ]  # fmt: skip


# --------------------------------------------------------------------------- recurrent
def _recurrent() -> list[Spec]:
    ms = module_specs
    seq = (x(5, 2, 4),)
    options = [
        v(num_layers=2), v(bidirectional=True), v(batch_first=True, inputs=[x(2, 5, 4)]),
        v(bias=False), v(num_layers=2, bidirectional=True),
        v(num_layers=2, dropout=0.3, random=True),
    ]  # fmt: skip
    h0 = v("h0 given", inputs=[*seq, x(1, 2, 5)])
    hc0 = v("(h0, c0) given", inputs=[*seq, x(1, 2, 5), x(1, 2, 5)],
            call=lambda u, s, h, c: u(s, (h, c)))  # fmt: skip
    return [
        *ms(nn.RNN, (4, 5), seq, [*options, v(nonlinearity="relu"), h0]),
        *ms(nn.GRU, (4, 5), seq, [*options, h0]),
        *ms(nn.LSTM, (4, 5), seq, [
            *options, hc0, v(proj_size=3), v(proj_size=3, bidirectional=True),
            v(proj_size=3, num_layers=2, batch_first=True, inputs=[x(2, 5, 4)]),
            v(proj_size=3, num_layers=2, dropout=0.3, random=True),
        ]),
        *ms(nn.RNNCell, (4, 5), (x(3, 4),), [v(nonlinearity="relu"), v(bias=False),
                                              v("hx given", inputs=[x(3, 4), x(3, 5)])]),
        *ms(nn.GRUCell, (4, 5), (x(3, 4),),
            [v(bias=False), v("hx given", inputs=[x(3, 4), x(3, 5)])]),
        *ms(nn.LSTMCell, (4, 5), (x(3, 4),), [
            v(bias=False),
            v("(hx, cx) given", inputs=[x(3, 4), x(3, 5), x(3, 5)],
              call=lambda u, s, h, c: u(s, (h, c))),
        ]),
    ]  # fmt: skip


# --------------------------------------------------------------------------- attention
def _attention() -> list[Spec]:
    ms = module_specs
    qkv = (x(4, 2, 8), x(4, 2, 8), x(4, 2, 8))
    mha = [
        v(batch_first=True, inputs=[x(2, 4, 8)] * 3),
        v(kdim=6, vdim=5, inputs=[x(4, 2, 8), x(3, 2, 6), x(3, 2, 5)]),
        v(bias=False), v(add_bias_kv=True), v(add_zero_attn=True),
        v(dropout=0.2, random=True),
        v("self-attention (query is key is value)", inputs=[x(4, 2, 8)],
          call=lambda u, h: u(h, h, h)),
        v("need_weights=False", call=lambda u, q, k, w: u(q, k, w, need_weights=False)),
        v("average_attn_weights=False",
          call=lambda u, q, k, w: u(q, k, w, average_attn_weights=False)),
        v("attn_mask causal (bool)", call=lambda u, q, k, w: u(q, k, w, attn_mask=causal(4))),
        v("attn_mask float", call=lambda u, q, k, w: u(
            q, k, w, attn_mask=torch.linspace(-1, 0, 16).reshape(4, 4))),
        v("is_causal with its mask",
          call=lambda u, q, k, w: u(q, k, w, attn_mask=causal(4), is_causal=True,
                                    need_weights=False)),
        v("key_padding_mask", inputs=[*qkv, padding_mask(2, 4)],
          call=lambda u, q, k, w, m: u(q, k, w, key_padding_mask=m)),
    ]  # fmt: skip
    enc = dict(dim_feedforward=16, dropout=0.0)
    src, tgt = x(4, 2, 8), x(3, 2, 8)
    layer_opts = [
        v(norm_first=True), v(activation="gelu"), v(activation=labelled(F.silu, "F.silu")),
        v(bias=False), v(layer_norm_eps=0.1), v(dropout=0.1, random=True),
    ]  # fmt: skip

    def encoder(layers: int, norm: bool = False):
        def make(**kw):
            layer = nn.TransformerEncoderLayer(8, 2, **{**enc, **kw})
            return nn.TransformerEncoder(layer, layers, nn.LayerNorm(8) if norm else None,
                                         enable_nested_tensor=False)  # fmt: skip

        return make

    def decoder(layers: int, norm: bool = False):
        def make(**kw):
            layer = nn.TransformerDecoderLayer(8, 2, **{**enc, **kw})
            return nn.TransformerDecoder(layer, layers, nn.LayerNorm(8) if norm else None)

        return make

    tiny = dict(num_encoder_layers=1, num_decoder_layers=1, dim_feedforward=16, dropout=0.0)
    return [
        *ms(nn.MultiheadAttention, (8, 2), qkv, mha, note="embed_dim=8, num_heads=2"),
        *ms(nn.TransformerEncoderLayer, (8, 2), (src,), [
            v(batch_first=True, inputs=[x(2, 4, 8)]), *layer_opts,
            v("src_mask causal", call=lambda u, s: u(s, src_mask=causal(4))),
            v("src_mask causal, is_causal=True",
              call=lambda u, s: u(s, src_mask=causal(4), is_causal=True)),
            v("src_key_padding_mask", inputs=[src, padding_mask(2, 4)],
              call=lambda u, s, m: u(s, src_key_padding_mask=m)),
        ], base=enc, note="d_model=8, nhead=2"),
        *ms(nn.TransformerDecoderLayer, (8, 2), (tgt, src), [
            v(batch_first=True, inputs=[x(2, 3, 8), x(2, 4, 8)]), *layer_opts,
            v("tgt_mask causal", call=lambda u, t, m: u(t, m, tgt_mask=causal(3))),
            v("memory_key_padding_mask", inputs=[tgt, src, padding_mask(2, 4)],
              call=lambda u, t, m, k: u(t, m, memory_key_padding_mask=k)),
        ], base=enc, note="d_model=8, nhead=2"),
        *ms(encoder(2), (), (src,), [
            v(norm_first=True),
            v("mask causal", call=lambda u, s: u(s, mask=causal(4))),
        ], name="TransformerEncoder", note="2 layers of d_model=8, nhead=2"),
        *ms(encoder(2, norm=True), (), (src,), name="TransformerEncoder",
            note="2 layers, norm=LayerNorm(8)"),
        *ms(decoder(2), (), (tgt, src), [v(norm_first=True)], name="TransformerDecoder",
            note="2 layers of d_model=8, nhead=2"),
        *ms(decoder(2, norm=True), (), (tgt, src), name="TransformerDecoder",
            note="2 layers, norm=LayerNorm(8)"),
        *ms(nn.Transformer, (8, 2), (src, tgt), [
            v(batch_first=True, inputs=[x(2, 4, 8), x(2, 3, 8)]), v(norm_first=True),
            v("tgt_mask causal", call=lambda u, s, t: u(s, t, tgt_mask=causal(3))),
            v("key padding masks", inputs=[src, tgt, padding_mask(2, 4)],
              call=lambda u, s, t, m: u(s, t, src_key_padding_mask=m,
                                         memory_key_padding_mask=m)),
        ], base=tiny, note="d_model=8, nhead=2, 1 + 1 layers"),
    ]  # fmt: skip


# --------------------------------------------------------------------------- losses
def _losses() -> list[Spec]:
    def ls(cls, args, inputs, variants=(), **kw):
        return module_specs(cls, args, inputs, variants, head="loss", **kw)

    r = _REDUCTIONS
    reg = (x(3, 5), floats(3, 5))
    ce = (x(4, 5), ints(5, 4, ensure={(0,): 1}))
    nll = (x(4, 5, then=log_softmax(1)), ints(5, 4, ensure={(0,): 1}))
    kdim_ce = (x(3, 5, 4, then=None), ints(5, 3, 4, ensure={(0, 0): 1}))
    lp = (x(3, 5, then=log_softmax(1)), soft_labels(3, 5))
    ctc = (x(6, 2, 4, then=log_softmax(2)), ints(4, 2, 3, low=1),
           const(torch.tensor([6, 6])), const(torch.tensor([3, 2])))  # fmt: skip
    return [
        *ls(nn.L1Loss, (), reg, r),
        *ls(nn.MSELoss, (), reg, r),
        *ls(nn.HuberLoss, (), reg, [*r, v(delta=0.5)]),
        *ls(nn.SmoothL1Loss, (), reg, [*r, v(beta=0.5), v(beta=0.0)]),
        *ls(nn.BCELoss, (), (x(3, 5, then=torch.sigmoid), probs(3, 5)),
            [*r, v(weight=Fresh((5,)))], note="input sigmoid(.)"),
        *ls(nn.BCEWithLogitsLoss, (), (x(3, 5), probs(3, 5)),
            [*r, v(weight=Fresh((5,))), v(pos_weight=Fresh((5,))),
             v(pos_weight=Fresh((5,)), weight=Fresh((3, 1)), reduction="sum")]),
        *ls(nn.CrossEntropyLoss, (), ce, [
            *r, v(weight=Fresh((5,))), v(ignore_index=1), v(label_smoothing=0.1),
            v(label_smoothing=0.1, weight=Fresh((5,))),
            v(label_smoothing=0.1, ignore_index=1, reduction="sum"),
            v(weight=Fresh((5,)), ignore_index=1, reduction="none"),
            v("probability targets", inputs=[x(4, 5), soft_labels(4, 5)]),
            v("probability targets", label_smoothing=0.2, weight=Fresh((5,)),
              inputs=[x(4, 5), soft_labels(4, 5)]),
            v("input (N, C, d)", inputs=list(kdim_ce)),
            v("input (N, C, d)", ignore_index=1, weight=Fresh((5,)), inputs=list(kdim_ce)),
            v("targets with -100", inputs=[x(4, 5), ints(5, 4, ensure={(1,): -100})]),
        ]),
        *ls(nn.NLLLoss, (), nll, [
            *r, v(weight=Fresh((5,))), v(ignore_index=1),
            v(weight=Fresh((5,)), ignore_index=1),
            v("input (N, C, d)", inputs=[x(3, 5, 4, then=log_softmax(1)), kdim_ce[1]]),
        ], note="input log_softmax(.)"),
        *ls(nn.NLLLoss2d, (), (x(2, 5, 3, 3, then=log_softmax(1)), ints(5, 2, 3, 3)),
            note="input (N, C, H, W) log_softmax(.)"),
        *ls(nn.KLDivLoss, (), lp, [
            v(reduction="batchmean"), v(reduction="sum"), v(reduction="none"),
            v(log_target=True, inputs=[lp[0], Data(lambda g: torch.randn(3, 5, generator=g)
                                                  .log_softmax(1))]),
        ], note="input log_softmax(.)"),
        *ls(nn.PoissonNLLLoss, (), (x(3, 5), Data(lambda g: torch.randint(0, 5, (3, 5),
                                                                          generator=g).float())), [
            *r, v(full=True),
            v(log_input=False, inputs=[x(3, 5, then=positive), ints(5, 3, 5)]),
            v(log_input=False, eps=0.5, full=True, inputs=[x(3, 5, then=positive), ints(5, 3, 5)]),
        ]),
        *ls(nn.GaussianNLLLoss, (), (x(3, 5), floats(3, 5), x(3, 5, then=positive)), [
            *r, v(full=True), v(eps=0.5),
            v("var (N, 1)", inputs=[x(3, 5), floats(3, 5), x(3, 1, then=positive)]),
        ], note="var softplus(.) + 0.1"),
        *ls(nn.CosineEmbeddingLoss, (), (x(3, 5), x(3, 5), signs(3)), [*r, v(margin=0.2)]),
        *ls(nn.HingeEmbeddingLoss, (), (x(3, 5), signs(3, 5)), [*r, v(margin=0.5)]),
        *ls(nn.MarginRankingLoss, (), (x(6), x(6), signs(6)), [*r, v(margin=0.3)]),
        *ls(nn.MultiLabelMarginLoss, (), (x(3, 5), const(torch.tensor(
            [[3, 0, -1, 1, 2], [1, 2, 3, 4, -1], [4, -1, 0, 0, 0]]))), r),
        *ls(nn.MultiLabelSoftMarginLoss, (), (x(3, 5), binary(3, 5)),
            [*r, v(weight=Fresh((5,)))]),
        *ls(nn.MultiMarginLoss, (), ce, [*r, v(p=2), v(margin=0.5), v(weight=Fresh((5,)))]),
        *ls(nn.SoftMarginLoss, (), (x(3, 5), signs(3, 5)), r),
        *ls(nn.TripletMarginLoss, (), (x(3, 5), x(3, 5), x(3, 5)), [
            *r, v(margin=0.5), v(p=1.0), v(swap=True), v(eps=0.1),
        ]),
        *ls(nn.TripletMarginWithDistanceLoss, (), (x(3, 5), x(3, 5), x(3, 5)), [
            *r, v(distance_function=labelled(lambda a, b: 1 - F.cosine_similarity(a, b),
                                            "1 - cosine_similarity")),
            v(margin=0.5), v(swap=True),
        ]),
        *ls(nn.CTCLoss, (), ctc, [
            *r, v(blank=3, inputs=[ctc[0], ints(3, 2, 3), *ctc[2:]]),
            v(zero_infinity=True, inputs=[ctc[0], ctc[1], const(torch.tensor([6, 2])),
                                         const(torch.tensor([3, 3]))],
              note="an infeasible target"),
            v("concatenated targets", inputs=[ctc[0], ints(4, 5, low=1), *ctc[2:]]),
        ], note="log_probs (T, N, C) log_softmax(.)"),
        *ls(nn.AdaptiveLogSoftmaxWithLoss, (8, 10, [4, 8]),
            (x(4, 8), ints(10, 4, ensure={(0,): 9, (1,): 5})),
            [v(div_value=2.0), v(head_bias=True)], pick=lambda out: out.loss,
            note="cutoffs=[4, 8], its .loss"),
        *ls(nn.LinearCrossEntropyLoss, (8, 5), (x(4, 8), ints(5, 4, ensure={(0,): 1})), [
            *r, v(bias=True), v(label_smoothing=0.1), v(ignore_index=1),
            v(weight=Fresh((5,))),
            v(out_features=(3,), inputs=[x(4, 8), ints(5, 4, 3)]),
        ]),
    ]  # fmt: skip


# --------------------------------------------------------------------------- torch.nn.utils
def _wrapped(name: str, wrap, make, inputs, note: str = "") -> Spec:
    """A module transformed by a ``torch.nn.utils`` function (a parametrization, a hook)."""
    return Spec(f"utils.{name}", note, lambda: wrap(make()), tuple(inputs))


def utils_specs() -> list[Spec]:
    """Weight parametrizations users add to their layers (not module classes themselves:
    ``tests/test_nn_coverage.py`` checks the names exist in ``torch.nn.utils``)."""
    from torch.nn.utils import parametrizations as P

    lin, sq = (lambda: nn.Linear(8, 5)), (lambda: nn.Linear(5, 5))
    conv = lambda: nn.Conv2d(3, 4, 3)  # noqa: E731
    return [
        _wrapped("parametrizations.weight_norm", P.weight_norm, lin, [x(3, 8)], "of a Linear"),
        _wrapped("parametrizations.weight_norm", P.weight_norm, conv, [x(2, 3, 5, 5)],
                 "of a Conv2d"),
        _wrapped("parametrizations.spectral_norm", P.spectral_norm, lin, [x(3, 8)],
                 "of a Linear"),
        _wrapped("parametrizations.spectral_norm", P.spectral_norm, conv, [x(2, 3, 5, 5)],
                 "of a Conv2d"),
        _wrapped("parametrizations.orthogonal", P.orthogonal, sq, [x(3, 5)], "of a Linear"),
        _wrapped("weight_norm", nn.utils.weight_norm, lin, [x(3, 8)], "of a Linear (hook)"),
        _wrapped("spectral_norm", nn.utils.spectral_norm, lin, [x(3, 8)], "of a Linear (hook)"),
    ]  # fmt: skip


def nn_specs() -> list[Spec]:
    """Every spec of a ``torch.nn`` class, family by family."""
    return [
        *_activations(),
        *_dropouts(),
        *_linear_and_shape(),
        *_convolutions(),
        *_pooling(),
        *_padding(),
        *_resampling(),
        *_normalization(),
        *_embeddings(),
        *_recurrent(),
        *_attention(),
        *_losses(),
    ]
