"""The native kernel in half precision against float64 over random calls: FlashAttention's 2x rule.

Each call draws a length (1-700), heads and kv heads (GQA), D in {16, 32, 64, 80}, Dv in {D, 32},
a scale, a mask (sliding window, causal documents, causal, causal + padding, a window or a prefix
of keys (two ranges), prefix-LM), and, each with probability 0.3, soft-capping, ALiBi and sinks;
with probability 0.4 the lse joins the loss. The dtype is drawn too: float32 is held to 2e-4 of
the reference's scale, bf16 and fp16 to twice the error of PyTorch's own call in that dtype
against float64 (SDPA over the dense mask for plain calls, PyTorch ops in the dtype where SDPA has
no such feature: the reference backend), for the output and each gradient at its worst element.
``--dropout`` adds dropout 0.2 (the reference then draws the same pattern: it is a function of the
seed and position). ``--units`` names the units bf16's products run on (``tiles``, the AMX tiles and
the default; ``dots``, AVX512-BF16's dot products; ``convert``, float32), each where the CPU has them.

Not a test: 400 calls take minutes. The docs' fuzz figures (docs/guides/backends.md) come from

    python benchmarks/half_accuracy.py --calls 400
    python benchmarks/half_accuracy.py --calls 150 --dropout
    python benchmarks/half_accuracy.py --calls 400 --units convert
    python benchmarks/half_accuracy.py --calls 400 --units dots
"""

from __future__ import annotations

import argparse
import os
import random
import sys

import torch
import torch.nn.functional as F

import attnkit
from attnkit import masks
from attnkit._backends import native
from attnkit._backends.tiled_plan import tuning

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
from oracle import output_and_gradients  # noqa: E402  (the tests' one way to run a contender)

GRADIENTS = ("output", "dq", "dk", "dv")


def random_mask(rng: random.Random, length: int) -> masks.StructuredMask:
    kind = rng.choice(["window", "documents", "causal", "padding", "two ranges", "prefix-LM"])
    if kind == "window":
        return masks.sliding_window(rng.randint(1, 400)) & masks.causal()
    if kind == "documents":
        cuts = sorted(rng.sample(range(1, length), min(rng.randint(1, 5), length - 1)))
        return masks.document([b - a for a, b in zip([0, *cuts], [*cuts, length])]) & masks.causal()
    if kind == "causal":
        return masks.causal()
    if kind == "padding":
        return masks.causal() & masks.padding([rng.randint(1, length)])
    if kind == "two ranges":
        return (masks.sliding_window(rng.randint(1, 50)) | masks.padding([rng.randint(1, 20)])) & masks.causal()
    return masks.prefix_lm(rng.randint(1, length))


def one_call(case: int, dropout: bool, units: str) -> list[str]:
    """The failures of call ``case`` (its draws are a function of ``case``), as lines."""
    rng, g = random.Random(case), torch.Generator().manual_seed(case)
    length, heads = rng.randint(1, 700), rng.choice([1, 2, 4])
    kv_heads = rng.choice([h for h in (1, 2, 4) if heads % h == 0])
    dim = rng.choice([16, 32, 64, 80])
    dim_v = rng.choice([dim, 32])
    dtype = rng.choice([torch.float32, torch.float32, torch.bfloat16, torch.float16])
    scale = rng.choice([None, 1.0, 0.3])
    mask = random_mask(rng, length)
    extra: dict = {}
    if rng.random() < 0.3:
        extra["softcap"] = rng.choice([5.0, 30.0])
    if rng.random() < 0.3:
        extra["alibi_slopes"] = torch.rand(heads, generator=g)
    if rng.random() < 0.3:
        extra["sinks"] = torch.randn(heads, generator=g)
    if dropout:
        extra["dropout"] = 0.2
    lse_weight = torch.randn(1, heads, length, generator=g) if rng.random() < 0.4 else None
    # the inputs are values of the dtype, so float64 sees exactly what the kernel sees
    q = torch.randn(1, heads, length, dim, generator=g).to(dtype).double()
    k = torch.randn(1, kv_heads, length, dim, generator=g).to(dtype).double()
    v = torch.randn(1, kv_heads, length, dim_v, generator=g).to(dtype).double()
    grad_out = torch.randn(1, heads, length, dim_v, generator=g).to(dtype).double()

    def drawn():
        return {"generator": torch.Generator().manual_seed(case)} if dropout else {}

    def ours(a, b, c):
        with tuning(kernel="native"):
            return attnkit.attention(a, b, c, mask=mask, backend="tiled", scale=scale,
                                     return_lse=lse_weight is not None, **drawn(), **extra)

    def reference(a, b, c):
        if lse_weight is None:
            return attnkit.attention(a, b, c, mask=mask, backend="reference", scale=scale, **drawn(), **extra)
        with tuning(kernel="blocks"):  # the reference backend returns no lse
            return attnkit.attention(a, b, c, mask=mask, backend="tiled", scale=scale, return_lse=True,
                                     **drawn(), **extra)

    with native.half_products(units):
        got = output_and_gradients(ours, (q, k, v), grad_out, dtype, lse_weight)
    want = output_and_gradients(reference, (q, k, v), grad_out, torch.float64, lse_weight)
    plain = not extra and lse_weight is None
    if dtype == torch.float32:
        bar = None
    elif plain:
        dense, repeat = mask.dense(length, length, ndim=4), heads // kv_heads

        def sdpa(a, b, c):
            return F.scaled_dot_product_attention(a, b.repeat_interleave(repeat, 1), c.repeat_interleave(repeat, 1),
                                                  attn_mask=dense, scale=scale)
        bar = output_and_gradients(sdpa, (q, k, v), grad_out, dtype, None)
    else:
        bar = output_and_gradients(reference, (q, k, v), grad_out, dtype, lse_weight)
    failures = []
    for index, what in enumerate(GRADIENTS):
        error = (got[index].double() - want[index]).abs().max().item()
        if bar is None:
            allowed = 2e-4 * max(1.0, want[index].abs().max().item())
        else:
            allowed = 2 * (bar[index].double() - want[index]).abs().max().item() + 1e-6
        if not error <= allowed:
            failures.append(f"call {case}: {what} {str(dtype)[6:]} L={length} H={heads}/{kv_heads} D={dim}/{dim_v} "
                            f"scale={scale} {mask} {sorted(extra)} lse={lse_weight is not None}: "
                            f"{error:.3e} > {allowed:.3e}")
    return failures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calls", type=int, default=100)
    parser.add_argument("--first", type=int, default=0, help="the first call's number")
    parser.add_argument("--dropout", action="store_true", help="dropout 0.2 on every call")
    parser.add_argument("--units", choices=native.HALF_PRODUCTS, default="tiles",
                        help="the units bf16's products run on, where the CPU has them (else converted to float32)")
    args = parser.parse_args()
    failed = 0
    for case in range(args.first, args.first + args.calls):
        for line in one_call(case, args.dropout, args.units):
            print(line, flush=True)
            failed += 1
    print(f"{args.calls} calls, {failed} results over the bar (bf16's products on "
          f"{args.units if native.half_products_available(args.units) else 'convert'})")


if __name__ == "__main__":
    main()
