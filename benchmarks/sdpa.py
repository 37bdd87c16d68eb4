"""attnkit.attention(backend="auto") vs F.scaled_dot_product_attention, measured in one run.

Prints a Markdown table: median time of each and their ratio (ours / PyTorch's) for
B=1, H=8, D=64, L from 512 to 8192, with no mask, causal, and a dense boolean mask.
    python benchmarks/sdpa.py [--lengths 512 1024 ...] [--repeats N] [--device cuda] [--dtype bfloat16]
On a GPU each timed call ends with a synchronisation, so times are the calls' wall time.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(__file__))
import attnkit  # noqa: E402
from common import describe_machine, median_times  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", type=int, nargs="+", default=[512, 1024, 2048, 4096, 8192])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=("float32", "float16", "bfloat16"))
    args = parser.parse_args()
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)

    def synced(fn):
        if device.type != "cuda":
            return fn
        return lambda: (fn(), torch.cuda.synchronize())

    torch.manual_seed(0)
    print(f"# attention(backend='auto') / F.scaled_dot_product_attention  ({describe_machine(device)})")
    print(f"# B=1, H=8, D=64, {args.dtype}, median of {args.repeats} interleaved runs\n")
    print("| L | mask | attnkit (ms) | SDPA (ms) | ratio |")
    print("|---:|---|---:|---:|---:|")
    worst = 0.0
    for length in args.lengths:
        query, key, value = (torch.randn(1, 8, length, 64, device=device, dtype=dtype) for _ in range(3))
        keep = torch.rand(length, length, device=device) < 0.9  # dense boolean mask, True = may attend
        contenders = {
            "none": (lambda: attnkit.attention(query, key, value),
                     lambda: F.scaled_dot_product_attention(query, key, value)),
            "causal": (lambda: attnkit.attention(query, key, value, causal=True),
                       lambda: F.scaled_dot_product_attention(query, key, value, is_causal=True)),
            "bool": (lambda: attnkit.attention(query, key, value, mask=keep),
                     lambda: F.scaled_dot_product_attention(query, key, value, attn_mask=keep)),
        }
        repeats = args.repeats if length < 8192 else max(3, args.repeats // 2)
        for name, (ours, theirs) in contenders.items():
            times = median_times({"ours": synced(ours), "theirs": synced(theirs)}, repeats=repeats)
            ratio = times["ours"] / times["theirs"]
            worst = max(worst, ratio)
            print(f"| {length} | {name} | {times['ours'] * 1e3:.1f} | {times['theirs'] * 1e3:.1f} | {ratio:.3f} |",
                  flush=True)
    print(f"\nworst ratio: {worst:.3f} (goal: <= 1.05)")


if __name__ == "__main__":
    main()
