"""The ``attnkit`` command line: ``explain`` walks through attention step by step, ``show``
writes a report of a real model's attention, ``train`` trains a small GPT and ``generate``
continues text with it, ``build-kernel`` compiles the native CPU kernel.

A user's mistake (a missing model, a bad ``--out``, an index out of range, a missing optional
package, a size beyond the machine's memory) is one line on stderr, ``attnkit <command>: error:
...``, and exit status 2, like argparse's own usage errors; never a traceback.
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
    """A mistake in the command line itself, found after parsing (e.g. options that do not go together).

    A command raises it with the message to show; :func:`attnkit.cli.main` prints that as one
    line, ``attnkit <command>: error: <message>``, on stderr and returns exit status 2.

    Example:

        >>> import contextlib, sys
        >>> from attnkit.cli import UsageError, main
        >>> str(UsageError("--scale applies to the toy model only"))
        '--scale applies to the toy model only'
        >>> with contextlib.redirect_stderr(sys.stdout):      # show the error line here
        ...     main(["explain", "--model", "minilm", "--scale", "2"])
        attnkit explain: error: --scale applies to the toy model only (a real model uses the scale it was trained with)
        2
    """


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


#: The largest --learning-rate accepted. AdamW's step moves each weight by about the learning rate
#: and decays it by ``1 - lr * weight_decay``: far above any useful rate (~1e-3) but far below where
#: float32 weights overflow (~3e38), so a typo such as 1e308 is refused before training starts.
MAX_LEARNING_RATE = 1e4


def _learning_rate(text: str) -> float:
    value = _finite_float(text)
    if not 0 < value <= MAX_LEARNING_RATE:
        raise argparse.ArgumentTypeError(f"expected a number in (0, {MAX_LEARNING_RATE:g}], got {text!r}")
    return value


def _index(text: str) -> int:
    return _at_least(0, text)


def _at_least(least: int, text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= {least}, got {text!r}") from None
    if value < least:
        raise argparse.ArgumentTypeError(f"expected an integer >= {least}, got {text!r}")
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
    elif _attnkit_gpt(args.model):
        if args.scale is not None or args.causal:
            raise UsageError("--scale and --causal apply to the toy model and attnkit's own encoders; "
                             f"{args.model!r} is a causal GPT with its own scale")
        gpt = explain.GPTDirectory(args.model)
        text = args.text if args.text is not None else DEFAULT_TEXT
        steps = explain.checkpoint_steps(gpt, text, layer=args.layer, head=args.head)
        print(f"Layer {args.layer}, head {args.head} of {gpt.name} (attnkit's GPT, Llama architecture) on {text!r}")
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


def _attnkit_gpt(model: str) -> bool:
    """A GPT that ``attnkit train`` wrote: explained by attnkit's own GPT, without transformers."""
    from .models.llama_export import written_by_save_llama

    return written_by_save_llama(model)


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


def _positive(text: str) -> int:
    return _at_least(1, text)


