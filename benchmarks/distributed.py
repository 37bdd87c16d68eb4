"""Sequence-parallel attention on gloo (CPU): traffic, memory, hidden communication, speed.

    python benchmarks/distributed.py [--world 2] [--length 4096] [--heads 8] [--kv-heads 8] [--dim 64]
                                     [--usual-malloc] [--only NAME] [--head-groups G]

Spawns ``--world`` gloo ranks on this machine. For each case (ring over the whole sequence, causal,
a sliding window, packed documents, zigzag causal; Ulysses causal), one forward + backward of
float32 ``[1, H, L, D]`` attention, and prints per rank:

- **bytes received** in the forward, against the theory: the ring receives ``(P-1)/P`` of K and V
  (causal: only earlier ranks', ``r/P``), a window of ``w`` keys the ``w - 1`` keys before its
  shard (the neighbour's boundary), documents that no shard boundary cuts nothing; Ulysses
  receives ``(P-1)/P`` of its heads' Q, K, V;
- **peak memory** of the call (inputs, gradients and everything the call allocates: the peak
  resident set over a fresh high-water mark, ``/proc/self/clear_refs``, with glibc told to map
  big blocks and return them on free) against the same call in one process, as a share (the goal:
  ``<= 1/P + 10%``; left out with ``--usual-malloc``, which times with glibc's usual allocator);
- the **share of communication hidden** behind compute: ``1 - waited / alone``, where ``waited``
  is the time the call spent blocked on messages and ``alone`` the time the same messages take
  exchanged with nothing else to do;
- the median wall time of forward + backward against one process on the whole sequence (on a
  machine with fewer cores than ranks this says little: the ranks share the cores), and against
  the same method unsplit, the two runs interleaved: the ring with one block per message
  (``block_size`` as long as the sequence: whole messages, each unit in one kernel call, as
  before streaming), Ulysses with all of a rank's heads in one group (``head_groups=1``).

Then PyTorch's own ``context_parallel`` on the same problem, or the reason it does not run.
``--only NAME`` runs the cases whose name contains ``NAME`` (``--only ulysses``); ``--head-groups``
runs Ulysses in that many groups of heads instead of its default.
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))

import attnkit  # noqa: E402
import attnkit.kernel  # noqa: E402
from attnkit import masks  # noqa: E402
from attnkit.distributed import (even_lengths, ring_attention, shard, traffic,  # noqa: E402
                                 ulysses_attention)
from attnkit.distributed import comm  # noqa: E402
from attnkit.distributed.layout import chunks  # noqa: E402
from attnkit.distributed.schedule import make_schedule  # noqa: E402

WINDOW = 256
REPEATS = 5


def _cases(length: int, world: int, only: str | None = None):
    documents = masks.document(even_lengths(length, 2 * world))  # two documents a shard, none cut by a shard
    return [case for case in _all_cases(documents) if only is None or only in case[0]]


def _all_cases(documents):
    return [
        ("ring, no mask", "ring", "contiguous", None, False),
        ("ring, causal", "ring", "contiguous", None, True),
        ("ring zigzag, causal", "ring", "zigzag", None, True),
        (f"ring, window {WINDOW}", "ring", "contiguous", masks.sliding_window(WINDOW), False),
        ("ring, documents", "ring", "contiguous", documents & masks.causal(), False),
        ("ulysses, causal", "ulysses", "contiguous", None, True),
    ]


def _theory(name: str, rank: int, world: int, lengths: list[int], layout: str, args) -> int:
    """Bytes the forward must receive on ``rank`` (see the module docstring)."""
    per_key = args.kv_heads * 2 * args.dim * 4  # K and V, float32
    if name.startswith("ulysses"):  # its heads' Q, K, V of the other shards in; its shard of the others' output back
        others = sum(n for r, n in enumerate(lengths) if r != rank)
        heads, kv_heads = args.heads // world, args.kv_heads // world
        return others * (heads + 2 * kv_heads) * args.dim * 4 + (world - 1) * lengths[rank] * heads * args.dim * 4
    if "no mask" in name:
        return (sum(lengths) - lengths[rank]) * per_key
    if "causal" in name:  # every key of another rank before this rank's last position
        own = chunks(lengths, layout)
        last = max(c.stop for c in own[rank])
        return sum(max(0, min(c.stop, last) - c.start) for r, cs in enumerate(own) if r != rank for c in cs) * per_key
    if "window" in name:
        return (WINDOW - 1) * per_key if rank > 0 else 0
    return 0


def _peak_bytes(fn) -> int:
    """Peak resident memory ``fn`` adds (a fresh high-water mark); Linux only. Memory the native
    kernel keeps for reuse is given back first, so that the call's outputs count."""
    attnkit.kernel.release_memory()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    before = _status("VmRSS")
    fn()
    return _status("VmHWM") - before


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(field)


