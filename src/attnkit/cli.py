"""The ``attnkit`` command line: ``explain`` walks through attention step by step, ``show``
writes a report of a real model's attention."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

DEFAULT_TEXT = "The quick brown fox jumps over the lazy dog."


def _explain(args: argparse.Namespace) -> int:
    from . import explain

    if args.model == "toy":
        if args.text is not None or args.layer or args.head:
            raise SystemExit("attnkit explain: the toy model has one fixed sentence and one head; "
                             "use --model minilm for your own text, --layer and --head")
        print("Self-attention, step by step, on seed 002's sentence \"Your journey starts with one step\"")
        if args.causal:
            print("(causal: each token may attend only to itself and the tokens before it)")
        steps = explain.toy_steps(causal=args.causal, scale=args.scale if args.scale is not None else 1.0)
    else:
        from . import models

        encoder = models.load(args.model)
        text = args.text if args.text is not None else DEFAULT_TEXT
        print(f"Layer {args.layer}, head {args.head} of {encoder.name} on {text!r}")
        if args.causal:
            print("(causal: a mask the model was not trained with, applied in every layer to show the mechanism)")
        try:
            steps = explain.model_steps(encoder, text, layer=args.layer, head=args.head, causal=args.causal)
        except ValueError as error:
            raise SystemExit(f"attnkit explain: {error}") from None
    print()
    print(explain.render(steps))
    return 0


def _show(args: argparse.Namespace) -> int:
    from .show import show

    try:
        result = show(args.text, model=args.model, out=args.out, layer=args.layer, head=args.head,
                      images=not args.no_images)
    except ValueError as error:
        raise SystemExit(f"attnkit show: {error}") from None
    print("\n".join(result.summary))
    print()
    print("wrote:")
    for path in result.paths:
        print(f"  {path}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="attnkit", description="Attention mechanisms, exact and easy to look inside.")
    commands = parser.add_subparsers(dest="command", required=True)
    explain = commands.add_parser("explain", help="walk through attention step by step")
    explain.add_argument("text", nargs="?", help=f"text to explain (with a real model; default {DEFAULT_TEXT!r})")
    explain.add_argument("--model", default="toy",
                         help="'toy' (seed 002's six tokens, default), 'minilm', or a model directory")
    explain.add_argument("--layer", type=int, default=0, help="layer to show (real models)")
    explain.add_argument("--head", type=int, default=0, help="head to show (real models)")
    explain.add_argument("--causal", action="store_true", help="mask future tokens and show the mask")
    explain.add_argument("--scale", type=float, default=None,
                         help="score scale for the toy model (default 1, as in the seed's weightless example)")
    explain.set_defaults(run=_explain)

    show = commands.add_parser("show", help="write a standalone HTML report and images of a model's attention")
    show.add_argument("text", nargs="*", help="texts to show (default: a built-in sentence)")
    show.add_argument("--model", default="minilm", help="'minilm' (default), a model directory, or 'toy'")
    show.add_argument("--out", default="attnkit-report", help="output directory (default: attnkit-report)")
    show.add_argument("--layer", type=int, default=0, help="layer of the single-head images")
    show.add_argument("--head", type=int, default=0, help="head of the single-head images")
    show.add_argument("--no-images", action="store_true", help="write only the HTML report")
    show.set_defaults(run=_show)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