def _threads(text: str) -> int:
    """--threads: 1 up to the CPUs this process may run on. torch.set_num_threads takes any count,
    and the next parallel region then starts that many threads: 100000 ended the process with a
    segmentation fault once thread creation was refused."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    value = _positive(text)
    if value > cpus:
        raise argparse.ArgumentTypeError(f"expected an integer in [1, {cpus}] (the CPUs this process may use), "
                                         f"got {text!r}")
    return value


def _train(args: argparse.Namespace) -> int:
    import torch

    from .training import TrainConfig, train

    if args.threads:
        torch.set_num_threads(args.threads)
    sizes = {"tiny": dict(hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1, intermediate_size=96,
                          vocab_size=300, seq_len=32, batch_size=4, max_documents=12, eval_rows=4),
             "default": {}}[args.size]
    options = {name: getattr(args, name) for name in ("steps", "batch_size", "seq_len", "learning_rate", "seed",
                                                      "eval_interval", "checkpoint_interval")
               if getattr(args, name) is not None}
    config = TrainConfig(out=args.out, **{**sizes, **options})
    result = train(config, resume=args.resume)
    step, loss = result.evals[-1] if result.evals else (config.steps, float("nan"))
    print(f"validation loss {loss:.3f} after {step} steps ({result.tokens_per_second:,.0f} tokens/s)")
    print(f"model (Hugging Face Llama format): {result.model_dir}")
    print(f"checkpoint: {result.model_dir.parent / 'checkpoint'} (continue with --resume)")
    if result.sample:
        print("\nsample:\n" + result.sample)
    return 0


def _generate(args: argparse.Namespace) -> int:
    import torch

    from .models.generate import generate_text
    from .models.llama_export import load_llama

    model, tokenizer = load_llama(args.model)
    if tokenizer is None:
        raise ValueError(f"model directory {args.model!r} has no tokenizer.json")
    texts = generate_text(model, tokenizer, args.prompt or [""], args.max_new_tokens, temperature=args.temperature,
                          top_k=args.top_k, top_p=args.top_p, generator=torch.Generator().manual_seed(args.seed))
    print("\n\n".join(texts))
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The ``attnkit`` argument parser, with its subcommands ``explain``, ``show``, ``train``,
    ``generate`` and ``build-kernel``.

    Each parsed namespace has ``command`` (the subcommand's name) and ``run`` (the function that
    carries it out, given the namespace). A parse error exits with status 2 and one line on
    stderr (``SystemExit``), as :func:`attnkit.cli.main` does for errors found later.

    Returns:
        A new ``argparse.ArgumentParser`` (``prog="attnkit"``).

    Example:

        >>> from attnkit.cli import build_parser
        >>> args = build_parser().parse_args(["show", "--model", "toy", "--no-images"])
        >>> args.command, args.model, args.out, args.no_images, args.layer
        ('show', 'toy', 'attnkit-report', True, None)
        >>> import contextlib, sys
        >>> with contextlib.redirect_stderr(sys.stdout):      # show the error line here
        ...     try:
        ...         build_parser().parse_args(["explain", "--head", "-1"])
        ...     except SystemExit as exit:
        ...         print("exit status", exit.code)
        attnkit explain: error: argument --head: expected an integer >= 0, got '-1' (see attnkit explain --help)
        exit status 2
    """
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
    show.add_argument("--model", default="minilm",
                      help="'minilm' (default), a model directory (BERT, a GPT from attnkit train, or with "
                           "transformers installed any Hugging Face checkpoint), 'toy', or 'induction' (trains the "
                           "induction-head demo, seconds, and draws its heads)")
    show.add_argument("--out", default="attnkit-report", metavar="DIR",
                      help="directory for attention.html and the images, created if needed; files of the same "
                           "names in it are replaced (default: attnkit-report)")
    show.add_argument("--layer", type=_index, default=None, help="layer of the single-head images (default 0)")
    show.add_argument("--head", type=_index, default=None, help="head of the single-head images (default 0; "
                      "the best induction head for --model induction)")
    show.add_argument("--no-images", action="store_true", help="write only the HTML report")
    show.set_defaults(run=_show)

    train = commands.add_parser("train", help="train a small GPT (Llama architecture) on the Python Language Reference")
    train.add_argument("--out", default="attnkit-gpt", metavar="DIR",
                       help="directory for checkpoint/ and model/ (default: attnkit-gpt)")
    train.add_argument("--size", choices=["default", "tiny"], default="default",
                       help="'default' (~1M parameters, a few minutes on 2 cores) or 'tiny' (seconds, for tests)")
    train.add_argument("--steps", type=_positive, help="optimizer steps (default 300)")
    train.add_argument("--batch-size", type=_positive, help="rows per step (default 16)")
    train.add_argument("--seq-len", type=_positive, help="tokens per row (default 128)")
    train.add_argument("--learning-rate", type=_learning_rate,
                       help=f"peak learning rate, in (0, {MAX_LEARNING_RATE:g}] (default 3e-3)")
    train.add_argument("--eval-interval", type=_positive, help="steps between validation losses (default 100)")
    train.add_argument("--checkpoint-interval", type=_positive, help="steps between checkpoints (default 100)")
    train.add_argument("--seed", type=_index, help="seed of everything random (default 0)")
    train.add_argument("--resume", action="store_true", help="continue from DIR/checkpoint, bit for bit")
    train.add_argument("--threads", type=_threads,
                       help="CPU threads for PyTorch, at most the CPUs available (default: PyTorch's choice)")
    train.set_defaults(run=_train)

    gen = commands.add_parser("generate", help="continue text with a trained GPT and its KV cache")
    gen.add_argument("prompt", nargs="*", help="prompts, generated as one batch (default: from the start of a text)")
    gen.add_argument("--model", default="attnkit-gpt/model", metavar="DIR",
                     help="a Llama-format directory, e.g. what attnkit train wrote (default: attnkit-gpt/model)")
    gen.add_argument("--max-new-tokens", type=_index, default=100, help="tokens to add to each prompt (default 100)")
    gen.add_argument("--temperature", type=_finite_float, default=0.8, help="0 = greedy (default 0.8)")
    gen.add_argument("--top-k", type=_positive, default=None, help="sample among the k most likely tokens")
    gen.add_argument("--top-p", type=_finite_float, default=None, help="sample within the top-p probability mass")
    gen.add_argument("--seed", type=_index, default=0, help="seed of the sampling generator (default 0)")
    gen.set_defaults(run=_generate)

    from . import kernel

    build = commands.add_parser("build-kernel", help="compile attnkit's native CPU kernel for structured masks (once)",
                                description=kernel.__doc__.split("\n\n")[0])
    kernel.add_arguments(build)
    build.set_defaults(run=kernel.run)
    return parser


