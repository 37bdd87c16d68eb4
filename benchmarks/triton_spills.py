"""Registers and spills of attnkit's Triton kernels for an H100 (sm_90a), on a machine without a GPU.

Triton compiles its source to PTX for any target, and the ptxas that triton ships assembles it
for sm_90a and reports, per kernel, the registers used and the bytes spilled to local memory.
Spills are not times: they say where register pressure is, not what a kernel costs on the card.
But they can be read where no GPU is lent, and they pick which configurations
``benchmarks/triton_blocks.py`` should time when one is. ``tests/test_triton_compiles.py`` builds
the kernels through :func:`build` too.

    python benchmarks/triton_spills.py                    # bf16, D = 128: forward and backward tiles
    python benchmarks/triton_spills.py --dtype float16 --head-dim 64
"""

from __future__ import annotations

import argparse
import importlib
import os
import re
import subprocess
import sys
import tempfile

#: Pointer arguments and their element types; other capitalised or gradient arguments are tensors
#: of the call's dtype, other arguments int32 or the float32 ``FLOATS``.
POINTERS = {"Lse": "*fp32", "Delta": "*fp32", "dLse": "*fp32", "Slopes": "*fp32", "Lo": "*i32", "Hi": "*i32",
            "Summary": "*i32", "Reached": "*i32", "Seed": "*i64", "Gate": "*i32"}
FLOATS = ("scale", "softcap", "drop_scale")
ELEMENTS = {"bfloat16": "*bf16", "float16": "*fp16", "float32": "*fp32"}


def build(fn, element: str, constants: dict, warps: int, stages: int) -> dict[str, int]:
    """Compile the ``@triton.jit`` kernel ``fn`` for sm_90a with ``constants`` (its constexprs) and
    assemble it with triton's ptxas: ``{"registers", "spill_stores", "spill_loads"}``. Raises
    AssertionError with ptxas's message where assembling fails."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    signature = {}
    for name in fn.arg_names:
        if name in constants:
            signature[name] = "constexpr"
        elif name in POINTERS:
            signature[name] = POINTERS[name]
        elif name[0].isupper() or name[:2] in ("dO", "dQ", "dK", "dV"):
            signature[name] = element
        else:
            signature[name] = "fp32" if name in FLOATS else "i32"
    compiled = triton.compile(ASTSource(fn=fn, signature=signature, constexprs=constants),
                              target=GPUTarget("cuda", 90, 32), options=dict(num_warps=warps, num_stages=stages))
    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
        f.write(compiled.asm["ptx"])
    try:
        done = subprocess.run([ptxas, "-v", "-arch=sm_90a", f.name, "-o", os.devnull], capture_output=True,
                              text=True)
    finally:
        os.unlink(f.name)
    assert done.returncode == 0, done.stderr

    def number(pattern: str) -> int:
        found = re.search(pattern, done.stderr)
        return int(found.group(1)) if found else 0

    return {"registers": number(r"Used (\d+) registers"), "spill_stores": number(r"(\d+) bytes spill stores"),
            "spill_loads": number(r"(\d+) bytes spill loads")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", choices=("bfloat16", "float16"), default="bfloat16")
    parser.add_argument("--head-dim", type=int, default=128)
    args = parser.parse_args()
    if os.environ.get("TRITON_INTERPRET") == "1":
        sys.exit("unset TRITON_INTERPRET: the interpreter compiles nothing")
    import torch

    sys.path.insert(0, os.path.dirname(__file__))
    from triton_blocks import BACKWARD, FORWARD

    kernels = importlib.import_module("attnkit._backends.triton")
    forward, backward_kv, backward_q = (importlib.import_module("attnkit._backends.triton." + name)
                                        for name in ("forward", "backward_kv", "backward_q"))
    dtype, dim, element = getattr(torch, args.dtype), args.head_dim, ELEMENTS[args.dtype]
    flags = dict(BLOCK_D=dim, BLOCK_DV=dim, RANGES=1, SOFTCAP=False, HAS_ALIBI=False, DROPOUT=False, IEEE=False)

    def only(fn, extra: dict) -> dict:
        return {k: v for k, v in {**flags, **extra}.items() if k in fn.arg_names}

    def row(stats: dict[str, int]) -> str:
        return f"{stats['registers']} | {stats['spill_stores']} | {stats['spill_loads']}"

    print(f"# ptxas sm_90a (triton's), {args.dtype}, D = {dim}, one range, no score modifiers; * = the default\n")
    print("| forward (BLOCK_M, BLOCK_N, warps, stages) | second pass | registers | spill stores (B) | spill loads (B) |")
    print("|---|---|---:|---:|---:|")
    default = kernels.forward_blocks(dim, dtype)
    for config in dict.fromkeys([default, *FORWARD]):
        block_m, block_n, warps, stages = config
        for second_pass in (True, False):
            stats = build(forward._forward_kernel, element,
                          only(forward._forward_kernel, dict(BLOCK_M=block_m, BLOCK_N=block_n, SECOND_PASS=second_pass,
                                                             GATED=False)), warps, stages)
            mark = "*" if config == default else ""
            print(f"| {config}{mark} | {'compiled in' if second_pass else 'none'} | {row(stats)} |", flush=True)
    print("\n| backward ((dK/dV M, N, dQ M, N), warps, stages) | kernel | registers | spill stores (B) | "
          "spill loads (B) |")
    print("|---|---|---:|---:|---:|")
    default_backward = kernels.backward_blocks(dim, dtype)
    for config in dict.fromkeys([default_backward, *BACKWARD]):
        (kv_m, kv_n, q_m, q_n), warps, stages = config
        mark = "*" if config == default_backward else ""
        for name, fn, sizes, runs in (("dK/dV", backward_kv.dkdv_kernel, (kv_m, kv_n), False),
                                      ("dK/dV, walk in runs", backward_kv.dkdv_kernel, (kv_m, kv_n), True),
                                      ("dQ", backward_q.dq_kernel, (q_m, q_n), False)):
            stats = build(fn, element, only(fn, dict(BLOCK_M=sizes[0], BLOCK_N=sizes[1], RUNS=runs)), warps, stages)
            print(f"| {config}{mark} | {name} | {row(stats)} |", flush=True)


if __name__ == "__main__":
    main()
