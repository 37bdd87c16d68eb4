"""A soak of the native kernel against the float64 oracle at the sizes it meets in use: not part of
``make test`` (the suite's cases have at most 40 rows and blocks of 1-9, which reach the 32-row
groups' trimmed halves only in part). It reruns ``test_native.py``'s and ``test_native_half.py``'s
checks on cases with blocks of 16-128 rows, chunks of 16-1024, up to 200 rows and keys, D of 16, 32,
64 or 1-70, and windows, documents, causal + padding, windows whose ends move row by row, or random
intervals. Run it after changing the kernel (pytest does not collect this file by itself)::

    SOAK_EXAMPLES=12000 python -m pytest tests/soak_native.py -p no:randomly -k ieee      # ~20 min
    SOAK_EXAMPLES=20000 python -m pytest tests/soak_native.py -p no:randomly -k "not ieee"

Its first runs (2026-11-28) found a fault of the kernel's (a row of -inf scores spreading an output
NaN through the backward's row term) and two corners where the IEEE oracle's exact float64 sums
cannot bind a float32 kernel (``test_native._order_dependent``, ``_undetermined_winner``).
"""

from __future__ import annotations

import os

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import test_native as T
import test_native_half as TH

torch.set_num_threads(int(os.environ.get("SOAK_THREADS", "1")))


@st.composite
def big_cases(draw, max_len=200):
    """``test_native.interval_cases`` at the sizes and tiles of real calls, with structured intervals."""
    batch = draw(st.integers(1, 2))
    kv_heads = draw(st.sampled_from([1, 2]))
    heads = kv_heads * draw(st.sampled_from([1, 2]))
    lq = draw(st.integers(1, max_len))
    lk = draw(st.sampled_from([lq, draw(st.integers(1, max_len))]))
    dk = draw(st.sampled_from([16, 32, 64, draw(st.integers(1, 70))]))
    dv = draw(st.sampled_from([dk, draw(st.integers(1, 70))]))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    query = torch.randn(batch, lq, heads, dk, generator=g).transpose(1, 2) if draw(st.booleans()) else \
        torch.randn(batch, heads, lq, dk, generator=g)
    outer = draw(st.booleans())
    key, value = (torch.randn(batch, lk, kv_heads, d, generator=g).transpose(1, 2) if outer else
                  torch.randn(batch, kv_heads, lk, d, generator=g) for d in (dk, dv))
    rows = draw(st.sampled_from([1, batch]))
    kind = draw(st.sampled_from(["random", "window", "documents", "causal_pad", "jitter"]))
    pos = torch.arange(lq)[None].expand(rows, lq) + (lk - lq)
    if kind == "random":
        lo = torch.randint(-3, lk + 2, (rows, lq), generator=g)
        hi = lo + torch.randint(0, lk + 3, (rows, lq), generator=g)
    elif kind == "window":
        w = draw(st.integers(1, 80))
        hi = pos + 1
        lo = hi - w
    elif kind == "documents":
        cuts = sorted(set(draw(st.lists(st.integers(1, max(1, lk - 1)), max_size=6))))
        starts = torch.zeros(lk, dtype=torch.long)
        for c in cuts:
            starts[c:] = c
        p = pos.clamp(0, lk - 1)
        lo = starts[p]
        hi = pos + 1
    elif kind == "causal_pad":
        pad = draw(st.integers(0, lk))
        lo = torch.zeros(rows, lq, dtype=torch.long)
        hi = torch.minimum(pos + 1, torch.full_like(pos, lk - pad))
    else:  # a window whose ends move a little row by row (halves with different reach)
        w = draw(st.integers(4, 80))
        hi = pos + 1 + torch.randint(-3, 4, (rows, lq), generator=g)
        lo = hi - w + torch.randint(-3, 4, (rows, lq), generator=g)
    lo, hi = lo.long().contiguous(), hi.long().contiguous()
    return dict(query=query, key=key, value=value, lo=lo, hi=hi,
                scale=draw(st.floats(0.05, 1.0)), block=draw(st.sampled_from([16, 32, 33, 48, 64, 96, 128])),
                chunk=draw(st.sampled_from([16, 32, 64, 100, 128, 1024])))


# test_native.ieee_cases draws its cases from interval_cases when it runs: these, in this process
T.interval_cases = big_cases
SOAK = settings(max_examples=int(os.environ.get("SOAK_EXAMPLES", "400")), deadline=None,
                derandomize=False, suppress_health_check=list(HealthCheck), print_blob=True)


@SOAK
@given(c=big_cases())
def test_forward(c):
    T.test_output_and_lse_match_the_oracle.hypothesis.inner_test(c)


@SOAK
@given(c=big_cases(), parts=st.integers(1, 4), with_lse=st.booleans(), seed=st.integers(0, 2**31 - 1),
       bblock=st.sampled_from([None, 16, 32, 64, 128]), bchunk=st.sampled_from([None, 32, 128, 1024]))
def test_backward(c, parts, with_lse, seed, bblock, bchunk):
    c = dict(c, block=bblock or c["block"], chunk=bchunk or c["chunk"])  # the backward's own tiles, or the case's
    T.test_gradients_match_the_oracle.hypothesis.inner_test(c, parts, with_lse, seed)


@SOAK
@given(c=T.ieee_cases())
def test_ieee(c):
    T._assert_follows_ieee(c)


@SOAK
@given(c=big_cases(), p=st.sampled_from([0.1, 0.5, 0.9]), seed=st.integers(-2**62, 2**62), with_lse=st.booleans())
def test_dropout(c, p, seed, with_lse):
    check = T.test_dropout_forward_and_gradients_match_the_oracle_with_the_same_pattern.hypothesis.inner_test
    check(c, p, seed, with_lse)


@SOAK
@given(c=big_cases(), dtype=st.sampled_from([torch.bfloat16, torch.float16]), dropout=st.sampled_from([0.0, 0.3]),
       softcap=st.sampled_from([None, 2.0]), alibi=st.booleans(), with_nan=st.booleans(), parts=st.sampled_from([1, 3]))
def test_half_is_float32_rounded(c, dtype, dropout, softcap, alibi, with_nan, parts):
    TH.test_half_precision_is_the_float32_kernel_rounded_once.hypothesis.inner_test(
        c, dtype, dropout, softcap, alibi, with_nan, parts)