def _inputs(length, heads, kv_heads, dim):
    g = torch.Generator().manual_seed(0)
    return (torch.randn(1, heads, length, dim, generator=g), torch.randn(1, kv_heads, length, dim, generator=g),
            torch.randn(1, kv_heads, length, dim, generator=g))


def _single(args, mask, causal):
    """One process on the whole sequence: the time and peak memory of forward + backward."""
    def run():
        q, k, v = (t.requires_grad_() for t in _inputs(args.length, args.heads, args.kv_heads, args.dim))
        attnkit.attention(q, k, v, mask=mask, causal=causal).sum().backward()
    run()
    memory = _peak_bytes(run)
    times = []
    for _ in range(REPEATS):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return statistics.median(times), memory


def _alone(schedule, k, v, group=None) -> float:
    """The time the forward's messages take exchanged with no compute between them."""
    world, rank = schedule.world, schedule.rank
    dist.barrier()
    start = time.perf_counter()
    for step in range(1, world):
        exchange = comm.Exchange(group, 1000 + step)
        to, source = (rank + step) % world, (rank - step) % world
        if to in schedule.sends:
            exchange.send(to, comm.views(schedule.sends[to], k, v))
        if source in schedule.receives:
            exchange.receive(source, comm.shapes(schedule.receives[source], k, v), k.dtype, k.device)
        exchange.wait()
    return time.perf_counter() - start


def _rank(rank, world, init, args, queue):
    torch.set_num_threads(max(1, args.threads))
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world)
    lengths = even_lengths(args.length, world)
    rows = []
    for name, method, layout, mask, causal in _cases(args.length, world, args.only):
        function = ring_attention
        if method == "ulysses":
            function = functools.partial(ulysses_attention, head_groups=args.head_groups)
        whole = _inputs(args.length, args.heads, args.kv_heads, args.dim)
        mine = [shard(t, rank, world, layout=layout) for t in whole]
        del whole

        def run(**options):
            q, k, v = (t.clone().requires_grad_() for t in mine)
            function(q, k, v, mask=mask, causal=causal, layout=layout, **options).sum().backward()

        run()
        with torch.no_grad(), traffic() as forward:
            function(*mine, mask=mask, causal=causal, layout=layout)
        memory = _peak_bytes(run)
        times, waits, whole = [], [], []
        for _ in range(REPEATS):
            dist.barrier()
            with traffic() as record:
                start = time.perf_counter()
                run()
                times.append(time.perf_counter() - start)
            waits.append(record.wait_seconds)
            # unsplit, interleaved: one block per message, or one group of heads
            dist.barrier()
            start = time.perf_counter()
            run(**({"block_size": args.length} if method == "ring" else {"head_groups": 1}))
            whole.append(time.perf_counter() - start)
        alone = 0.0
        if method == "ring":
            schedule = make_schedule(lengths, layout, rank, mask, causal)
            alone = statistics.median(_alone(schedule, mine[1], mine[2]) for _ in range(REPEATS))
            alone *= 3  # the backward sends the pieces again, and their gradients (as many bytes) home
        rows.append(dict(name=name, bytes=forward.bytes_received,
                         theory=_theory(name, rank, world, lengths, layout, args), memory=memory,
                         time=statistics.median(times), wait=statistics.median(waits), alone=alone,
                         whole=statistics.median(whole) if whole else 0.0))
    single = [_single(args, mask, causal) if rank == 0 else None
              for _, _, _, mask, causal in _cases(args.length, world, args.only)]
    queue.put((rank, rows, single, _context_parallel(world, args)))
    dist.barrier()
    dist.destroy_process_group()


