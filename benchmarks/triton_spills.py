"""Registers and spills of attnkit's Triton kernels for an H100 (sm_90a), on a machine without a GPU.

Triton compiles its source to PTX for any target, and the ptxas that triton ships assembles it
for sm_90a and reports, per kernel, the registers used and the bytes spilled to local memory.
Spills are not times: they say where register pressure is, not what a kernel costs on the card.
But they can be read where no GPU is lent, and they pick which configurations
``benchmarks/triton_blocks.py`` should time when one is. ``tests/test_triton_compiles.py`` builds
the kernels through :func:`captured` and :func:`build` too.

The kernel compiled is the one a launch on the card would compile. A launch specialises its
arguments by value: an integer equal to 1 becomes a constant (a contiguous last dimension's
stride), and integers and pointers divisible by 16 are marked so (the other strides, the lengths,
the tensors' addresses). Those marks decide whether loads are vectorised and whether the loops'
loads are pipelined through asynchronous copies (``cp.async``), so a kernel compiled without them
is another kernel, with other registers and spills. So the launches are taken from real calls of
the package's launchers on CPU tensors of the benchmark's shape (:func:`captured`: each kernel's
``run`` records its arguments instead of running), and specialised by the launcher's own rule
(:func:`specialized`).

    python benchmarks/triton_spills.py                    # bf16, D = 128: forward and backward tiles
    python benchmarks/triton_spills.py --dtype float16 --head-dim 64
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import inspect
import os
import re
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass

#: Triton's pointer types by torch dtype name.
POINTER_TYPES = {"bfloat16": "*bf16", "float16": "*fp16", "float32": "*fp32", "int32": "*i32", "int64": "*i64",
                 "uint8": "*u8", "bool": "*i1"}


@dataclass(frozen=True)
class Launch:
    """One kernel launch as the launcher made it: the ``@triton.jit`` function, its arguments by
    name (constexprs included) and ``num_warps``, ``num_stages``."""
    fn: object
    arguments: dict
    warps: int
    stages: int

    @property
    def name(self) -> str:
        return self.fn.__name__


def _kernels() -> list:
    """Every ``@triton.jit`` kernel attnkit launches (a launcher reaches them through ``[grid]``)."""
    modules = [importlib.import_module("attnkit._backends.triton." + name)
               for name in ("forward", "backward", "backward_kv", "backward_q")]
    return list({id(k): k for m in modules for k in vars(m).values() if hasattr(k, "arg_names")
                 and hasattr(k, "run")}.values())


@contextlib.contextmanager
def captured() -> Iterator[list[Launch]]:
    """Within the block, launching a kernel records a :class:`Launch` instead of running it (the
    outputs stay as allocated), so a launcher can be called on CPU tensors without a GPU."""
    launches: list[Launch] = []
    kernels = _kernels()

    def recorder(kernel):
        def run(*args, grid, warmup, num_warps=4, num_stages=3, **kwargs):
            bound = inspect.signature(kernel.fn).bind(*args, **kwargs)
            launches.append(Launch(kernel, dict(bound.arguments), num_warps, num_stages))
        return run

    for kernel in kernels:
        kernel.run = recorder(kernel)
    try:
        yield launches
    finally:
        for kernel in kernels:
            del kernel.run  # the class's method again


def specialized(launch: Launch) -> tuple[dict, dict, dict]:
    """``(signature, constexprs, attrs)`` of a launch, as Triton's launcher specialises it: an int
    equal to 1 (or a ``None``) becomes a constant, ints and tensor addresses divisible by 16 carry
    ``tt.divisibility = 16``, ints of 2^31 or more are i64, floats fp32, bools i1, TMA descriptors
    ``tensordesc<dtype[tile]>`` (parameters marked ``do_not_specialize`` keep their type only)."""
    import torch
    from triton.tools.tensor_descriptor import TensorDescriptor

    signature, constexprs, attrs = {}, {}, {}
    for param in launch.fn.params:
        name, index, value = param.name, param.num, launch.arguments[param.name]
        fixed = param.do_not_specialize
        divisible = not (fixed or param.do_not_specialize_on_alignment)
        if param.is_constexpr or value is None or (not fixed and type(value) is int and value == 1):
            signature[name], constexprs[name] = "constexpr", value
            continue
        if isinstance(value, TensorDescriptor):  # a TMA copy's descriptor: typed by its tile, never marked
            dtype = POINTER_TYPES[str(value.base.dtype).removeprefix("torch.")][1:]
            signature[name] = f"tensordesc<{dtype}[{','.join(map(str, value.block_shape))}]>"
            continue
        if isinstance(value, torch.Tensor):
            signature[name] = POINTER_TYPES[str(value.dtype).removeprefix("torch.")]
            divisible = divisible and value.data_ptr() % 16 == 0
        elif isinstance(value, bool):
            signature[name], divisible = "i1", False
        elif isinstance(value, int):
            signature[name] = "i32" if -2 ** 31 <= value < 2 ** 31 else "i64"
            divisible = divisible and value % 16 == 0
        elif isinstance(value, float):
            signature[name], divisible = "fp32", False
        else:
            raise TypeError(f"{launch.name}: argument {name} of type {type(value).__name__}")
        if divisible:
            attrs[(index,)] = [["tt.divisibility", 16]]
    return signature, constexprs, attrs


def build(launch: Launch) -> dict[str, int]:
    """Compile a launch's kernel as :func:`specialized` says for sm_90a and assemble it with
    triton's ptxas: ``{"registers", "spill_stores", "spill_loads", "async_copies", "tensor_copies",
    "shared", "serialized"}`` (``cp.async`` instructions in the PTX, 0 where no load of a loop is
    pipelined, and TMA's bulk copies ``cp.async.bulk.tensor`` among them, counted alone too;
    bytes of shared memory a program asks for, which must fit the card's: 227 KiB on an H100;
    whether ptxas serialised the kernel's wgmma instructions, each waiting for the one before, its
    warning C7515), and ``"loops"``: the SASS instructions in each loop body that holds a wgmma
    (:func:`wgmma_loops`). Raises AssertionError with ptxas's message where assembling fails."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    signature, constexprs, attrs = specialized(launch)
    compiled = triton.compile(ASTSource(fn=launch.fn, signature=signature, constexprs=constexprs, attrs=attrs),
                              target=GPUTarget("cuda", 90, 32),
                              options=dict(num_warps=launch.warps, num_stages=launch.stages))
    ptx = compiled.asm["ptx"]
    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
        f.write(ptx)
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
            "spill_loads": number(r"(\d+) bytes spill loads"), "async_copies": len(re.findall(r"cp\.async", ptx)),
            "tensor_copies": len(re.findall(r"cp\.async\.bulk\.tensor", ptx)),
            "shared": compiled.metadata.shared,
            "serialized": "wgmma.mma_async instructions are serialized" in done.stderr,
            "loops": wgmma_loops(compiled.asm["cubin"])}


