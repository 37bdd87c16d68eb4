"""The native kernel's tile tables: how many query rows a block computes together and how many
keys a step of the running softmax takes, chosen by the mean number of keys a row attends, and how
the backward splits rows across threads. Measured with ``benchmarks/masks.py`` (L = 16384, H = 8,
D = 64, fp32, 2 threads); also :func:`computed_fraction`, the share of pairs a call multiplies,
which ``benchmarks/masks.py`` reports."""

from __future__ import annotations

import torch
from torch import Tensor

#: (query rows per block, keys per chunk of the running softmax) by the mean number of keys a
#: row attends, smallest first, for the forward's register tiles (the rows of a block are padded
#: to groups of 32). A chunk's scores, weights and values stay in L1 at 64 keys; 128-key chunks
#: spill the weights (32 KiB with 64 rows) and ran 10-25% slower. Min of 3-7 runs at L = 16384,
#: H = 8, D = 64, 2 threads (a shared machine): window 512 (span 543 per 32 rows) 32 x 64 140 ms,
#: 32 x 32 146, 32 x 128 148, 64 x 64 162; 8 documents (~2300 keys per row) 32 x 64 658 ms,
#: 64 x 64 675-777, 64 x 128 897; causal + padding (~7700 keys per row) 64 x 64 1902 ms,
#: 32 x 64 1980, 32 x 128 2093, 64 x 128 2173-2380 (64 rows halve the key and value traffic of
#: the long spans).
TILES = ((4096, (32, 64)), (float("inf"), (64, 64)))

#: The backward's tiles, the same way (its chunk holds two score buffers: weights and their
#: gradients). Median of 3 at L = 16384: the window within 4% from 16 x 1024 to 128 x 128 (32 x
#: 1024 best, 0.29 s); causal + padding 128 x 128 to 256 x 128 (3.6-3.7 s) against 4.1-4.3 s for
#: 32-64 row blocks, whose dK, dV products add rank-32 updates. Rows of 1024-4096 keys take 64-row
#: blocks (each dK, dV update of rank 64, over a span not much wider): 8 documents (~2300 keys a
#: row) 32 x 1024 / 64 x 256 / 64 x 512 ms 1,158 / 1,051 / 1,051 (median of 9 interleaved, two more
#: runs 1,069-1,194 against 926-1,155), a causal window of 2048 1,021 / 917 / 897, of 1024 (992
#: keys a row) level at 475-477, of 512 32 x 1024 5-10% faster (``native_kernel.py --backward``).
BACKWARD_TILES = ((1024, (32, 1024)), (4096, (64, 512)), (float("inf"), (128, 128)))
#: The backward's tiles where its half-precision products run on the packed layouts (AMX tiles or dot
#: products, ``csrc/products.h``; the chunk is at least 1024 keys there). The products over rows
#: (dV, dK) load and store their accumulators once per block: 64 rows give each load two tile
#: steps where 32 gave one, and 128 widen the block's key span. Xeon with AMX, L = 16384, H = 8,
#: D = 64, bf16, 2 threads, medians of 8 alternating rounds over the raw op, blocks of 32 / 64 /
#: 128 rows: window 512 107 / 101 / 123 ms, 8 documents 429 / 372 / 420, causal + padding 1,314 /
#: 1,191 / 1,296 (a second series of 6: 102 / 97 / 122, 411 / 356 / 373, 1,683 / 1,550 / 1,822).
#: The forward's table held there (window 32 rows 36.8 ms against 41.6 at 64).
PACKED_BACKWARD_TILES = ((float("inf"), (64, 1024)),)

#: With fewer (sequence, kv head) pairs than this many per thread, the backward also splits rows
#: (each part adds into its own dK, dV copy). Window 512, L = 16384, 8 query heads, 2 threads:
#: one kv head 0.35 s unsplit, 0.28 s in 2-4 parts, 0.29 in 8; eight kv heads 0.29 s unsplit,
#: 0.33-0.45 s in 2-8 parts (zeroing and summing the copies). On one thread there is nothing to
#: feed and rows stay whole: causal, L = 4096, one kv head, 1 thread, median of 7: 59.6 ms whole,
#: 60.8 in 2 parts, 62.4 in 4 (L = 1024: 3.7, 3.9, 3.9 ms), and each part's dK, dV copy is memory
#: (two more key-sized tensors for 2 parts: what a group of Ulysses' heads, one kv head, would hold).
PARTS_PER_THREAD = 2


def _by_mean_keys(table: tuple, lo: Tensor, hi: Tensor) -> tuple[int, int]:
    """The ``(block, chunk)`` of ``table`` for the mean number of keys the rows attend."""
    # an integer sum: 3 small ops, ~7 us a call where the float mean's 5 took ~14
    mean_keys = int((hi - lo).clamp_(min=0).sum()) / lo.numel() if lo.numel() else 0.0
    return next(sizes for below, sizes in table if mean_keys < below)


def tiles(lo: Tensor, hi: Tensor) -> tuple[int, int]:
    """``(block, chunk)`` of the forward for rows attending ``[lo, hi)`` (see ``TILES``)."""
    return _by_mean_keys(TILES, lo, hi)


def backward_tiles(lo: Tensor, hi: Tensor, packed: bool = False) -> tuple[int, int]:
    """``(block, chunk)`` of the backward for rows attending ``[lo, hi)`` (see ``BACKWARD_TILES``;
    ``PACKED_BACKWARD_TILES`` where the products run on the packed bfloat16 layouts: ``packed``)."""
    return _by_mean_keys(PACKED_BACKWARD_TILES if packed else BACKWARD_TILES, lo, hi)


def backward_parts(batch: int, kv_heads: int, q_len: int, block: int) -> int:
    """How many row parts each (sequence, kv head) of the backward is cut into: enough for the
    threads when there are few pairs (see ``PARTS_PER_THREAD``; one thread: whole), never more than
    its blocks."""
    threads = torch.get_num_threads()
    if threads == 1:
        return 1
    pairs = max(batch * kv_heads, 1)
    return max(1, min(-(-PARTS_PER_THREAD * threads // pairs), -(-q_len // block)))


def computed_fraction(lo: Tensor, hi: Tensor, k_len: int) -> float:
    """Share of the ``Lq x Lk`` (query, key) pairs that the forward multiplies for rows attending
    ``[lo, hi)`` (``[S, Lq]``, mean over the S sequences): every row of a block over the span of the
    block's intervals. Cheap (a dozen vector ops over ``[S, Lq]``, ~30 us at Lq = 128)."""
    if lo.numel() == 0 or k_len == 0:
        return 0.0
    block, _ = tiles(lo, hi)
    lo, hi = lo.clamp(0, k_len), hi.clamp(0, k_len)
    empty = lo >= hi
    first, last = lo.masked_fill(empty, k_len), hi.masked_fill(empty, 0)  # empty rows span nothing
    sequences, rows = lo.shape
    blocks = -(-rows // block)
    first = torch.nn.functional.pad(first, (0, blocks * block - rows), value=k_len)
    last = torch.nn.functional.pad(last, (0, blocks * block - rows), value=0)
    span = (last.view(sequences, blocks, block).amax(-1) - first.view(sequences, blocks, block).amin(-1)).clamp(min=0)
    pairs = int(span[:, :-1].sum()) * block + int(span[:, -1].sum()) * (rows - block * (blocks - 1))
    return pairs / (lo.numel() * k_len)
