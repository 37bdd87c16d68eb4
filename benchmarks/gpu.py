"""Structured masks on a CUDA GPU: attnkit (its route, and each of its engines) against FlexAttention
and SDPA, forward and forward + backward.

For each length and mask (sliding window 1024, 8 causal documents of uneven lengths, causal, causal
+ padding of the last quarter of the keys), B = 1, H = 16, D = 128, bf16 by default, it prints per
contender: median time (CUDA events, interleaved rounds), useful TFLOP/s (4 x attended pairs x D x
H; training x 3.5), the share of SDPA's causal TFLOP/s at the same length, the ratio to
FlexAttention's TFLOP/s, extra peak memory of a steady call, and the first call's time (compiling
included). Contenders:

- ``attnkit auto``: ``attnkit.attention(q, k, v, mask=...)`` as a user calls it (its route printed);
- ``attnkit flex`` / ``attnkit triton``: the tiled backend with that engine forced;
- ``flex``: FlexAttention compiled, its BlockMask from ``create_block_mask`` built once outside the
  timing (its build time is printed: what a user of Flex pays per new mask);
- ``sdpa``: the dense boolean mask where it fits in memory, SDPA's causal path for plain causal.

Also printed: the time to build attnkit's block structure from the intervals (``row_ranges`` and
the BlockMask, ``attnkit.masks`` -> ``flex.block_mask_from_bounds``) against ``create_block_mask``,
and the recompiles of 20 calls whose window size / document boundaries vary (goal: none after
the first).

    python benchmarks/gpu.py                          # L = 8192, 32768, 131072; forward and training
    python benchmarks/gpu.py --lengths 32768 --no-train --repeats 5
    python benchmarks/gpu.py --masks-only --device cpu     # the block structure's build alone, any device
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

import attnkit
from attnkit import masks
from attnkit._backends import auto_runs, flex, tiled_plan
from attnkit._call import make_call


def mask_cases(length: int, device: str = "cuda") -> dict[str, tuple[masks.StructuredMask, Callable, bool]]:
    """name -> (attnkit mask, Flex mask_mod factory, plain causal)."""
    cuts = torch.linspace(0, 1, 9)[1:-1] ** 1.3 * length  # 8 documents of uneven lengths
    bounds = [0, *[int(c) for c in cuts], length]
    lengths = [b - a for a, b in zip(bounds, bounds[1:])]
    ids = torch.repeat_interleave(torch.arange(8), torch.tensor(lengths)).to(device)
    valid = 3 * length // 4
    return {  # causal first: the others' share of SDPA's causal rate needs it
        "causal": (masks.causal(), lambda: lambda b, h, q, k: q >= k, True),
        "window 1024": (masks.sliding_window(1024), lambda: lambda b, h, q, k: (q >= k) & (q - k < 1024), False),
        "8 causal documents": (masks.document(lengths) & masks.causal(),
                               lambda: lambda b, h, q, k: (ids[q] == ids[k]) & (q >= k), False),
        "causal + padding": (masks.causal() & masks.padding(valid), lambda: lambda b, h, q, k: (q >= k) & (k < valid),
                             False),
    }


def attended_pairs(mask: masks.StructuredMask, length: int) -> int:
    lo, hi = mask.row_ranges(length, length)
    return int((hi - lo).clamp(min=0).sum())


def cuda_time(fn: Callable[[], object]) -> float:
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    stop.record()
    torch.cuda.synchronize()
    return start.elapsed_time(stop) / 1000


def first_and_peak(fn: Callable[[], object]) -> tuple[float, float]:
    """First call's wall time (compiling included) and a steady call's extra peak memory (GiB)."""
    torch.cuda.synchronize()
    began = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    first = time.perf_counter() - began
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return first, (torch.cuda.max_memory_allocated() - base) / 2**30


def contenders(q, k, v, mask, flex_mod, plain_causal, train: bool) -> dict[str, Callable[[], object]]:
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    length = q.shape[2]
    compiled_flex = torch.compile(flex_attention)
    built = time.perf_counter()
    try:
        flex_blocks = create_block_mask(flex_mod(), 1, 1, length, length, device="cuda")
        torch.cuda.synchronize()
        print(f"    create_block_mask: {1000 * (time.perf_counter() - built):.1f} ms")
    except torch.OutOfMemoryError:
        flex_blocks = None
        print("    create_block_mask: out of memory")
        torch.cuda.empty_cache()

    def step(fn):
        if not train:
            return lambda: fn()
        return lambda: fn().sum().backward()

    def ours(kernel: str | None):
        def run():
            if kernel is None:
                return attnkit.attention(q, k, v, mask=mask)
            with tiled_plan.tuning(kernel=kernel):
                return attnkit.attention(q, k, v, mask=mask, backend="tiled")
        return run

    runs = {"attnkit auto": step(ours(None)), "attnkit flex": step(ours("flex")),
            "attnkit triton": step(ours("triton"))}
    if flex_blocks is not None:
        runs["flex"] = step(lambda: compiled_flex(q, k, v, block_mask=flex_blocks, enable_gqa=True))
    if plain_causal:
        runs["sdpa"] = step(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True))
    elif length <= 32768:  # the dense boolean mask: L * L bytes
        dense = mask.dense(length, length, device="cuda")
        runs["sdpa"] = step(lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=dense, enable_gqa=True))
    return runs


def block_structure_time(mask: masks.StructuredMask, length: int, repeats: int) -> float:
    def build():
        lo, hi = (t.cuda() for t in mask.row_ranges(length, length))
        return flex.block_mask_from_bounds(lo, hi, length, length)

    build()
    return statistics.median(cuda_time(build) for _ in range(repeats))


def mask_build_table(device: str, lengths: list[int], repeats: int) -> None:
    """Building the block structure: attnkit's BlockMask from the intervals (row_ranges included)
    against FlexAttention's create_block_mask (its mask_mod over every pair), medians of ``repeats``."""
    from torch.nn.attention.flex_attention import create_block_mask

    def timed(fn) -> float:
        fn()
        times = []
        for _ in range(repeats):
            if device == "cuda":
                torch.cuda.synchronize()
            began = time.perf_counter()
            fn()
            if device == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - began)
        return statistics.median(times)

    print(f"# block structure build, {device}, torch {torch.__version__}; medians of {repeats} (ms)")
    print("| L | mask | attnkit (from intervals) | create_block_mask |")
    print("|---:|---|---:|---:|")
    for length in lengths:
        for name, (mask, flex_mod, _) in mask_cases(length, device).items():
            def ours():
                lo, hi = (t.to(device) for t in mask.row_ranges(length, length))
                return flex.block_mask_from_bounds(lo, hi, length, length)

            theirs = "-"
            if length * length <= 2**30:  # create_block_mask evaluates every pair
                try:
                    theirs = f"{1e3 * timed(lambda: create_block_mask(flex_mod(), 1, 1, length, length, device=device)):.1f}"
                except (RuntimeError, torch.OutOfMemoryError) as error:
                    theirs = f"fails: {str(error).splitlines()[0][:60]}"
            print(f"| {length} | {name} | {1e3 * timed(ours):.2f} | {theirs} |", flush=True)