def wgmma_loops(cubin: bytes) -> list[int]:
    """The instructions of each loop body (a backward branch's target up to it) that holds an
    ``HGMMA``, in code order, from triton's ``nvdisasm``: static counts, not times, but on a card
    where the tensor cores finish a block in a few hundred cycles the other instructions of a
    block are what the warps spend their issue slots on."""
    import triton

    nvdisasm = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "nvdisasm")
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(cubin)
    try:
        sass = subprocess.run([nvdisasm, "-c", f.name], capture_output=True, text=True, check=True).stdout
    finally:
        os.unlink(f.name)
    labels, instructions = {}, []
    for line in sass.splitlines():
        label = re.match(r"^\s*\.(L_x_\d+):", line)
        if label:
            labels[label.group(1)] = len(instructions)
        elif found := re.match(r"^\s*/\*[0-9a-f]{4,}\*/\s+(.*?);", line):
            instructions.append(found.group(1))
    loops = []
    for end, instruction in enumerate(instructions):
        target = re.search(r"BRA.*?(L_x_\d+)", instruction)
        if target and labels.get(target.group(1), end + 1) <= end:
            body = instructions[labels[target.group(1)]:end + 1]
            # TMA's waits on a barrier spin out of line, at the code's end, and branch back into their
            # loop: a "body" from there holds the kernel's exit, and is no loop
            if any("HGMMA" in op for op in body) and not any(op.split()[-1] == "EXIT" for op in body):
                loops.append(len(body))
    return loops


