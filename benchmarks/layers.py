"""attnkit.nn.MultiHeadAttention vs torch.nn.MultiheadAttention, forward time, measured in one run.

Both layers hold the same weights (ours is made with ``from_torch``) and run batch-first
self-attention on the same input: embed 512, 8 heads, batch 1, fp32. Modes:

- eval: ``.eval()`` under ``torch.no_grad()``, where PyTorch takes its native fast path;
- train: ``.train()`` with autograd recording (dropout 0, so both compute the same numbers;
  ``--dropout P`` gives both layers dropout P: then the train rows time different random draws
  of the same work, and PyTorch's CPU SDPA falls back to its math path, attnkit's ``"auto"`` to
  its native kernel).

``need_weights=True`` asks both for per-head weights (PyTorch: ``average_attn_weights=False``,
the same output as ours). Ratio = PyTorch's time / ours: above 1 means attnkit is faster.
Goal: >= 1.5 in eval at L = 2048 without weights (PyTorch's eval fast path materialises the
L x L scores there, ours runs the fused kernel), >= 1.0 everywhere else (with weights both
materialise them: the same work).
    python benchmarks/layers.py [--lengths 512 2048] [--repeats N] [--batch B] [--threads T] [--dropout P]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(__file__))
from attnkit.nn import MultiHeadAttention  # noqa: E402
from common import describe_machine, median_times  # noqa: E402

EMBED, HEADS = 512, 8


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", type=int, nargs="+", default=[512, 2048])
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    parser.add_argument("--dropout", type=float, default=0.0, help="dropout of both layers (train rows)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    torch.manual_seed(0)
    theirs = nn.MultiheadAttention(EMBED, HEADS, dropout=args.dropout, batch_first=True)
    ours = MultiHeadAttention.from_torch(theirs)
    print(f"# attnkit.nn.MultiHeadAttention vs torch.nn.MultiheadAttention, forward  ({describe_machine()})")
    print(f"# embed {EMBED}, {HEADS} heads, batch {args.batch}, fp32, self-attention, dropout {args.dropout}; median of "
          f"{args.repeats} interleaved runs (shared machine: medians, not minima)\n")
    print("| L | mode | need_weights | attnkit (ms) | PyTorch (ms) | speed-up (PyTorch / attnkit) |")
    print("|---:|---|---|---:|---:|---:|")
    speedups: dict[tuple[int, str, bool], float] = {}
    for length in args.lengths:
        x = torch.randn(args.batch, length, EMBED)
        for mode in ("eval", "train"):
            ours.train(mode == "train")
            theirs.train(mode == "train")
            grad = torch.no_grad() if mode == "eval" else contextlib.nullcontext()
            for need_weights in (False, True):
                with grad:
                    times = median_times({
                        "ours": lambda: ours(x, need_weights=need_weights),
                        "theirs": lambda: theirs(x, x, x, need_weights=need_weights, average_attn_weights=False),
                    }, repeats=args.repeats)
                speedup = speedups[length, mode, need_weights] = times["theirs"] / times["ours"]
                print(f"| {length} | {mode} | {need_weights} | {times['ours'] * 1e3:.1f} | "
                      f"{times['theirs'] * 1e3:.1f} | {speedup:.2f} |", flush=True)
    headline = (2048, "eval", False)
    if headline in speedups:
        print(f"\neval, L=2048, need_weights=False: {speedups.pop(headline):.2f} (goal: >= 1.5)")
    print(f"slowest speed-up of the other rows: {min(speedups.values()):.2f} (goal: >= 1.0)")


if __name__ == "__main__":
    main()
