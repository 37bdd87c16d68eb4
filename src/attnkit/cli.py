"""The ``attnkit`` command line."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence


def _explain(args: argparse.Namespace) -> int:
    from .explain import render, toy_steps

    print("Self-attention, step by step, on seed 002's sentence \"Your journey starts with one step\"")
    if args.causal:
        print("(causal: each token may attend only to itself and the tokens before it)")
    print()
    print(render(toy_steps(causal=args.causal, scale=args.scale)))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="attnkit", description="Attention mechanisms, exact and easy to look inside.")
    commands = parser.add_subparsers(dest="command", required=True)
    explain = commands.add_parser("explain", help="walk through attention step by step")
    explain.add_argument("--causal", action="store_true", help="mask future tokens and show the mask")
    explain.add_argument("--scale", type=float, default=1.0,
                         help="score scale (default 1, as in the seed's weightless example)")
    explain.set_defaults(run=_explain)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
