"""The ``attnkit`` command line: ``explain`` walks through attention step by step, ``show``
writes a report of a real model's attention, ``build-kernel`` compiles the native CPU kernel.

A user's mistake (a missing model, a bad ``--out``, an index out of range, a missing optional
package) is one line on stderr, ``attnkit <command>: error: ...``, and exit status 2, like
argparse's own usage errors; never a traceback.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from collections.abc import Sequence

from . import __version__

DEFAULT_TEXT = "The quick brown fox jumps over the lazy dog."
USAGE_ERROR = 2


class UsageError(Exception):
    """A mistake in the command line itself, found after parsing (e.g. options that do not go together)."""


class _Parser(argparse.ArgumentParser):
    """argparse's errors on one line: no usage block, a pointer to ``--help`` instead."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(USAGE_ERROR, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _finite_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"expected a finite number, got {text!r}")
    return value


def _index(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {text!r}")
    return value


def _explain(args: argparse.Namespace) -> int:
    from . import explain

    if args.model == "toy":
        if args.text is not None or args.layer or args.head:
            raise UsageError("the toy model has one fixed sentence and one head; "
                             "use --model minilm for your own text, --layer and --head")
        print("Self-attention, step by step, on seed 002's sentence \"Your journey starts with one step\"")
        if args.causal:
            print("(causal: each token may attend only to itself and the tokens before it)")
        steps = explain.toy_steps(causal=args.causal, scale=args.scale if args.scale is not None else 1.0)
    elif _transformers_checkpoint(args.model):
        from .integrations.checkpoints import Checkpoint

        if args.scale is not None or args.causal:
            raise UsageError("--scale and --causal apply to the toy model and attnkit's own encoders; "
                             f"{args.model!r} runs with the scale and masks it was built with")
        checkpoint = Checkpoint(args.model)
        text = args.text if args.text is not None else DEFAULT_TEXT
        steps = explain.checkpoint_steps(checkpoint, text, layer=args.layer, head=args.head)
        print(f"Layer {args.layer}, head {args.head} of {checkpoint.name} "
              f"({checkpoint.model.config.model_type}, attention on attnkit) on {text!r}")
    else:
        from . import models

        if args.scale is not None:
            raise UsageError("--scale applies to the toy model only (a real model uses the scale it was trained with)")
        encoder = models.load(args.model)
        text = args.text if args.text is not None else DEFAULT_TEXT
        steps = explain.model_steps(encoder, text, layer=args.layer, head=args.head, causal=args.causal)
        print(f"Layer {args.layer}, head {args.head} of {encoder.name} on {text!r}")
        if args.causal:
            print("(causal: a mask the model was not trained with, applied in every layer to show the mechanism)")
    print()
    print(explain.render(steps))
    return 0


def _transformers_checkpoint(model: str) -> bool:
    """A model directory of a type attnkit's own loader does not read (GPT-2, Llama, T5, ...)."""
    from .integrations.checkpoints import wants_transformers

    return wants_transformers(model)


def _show(args: argparse.Namespace) -> int:
    from .show import show

    result = show(args.text, model=args.model, out=args.out, layer=args.layer, head=args.head,
                  images=not args.no_images)
    print("\n".join(result.summary))
    print()
    print("wrote:")
    for path in result.paths:
        print(f"  {path}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="attnkit", description="Attention mechanisms, exact and easy to look inside.")
    parser.add_argument("--version", action="version", version=f"attnkit {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)
    explain = commands.add_parser("explain", help="walk through attention step by step")
    explain.add_argument("text", nargs="?", help=f"text to explain (with a real model; default {DEFAULT_TEXT!r})")
    explain.add_argument("--model", default="toy",
                         help="'toy' (seed 002's six tokens, default), 'minilm', or a model directory "
                              "(BERT-family, or with transformers installed any Hugging Face checkpoint)")
    explain.add_argument("--layer", type=_index, default=0, help="layer to show (real models)")
    explain.add_argument("--head", type=_index, default=0, help="head to show (real models)")
    explain.add_argument("--causal", action="store_true", help="mask future tokens and show the mask")
    explain.add_argument("--scale", type=_finite_float, default=None,
                         help="score scale for the toy model (default 1, as in the seed's weightless example)")
    explain.set_defaults(run=_explain)

    show = commands.add_parser("show", help="write a standalone HTML report and images of a model's attention")
    show.add_argument("text", nargs="*", help="texts to show (default: a built-in sentence)")
    show.add_argument("--model", default="minilm", help="'minilm' (default), a model directory (BERT-family, or with transformers "
                      "installed any Hugging Face checkpoint), or 'toy'")
    show.add_argument("--out", default="attnkit-report", metavar="DIR",
                      help="directory for attention.html and the images, created if needed; files of the same "
                           "names in it are replaced (default: attnkit-report)")
    show.add_argument("--layer", type=_index, default=0, help="layer of the single-head images")
    show.add_argument("--head", type=_index, default=0, help="head of the single-head images")
    show.add_argument("--no-images", action="store_true", help="write only the HTML report")
    show.set_defaults(run=_show)

    from . import kernel

    build = commands.add_parser("build-kernel", help="compile attnkit's native CPU kernel for structured masks (once)",
                                description=kernel.__doc__.split("\n\n")[0])
    kernel.add_arguments(build)
    build.set_defaults(run=kernel.run)
    return parser


def _one_line(error: BaseException) -> str:
    return " ".join(line.strip() for line in str(error).splitlines() if line.strip()) or type(error).__name__


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit status (0, or 2 for a user error)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.run(args)
    except BrokenPipeError:
        # The reader went away (``attnkit explain | head``): stop quietly, as other tools do.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except (UsageError, ValueError, OSError, ImportError) as error:
        # ValueError: bad input found by attnkit (an index out of range, a malformed model);
        # OSError: a missing model directory, an --out that cannot be written;
        # ImportError: an optional package that is not installed (the message says how to install it).
        print(f"attnkit {args.command}: error: {_one_line(error)}", file=sys.stderr)
        return USAGE_ERROR
    except KeyboardInterrupt:
        print(f"attnkit {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
