"""What "auto" runs in half precision against the alternatives, in one process (issue 26).

For each mask and length: ``attnkit.attention`` as ``"auto"`` routes it (its pick printed), the
native kernel forced (``backend="tiled"`` with ``kernel="native"``), and PyTorch's own path for the
same call (SDPA for no mask and plain causal, PyTorch's kernels block by block for the structured
masks: the native kernel turned off). Forward, or forward + backward with ``--train``; medians of
``--repeats`` rounds after two warm-ups, the three taking turns (``common.median_times``); the
ratios are native / PyTorch's. ``--units`` names the units the kernel's bfloat16 products run on
(``native.half_products``: ``tiles``, the AMX tiles and the default; ``dots``, AVX512-BF16's dot
products; ``convert``, float32), each where the CPU has them, to compare the paths on one CPU. A
CPU without AMX can be played on one that has it: PyTorch's kernels (oneDNN) then run with
``ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16`` in the environment, and the kernel with ``--units dots``
or ``--units convert``.

    python benchmarks/half_routes.py --dtype bfloat16 --lengths 8192
    python benchmarks/half_routes.py --dtype bfloat16 --masks none causal --lengths 256 512 1024 2048 4096
    ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16 python benchmarks/half_routes.py --units dots --masks window512
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys

import torch

import attnkit
from attnkit import masks
from attnkit._backends import auto_runs, native
from attnkit._backends.tiled_plan import tuning
from attnkit._call import make_call

sys.path.insert(0, os.path.dirname(__file__))
from common import median_times  # noqa: E402

MASKS = {
    "window512": lambda length: dict(mask=masks.sliding_window(512)),
    "documents8": lambda length: dict(mask=masks.document([length // 8] * 8)),
    "causal+padding": lambda length: dict(mask=masks.causal() & masks.padding([length * 3 // 4])),
    "causal": lambda length: dict(causal=True),
    "none": lambda length: {},
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), default="bfloat16")
    parser.add_argument("--train", action="store_true")
    parser.add_argument("--lengths", type=int, nargs="+", default=[8192])
    parser.add_argument("--masks", nargs="+", choices=list(MASKS), default=list(MASKS))
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--units", choices=native.HALF_PRODUCTS, default="tiles")
    args = parser.parse_args()
    if not native.available():
        raise SystemExit(f"the native kernel is not built: {native.why_unavailable()}")
    dtype = getattr(torch, args.dtype)
    units = native.half_products(args.units)
    print(f"# {args.dtype}, {'forward + backward' if args.train else 'forward'}, B = 1, H = {args.heads}, "
          f"D = {args.dim}, {torch.get_num_threads()} threads; the kernel's bf16 products on {args.units} "
          f"(AMX tiles available: {native.matrix_units_available()}, AVX512-BF16 dot products: "
          f"{native.dot_products_available()}); ONEDNN_MAX_CPU_ISA={os.environ.get('ONEDNN_MAX_CPU_ISA', '(unset)')}")
    print("| mask | L | auto's pick | auto (ms) | native kernel (ms) | PyTorch's (ms) | native / PyTorch's |")
    print("|---|---:|---|---:|---:|---:|---:|")
    with units:
        for length in args.lengths:
            g = torch.Generator().manual_seed(0)
            q, k, v = (torch.randn(1, args.heads, length, args.dim, generator=g).to(dtype).requires_grad_(args.train)
                       for _ in range(3))
            grad_out = torch.randn(1, args.heads, length, args.dim, generator=g).to(dtype)
            for name in args.masks:
                options = MASKS[name](length)

                def step(**extra):
                    out = attnkit.attention(q, k, v, **options, **extra)
                    if args.train:
                        out.backward(grad_out)

                call = make_call(q, k, v, **{**dict(mask=None, causal=False, scale=None, dropout=0.0, generator=None,
                                                    return_weights=False), **options})
                structured = "mask" in options

                def native_forced():
                    with tuning(kernel="native"):
                        step(backend="tiled")

                def pytorchs():
                    with native.turned_off() if structured else contextlib.nullcontext():
                        step(backend="tiled" if structured else "torch")

                times = median_times({"auto": step, "native": native_forced, "pytorch": pytorchs}, args.repeats,
                                     warmup=2)
                auto, ours, theirs = (1e3 * times[name] for name in ("auto", "native", "pytorch"))
                print(f"| {name} | {length} | {auto_runs(call)} | {auto:.1f} | {ours:.1f} | {theirs:.1f} | "
                      f"{ours / theirs:.2f} |", flush=True)


if __name__ == "__main__":
    main()
