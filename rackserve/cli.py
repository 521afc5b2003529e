"""The `rackserve` command line."""

from __future__ import annotations

import argparse
import sys


def _make_tiny(args: argparse.Namespace) -> int:
    from rackserve.model.tiny import make_tiny

    path = make_tiny(args.dir, seed=args.seed)
    print(f"wrote the tiny DeepSeek-V4 checkpoint to {path}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rackserve", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    tiny = sub.add_parser("make-tiny", help="write the built-in tiny checkpoint (random weights) to DIR")
    tiny.add_argument("dir", help="output directory (created if missing)")
    tiny.add_argument("--seed", type=int, default=0, help="seed of the random weights (default 0)")
    tiny.set_defaults(func=_make_tiny)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
