"""Where an attnkit call on CUDA spends its time beyond the kernel: the kernel alone against the
call through ``attnkit.attention`` (each engine forced, and as ``"auto"`` routes it), GPU time by
CUDA events and host time per call, and a profile of the host's work (torch.profiler, the top
entries by self CPU time).

    python benchmarks/gpu_overhead.py                        # window 1024, L = 32768, bf16, H = 16, D = 128
    python benchmarks/gpu_overhead.py --length 4096 --train
"""

from __future__ import annotations

import argparse
import importlib
import os
import statistics
import sys
import time

import torch

import attnkit
from attnkit import masks
from attnkit._backends import blockwise, tiled_plan

sys.path.insert(0, os.path.dirname(__file__))
from common import cuda_median  # noqa: E402


def gpu_ms(fn, repeats: int) -> float:
    return 1e3 * cuda_median(fn, repeats)


def host_ms(fn, repeats: int) -> float:
    """Host time per call with the GPU kept out of the way (synchronised before each call)."""
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        began = time.perf_counter()
        fn()
        times.append(1e3 * (time.perf_counter() - began))
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--length", type=int, default=32768)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--train", action="store_true")
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("benchmarks/gpu_overhead.py needs a CUDA device")
    kernel = importlib.import_module("attnkit._backends.triton")
    forward_kernel = importlib.import_module("attnkit._backends.triton.forward")
    length, heads, dim = args.length, args.heads, args.head_dim
    q, k, v = (torch.randn(1, heads, length, dim, device="cuda", dtype=torch.bfloat16, requires_grad=args.train)
               for _ in range(3))
    mask = masks.sliding_window(1024)
    lo, hi = (t.cuda() for t in mask.row_ranges(length, length))
    prep = kernel.prepare(q.detach(), k.detach(), v.detach(), lo, hi, scale=dim ** -0.5, softcap=None,
                          alibi_slopes=None, dropout=0.0, seed=None)
    blocks = kernel.forward_blocks(dim, torch.bfloat16)

    def engine(name):
        def run():
            with tiled_plan.tuning(kernel=name):
                out = attnkit.attention(q, k, v, mask=mask, backend="tiled")
            if args.train:
                out.sum().backward()
        return run

    def auto():
        out = attnkit.attention(q, k, v, mask=mask)  # as a user calls it: the route chosen per call
        if args.train:
            out.sum().backward()

    def flex_unchecked():
        # A measurement of what the Flex engine's check of its output costs (reads of the device):
        # the check answering "nothing to redo". Not a mode attnkit has.
        checked = blockwise.pairwise_if_not_finite
        blockwise.pairwise_if_not_finite = lambda out, lse, *args, **kwargs: (out, lse)
        try:
            engine("flex")()
        finally:
            blockwise.pairwise_if_not_finite = checked

    runs = {"triton kernel alone": lambda: forward_kernel.launch(prep, *blocks), "attnkit triton": engine("triton"),
            "attnkit flex": engine("flex"), "attnkit auto": auto,
            "attnkit flex, output check skipped (measurement only)": flex_unchecked}
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, window 1024, L={length}, H={heads}, D={dim}, "
          f"bf16, {'forward + backward' if args.train else 'forward'}; medians of {args.repeats}")
    print("| run | GPU-timed ms | host ms per call (GPU idle before) |\n|---|---:|---:|")
    for label, fn in runs.items():
        fn()
        fn()
        print(f"| {label} | {gpu_ms(fn, args.repeats):.3f} | {host_ms(fn, args.repeats):.3f} |", flush=True)
    from torch.profiler import ProfilerActivity, profile

    for label in ("attnkit triton", "attnkit flex", "attnkit auto"):
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(3):
                runs[label]()
            torch.cuda.synchronize()
        print(f"\n## {label}: 3 calls, top by self CPU time")
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=18, max_name_column_width=60))


if __name__ == "__main__":
    main()
