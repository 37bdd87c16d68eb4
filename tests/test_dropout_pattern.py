"""One dropout pattern, whichever path computes it: a pure function of (seed, batch, head, row,
key). The tensor-op hash (``attnkit._backends.dropout``) against the native kernel bit for bit,
then every backend and kernel, compiled or not, read back through identity values; the global
RNG untouched with a generator, and seeded calls reproducible from threads."""

from __future__ import annotations

import threading

import pytest
import torch

import attnkit
from attnkit import masks
from attnkit._backends import dropout, native

needs_native = pytest.mark.skipif(not native.available(), reason=f"native kernel: {native.why_unavailable()}")

B, H, HKV, L = 2, 4, 2, 40


def _inputs():
    """Queries near 0 keep every weight far from underflow; the identity as values makes each output
    row its weights (dropped ones exactly 0)."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(B, H, L, 8, generator=g) * 0.01
    k = torch.randn(B, HKV, L, 8, generator=g)
    return q, k, torch.eye(L).expand(B, HKV, L, L).contiguous()


def _identity_call(backend, p, generator=None, mask=None, inputs=None):
    """The weights a call applied, read back through identity values."""
    q, k, v = inputs if inputs is not None else _inputs()
    return attnkit.attention(q, k, v, mask=mask, dropout=p, generator=generator, backend=backend)


@needs_native
@pytest.mark.parametrize("p", [0.1, 0.5, 0.9])
@pytest.mark.parametrize("seed", [0, 123456789012345678, 2**62 + 12345])
def test_the_tensor_hash_is_the_native_kernels_bit_for_bit(p, seed):
    g = torch.Generator().manual_seed(1)
    q, k = torch.randn(B, H, 37, 8, generator=g) * 0.01, torch.randn(B, HKV, 53, 8, generator=g)
    lo, hi = torch.zeros(1, 37, dtype=torch.long), torch.full((1, 37), 53)
    weights, _ = native.interval_forward(q, k, torch.eye(53).expand(B, HKV, 53, 53), lo, hi, 1.0, dropout=p,
                                         seed=seed, block=5, chunk=7)
    assert torch.equal(weights != 0, dropout.keep_mask(torch.tensor(seed), B, H, 37, 53, p))


@needs_native
def test_the_native_kernel_places_a_shard_at_its_global_positions():
    """dropout_start = (head, row, key): a piece of heads, rows and keys draws its slice of the whole
    pattern."""
    seed, p = 2**40 + 7, 0.4
    g = torch.Generator().manual_seed(2)
    q, k = torch.randn(B, 2, 9, 8, generator=g) * 0.01, torch.randn(B, 1, 13, 8, generator=g)
    lo, hi = torch.zeros(1, 9, dtype=torch.long), torch.full((1, 9), 13)
    weights, _ = native.interval_forward(q, k, torch.eye(13).expand(B, 1, 13, 13), lo, hi, 1.0, dropout=p,
                                         seed=seed, block=4, chunk=5, dropout_start=(2, 21, 30))
    whole = dropout.keep_mask(torch.tensor(seed), B, H, 40, 50, p)
    assert torch.equal(weights != 0, whole[:, 2:4, 21:30, 30:43])


def test_the_pattern_depends_on_the_position_only():
    """Drawn for a block of positions, the pattern is the corresponding block of the whole."""
    seed = torch.tensor(987654321)
    whole = dropout.keep_mask(seed, 3, 2, 20, 30, 0.4)
    b, h = torch.tensor(2), torch.tensor([[[1]]])
    rows, keys = torch.arange(5, 12)[:, None], torch.arange(10, 25)
    assert torch.equal(dropout.kept(seed, b, h, rows, keys, 0.4)[0], whole[2, 1, 5:12, 10:25])


@pytest.mark.parametrize("mask", [None, masks.sliding_window(7)], ids=["no mask", "window"])
def test_every_backend_and_kernel_draws_the_same_pattern(mask):
    p = 0.3
    seed_state = lambda: torch.Generator().manual_seed(42)  # noqa: E731
    patterns = {"reference": _identity_call("reference", p, seed_state(), mask) != 0,
                "torch": _identity_call("torch", p, seed_state(), mask) != 0,
                "auto": _identity_call("auto", p, seed_state(), mask) != 0}
    with native.turned_off():
        patterns["tiled on PyTorch's kernels"] = _identity_call("tiled", p, seed_state(), mask) != 0
    if native.available():
        patterns["tiled, native kernel"] = _identity_call("tiled", p, seed_state(), mask) != 0
    seed = dropout.draw_seed(seed_state())
    kept = dropout.keep_mask(seed, B, H, L, L, p)
    if mask is not None:
        kept = kept & mask.dense(L, L)
    for name, pattern in patterns.items():
        assert torch.equal(pattern, kept), name


def test_compiled_code_draws_the_same_pattern_from_the_global_rng():
    """torch.compile (fullgraph) cannot trace a generator: with none, the seed comes from the global
    RNG, and the compiled call's pattern is the eager one (aot_eager keeps PyTorch's own RNG); with
    one, the error says why."""
    inputs = _inputs()
    window = masks.sliding_window(7)

    def call(q, k, v):
        return attnkit.attention(q, k, v, mask=window, dropout=0.3)

    torch.manual_seed(5)
    eager = call(*inputs)
    compiled = torch.compile(call, fullgraph=True, backend="aot_eager")
    torch.manual_seed(5)
    assert torch.equal(compiled(*inputs) != 0, eager != 0)
    generator = torch.Generator().manual_seed(1)
    with_generator = torch.compile(lambda q, k, v: attnkit.attention(q, k, v, dropout=0.3, generator=generator),
                                   fullgraph=True, backend="aot_eager")
    with pytest.raises(Exception, match="pass generator=None"):
        with_generator(*inputs)


@pytest.mark.parametrize("backend", ["reference", "torch", "tiled", "auto"])
def test_a_generator_leaves_the_global_rng_alone_and_threads_reproduce(backend):
    """Seeded calls in 6 threads at once give what they give alone, and no thread's global random
    stream moves (nothing reads or reseeds the global RNG when a generator is given)."""
    expected = [_identity_call(backend, 0.4, torch.Generator().manual_seed(i)) for i in range(6)]
    results = [None] * 6
    start = threading.Barrier(6)

    def work(i):
        torch.manual_seed(100 + i)  # the global generator is shared by threads: read it right after
        start.wait()
        results[i] = [_identity_call(backend, 0.4, torch.Generator().manual_seed(i)) for _ in range(3)]

    torch.manual_seed(7)
    before = torch.rand(3)
    torch.manual_seed(7)
    threads = [threading.Thread(target=work, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i in range(6):
        for result in results[i]:
            assert torch.equal(result, expected[i])
    torch.manual_seed(7)
    assert torch.equal(torch.rand(3), before)