def _one_line(error: BaseException) -> str:
    return " ".join(line.strip() for line in str(error).splitlines() if line.strip()) or type(error).__name__


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit status (0, or 2 for a user error).

    Args:
        argv: the arguments after ``attnkit``, e.g. ``["explain", "--causal"]``; default
            ``sys.argv[1:]``.

    Returns:
        0 on success; 2 for a user's mistake (:class:`attnkit.cli.UsageError`, a ``ValueError``,
        ``OSError``, ``ImportError`` or ``MemoryError``: one line on stderr, no traceback); 130 when
        interrupted.
        What the command prints goes to stdout.

    Raises:
        SystemExit: for ``--help``, ``--version`` and arguments argparse rejects (status 2).

    Example:

        >>> from attnkit.cli import main
        >>> main(["explain", "--causal"])                     # the toy walkthrough, printed
        Self-attention, step by step, on seed 002's sentence "Your journey starts with one step"
        (causal: each token may attend only to itself and the tokens before it)
        <BLANKLINE>
        Step 1: inputs [6, 3]
        ...
        Reading the weights:
          'Your' attends most to 'Your' (1.0000)
          'journey' attends most to 'journey' (0.6320)
        ...
        0
        >>> main(["show", "--model", "toy", "--no-images", "--out", "report"])
        'Your journey starts with one step' (6 tokens): most-attended word of each head
          layer 0: journey(0.22)
        <BLANKLINE>
        wrote:
          report/attention.html
        0
    """
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.run(args)
    except BrokenPipeError:
        # The reader went away (``attnkit explain | head``): stop quietly, as other tools do.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except (UsageError, ValueError, OSError, ImportError, MemoryError) as error:
        # ValueError: bad input found by attnkit (an index out of range, a malformed model);
        # OSError: a missing model directory, an --out that cannot be written;
        # ImportError: an optional package that is not installed (the message says how to install it);
        # MemoryError: a size beyond this machine (the KV cache of --max-new-tokens 1000000000).
        print(f"attnkit {args.command}: error: {_one_line(error)}", file=sys.stderr)
        return USAGE_ERROR
    except KeyboardInterrupt:
        print(f"attnkit {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
