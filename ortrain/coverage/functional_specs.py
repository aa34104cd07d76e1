"""The public callables of ``torch.nn.functional``: a spec of their own, the spec of a
module class whose forward calls them (``EXERCISED_BY``), or the reason they are no
trainable op (``NOT_AN_OP``).

``tests/test_nn_coverage.py`` fails when a public callable of ``torch.nn.functional`` has
no entry, and checks every ``EXERCISED_BY`` entry by running that spec's eager forward
and recording the functions it calls.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ortrain.coverage.nn_specs import causal, x
from ortrain.coverage.spec import Spec, fn_spec

# Not differentiable ops: helpers the module imports, integer results, CUDA-only kernels.
NOT_AN_OP: dict[str, str] = {
    "Optional": "typing.Optional, imported by the module",
    "boolean_dispatch": "a helper that picks one of two functions by a flag (its targets are here)",
    "handle_torch_function": "the __torch_function__ dispatch helper",
    "has_torch_function": "the __torch_function__ dispatch helper",
    "has_torch_function_unary": "the __torch_function__ dispatch helper",
    "has_torch_function_variadic": "the __torch_function__ dispatch helper",
    "assert_int_or_pair": "an argument check",
    "one_hot": "integer output: nothing to differentiate",
    "scaled_mm": "float8 scaled matrix product: CUDA kernels only",
    "scaled_grouped_mm": "float8 scaled grouped matrix product: CUDA kernels only",
    "native_channel_shuffle": "eager PyTorch has no derivative for it (torch 2.13); "
    "channel_shuffle is the differentiable form (ChannelShuffle)",
    "grouped_mm": "eager PyTorch cannot differentiate it on CPU (torch 2.13: its backward "
    "fails with 'Invalid strides/sizes'); transformers' grouped_mm experts train in the zoo",
}

# Functions whose module class calls them: the spec that exercises them (its id).
EXERCISED_BY: dict[str, str] = {
    "conv1d": "Conv1d",
    "conv2d": "Conv2d",
    "conv3d": "Conv3d",
    "conv_transpose1d": "ConvTranspose1d",
    "conv_transpose2d": "ConvTranspose2d",
    "conv_transpose3d": "ConvTranspose3d",
    "avg_pool1d": "AvgPool1d(kernel_size=3, stride=2, padding=1)",
    "avg_pool2d": "AvgPool2d(kernel_size=3, stride=2, padding=1)",
    "avg_pool3d": "AvgPool3d(kernel_size=3, stride=2, padding=1)",
    "fractional_max_pool2d": "FractionalMaxPool2d(output_size=3, _random_samples fixed)",
    "fractional_max_pool2d_with_indices":
        "FractionalMaxPool2d(return_indices=True, _random_samples fixed)",
    "fractional_max_pool3d": "FractionalMaxPool3d(output_size=2, _random_samples fixed)",
    "fractional_max_pool3d_with_indices": "FractionalMaxPool3d(return_indices=True)",
    "max_pool1d": "MaxPool1d(kernel_size=3, stride=2, padding=1)",
    "max_pool1d_with_indices": "MaxPool1d(return_indices=True)",
    "max_pool2d": "MaxPool2d(kernel_size=3, stride=2, padding=1)",
    "max_pool2d_with_indices": "MaxPool2d(return_indices=True)",
    "max_pool3d": "MaxPool3d(kernel_size=3, stride=2, padding=1)",
    "max_pool3d_with_indices": "MaxPool3d(return_indices=True)",
    "max_unpool1d": "MaxUnpool1d(of max_pool1d(2)'s indices)",
    "max_unpool2d": "MaxUnpool2d(of max_pool2d(2)'s indices)",
    "max_unpool3d": "MaxUnpool3d(of max_pool3d(2)'s indices)",
    "lp_pool1d": "LPPool1d(norm_type=2, kernel_size=3)",
    "lp_pool2d": "LPPool2d(norm_type=2, kernel_size=2)",
    "lp_pool3d": "LPPool3d(norm_type=2, kernel_size=2)",
    "adaptive_max_pool1d": "AdaptiveMaxPool1d",
    "adaptive_max_pool1d_with_indices": "AdaptiveMaxPool1d(return_indices=True)",
    "adaptive_max_pool2d": "AdaptiveMaxPool2d",
    "adaptive_max_pool2d_with_indices": "AdaptiveMaxPool2d(return_indices=True)",
    "adaptive_max_pool3d": "AdaptiveMaxPool3d",
    "adaptive_max_pool3d_with_indices": "AdaptiveMaxPool3d(return_indices=True)",
    "adaptive_avg_pool1d": "AdaptiveAvgPool1d",
    "adaptive_avg_pool2d": "AdaptiveAvgPool2d(output_size=(3, 2))",
    "adaptive_avg_pool3d": "AdaptiveAvgPool3d",
    "dropout": "Dropout",
    "alpha_dropout": "AlphaDropout",
    "dropout1d": "Dropout1d",
    "dropout2d": "Dropout2d",
    "dropout3d": "Dropout3d",
    "feature_alpha_dropout": "FeatureAlphaDropout",
    "threshold": "Threshold(threshold=0.1, value=20.0)",
    "relu": "ReLU",
    "glu": "GLU",
    "hardtanh": "Hardtanh",
    "elu": "ELU",
    "selu": "SELU",
    "celu": "CELU",
    "leaky_relu": "LeakyReLU",
    "prelu": "PReLU",
    "rrelu": "RReLU",
    "logsigmoid": "LogSigmoid",
    "gelu": "GELU",
    "hardshrink": "Hardshrink",
    "tanhshrink": "Tanhshrink",
    "softsign": "Softsign",
    "softplus": "Softplus",
    "softmin": "Softmin(dim=1)",
    "softmax": "Softmax(dim=1)",
    "log_softmax": "LogSoftmax(dim=1)",
    "softshrink": "Softshrink",
    "hardsigmoid": "Hardsigmoid",
    "linear": "Linear",
    "bilinear": "Bilinear",
    "silu": "SiLU",
    "mish": "Mish",
    "hardswish": "Hardswish",
    "embedding": "Embedding",
    "embedding_bag": "EmbeddingBag(mode='mean')",
    "batch_norm": "BatchNorm1d",
    "instance_norm": "InstanceNorm1d",
    "layer_norm": "LayerNorm",
    "rms_norm": "RMSNorm",
    "group_norm": "GroupNorm(num_groups=2, num_channels=4)",
    "local_response_norm": "LocalResponseNorm(size=3)",
    "ctc_loss": "CTCLoss(log_probs (T, N, C) log_softmax(.))",
    "nll_loss": "NLLLoss(input log_softmax(.))",
    "poisson_nll_loss": "PoissonNLLLoss",
    "gaussian_nll_loss": "GaussianNLLLoss(var softplus(.) + 0.1)",
    "kl_div": "KLDivLoss(input log_softmax(.))",
    "cross_entropy": "CrossEntropyLoss",
    "binary_cross_entropy": "BCELoss(input sigmoid(.))",
    "binary_cross_entropy_with_logits": "BCEWithLogitsLoss",
    "linear_cross_entropy": "LinearCrossEntropyLoss",
    "smooth_l1_loss": "SmoothL1Loss",
    "huber_loss": "HuberLoss",
    "l1_loss": "L1Loss",
    "mse_loss": "MSELoss",
    "margin_ranking_loss": "MarginRankingLoss",
    "hinge_embedding_loss": "HingeEmbeddingLoss",
    "multilabel_margin_loss": "MultiLabelMarginLoss",
    "soft_margin_loss": "SoftMarginLoss",
    "multilabel_soft_margin_loss": "MultiLabelSoftMarginLoss",
    "cosine_embedding_loss": "CosineEmbeddingLoss",
    "multi_margin_loss": "MultiMarginLoss",
    "pixel_shuffle": "PixelShuffle",
    "pixel_unshuffle": "PixelUnshuffle",
    "channel_shuffle": "ChannelShuffle",
    "interpolate": "Upsample(scale_factor=2)",
    "pad": "ReflectionPad2d(padding=(1, 2, 2, 0))",
    "pairwise_distance": "PairwiseDistance",
    "cosine_similarity": "CosineSimilarity",
    "triplet_margin_loss": "TripletMarginLoss",
    "triplet_margin_with_distance_loss": "TripletMarginWithDistanceLoss",
    "unfold": "Unfold(kernel_size=2)",
    "fold": "Fold(output_size=(4, 5), kernel_size=2)",
    "multi_head_attention_forward": "MultiheadAttention(embed_dim=8, num_heads=2)",
}  # fmt: skip


def _grid(*shape: int):
    """A sampling grid in [-1, 1] (a Linear over its last axis of 2 or 3, then tanh),
    reaching a little past the border so the padding modes matter."""
    return x(*shape, then=lambda t: 1.2 * torch.tanh(t))


def _in_place(fn, **kwargs) -> Spec:
    """An in-place activation on the Linear's output (the harness's ``pre``)."""
    return fn_spec(fn, (x(3, 8),), **kwargs)


def functional_specs() -> list[Spec]:
    img, qkv = x(2, 3, 4, 5), (x(2, 2, 4, 8), x(2, 2, 4, 8), x(2, 2, 4, 8))
    sdpa = F.scaled_dot_product_attention
    return [
        # in-place forms (the module classes call the functional form with inplace=True)
        _in_place(F.relu_),
        _in_place(F.elu_, alpha=0.6),
        _in_place(F.selu_),
        _in_place(F.celu_, alpha=0.6),
        _in_place(F.leaky_relu_, negative_slope=0.2),
        _in_place(F.hardtanh_, min_val=-0.5, max_val=0.3),
        _in_place(F.threshold_, threshold=0.1, value=20.0),
        _in_place(F.rrelu_, random=True),
        # functions their module class does not call (ReLU6 calls hardtanh; Tanh and
        # Sigmoid call torch.tanh and torch.sigmoid, F's are deprecated wrappers of them)
        fn_spec(F.relu6, (x(3, 8),)),
        fn_spec(F.tanh, (x(3, 8),)),
        fn_spec(F.sigmoid, (x(3, 8),)),
        # functions without a module class
        fn_spec(F.gumbel_softmax, (x(3, 8),), tau=0.5, random=True),
        fn_spec(F.gumbel_softmax, (x(3, 8),), tau=0.5, hard=True, random=True),
        fn_spec(F.conv_tbc, (x(5, 2, 3),), params={"weight": (2, 3, 4), "bias": (4,)},
                positional=("weight", "bias"), pad=1),
        fn_spec(F.upsample, (img,), scale_factor=2, mode="bilinear"),
        fn_spec(F.upsample_nearest, (img,), scale_factor=2),
        fn_spec(F.upsample_bilinear, (img,), scale_factor=2),
        fn_spec(F.interpolate, (img,), scale_factor=0.5, mode="area"),
        fn_spec(F.interpolate, (img,), size=(3, 3), mode="area"),
        fn_spec(F.interpolate, (img,), size=(2, 3), mode="bilinear", antialias=True),
        fn_spec(F.interpolate, (img,), size=(2, 3), mode="bicubic", antialias=True),
        fn_spec(F.pad, (img,), pad=(1, 2, 2, 0), mode="constant", value=0.5),
        fn_spec(F.pad, (img,), pad=(1, 2, 2, 0), mode="reflect"),
        fn_spec(F.pad, (img,), pad=(1, 2, 2, 0), mode="replicate"),
        fn_spec(F.pad, (img,), pad=(1, 2, 2, 0), mode="circular"),
        fn_spec(F.grid_sample, (img, _grid(2, 3, 3, 2)), align_corners=False),
        fn_spec(F.grid_sample, (img, _grid(2, 3, 3, 2)), align_corners=True),
        fn_spec(F.grid_sample, (img, _grid(2, 3, 3, 2)), mode="nearest", align_corners=False),
        fn_spec(F.grid_sample, (img, _grid(2, 3, 3, 2)), mode="bicubic", align_corners=False),
        fn_spec(F.grid_sample, (img, _grid(2, 3, 3, 2)), padding_mode="border",
                align_corners=False),
        fn_spec(F.grid_sample, (img, _grid(2, 3, 3, 2)), padding_mode="reflection",
                align_corners=False),
        fn_spec(F.grid_sample, (x(2, 2, 3, 4, 4), _grid(2, 2, 3, 3, 3)), align_corners=False,
                note="input (N, C, D, H, W)"),
        fn_spec(F.affine_grid, (x(2, 2, 3),), size=[2, 3, 4, 5], align_corners=False),
        fn_spec(F.affine_grid, (x(2, 2, 3),), size=[2, 3, 4, 5], align_corners=True),
        fn_spec(F.affine_grid, (x(2, 3, 4),), size=[2, 1, 3, 4, 5], align_corners=False),
        fn_spec(F.pdist, (x(5, 4),)),
        fn_spec(F.pdist, (x(5, 4),), p=1.0),
        fn_spec(F.normalize, (x(3, 8),)),
        fn_spec(F.normalize, (x(3, 8),), p=1.0, dim=0),
        fn_spec(F.batch_norm, (x(4, 3),), params={"weight": (3,), "bias": (3,)},
                buffers={"running_mean": lambda: torch.randn(3) * 0.1,
                         "running_var": lambda: torch.rand(3) + 0.5},
                positional=("running_mean", "running_var"), training=False,
                label="training=False (running statistics, frozen)"),
        # attention
        fn_spec(sdpa, qkv),
        fn_spec(sdpa, qkv, is_causal=True),
        fn_spec(sdpa, qkv, scale=0.5),
        fn_spec(sdpa, qkv, label="attn_mask (bool)",
                call=lambda u, q, k, w: u.fn(q, k, w, attn_mask=~causal(4))),
        fn_spec(sdpa, qkv, label="attn_mask (float)",
                call=lambda u, q, k, w: u.fn(q, k, w,
                                            attn_mask=torch.linspace(-1, 0, 16).reshape(4, 4))),
        fn_spec(sdpa, (x(2, 4, 4, 8), x(2, 2, 4, 8), x(2, 2, 4, 8)), enable_gqa=True),
        fn_spec(sdpa, (x(2, 2, 4, 8), x(2, 2, 6, 8), x(2, 2, 6, 5)), label="L != S, Ev != E"),
        fn_spec(sdpa, qkv, dropout_p=0.3, random=True),
    ]  # fmt: skip