def _context_parallel(world, args) -> str:
    try:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor.experimental import context_parallel
        mesh = init_device_mesh("cpu", (world,))
        q, k, v = _inputs(args.length, args.heads, args.heads, args.dim)
        start = time.perf_counter()
        with context_parallel(mesh, buffers=[q, k, v], buffer_seq_dims=[2, 2, 2]):
            torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return f"ran: {time.perf_counter() - start:.3f} s forward"
    except Exception as error:  # report why it does not run here
        return f"does not run on CPU: {type(error).__name__}: {str(error).splitlines()[0][:160]}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--length", type=int, default=4096)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    parser.add_argument("--usual-malloc", action="store_true",
                        help="time with glibc's usual allocator and leave out the memory column (see below)")
    parser.add_argument("--only", help="run only the cases whose name contains this")
    parser.add_argument("--head-groups", type=int, help="Ulysses' head_groups (default: its own choice)")
    args = parser.parse_args()
    if not args.usual_malloc:
        # big blocks straight from mmap and back on free, so the resident set follows the live tensors
        # and its high-water mark is the call's peak (glibc would otherwise keep freed pages). This
        # also makes every such block fault its pages in afresh, which costs the ring's many smaller
        # temporaries (streamed in blocks) more than one process's few big ones: --usual-malloc times
        # without it.
        os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", "65536")
        os.environ.setdefault("MALLOC_TRIM_THRESHOLD_", "0")
    context = mp.get_context("spawn")
    queue = context.SimpleQueue()
    init = tempfile.mktemp()
    mp.spawn(_rank, args=(args.world, init, args, queue), nprocs=args.world)
    results = sorted(queue.get() for _ in range(args.world))
    single = results[0][2]
    print(f"# sequence-parallel attention, gloo, P={args.world}, [1, {args.heads} (kv {args.kv_heads}), "
          f"{args.length}, {args.dim}] fp32, forward + backward, {args.threads} thread(s) per rank, "
          f"torch {torch.__version__}; medians of {REPEATS}"
          f"{f'; Ulysses head_groups={args.head_groups}' if args.head_groups else ''}"
          f"{'; glibc usual malloc: no memory column' if args.usual_malloc else ''}\n")
    print("| case | rank | received (MB) | theory (MB) | peak memory / one process | hidden comm | time / one process "
          "| time / unsplit |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for index in range(len(single)):
        single_time, single_memory = single[index]
        for rank, rows, _, _ in results:
            row = rows[index]
            theory = "-" if row["theory"] < 0 else f"{row['theory'] / 1e6:.2f}"
            hidden = "-" if row["alone"] <= 0 else f"{max(0.0, 1 - row['wait'] / row['alone']):.0%}"
            blocks = "-" if row["whole"] <= 0 else f"{row['time'] / row['whole']:.2f}"
            memory = "-" if args.usual_malloc else f"{row['memory'] / single_memory:.2f}"
            print(f"| {row['name']} | {rank} | {row['bytes'] / 1e6:.2f} | {theory} | "
                  f"{memory} | {hidden} | {row['time'] / single_time:.2f} | {blocks} |")
    print(f"\none process: " + ", ".join(f"{name} {t * 1e3:.0f} ms" + ("" if args.usual_malloc else f" / {m / 1e6:.0f} MB")
                                         for (name, *_), (t, m) in zip(_cases(args.length, args.world, args.only),
                                                                       single)))
    print(f"torch context_parallel: {results[0][3]}")


if __name__ == "__main__":
    main()