def recompiles(length: int, heads: int, head_dim: int, dtype: torch.dtype) -> int:
    """Recompiles (new Dynamo graphs) over 20 calls of one shape whose masks' values change."""
    from torch._dynamo.utils import counters

    q = torch.randn(1, heads, length, head_dim, device="cuda", dtype=dtype)
    attnkit.attention(q, q, q, mask=masks.sliding_window(512))
    before = counters["stats"]["unique_graphs"]
    for i in range(10):
        attnkit.attention(q, q, q, mask=masks.sliding_window(256 + 64 * i))
        cut = length // 4 + 37 * i
        attnkit.attention(q, q, q, mask=masks.document([cut, length - cut]) & masks.causal())
    return counters["stats"]["unique_graphs"] - before


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[8192, 32768, 131072])
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=16)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--no-train", action="store_true")
    parser.add_argument("--masks", nargs="+", default=None, help="names to keep (substrings)")
    parser.add_argument("--masks-only", action="store_true", help="time the block structure's build alone")
    parser.add_argument("--device", default="cuda", help="with --masks-only: where to build")
    args = parser.parse_args()
    if args.masks_only:
        mask_build_table(args.device, args.lengths, args.repeats)
        return
    if not torch.cuda.is_available():
        sys.exit("benchmarks/gpu.py needs a CUDA device")
    dtype = getattr(torch, args.dtype)
    # Flex's contender compiles flex_attention itself, once per mask and mode: past dynamo's default
    # of 8 versions it would run unfused (an L x L score matrix) and fail for memory
    torch._dynamo.config.recompile_limit = 64
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, {args.dtype}, B=1, H={args.heads} "
          f"(kv {args.kv_heads}), D={args.head_dim}; medians of {args.repeats} interleaved rounds, each starting one "
          f"contender later")
    print(f"# recompiles over 20 calls with varied windows / documents (L = 4096): "
          f"{recompiles(4096, args.heads, args.head_dim, dtype)}")
    for train in ([False] if args.no_train else [False, True]):
        for length in args.lengths:
            g = torch.Generator(device="cuda").manual_seed(0)
            q = torch.randn(1, args.heads, length, args.head_dim, device="cuda", dtype=dtype, generator=g)
            k, v = (torch.randn(1, args.kv_heads, length, args.head_dim, device="cuda", dtype=dtype, generator=g)
                    for _ in range(2))
            if train:
                q, k, v = (t.requires_grad_() for t in (q, k, v))
            factor = 3.5 if train else 1.0
            causal_rate = None
            for name, (mask, flex_mod, plain_causal) in mask_cases(length).items():
                if args.masks and not any(m in name for m in args.masks) and not plain_causal:
                    continue
                pairs = attended_pairs(mask, length)
                flops = 4 * pairs * args.head_dim * args.heads * factor
                route = auto_runs(make_call(q, k, v, mask=mask, causal=False, scale=None, dropout=0.0,
                                            generator=None, return_weights=False))
                print(f"\n## L = {length}, {name}, {'forward + backward' if train else 'forward'}; auto runs {route}; "
                      f"block structure built in {1000 * block_structure_time(mask, length, 5):.2f} ms")
                runs = contenders(q, k, v, mask, flex_mod, plain_causal, train)
                firsts = {}
                for label, fn in list(runs.items()):
                    try:
                        firsts[label] = first_and_peak(fn)
                    except (torch.OutOfMemoryError, RuntimeError) as error:
                        print(f"    {label}: failed: {str(error).splitlines()[0][:120]}")
                        runs.pop(label)
                        torch.cuda.empty_cache()
                times: dict[str, list[float]] = {label: [] for label in runs}
                labels = list(runs)
                for round_ in range(args.repeats):
                    # each round starts one contender later: the one after the dense SDPA call (a
                    # GiB-sized mask, its own workspace) is not always the same one
                    for label in labels[round_ % len(labels):] + labels[:round_ % len(labels)]:
                        times[label].append(cuda_time(runs[label]))
                rates = {label: flops / statistics.median(t) / 1e12 for label, t in times.items()}
                if plain_causal and "sdpa" in rates:
                    causal_rate = rates["sdpa"]
                print(f"    {'contender':<16}{'ms':>9}{'TFLOP/s':>9}{'% sdpa causal':>15}{'/ flex':>8}"
                      f"{'+GiB':>7}{'first s':>9}")
                for label, t in times.items():
                    share = f"{100 * rates[label] / causal_rate:.0f}%" if causal_rate else "-"
                    versus = f"{rates[label] / rates['flex']:.2f}" if "flex" in rates else "-"
                    first, peak = firsts[label]
                    print(f"    {label:<16}{1000 * statistics.median(t):>9.2f}{rates[label]:>9.0f}{share:>15}"
                          f"{versus:>8}{peak:>7.2f}{first:>9.2f}")
                del runs
                torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