def benchmark_call(length: int, heads: int, head_dim: int, dtype_name: str):
    """``benchmarks/triton_blocks.py``'s window-1024 call on CPU tensors: ``(prep, grad)`` for the
    launchers (``forward.launch(prep, ...)``, ``backward.launch(prep, grad, ...)``)."""
    import torch

    from attnkit import masks
    from attnkit._backends import triton as kernel

    dtype = getattr(torch, dtype_name)
    q, k, v, grad = (torch.zeros(1, heads, length, head_dim, dtype=dtype) for _ in range(4))
    lo, hi = masks.sliding_window(1024).row_ranges(length, length)
    prep = kernel.prepare(q, k, v, lo, hi, scale=head_dim ** -0.5, softcap=None, alibi_slopes=None,
                          dropout=0.0, seed=None)
    return prep, grad


def row(stats: dict[str, int]) -> str:
    return (f"{stats['registers']} | {stats['spill_stores']} | {stats['spill_loads']} | {stats['async_copies']} | "
            f"{stats['shared'] / 1024:.0f} | {'yes' if stats['serialized'] else 'no'} | "
            f"{' / '.join(map(str, stats['loops']))}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", choices=("bfloat16", "float16"), default="bfloat16")
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--length", type=int, default=32768)
    parser.add_argument("--heads", type=int, default=16)
    args = parser.parse_args()
    if os.environ.get("TRITON_INTERPRET") == "1":
        sys.exit("unset TRITON_INTERPRET: the interpreter compiles nothing")
    import torch

    sys.path.insert(0, os.path.dirname(__file__))
    from triton_blocks import BACKWARD, FORWARD, TMA

    kernels = importlib.import_module("attnkit._backends.triton")
    forward, backward = (importlib.import_module("attnkit._backends.triton." + name)
                         for name in ("forward", "backward"))
    dtype = getattr(torch, args.dtype)
    prep, grad = benchmark_call(args.length, args.heads, args.head_dim, args.dtype)
    print(f"# ptxas sm_90a (triton's), {args.dtype}, L = {args.length}, H = {args.heads}, D = {args.head_dim}, "
          f"window 1024 (triton_blocks.py's call, specialised as its launch); * = the default\n")
    print("| forward (BLOCK_M, BLOCK_N, warps, stages) | second pass | registers | spill stores (B) | "
          "spill loads (B) | cp.async | shared (KiB) | wgmma serialised | loop instructions |")
    print("|---|---|---:|---:|---:|---:|---:|---|---|")
    default = kernels.forward_blocks(args.head_dim, dtype)
    for config in dict.fromkeys([default, *FORWARD]):
        for second_pass in ("inline", "off"):
            with captured() as launches:
                out, lse = forward.launch(prep, *config, second_pass=second_pass)
            mark = "*" if config == default else ""
            label = "compiled in" if second_pass == "inline" else "none"
            print(f"| {config}{mark} | {label} | {row(build(launches[0]))} |", flush=True)
    for config in TMA:  # the whole blocks' tiles through TMA descriptors (forward.launch's loads="tma")
        with captured() as launches:
            forward.launch(prep, *config, second_pass="off", loads="tma")
        print(f"| {config}, TMA loads | none | {row(build(launches[0]))} |", flush=True)
    print("\n| backward ((dK/dV M, N, dQ M, N), warps, stages) | kernel | registers | spill stores (B) | "
          "spill loads (B) | cp.async | shared (KiB) | wgmma serialised | loop instructions |")
    print("|---|---|---:|---:|---:|---:|---:|---|---|")
    default_backward = kernels.backward_blocks(args.head_dim, dtype)
    for blocks, warps, stages in dict.fromkeys([default_backward, *BACKWARD]):
        mark = "*" if (blocks, warps, stages) == default_backward else ""
        for walk in backward.WALKS:
            with captured() as launches:
                backward.launch(prep, grad, None, out, lse, blocks, warps, stages, walk)
            for launch in launches:
                if launch.name == "_delta_kernel" or (walk == "runs" and launch.name != "dkdv_kernel"):
                    continue
                name = {"dkdv_kernel": "dK/dV", "dq_kernel": "dQ"}[launch.name]
                name += ", walk in runs" if walk == "runs" and launch.name == "dkdv_kernel" else ""
                print(f"| {(blocks, warps, stages)}{mark} | {name} | {row(build(launch))} |", flush=True)


if __name__ == "__main__":
    main()
