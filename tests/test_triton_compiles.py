"""attnkit's Triton kernels compile for an H100 (sm_90a) on a machine without a GPU.

The interpreter tests (test_triton_kernel.py) check what the kernels compute; Triton's interpreter
accepts constructs its compiler refuses (types, shapes, control flow), so here every kernel goes
through the real pipeline, Triton source -> PTX -> ptxas (the one bundled with triton) -> cubin,
for Hopper, in the dtypes and head sizes models use, plain and with every feature. The launches
are those the launchers make for a real call, specialised by value as a launch on the card would
(strides of 1 become constants, multiples of 16 are marked so): compiled without that, the loops'
loads are neither vectorised nor pipelined, and ptxas would be judging another kernel. A child process
runs it: this one's kernels were decorated for the interpreter (TRITON_INTERPRET=1)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("triton")

SCRIPT = textwrap.dedent('''
    import importlib
    import torch
    import attnkit._backends.triton as kernels
    # the modules (the package's own names forward / backward are its entry points)
    forward, backward = (importlib.import_module("attnkit._backends.triton." + name)
                         for name in ("forward", "backward"))

    # benchmarks/: records the launches a call makes, specialises them as the launcher does, compiles
    # for sm_90a and assembles with triton's ptxas
    from triton_spills import build, captured

    # float32 (IEEE products on the FMA units, unrolled) takes a minute more to compile: left to the GPU tests
    for dtype, dim, features in ((torch.bfloat16, 128, False), (torch.float16, 64, True)):
        heads, kv_heads, length = (4, 2, 96) if features else (4, 4, 256)
        g = torch.Generator().manual_seed(0)
        # the [N, L, H, D] memory layout models pass, seen as [N, H, L, D]
        q, k, v, grad = (torch.randn(1, length, h, dim, generator=g).to(dtype).transpose(1, 2)
                         for h in (heads, kv_heads, kv_heads, heads))
        rows = torch.arange(length)
        if features:  # two ranges a row: a window and a first key (a sink)
            lo = torch.stack([torch.zeros(length), (rows - 16).clamp(min=1)]).long()[None]
            hi = torch.stack([torch.ones(length), rows + 1]).long()[None]
        else:
            lo, hi = (rows - 64).clamp(min=0)[None, None], (rows + 1)[None, None]
        prep = kernels.prepare(q, k, v, lo, hi, scale=dim ** -0.5, softcap=30.0 if features else None,
                               alibi_slopes=torch.rand(heads) if features else None, dropout=0.1 if features else 0.0,
                               seed=torch.tensor(7) if features else None)
        blocks = kernels.forward_blocks(dim, dtype)
        sizes, warps, stages = kernels.backward_blocks(dim, dtype)
        with captured() as launches:
            # the forward with its second pass inline, and gated (the kernel without it, then the redo launch)
            for second_pass in ("inline", "gated"):
                out, lse = forward.launch(prep, *blocks, second_pass=second_pass)
            # and the whole blocks' key and value tiles through TMA descriptors
            forward.launch(prep, *blocks, second_pass="off", loads="tma")
            for walk in backward.WALKS:
                backward.launch(prep, grad, torch.randn(lse.shape) if features else None, out, lse, sizes, warps,
                                stages, walk)
        names = sorted(launch.name for launch in launches)
        assert names == sorted(["_forward_kernel"] * 4 + ["_delta_kernel", "dkdv_kernel", "dq_kernel"] * 2), names
        for launch in launches:
            stats = build(launch)
            # the launch's specialisation reached the kernel: the forward's and dQ's key loops load
            # through asynchronous copies (pipelined); unspecialised, neither does
            if launch.name == "dq_kernel" or (launch.name == "_forward_kernel" and not launch.arguments["GATED"]):
                assert stats["async_copies"] > 0, (launch.name, stats)
            # TMA's bulk copies where the launch took descriptors, none elsewhere
            assert (stats["tensor_copies"] > 0) == bool(launch.arguments.get("TMA")), (launch.name, stats)
            assert stats["shared"] <= 227 * 1024, (launch.name, stats)  # an H100's shared memory a block
            # each wgmma waiting for the one before (ptxas's C7515): the forward did that with a loop per
            # run of blocks once its tiles moved by offsets
            assert not stats["serialized"], (launch.name, stats)
        print("compiled", dtype, dim, "features" if features else "plain")
''')


def test_every_kernel_compiles_for_sm90():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    benchmarks = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks")
    env["PYTHONPATH"] = os.pathsep.join([*sys.path, benchmarks])
    done = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env, timeout=300)
    if done.returncode != 0 and "ptxas" in done.stderr and "No such file" in done.stderr:
        pytest.skip("this triton build ships no ptxas")
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.count("compiled") == 2
