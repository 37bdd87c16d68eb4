"""attnkit.distributed on real processes: 2 and 4 gloo ranks (CPU), spawned with torch.multiprocessing.

Each spawned job runs many checks (see tests/distributed_workers.py): every mask kind, both
layouts, uneven shards, GQA, dropout, output/lse/gradients equal to single-process
``attnkit.attention``; the traffic the mask decides, counted in bytes; attnkit's GPT trained 20
steps over 2 ranks with the same losses as one process (and a small attnkit.nn LM under
``sequence_parallel``); the README's torchrun example. Process start is the slow part (a torch import per rank), hence two jobs.
"""

from __future__ import annotations

import socket

import pytest
import torch.distributed as dist
import torch.multiprocessing as mp

import distributed_workers
from attnkit import masks
from attnkit.distributed.schedule import make_schedule
from attnkit.distributed.stream import backward_stream, forward_stream

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                reason="torch.distributed with gloo is not available")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("world, job", [(2, "two"), (4, "four")])
def test_sequence_parallel_equals_one_process(tmp_path, world, job):
    """The two-rank job ends with the README's torchrun example (as torchrun would start it)."""
    port = _free_port() if world == 2 else None
    mp.spawn(distributed_workers.main, args=(world, str(tmp_path / "init"), job, port), nprocs=world, join=True)


def test_ring_in_blocks_equals_one_process(tmp_path):
    """Three ranks (an odd ring: steps whose senders and receivers differ), the ring streamed in
    blocks of 1 to 12 keys and 2 to 6 rows (distributed_workers._blocks)."""
    mp.spawn(distributed_workers.main, args=(3, str(tmp_path / "init"), "blocks"), nprocs=3, join=True)


def test_kernel_calls_get_their_row_ranges_on_the_inputs_device():
    """The ring plans on the CPU (its decisions read values) and hands each kernel call its row
    ranges on the inputs' device (on CUDA the op refused CPU ranges: tests/test_cuda.py)."""
    schedule = make_schedule([40, 40], "contiguous", 1, masks.sliding_window(9), False, "meta")
    for stream in (forward_stream(schedule, 16), backward_stream(schedule, 16)):
        items = [*stream.own, *(item for received in stream.receives.values() for item in received)]
        calls = [call for item in items for calls in item.calls for call in calls]
        assert calls and all(c.lo.device.type == c.hi.device.type == "meta" for c in calls)


def test_ulysses_head_groups_default_and_split():
    """The default is the most groups of whole key/value heads with at least 2**24 query-key pairs
    each (capped by the key/value heads per rank, at least 1); groups differ by at most one
    key/value head and keep its query heads with it (GQA)."""
    from attnkit.distributed.ulysses import _split, default_groups

    assert default_groups(1, 4, 4, 4096) == 4  # benchmarks/distributed.py at P=2: one head a group
    assert default_groups(1, 2, 2, 4096) == 2  # and at P=4
    assert default_groups(1, 4, 4, 2048) == 1 and default_groups(4, 4, 4, 2048) == 4  # the batch counts
    assert default_groups(1, 8, 2, 8192) == 2  # no more groups than key/value heads
    assert default_groups(2, 2, 1, 40) == 1
    assert _split(4, 4, 4) == ((0, 1, 0, 1), (1, 1, 1, 1), (2, 1, 2, 1), (3, 1, 3, 1))
    assert _split(6, 3, 2) == ((0, 4, 0, 2), (4, 2, 2, 1))  # 2 query heads per kv head; 2 + 1 kv heads
    assert _split(8, 2, 1) == ((0, 8, 0, 2),)
