"""Dropout on the attention weights: one pattern, whichever path computes it.

Whether weight ``(batch b, head h, query row i, key j)`` is kept is a pure function of a 63-bit
``seed`` and that position: a counter-based hash, like the Philox streams of PyTorch's CUDA
kernels, so that no path stores the pattern and every path (attnkit's native kernel, the
plain-ops kernels, the reference formula, compiled graphs) draws the same one. Each call takes
one seed from its ``generator`` (or from the global RNG when there is none): the same generator
state gives the same result on every backend, kernel and device.

The hash, in unsigned 32-bit arithmetic (``*`` and ``+`` modulo 2**32)::

    fmix32(x)   = MurmurHash3's finaliser: x ^= x >> 16; x *= 0x85EBCA6B; x ^= x >> 13;
                  x *= 0xC2B2AE35; x ^= x >> 16
    mix(x, v)   = fmix32(x ^ fmix32(v + 0x9E3779B9))
    a           = mix(mix(mix(seed & 0xFFFFFFFF, b), h), i)          once per query row
    c           = mix(mix(mix(seed >> 32, b), h), i)
    bits        = fmix32(fmix32(j ^ a) ^ c)                           per key
    kept        = bits >= floor(p * 2**32)  (capped at 2**32 - 1); kept weights are scaled by 1 / (1 - p)

``b`` and ``h`` index the call's ``[B, H, Lq, Lk]`` weights after its leading dims are folded into
two (``[..., L, D]`` inputs: ``b`` is dim 0, ``h`` numbers the dims between; 2-D inputs have
``b = h = 0``); ``h`` is the query head under grouped-query attention. ``i`` and ``j`` are positions
within the call. The native kernel's ``csrc/dropout.h`` implements the same function (``Dropout``); the tests
compare the two bit for bit.

A piece of a larger call (one rank's shard in :mod:`attnkit.distributed`) draws the larger call's
pattern by carrying its offsets in the seed: ``seed`` is then the int64 vector ``[seed, h0, i0,
j0]`` (:func:`at_positions`) and weight ``(b, h, i, j)`` of the piece is weight ``(b, h0 + h, i0 + i,
j0 + j)`` of the whole. The native kernel takes the same offsets (``dropout_head_start``, ...).

Here the hash runs in int64 tensor ops, every product split so that it never exceeds 2**63
(exact on any device and under ``torch.compile``): the path for calls the native kernel does not
run.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["draw_seed", "kept", "keep_mask", "apply", "threshold", "at_positions", "has_offsets", "SEED_BITS"]

#: Seeds are drawn uniformly from [0, 2**SEED_BITS - 1) (randint's bound must fit in int64).
SEED_BITS = 63
_LOW32 = 0xFFFFFFFF
_GOLDEN = 0x9E3779B9


def _draw(generator: torch.Generator | None, device: torch.device) -> Tensor:
    return torch.randint(0, 2**SEED_BITS - 1, (), generator=generator, device=device, dtype=torch.int64)


def draw_seed(generator: torch.Generator | None, device: torch.device | str = "cpu") -> Tensor:
    """One seed for a call's dropout, an int64 scalar tensor on the generator's device (CPU when
    there is none). With ``generator=None`` it comes from the global RNG of ``device``; with one,
    the global RNG is neither read nor reseeded."""
    if generator is None:
        return _draw(None, torch.device(device))
    if torch.compiler.is_compiling():
        # Dynamo cannot trace a torch.Generator: this breaks the graph (the call then runs eagerly)
        # or, under fullgraph=True, stops the compile with this message
        raise TypeError("attnkit draws the dropout seed from a torch.Generator, which torch.compile cannot trace; "
                        "under fullgraph=True pass generator=None (the seed then comes from the global RNG)")
    return _draw(generator, generator.device)


def at_positions(seed: Tensor, heads: int = 0, rows: int = 0, keys: int = 0) -> Tensor:
    """The seed of a piece of a call whose query heads start at ``heads``, query rows at ``rows`` and
    keys at ``keys`` of the whole call: ``[seed, heads, rows, keys]`` (int64), or ``seed`` itself
    when every offset is 0 (so such a piece is an ordinary call, the native kernel included)."""
    seed = seed.reshape(-1)[0]
    if heads == rows == keys == 0:
        return seed
    offsets = torch.tensor([heads, rows, keys], dtype=torch.int64, device=seed.device)
    return torch.cat([seed.to(torch.int64)[None], offsets])


def has_offsets(seed: Tensor | None) -> bool:
    """Whether ``seed`` carries positions (:func:`at_positions`): a piece of a larger call."""
    return seed is not None and seed.dim() == 1


def _mul32(x: Tensor, constant: int) -> Tensor:
    """``x * constant mod 2**32`` for ``0 <= x < 2**32`` in int64, without overflow: the constant
    is split into 16-bit halves, each partial product below 2**48."""
    low, high = constant & 0xFFFF, constant >> 16
    return (x * low + (((x * high) & 0xFFFF) << 16)) & _LOW32


def _fmix32(x: Tensor) -> Tensor:
    x = x ^ (x >> 16)
    x = _mul32(x, 0x85EBCA6B)
    x = x ^ (x >> 13)
    x = _mul32(x, 0xC2B2AE35)
    return x ^ (x >> 16)


def _mix(x: Tensor, v: Tensor) -> Tensor:
    return _fmix32(x ^ _fmix32((v + _GOLDEN) & _LOW32))


def threshold(p: float) -> int:
    """Keys whose 32 hash bits are at least this are kept."""
    return min(int(p * 2.0**32), 2**32 - 1)


def kept(seed: Tensor, b: Tensor, h: Tensor, i: Tensor, j: Tensor, p: float) -> Tensor:
    """Whether the weights at positions ``(b, h, i, j)`` are kept (bool, the four int64 index
    tensors broadcast together; ``j`` along the last dim), for dropout ``p`` and the int64 scalar
    ``seed``. Any piece of a call's weights can be drawn this way (the tiled backend's blocks)."""
    seed = seed.to(device=b.device, dtype=torch.int64)
    if seed.dim() == 1:  # a piece of a larger call: its positions there (at_positions)
        seed, h, i, j = seed[0], h + seed[1], i + seed[2], j + seed[3]
    row_a = _mix(_mix(_mix(seed & _LOW32, b), h), i)
    row_c = _mix(_mix(_mix((seed >> 32) & _LOW32, b), h), i)
    return _fmix32(_fmix32(j ^ row_a) ^ row_c) >= threshold(p)


def keep_mask(seed: Tensor, batch: int, heads: int, q_len: int, k_len: int, p: float, *,
              device: torch.device | str | None = None) -> Tensor:
    """The kept weights of a call's ``[batch, heads, q_len, k_len]`` weights (bool, True = kept)
    for dropout probability ``p`` and the int64 scalar ``seed`` (see the module docstring)."""
    device = seed.device if device is None else torch.device(device)
    index = dict(dtype=torch.int64, device=device)
    b = torch.arange(batch, **index)[:, None, None, None]
    h = torch.arange(heads, **index)[None, :, None, None]
    i = torch.arange(q_len, **index)[None, None, :, None]
    return kept(seed, b, h, i, torch.arange(k_len, **index), p)


def apply(weights: Tensor, seed: Tensor, p: float) -> Tensor:
    """``weights [B, H, Lq, Lk]`` with dropout applied: dropped ones 0, kept ones ``/ (1 - p)``."""
    batch, heads, q_len, k_len = weights.shape
    keep = keep_mask(seed, batch, heads, q_len, k_len, p, device=weights.device)
    return weights * keep / (1.0 - p)
