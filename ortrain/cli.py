"""The `ortrain` command line."""

from __future__ import annotations

import argparse
import sys

RECIPES = ("gpt2", "bert")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if len(argv) >= 2 and argv[0] == "recipe" and argv[1] in RECIPES:
        # The recipe module parses its own flags (and answers --help itself).
        from ortrain.recipes import bert_pretrain, gpt2_pretrain

        recipe = {"gpt2": gpt2_pretrain, "bert": bert_pretrain}[argv[1]]
        return recipe.main(argv[2:])
    parser = argparse.ArgumentParser(prog="ortrain", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="train a small GPT-2 on built-in text, ortrain vs eager")
    demo.add_argument("--steps", type=int, default=60)
    demo.add_argument("--batch", type=int, default=8)
    demo.add_argument("--seq", type=int, default=128)
    demo.add_argument("--no-compare", action="store_true", help="skip the eager run")
    opt = sub.add_parser("optimize", help="apply ortrain's forward graph passes to an ONNX file")
    opt.add_argument("input", help="ONNX model to optimize")
    opt.add_argument("-o", "--output", required=True, help="where to write the optimized model")
    opt.add_argument("--level", choices=["basic", "extended"], default="extended")
    opt.add_argument("--report", help="write the per-pass table as JSON here")
    opt.add_argument(
        "--dim",
        action="append",
        default=[],
        metavar="NAME=SIZE",
        help="size of a symbolic input dimension in the output check (default 2; repeatable)",
    )
    bt = sub.add_parser("build-training", help="build training artifacts from an ONNX model")
    bt.add_argument("input", help="forward ONNX model with a scalar loss output")
    bt.add_argument("--loss", required=True, help="name of the loss output")
    bt.add_argument(
        "--trainable-from-initializers",
        action="store_true",
        required=True,
        help="train every float initializer (except --frozen)",
    )
    bt.add_argument("--frozen", default="", help="comma-separated initializers to keep fixed")
    bt.add_argument("--optimizer", default="adamw", choices=["adamw", "adam", "sgd", "lamb"])
    bt.add_argument("--lr", type=float, default=1e-3)
    bt.add_argument("--weight-decay", type=float, default=None)
    bt.add_argument("--max-grad-norm", type=float, default=None)
    bt.add_argument(
        "--dim",
        action="append",
        default=[],
        metavar="NAME=SIZE",
        help="size of a symbolic input dimension (the training graph is static; repeatable)",
    )
    bt.add_argument(
        "--no-optimize", action="store_true", help="plain gradient graph, no optimization passes"
    )
    bt.add_argument("-o", "--output", required=True, help="artifact directory")
    rec = sub.add_parser(
        "recipe",
        help="pretrain GPT-2 or BERT (recipes/); 'ortrain recipe gpt2 --help' lists the flags",
    )
    rec.add_argument("name", choices=RECIPES, help="which recipe (recipes/<name>_pretrain.py)")
    rec.add_argument("flags", nargs=argparse.REMAINDER, help="the recipe's own flags")
    args = parser.parse_args(argv)
    if args.command == "build-training":
        from ortrain.core.errors import OrtrainError
        from ortrain.offline import build_training

        hyper = {} if args.weight_decay is None else {"weight_decay": args.weight_decay}
        try:
            manifest = build_training(
                args.input,
                args.output,
                loss=args.loss,
                frozen=[f for f in args.frozen.split(",") if f],
                optimizer=args.optimizer,
                lr=args.lr,
                hyper=hyper,
                max_grad_norm=args.max_grad_norm,
                dims=_parse_dims(args.dim),
                optimize=not args.no_optimize,
            )
        except OrtrainError as exc:
            print(f"ortrain build-training: error: {exc}", file=sys.stderr)
            return 1
        except OSError as exc:  # the artifact folder: missing parent, read-only, a file
            where = exc.filename or args.output
            print(f"ortrain build-training: error: cannot write {where}: {exc.strerror}",
                  file=sys.stderr)  # fmt: skip
            return 1
        print(
            f"{len(manifest['parameters'])} trainable, {len(manifest['frozen'])} frozen "
            f"tensors; batch inputs {manifest['batch']}; wrote {args.output}"
        )
        return 0
    if args.command == "optimize":
        from ortrain.optimize import OptimizeError, optimize_file, summary

        try:
            dims = _parse_dims(args.dim)
            records = optimize_file(
                args.input, args.output, level=args.level, report=args.report, dims=dims
            )
        except OptimizeError as exc:
            print(f"ortrain optimize: error: {exc}", file=sys.stderr)
            return 1
        print(summary(records))
        first, last = records[0].nodes_before, records[-1].nodes_after
        print(
            f"{first} -> {last} nodes; outputs match ONNX Runtime on random inputs; "
            f"wrote {args.output}"
        )
        return 0
    if args.command == "demo":
        from ortrain.demo import run

        if args.steps < 2:
            parser.error("--steps must be at least 2")
        run(args.steps, args.batch, args.seq, compare=not args.no_compare)
    return 0


def _parse_dims(specs: list[str]) -> dict[str, int]:
    from ortrain.optimize import OptimizeError

    dims = {}
    for spec in specs:
        name, sep, size = spec.partition("=")
        if not sep or not name or not size.isdigit() or int(size) < 1:
            raise OptimizeError(f"--dim {spec!r}: expected NAME=SIZE with SIZE >= 1")
        dims[name] = int(size)
    return dims


if __name__ == "__main__":
    sys.exit(main())
