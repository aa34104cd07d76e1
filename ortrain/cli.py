"""The `ortrain` command line."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="ortrain", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="train a small GPT-2 on built-in text, ortrain vs eager")
    demo.add_argument("--steps", type=int, default=60)
    demo.add_argument("--batch", type=int, default=8)
    demo.add_argument("--seq", type=int, default=128)
    demo.add_argument("--no-compare", action="store_true", help="skip the eager run")
    args = parser.parse_args(argv)
    if args.command == "demo":
        from ortrain.demo import run

        if args.steps < 2:
            parser.error("--steps must be at least 2")
        run(args.steps, args.batch, args.seq, compare=not args.no_compare)
    return 0


if __name__ == "__main__":
    sys.exit(main())
