"""The native kernel alone: its raw forward and backward ops on the three masks of masks.py,
against a 2048^3 fp32 matmul timed in the same run (interleaved), with tile overrides.

masks.py times whole attention calls (Python, autograd, delta) next to SDPA and Flex, minutes per
run; this times only the kernel, seconds per run, so tile sweeps and profiles stay cheap. Useful
GFLOP/s as in masks.py: 4 * D flops per attended pair and head for the forward, 2.5x that for the
backward (FlashAttention's count), 3.5x for both.

    python benchmarks/native_kernel.py                          # forward and backward, default tiles
    python benchmarks/native_kernel.py --forward --tiles 64x512 128x512
    python benchmarks/native_kernel.py --backward --mask window --tiles 32x1024 64x256
    python benchmarks/native_kernel.py --mask window --dtypes float32 bfloat16   # half against fp32
    python benchmarks/native_kernel.py --mask window --dtypes bfloat16 --residual  # what the residual costs
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from attnkit._backends import native  # noqa: E402
from common import describe_machine, median_times, square_matmul  # noqa: E402
from masks import HEAD_DIM, HEADS, attended_pairs, inputs, machine_peak, mask_set, peak_note, share_of_peak  # noqa: E402

SHORT = {"window": 0, "documents": 1, "padding": 2}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--length", type=int, default=16384)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--mask", choices=sorted(SHORT), nargs="+", default=sorted(SHORT, key=SHORT.get))
    parser.add_argument("--forward", action="store_true", help="forward only")
    parser.add_argument("--backward", action="store_true", help="backward only")
    parser.add_argument("--tiles", nargs="+", default=[None], metavar="BLOCKxCHUNK",
                        help="tiles to compare (default: the tables' choice)")
    parser.add_argument("--parts", type=int, default=None, help="backward row parts (default: the table's)")
    parser.add_argument("--dropout", type=float, default=0.0)
    parser.add_argument("--dtypes", nargs="+", default=["float32"], choices=["float32", "bfloat16", "float16"],
                        help="input dtypes to compare, interleaved in one run")
    parser.add_argument("--residual", action="store_true",
                        help="half precision also with the output's residual (forward) read by the row term "
                             "(backward): what a differentiated call runs")
    args = parser.parse_args()
    if not native.available():
        sys.exit(f"native kernel: {native.why_unavailable()}")
    directions = ["forward"] * (not args.backward) + ["backward"] * (not args.forward)
    length = args.length
    rows = {dtype: inputs(length, getattr(torch, dtype)) for dtype in args.dtypes}
    scale = HEAD_DIM ** -0.5
    flops, matmul = square_matmul()
    print(f"# native kernel, B=1, H={HEADS}, D={HEAD_DIM}, {', '.join(args.dtypes)}, L={length} ({describe_machine()}); "
          f"median of {args.repeats} interleaved runs; ours / matmul in useful GFLOP/s\n")
    fma, _ = machine_peak()
    matmul_rates = []
    print("| mask | direction | dtype | tiles | ms | useful GFLOP/s | matmul GFLOP/s | ours / matmul | ours / FMA peak |")
    print("|---|---|---|---|---:|---:|---:|---:|---:|")
    all_masks = list(mask_set(length).items())
    for short in args.mask:
        name, (structured, _) = all_masks[SHORT[short]]
        lo, hi = structured.row_bounds(length, length)
        lo, hi = lo.reshape(1, -1), hi.reshape(1, -1)
        pairs = attended_pairs(structured, length)
        contenders = {"matmul": matmul}
        for dtype, (query, key, value) in rows.items():
            out, lse, low = native.interval_forward(query, key, value, lo, hi, scale, dropout=args.dropout, seed=1,
                                                    residual=True)
            grad_out = torch.randn_like(out)
            for tile, residual in ((t, r) for t in args.tiles for r in (False, True)):
                if residual and not (args.residual and low.numel()):
                    continue
                block, chunk = (None, None) if tile is None else map(int, tile.split("x"))
                label = (tile or "default") + (" + residual" if residual else "")
                if "forward" in directions:
                    contenders[("forward", dtype, label)] = (
                        lambda q=query, k=key, v=value, b=block, c=chunk, r=residual: native.interval_forward(
                            q, k, v, lo, hi, scale, block=b, chunk=c, dropout=args.dropout, seed=1, residual=r))
                if "backward" in directions:
                    contenders[("backward", dtype, label)] = (
                        lambda g=grad_out, q=query, k=key, v=value, o=out, s=lse, b=block, c=chunk,
                        r=low if residual else None:
                        native.interval_backward(g, q, k, v, o, s, lo, hi, scale, block=b, chunk=c,
                                                 parts=args.parts, dropout=args.dropout, seed=1,
                                                 out_low=r))
        times = median_times(contenders, repeats=args.repeats)
        peak = flops / times.pop("matmul") / 1e9
        matmul_rates.append(peak)
        for (direction, dtype, label), seconds in times.items():
            useful = (1.0 if direction == "forward" else 2.5) * 4 * HEAD_DIM * pairs * HEADS / seconds / 1e9
            print(f"| {name} | {direction} | {dtype} | {label} | {seconds * 1e3:.1f} | {useful:.0f} | {peak:.0f} "
                  f"| {useful / peak:.0%} | {share_of_peak(useful, fma)} |", flush=True)
    print(peak_note(matmul_rates))


if __name__ == "__main__":
    main()
