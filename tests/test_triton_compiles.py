"""attnkit's Triton kernels compile for an H100 (sm_90a) on a machine without a GPU.

The interpreter tests (test_triton_kernel.py) check what the kernels compute; Triton's interpreter
accepts constructs its compiler refuses (types, shapes, control flow), so here every kernel goes
through the real pipeline, Triton source -> PTX -> ptxas (the one bundled with triton) -> cubin,
for Hopper, in the dtypes and head sizes models use, plain and with every feature. A child process
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
    forward, backward, backward_kv, backward_q = (importlib.import_module("attnkit._backends.triton." + name)
                                                  for name in ("forward", "backward", "backward_kv", "backward_q"))

    from triton_spills import build  # benchmarks/: compiles for sm_90a and assembles with triton's ptxas

    # float32 (IEEE products on the FMA units, unrolled) takes a minute more to compile: left to the GPU tests
    for dtype, element, dim, features in ((torch.bfloat16, "*bf16", 128, False), (torch.float16, "*fp16", 64, True)):
        flags = dict(BLOCK_D=dim, BLOCK_DV=dim, RANGES=2 if features else 1, SOFTCAP=features, HAS_ALIBI=features,
                     DROPOUT=features, IEEE=dtype == torch.float32)
        block_m, block_n, warps, stages = kernels.forward_blocks(dim, dtype)
        (kv_m, kv_n, q_m, q_n), b_warps, b_stages = kernels.backward_blocks(dim, dtype)
        pick = lambda fn, extra: {k: v for k, v in {**flags, **extra}.items() if k in fn.arg_names}
        # the forward with its second pass inline, without it, and as the gated redo launch
        for second_pass, gated in ((True, False), (False, False), (True, True)):
            build(forward._forward_kernel, element,
                  pick(forward._forward_kernel, dict(BLOCK_M=block_m, BLOCK_N=block_n, SECOND_PASS=second_pass,
                                                     GATED=gated)), warps, stages)
        for runs in (False, True):  # the two walks of the query blocks (backward.WALKS)
            build(backward_kv.dkdv_kernel, element,
                  pick(backward_kv.dkdv_kernel, dict(BLOCK_M=kv_m, BLOCK_N=kv_n, RUNS=runs)), b_warps, b_stages)
        build(backward_q.dq_kernel, element, pick(backward_q.dq_kernel, dict(BLOCK_M=q_m, BLOCK_N=q_n)),
              b_warps, b_stages)
        build(backward._delta_kernel, element, pick(backward._delta_kernel, dict(BLOCK_M=64, HAS_DLSE=True)), 4, 1)
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
