"""The configuration every recipe shares and its command line: ``TrainConfig`` (one
dataclass field per flag, declared with ``field``), checks on its values (``validate``),
the argparse parser built from the fields and the presets, and ``cli``, which turns a
recipe's ``train`` into its ``main(argv) -> exit code``.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import types
import typing
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from ortrain.recipes import RecipeError


def field(default: Any, help: str, **kw: Any) -> Any:
    """A config field with its command-line help (``choices=`` restricts values)."""
    return dataclasses.field(default=default, metadata={"help": help, **kw})


@dataclasses.dataclass
class TrainConfig:
    """What every recipe shares; the defaults are the tiny preset's. A recipe's config
    subclasses this and adds its model."""

    preset: str = field("tiny", "tiny (CPU, minutes) or base (BERT-base / GPT-2 small size)")
    out: str | None = field(None, "output folder [runs/<recipe>-<preset>]")
    # data
    data: str | None = field(None, "text file, folder or JSONL [the Python stdlib's sources]")
    text_field: str = field("text", "JSONL field holding the text")
    tokenizer: str | None = field(None, "local tokenizer.json [train one on the data, cached]")
    vocab_size: int = field(2048, "vocabulary size of the tokenizer trained on the data")
    default_corpus_mb: float = field(4.0, "cap on the built-in corpus, in MB")
    eval_fraction: float = field(0.05, "fraction of the tokens held out for evaluation")
    # optimization
    steps: int = field(600, "optimizer steps")
    batch_size: int = field(16, "sequences per micro-batch per process")
    grad_accum: int = field(1, "micro-batches per optimizer step")
    lr: float = field(1e-3, "peak learning rate")
    warmup_steps: int = field(30, "linear warmup steps")
    weight_decay: float = field(0.01, "weight decay (not on biases and LayerNorm weights)")
    max_grad_norm: float | None = field(1.0, "global gradient-norm clipping ('none': off)")
    seed: int = field(0, "seed of weights, data order and masks")
    # system
    backend: str = field("ortrain", "ortrain, or torch (eager)", choices=("ortrain", "torch"))
    zero: int = field(0, "under torchrun: 0 data parallel, 1 ZeRO-1, 2 ZeRO-2", choices=(0, 1, 2))
    mixed_precision: str | None = field(None, "fp16 or bf16", choices=("fp16", "bf16"))
    device: str = field("cpu", "device for the model ('cuda': with --backend torch for now)")
    threads: int | None = field(None, "intra-op threads (ONNX Runtime / torch) [library default]")
    # logging and checkpoints
    eval_interval: int = field(100, "evaluate every N steps (0: only at start and end)")
    eval_batches: int = field(4, "held-out batches per evaluation")
    ckpt_interval: int = field(200, "checkpoint every N steps (0: only at the end)")
    keep_checkpoints: int = field(2, "how many recent checkpoints to keep")
    resume: str | None = field(None, "continue from the latest checkpoint in --out, or PATH")
    stop_at: int | None = field(None, "stop after this step as if interrupted (no last checkpoint)")
    peak_tflops: float | None = field(None, "peak FLOP/s for the utilisation [measured]")
    progress: bool = field(True, "show a progress bar")


def validate(cfg: TrainConfig) -> None:
    positive = ("steps", "batch_size", "grad_accum", "eval_batches", "keep_checkpoints")
    for name in positive:
        if getattr(cfg, name) < 1:
            raise RecipeError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(cfg, name)}")
    if cfg.warmup_steps < 0 or cfg.eval_interval < 0 or cfg.ckpt_interval < 0:
        raise RecipeError("--warmup-steps, --eval-interval and --ckpt-interval must be >= 0")
    if not 0.0 < cfg.eval_fraction < 1.0:
        raise RecipeError(f"--eval-fraction must be in (0, 1), got {cfg.eval_fraction}")
    if cfg.max_grad_norm is not None and cfg.max_grad_norm <= 0:
        raise RecipeError(f"--max-grad-norm must be > 0 or 'none', got {cfg.max_grad_norm}")
    if cfg.device.startswith("cuda") and not torch.cuda.is_available():
        raise RecipeError(f"--device {cfg.device}: torch sees no CUDA device on this machine")
    if cfg.stop_at is not None and not 0 < cfg.stop_at <= cfg.steps:
        raise RecipeError(f"--stop-at must be in 1..--steps ({cfg.steps}), got {cfg.stop_at}")


def _parse_optional(kind: type) -> Callable[[str], Any]:
    def parse(text: str) -> Any:
        return None if text.lower() == "none" else kind(text)

    parse.__name__ = kind.__name__  # argparse names the type in its errors
    return parse


def build_parser(
    cls: type[TrainConfig], presets: Mapping[str, Mapping[str, Any]], prog: str, doc: str
) -> argparse.ArgumentParser:
    """One flag per config field (``--batch-size`` for ``batch_size``); the help shows
    the presets' values. Unset flags keep the preset's value."""
    parser = argparse.ArgumentParser(
        prog=prog, description=doc, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        flag = "--" + f.name.replace("_", "-")
        kind = hints[f.name]
        optional = isinstance(kind, types.UnionType) and type(None) in typing.get_args(kind)
        if optional:
            kind = next(a for a in typing.get_args(kind) if a is not type(None))
        values = {p: dict(v).get(f.name, f.default) for p, v in presets.items()}
        kw: dict[str, Any] = {"dest": f.name, "default": argparse.SUPPRESS}
        kw["help"] = f.metadata["help"]
        if len(set(map(repr, values.values()))) > 1:
            kw["help"] += " [" + ", ".join(f"{p}: {v}" for p, v in values.items()) + "]"
        elif f.default is not None and f.name != "preset":
            kw["help"] += f" [{f.default}]"
        if f.name == "preset":
            kw.update(choices=list(presets))
        elif f.name == "resume":
            kw.update(nargs="?", const="latest", metavar="PATH")
        elif kind is bool:
            kw["action"] = argparse.BooleanOptionalAction
        else:
            kw["type"] = _parse_optional(kind) if optional else kind
            if "choices" in f.metadata:
                kw["choices"] = list(f.metadata["choices"])
        parser.add_argument(flag, **kw)
    return parser


def parse_config(
    cls: type[TrainConfig],
    presets: Mapping[str, Mapping[str, Any]],
    argv: Sequence[str] | None,
    prog: str,
    doc: str,
) -> TrainConfig:
    given = vars(build_parser(cls, presets, prog, doc).parse_args(argv))
    preset = given.pop("preset", "tiny")
    cfg = cls(**{**presets[preset], **given, "preset": preset})
    validate(cfg)
    return cfg


def cli(
    name: str, train: Callable[[Any], dict], cls: type[TrainConfig], presets: Any, doc: str
) -> Callable[[Sequence[str] | None], int]:
    """The recipe's ``main(argv) -> exit code``: bad input prints one line, exit code 1."""

    def main(argv: Sequence[str] | None = None) -> int:
        prog = f"ortrain recipe {name}"
        try:
            cfg = parse_config(cls, presets, argv, prog, doc)
            train(cfg)
        except RecipeError as exc:
            print(f"{prog}: error: {exc}", file=sys.stderr)
            return 1
        except KeyboardInterrupt:
            print(f"\n{prog}: interrupted; continue with --resume", file=sys.stderr)
            return 130
        return 0

    return main
