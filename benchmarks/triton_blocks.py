"""Tile sizes of attnkit's Triton kernel, measured: forward and backward over a set of
``(BLOCK_M, BLOCK_N, num_warps, num_stages)`` configurations on one structured mask.

It calls the kernel's launchers directly (``attnkit._backends.triton.forward.launch`` and
``backward.launch``), so what is timed is the kernel alone; the defaults the package uses
(``forward_blocks`` / ``backward_blocks``) are marked with ``*``. Timed first: the forward's default
tiles without the NaN/inf pass and with it inline, the tiles of ``INLINE`` with it inline, and those of
``TMA`` with the whole blocks' tiles loaded through TMA descriptors; the
backward's default tiles with each walk of the dK/dV kernel (``backward.WALKS``). Medians of CUDA-event times
over ``--repeats`` calls after one warm-up (the warm-up compiles; its time is printed too).

    python benchmarks/triton_blocks.py                       # window 1024 and 8 documents, L = 32768
    python benchmarks/triton_blocks.py --length 8192 --head-dim 64 --dtype float16
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

from attnkit import masks

sys.path.insert(0, os.path.dirname(__file__))
from common import cuda_median  # noqa: E402

FORWARD = [(64, 64, 4, 3), (64, 64, 4, 2), (64, 64, 4, 4), (64, 64, 8, 3), (64, 32, 4, 3), (128, 64, 8, 3),
           (64, 128, 8, 3), (128, 128, 8, 2)]
#: Forward tiles whose kernel spills nothing by ptxas with the NaN/inf pass compiled in (bf16, D = 128,
#: specialised as launched), timed with it inline beside the gated default.
INLINE = [(64, 64, 8, 3), (64, 32, 4, 3)]
#: Forward tiles timed with the whole blocks' key and value tiles loaded through TMA descriptors
#: (``forward.launch(..., loads="tma")``; by ptxas, 6% fewer instructions a whole block at the default
#: tiles and fewer registers: benchmarks/triton_spills.py), beside the default's pointer loads.
TMA = [(64, 64, 4, 3), (128, 64, 8, 3)]
BACKWARD = [((64, 128, 128, 64), 8, 2), ((64, 128, 128, 64), 8, 3), ((64, 128, 128, 64), 4, 2),
            ((32, 128, 128, 64), 8, 2), ((64, 128, 128, 32), 8, 2), ((64, 128, 64, 64), 4, 2),
            ((128, 128, 128, 128), 8, 1), ((32, 128, 128, 32), 8, 2),
            # fewer spills by ptxas (benchmarks/triton_spills.py's first version, unspecialised), not yet timed
            ((32, 64, 64, 32), 8, 2), ((16, 128, 128, 16), 8, 2)]

def timed(fn, repeats: int) -> tuple[float, float]:
    """(first call's seconds, median seconds of the next ``repeats``)."""
    torch.cuda.synchronize()
    began = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    first = time.perf_counter() - began
    return first, cuda_median(fn, repeats)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--length", type=int, default=32768)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--no-backward", action="store_true")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("benchmarks/triton_blocks.py needs a CUDA device")
    import importlib

    from attnkit._backends import triton as kernel

    # the modules, not the package's functions of the same names
    forward_kernel = importlib.import_module("attnkit._backends.triton.forward")
    backward_kernel = importlib.import_module("attnkit._backends.triton.backward")

    dtype, length, heads, head_dim = getattr(torch, args.dtype), args.length, args.heads, args.head_dim
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v, grad = (torch.randn(1, heads, length, head_dim, device="cuda", dtype=dtype, generator=g)
                     for _ in range(4))
    cuts = [int(c) for c in torch.linspace(0, 1, 9)[1:-1] ** 1.3 * length]
    bounds = [0, *cuts, length]
    cases = {"window 1024": masks.sliding_window(1024),
             "8 causal documents": masks.document([b - a for a, b in zip(bounds, bounds[1:])]) & masks.causal()}
    default_forward = kernel.forward_blocks(head_dim, dtype)
    default_backward = kernel.backward_blocks(head_dim, dtype)
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, {args.dtype}, L={length}, H={heads}, "
          f"D={head_dim}; medians of {args.repeats}; * = the package's default")
    for name, mask in cases.items():
        lo, hi = (t.cuda() for t in mask.row_ranges(length, length))
        pairs = int((hi - lo).clamp(min=0).sum())
        flops = 4 * pairs * head_dim * heads
        prep = kernel.prepare(q, k, v, lo, hi, scale=head_dim ** -0.5, softcap=None,
                              alibi_slopes=None, dropout=0.0, seed=None)
        print(f"\n## {name}: forward (BLOCK_M, BLOCK_N, warps, stages)")
        print("| config | ms | TFLOP/s | first s |\n|---|---:|---:|---:|")
        out = lse = None
        # First, so that a stage cut short still reports them: the default tiles without the pass that
        # keeps a masked-out NaN or inf value out (triton/non_finite.py), and with it compiled into the
        # kernel (the same bits as the default, gated: a second launch; more spills by ptxas).
        # Then the pass inline at the tiles where ptxas spills nothing with it (benchmarks/triton_spills.py):
        # there it may cost less than the gated second launch.
        for config, mode in ((default_forward, "off"), (default_forward, "inline"), *((c, "inline") for c in INLINE)):
            first, median = timed(lambda: forward_kernel.launch(prep, *config, second_pass=mode), args.repeats)
            print(f"| {config}, second pass {mode} | {1e3 * median:.3f} | {flops / median / 1e12:.0f} "
                  f"| {first:.1f} |", flush=True)
        for config in TMA:  # the second pass gated, as the default's
            first, median = timed(lambda: forward_kernel.launch(prep, *config, loads="tma"), args.repeats)
            print(f"| {config}, TMA loads | {1e3 * median:.3f} | {flops / median / 1e12:.0f} | {first:.1f} |",
                  flush=True)
        for config in dict.fromkeys([default_forward, *FORWARD]):
            try:
                first, median = timed(lambda: forward_kernel.launch(prep, *config), args.repeats)
            except Exception as error:  # noqa: BLE001 - a config that does not compile is a result
                print(f"| {config} | failed: {str(error).splitlines()[0][:80]} | | |", flush=True)
                continue
            mark = "*" if config == default_forward else ""
            print(f"| {config}{mark} | {1e3 * median:.3f} | {flops / median / 1e12:.0f} | {first:.1f} |", flush=True)
        out, lse = forward_kernel.launch(prep, *default_forward)
        if args.no_backward:
            continue
        print(f"\n## {name}: backward ((dK/dV BLOCK_M, BLOCK_N, dQ BLOCK_M, BLOCK_N), warps, stages)")
        print("| config | ms | TFLOP/s (x2.5) | first s |\n|---|---:|---:|---:|")
        # First: the default tiles with the dK/dV kernel walking its query blocks in runs (no branch
        # in its loops) against the default walk, each checked against its block summary
        for walk in backward_kernel.WALKS:
            run = lambda: backward_kernel.launch(prep, grad, None, out, lse, *default_backward, walk=walk)  # noqa: E731
            first, median = timed(run, args.repeats)
            print(f"| {default_backward}, walk {walk} | {1e3 * median:.3f} | {2.5 * flops / median / 1e12:.0f} | "
                  f"{first:.1f} |", flush=True)
        for blocks, warps, stages in dict.fromkeys([default_backward, *BACKWARD]):
            run = lambda: backward_kernel.launch(prep, grad, None, out, lse, blocks, warps, stages)  # noqa: E731
            try:
                first, median = timed(run, args.repeats)
            except Exception as error:  # noqa: BLE001
                print(f"| {(blocks, warps, stages)} | failed: {str(error).splitlines()[0][:80]} | | |", flush=True)
                continue
            mark = "*" if (blocks, warps, stages) == default_backward else ""
            print(f"| {(blocks, warps, stages)}{mark} | {1e3 * median:.3f} | {2.5 * flops / median / 1e12:.0f} | "
                  f"{first:.1f} |", flush=True)


if __name__ == "__main__":
    main()
