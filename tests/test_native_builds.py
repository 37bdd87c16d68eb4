"""The native kernel's builds compute the same bits. The tile shapes: a build with tiles of 4 keys
(features) by 1 vector of features (``ATTNKIT_NATIVE_TILES``, for tests) against the default 6 by 2
(6 by 4 on AVX-512), on any machine, since every row's sum takes the same terms in the same order
whatever the tile. And the two ISAs: the AVX-512 build (16-lane softmax, weights,
score gradients, dropout hash, soft-capping and ALiBi; 512-bit product tiles) against the AVX2 build
(8 lanes, 256-bit tiles), which computes each result by the same operations in the same order. The
AVX2 build is compiled into a temporary cache and run in a child process (a process can load only
one library registering the kernel's ops); the outputs, lse and all three gradients must be equal,
NaN for NaN, on calls with dropout, soft-capping, ALiBi, planted NaN/inf and an overflowing scale, in
float32 and in half precision (bf16, and fp16 in two bf16 parts, on the AMX tiles where the CPU has
them: both builds call the same tile code, with their own softmax between the products; the AVX-512
build's writes the packed weights itself, the AVX2 build's packs them after)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from attnkit._backends import native

CASES = """
import sys, torch
from attnkit._backends import native
results = []
for case, (length, dim, p, block, chunk, cap, alibi, scale, dtype, *finite) in enumerate([
        (300, 64, 0.1, 32, 64, 30.0, False, 0.3, torch.float32), (257, 40, 0.5, 64, 37, 0.0, True, 0.3, torch.float32),
        (200, 16, 0.0, 96, 50, 5.0, True, 0.7, torch.float32), (180, 80, 0.2, 32, 1000, 2.0, True, 1.5, torch.float32),
        (150, 24, 0.0, 33, 17, 50.0, False, 3e37, torch.float32), (130, 8, 0.0, 40, 9, 0.0, False, 0.5, torch.float32),
        (260, 32, 0.3, 32, 45, 0.0, False, 0.4, torch.float32), (140, 16, 0.0, 32, 30, 0.0, False, -0.6, torch.float32),
        # half precision: bf16 with D = 64 takes the AMX tiles where the CPU has them, the rest converts
        (300, 64, 0.1, 32, 64, 30.0, True, 0.3, torch.bfloat16), (1100, 64, 0.0, 32, 64, 0.0, False, 0.3, torch.bfloat16),
        (257, 40, 0.2, 64, 37, 5.0, True, 0.3, torch.bfloat16), (200, 64, 0.1, 96, 50, 2.0, True, 0.7, torch.float16),
        # the AVX-512 build's packed softmax in its other forms: plain scores with dropout (two parts),
        # and plain ones at a negative scale (scores stored, not rescored)
        (700, 64, 0.2, 48, 96, 0.0, False, 0.3, torch.bfloat16), (500, 64, 0.0, 32, 80, 0.0, False, -0.3, torch.bfloat16),
        # fp16 on the AMX tiles (two bf16 parts): with finite inputs only (the planted NaN, above,
        # sends a call back to the float32-convert path)
        (300, 64, 0.1, 32, 64, 30.0, True, 0.3, torch.float16, True),
        (700, 64, 0.0, 48, 96, 0.0, False, 0.3, torch.float16, True),
        (500, 32, 0.2, 32, 80, 0.0, False, -0.3, torch.float16, True)]):
    g = torch.Generator().manual_seed(case)
    q, k, v = (torch.randn(2, 4, length, dim, generator=g).to(dtype) for _ in range(3))
    if not finite:
        k[0, 1, 5, 3] = float("inf")
        q[1, 2, 7, 0] = float("nan")
    lo = torch.randint(-5, length, (2, length), generator=g)
    hi = lo + torch.randint(0, length, (2, length), generator=g)
    slopes = torch.rand(2, 4, generator=g) if alibi else None
    options = dict(block=block, chunk=chunk, dropout=p, seed=11, softcap=cap or None, alibi_slopes=slopes)
    out, lse = native.interval_forward(q, k, v, lo, hi, scale, **options)
    grad_out = torch.randn(out.shape, generator=g).to(dtype)
    results.append((out, lse, *native.interval_backward(grad_out, q, k, v, out, lse, lo, hi, scale, **options)))
# a window in 32-row blocks, whose halves skip the keys outside their rows' reach (tiles.h): NaN
# and inf planted in keys one half skips and the other attends, and in rows beside skipped keys
g = torch.Generator().manual_seed(99)
q, k, v, grad_out = (torch.randn(2, 4, 160, 64, generator=g) for _ in range(4))
rows = torch.arange(160)
lo, hi = (rows - 40)[None], (rows + 1)[None]
k[0, 1, 56, 3], v[1, 2, 5, 0], q[0, 3, 40, 0], grad_out[1, 0, 60, 4] = float("inf"), float("nan"), float("-inf"), float("nan")
out, lse = native.interval_forward(q, k, v, lo, hi, 0.3, block=32, chunk=64)
results.append((out, lse, *native.interval_backward(grad_out, q, k, v, out, lse, lo, hi, 0.3, block=32, chunk=64)))
torch.save((native.wide(), results), sys.argv[1])
"""


def _same_bits(ours, theirs):
    for case, (a_results, b_results) in enumerate(zip(ours, theirs)):
        for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), a_results, b_results):
            assert torch.equal(a.isnan(), b.isnan()), (case, name)
            assert torch.equal(a.nan_to_num(), b.nan_to_num()), (case, name, (a - b).nan_to_num().abs().max())


def _build(env):
    built = subprocess.run([sys.executable, "-m", "attnkit.kernel", "--strict"], capture_output=True, text=True,
                           env=env, check=False)
    assert built.returncode == 0, built.stdout + built.stderr


def _run(path, env=None):
    done = subprocess.run([sys.executable, "-c", CASES, str(path)], capture_output=True, text=True, env=env, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    return torch.load(path)


@pytest.mark.skipif(not native.available() or not native.wide(), reason="needs the AVX-512 build loaded")
def test_the_avx2_and_avx512_builds_give_the_same_bits(tmp_path):
    env = {**os.environ, "ATTNKIT_NATIVE_AVX512": "0", "ATTNKIT_NATIVE_DIR": str(tmp_path / "cache")}
    _build(env)
    (was_wide, wide), (was_narrow, narrow) = _run(tmp_path / "wide.pt"), _run(tmp_path / "narrow.pt", env)
    assert was_wide and not was_narrow
    _same_bits(wide, narrow)


@pytest.mark.skipif(not native.available(), reason=f"native kernel: {native.why_unavailable()}")
def test_every_tile_shape_gives_the_same_bits(tmp_path):
    env = {**os.environ, "ATTNKIT_NATIVE_TILES": "4x1", "ATTNKIT_NATIVE_DIR": str(tmp_path / "cache")}
    _build(env)
    (_, default), (_, other) = _run(tmp_path / "default.pt"), _run(tmp_path / "other.pt", env)
    _same_bits(default, other)


@pytest.mark.parametrize("given", ["7x1", "4x0", "4", "ax2"])
def test_a_bad_tile_shape_is_refused(given, monkeypatch):
    from attnkit._backends.native import building

    monkeypatch.setenv("ATTNKIT_NATIVE_TILES", given)
    with pytest.raises(ValueError, match="ATTNKIT_NATIVE_TILES"):
        building.tile_shape_flags()
