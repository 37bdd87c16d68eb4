"""Structured masks: attention(backend="auto") vs dense-mask SDPA vs compiled FlexAttention.

One run, B=1, H=8, D=64, fp32, L=16384 by default, three masks: a causal sliding window of 512,
8 packed documents (bidirectional within each, uneven lengths), causal + padding (the last
quarter of the keys is padding). For each contender it prints:

- steady-state time: each contender in its own fresh process (so that no contender's
  allocations, e.g. SDPA's L x L mask, land on the next: in one process a 12 s dense-mask step
  made attnkit's steps after it read 1.4-1.9x slower), ``--rounds`` rounds alternating the order,
  each process timing ``--repeats`` calls after a warm-up; the median over rounds and its spread
  (min-max) are printed. ``--in-process`` times them interleaved in one process instead. Ours
  also with attnkit's native kernel turned off (the tiled forward on PyTorch's kernel: what
  ``auto`` would run without it), where the native kernel is built (`make native`);
- first-call time, in a fresh subprocess: ours includes loading the native kernel and planning;
  FlexAttention includes
  create_block_mask and torch.compile, with an empty inductor cache (so nothing is reused);
- extra peak memory of the next (steady) call in that subprocess: the process's peak resident
  set (Linux VmHWM, reset through /proc/self/clear_refs just before the call) minus its resident
  set before it, so it counts everything the call allocates, torch's CPU allocations included
  (tracemalloc would see none of them). For SDPA the call includes building the dense boolean
  mask, which that path needs (the mask alone is L*L bytes); Flex reuses its compiled kernel and
  block mask (small);
- useful GFLOP/s: 4 * D flops per attended (query, key) pair and head (two matrix products),
  next to a square matmul in the same dtype timed in the same run, SDPA's causal kernel's rate
  (timed in each mask's rounds; the ratio to it is taken round by round, then its median),
  and the cores' FMA peak (fma_peak.c, built here; reported as not measurable where a matmul of
  the run beats it). ``--train`` in float32 also measures the peak in each mask's rounds, as a
  contender of its own, and takes ours over it round by round, as for SDPA's causal rate; the
  run's one peak is then the best of all its samples.

``--dtype bfloat16|float16`` runs the tables in half precision (inputs, outputs and the matmul).

    python benchmarks/masks.py                 # the tables of docs/performance.md (several minutes)
    python benchmarks/masks.py --long          # L = 131072, window 512: ours only, memory check
    python benchmarks/masks.py --threshold     # tiled vs the fused dense path at short lengths
    python benchmarks/masks.py --train         # forward + backward, each mask
    python benchmarks/masks.py --dtype bfloat16  # half precision, with SDPA's causal rate in bf16
    python benchmarks/masks.py --compile       # torch.compile(fullgraph=True) vs eager, each mask
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
import functools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(__file__))
import attnkit  # noqa: E402
import attnkit.kernel  # noqa: E402
from attnkit import masks  # noqa: E402
from attnkit._backends import auto_runs, native, tiled, tiled_plan  # noqa: E402
from attnkit._call import make_call  # noqa: E402
from common import (describe_machine, fma_peak, median_times, native_library_loaded, reliable_peak,  # noqa: E402
                    square_matmul)

HEADS, HEAD_DIM = 8, 64
MIB = 2**20


def document_lengths(length: int, count: int = 8) -> list[int]:
    """``count`` uneven document lengths summing to ``length`` (none a multiple of the block)."""
    weights = [1.0 + 0.37 * ((3 * i) % count) for i in range(count)]
    lengths = [int(length * w / sum(weights)) for w in weights]
    lengths[-1] += length - sum(lengths)
    return lengths


def mask_set(length: int, window: int = 512) -> dict[str, tuple[masks.StructuredMask, object]]:
    """Name -> (attnkit structured mask, the same rule as a FlexAttention mask_mod)."""
    lengths = document_lengths(length)
    # int32: with int64 ids, torch 2.13's inductor emits C++ for this mask_mod that fails to compile.
    doc_ids = torch.repeat_interleave(torch.arange(len(lengths), dtype=torch.int32), torch.tensor(lengths))
    real = length - length // 4

    def window_mod(b, h, q, kv):
        return (kv <= q) & (q - kv < window)

    def document_mod(b, h, q, kv):
        return doc_ids[q] == doc_ids[kv]

    def causal_padding_mod(b, h, q, kv):
        return (kv <= q) & (kv < real)

    return {
        f"sliding window {window}": (masks.sliding_window(window), window_mod),
        f"{len(lengths)} packed documents": (masks.document(lengths), document_mod),
        "causal + padding": (masks.causal() & masks.padding([real]), causal_padding_mod),
    }


def inputs(length: int, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return tuple(torch.randn(1, HEADS, length, HEAD_DIM, generator=g).to(dtype) for _ in range(3))


def bench_dtype() -> torch.dtype:
    """The run's dtype (``--dtype``), passed to child processes through ``BENCH_DTYPE``."""
    return getattr(torch, os.environ.get("BENCH_DTYPE", "float32"))


def attended_pairs(mask: masks.StructuredMask, length: int) -> int:
    lo, hi = mask.row_bounds(length, length)
    return int((hi - lo).clamp(min=0).sum())


# -- one measurement in a fresh process -------------------------------------------------------------


def _rss_kib(field: str) -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def child(contender: str, mask_name: str, length: int, window: int) -> None:
    """Time one first call, then measure the extra peak memory of a second one; print JSON.
    ``ours-train`` / ``sdpa-train``: forward and backward (from a fixed gradient of the output)."""
    torch.set_num_threads(int(os.environ.get("BENCH_THREADS", torch.get_num_threads())))
    train = contender.endswith("-train")
    contender = contender.removesuffix("-train")
    query, key, value = (t.requires_grad_(train) for t in inputs(length, bench_dtype()))
    structured, mask_mod = mask_set(length, window)[mask_name]
    if train:
        forward = (lambda: attnkit.attention(query, key, value, mask=structured)) if contender == "ours" else (
            lambda: F.scaled_dot_product_attention(query, key, value, attn_mask=structured.dense(length, length)))

        grad_out = torch.randn(query.shape).to(query.dtype)

        def call():
            output = forward()
            output.backward(grad_out)
            return output.detach()
        first = call
    elif contender == "ours":
        def call():
            return attnkit.attention(query, key, value, mask=structured)
        first = call
    elif contender == "sdpa":
        def call():  # the dense mask is part of what this path costs
            return F.scaled_dot_product_attention(query, key, value, attn_mask=structured.dense(length, length))
        first = call
    else:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention
        compiled = torch.compile(flex_attention, dynamic=False)
        block_mask = None

        def first():
            nonlocal block_mask
            block_mask = create_block_mask(mask_mod, None, None, length, length, device="cpu")
            return compiled(query, key, value, block_mask=block_mask)

        def call():
            return compiled(query, key, value, block_mask=block_mask)
    start = time.perf_counter()
    output = first()
    seconds = time.perf_counter() - start
    del output
    attnkit.kernel.release_memory()  # the kernel would reuse the freed output: count it as a first call does
    with open("/proc/self/clear_refs", "w") as clear:
        clear.write("5")  # reset the peak resident set (VmHWM) to the current one
    before = _rss_kib("VmRSS")
    output = call()
    extra = (_rss_kib("VmHWM") - before) * 1024
    print(json.dumps({"seconds": seconds, "extra_bytes": extra, "finite": bool(torch.isfinite(output).all()),
                      "kernel": native_library_loaded()}))


def _same_kernel(payload: dict, contender: str, mask_name: str) -> dict:
    """A child's results, when it loaded the library this run loaded (common.native_library_loaded);
    else the run stops: a run from a checkout being edited measured PyTorch's kernels for a while
    (the twenty-first session). A frozen checkout (a git worktree with an
    ATTNKIT_NATIVE_DIR of its own) cannot change under a run."""
    if payload.get("kernel", "") != native_library_loaded():
        raise SystemExit(f"masks.py: {contender} ({mask_name}) ran with the native kernel "
                         f"{payload.get('kernel') or 'not loaded'} where this run loaded "
                         f"{native_library_loaded() or 'none'}: its sources or its cache changed during the run; "
                         "run from a checkout nobody edits")
    return payload


def measure_first_call(contender: str, mask_name: str, length: int, window: int) -> dict:
    env = _child_env()
    with tempfile.TemporaryDirectory() as cache:
        env["TORCHINDUCTOR_CACHE_DIR"] = cache  # a cold compile, as a user's first run
        result = subprocess.run(
            [sys.executable, __file__, "--child", contender, mask_name, str(length), str(window)],
            capture_output=True, text=True, env=env, check=False,
        )
    if result.returncode != 0:
        return {"error": (result.stderr.strip().splitlines() or ["failed"])[-1]}
    return _same_kernel(json.loads(result.stdout.strip().splitlines()[-1]), contender, mask_name)


# -- steady times, each contender in its own process ---------------------------------------------------


def contender_step(contender: str, mask_name: str, length: int, window: int) -> Callable[[], object]:
    """The call one contender makes, built in this process: ``ours`` (``attention(backend="auto")``),
    ``ours-fused`` (the same with the native kernel off), ``sdpa`` (the dense boolean mask, built
    once), ``sdpa-causal`` (SDPA's causal kernel, no mask), ``flex`` (compiled, its block mask built
    once), ``matmul``; ``...-train``: forward and backward from a fixed gradient; ``...-dropout``:
    dropout 0.1 on the weights."""
    train = contender.endswith("-train")
    name = contender.removesuffix("-train")
    dropout = 0.1 if name.endswith("-dropout") else 0.0
    name = name.removesuffix("-dropout")
    dtype = bench_dtype()
    if name == "matmul":
        return square_matmul(dtype)[1]
    query, key, value = (t.requires_grad_(train) for t in inputs(length, dtype))
    structured, mask_mod = mask_set(length, window)[mask_name]
    if name == "ours":
        forward = lambda: attnkit.attention(query, key, value, mask=structured, dropout=dropout)  # noqa: E731
    elif name == "ours-fused":
        forward = lambda: _without_native(query, key, value, structured, dropout)  # noqa: E731
    elif name == "sdpa":
        dense = structured.dense(length, length)
        forward = lambda: F.scaled_dot_product_attention(query, key, value, attn_mask=dense)  # noqa: E731
    elif name == "sdpa-causal":
        forward = lambda: F.scaled_dot_product_attention(query, key, value, is_causal=True)  # noqa: E731
    elif name == "flex":
        forward, error = flex_contender(mask_mod, query, key, value)
        if forward is None:
            raise RuntimeError(error)
    else:
        raise ValueError(f"unknown contender {contender!r}")
    if not train:
        return forward
    grad_out = torch.randn(query.shape, generator=torch.Generator().manual_seed(1)).to(dtype)

    def step():
        forward().backward(grad_out)
        query.grad = key.grad = value.grad = None
    return step


def steady_child(contender: str, mask_name: str, length: int, window: int, repeats: int) -> None:
    """One warm-up call, then ``repeats`` timed ones; prints their times as JSON."""
    torch.set_num_threads(int(os.environ.get("BENCH_THREADS", torch.get_num_threads())))
    step = contender_step(contender, mask_name, length, window)
    step()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    print(json.dumps({"times": times, "kernel": native_library_loaded()}))


def _child_env() -> dict[str, str]:
    return dict(os.environ, BENCH_THREADS=str(torch.get_num_threads()), BENCH_DTYPE=str(bench_dtype()).split(".")[-1])


#: The FMA peak as a contender of steady_times: its samples are seconds per GFLOP (1 / the round's
#: peak), so that a round's sample reads like a time.
FMA_PEAK = "fma-peak"


def _peak_sample(mask_name: str) -> float | None:
    """One FMA_PEAK sample (common.fma_peak runs fma_peak.c in a process of its own), or None with
    the reason printed where it cannot be measured."""
    gflops, how = fma_peak(torch.get_num_threads())
    if gflops is None:
        print(f"    {FMA_PEAK} ({mask_name}) failed: {how}")
        return None
    return 1.0 / gflops


def steady_times(contenders: list[str], mask_name: str, args: argparse.Namespace) -> dict[str, list[float]]:
    """Per contender, the median time of each round (a fresh process each), rounds alternating the
    order; a contender that fails is left out and its error printed. ``--in-process``: one process,
    interleaved (benchmarks/common.median_times), one sample each."""
    if args.in_process:
        steps = {c: contender_step(c, mask_name, args.length, args.window) for c in contenders if c != FMA_PEAK}
        samples = {c: [t] for c, t in median_times(steps, repeats=args.repeats).items()}
        if FMA_PEAK in contenders and (peak := _peak_sample(mask_name)) is not None:
            samples[FMA_PEAK] = [peak]  # once, after the steps (one sample each, as theirs)
        return samples
    samples: dict[str, list[float]] = {c: [] for c in contenders}
    failed: set[str] = set()
    for round_ in range(args.rounds):
        for contender in (contenders if round_ % 2 == 0 else contenders[::-1]):
            if contender in failed:
                continue
            if contender == FMA_PEAK:
                peak = _peak_sample(mask_name)
                if peak is None:
                    failed.add(contender)
                else:
                    samples[contender].append(peak)
                continue
            result = subprocess.run(
                [sys.executable, __file__, "--steady", contender, mask_name, str(args.length), str(args.window),
                 str(args.repeats)], capture_output=True, text=True, env=_child_env(), check=False)
            if result.returncode != 0:
                failed.add(contender)
                print(f"    {contender} ({mask_name}) failed: {(result.stderr.strip().splitlines() or ['?'])[-1]}")
                continue
            payload = _same_kernel(json.loads(result.stdout.strip().splitlines()[-1]), contender, mask_name)
            samples[contender].append(statistics.median(payload["times"]))
    return {c: ts for c, ts in samples.items() if ts}


def median_of(samples: dict[str, list[float]]) -> dict[str, float]:
    return {c: statistics.median(ts) for c, ts in samples.items()}


def _fmt_spread(samples: list[float] | None) -> str:
    """``median (min-max)`` in ms over the rounds, or the median alone with one sample."""
    if not samples:
        return "n/a"
    median = statistics.median(samples)
    if len(samples) == 1:
        return _fmt_ms(median)
    return f"{_fmt_ms(median)} ({_fmt_ms(min(samples))}-{_fmt_ms(max(samples))})"


# -- the table ---------------------------------------------------------------------------------------


def flex_contender(mask_mod, query, key, value) -> tuple[object, str | None]:
    """Compiled FlexAttention with its block mask built, compiled by one warm-up call; or the
    reason it cannot run here."""
    length = query.shape[-2]
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        block_mask = create_block_mask(mask_mod, None, None, length, length, device="cpu")
        compiled = torch.compile(flex_attention, dynamic=False)  # no shape-generic recompile
        compiled(query, key, value, block_mask=block_mask)
        return (lambda: compiled(query, key, value, block_mask=block_mask)), None
    except Exception as error:  # noqa: BLE001  (a missing or failing FlexAttention is reported, not fatal)
        lines = str(error).splitlines()
        first_error = next((line for line in lines if "error:" in line), lines[0] if lines else "")
        return None, f"{type(error).__name__}: {first_error.strip()}"


def main_table(args: argparse.Namespace) -> None:
    length, window = args.length, args.window
    dtype = bench_dtype()
    flops = square_matmul(dtype)[0]
    dtype_name = str(dtype).split(".")[-1]
    print(f"# Structured masks, B=1, H={HEADS}, D={HEAD_DIM}, {dtype_name}, L={length}  ({describe_machine()})")
    how = ("one process, interleaved" if args.in_process else
           f"each contender in a fresh process, {args.rounds} rounds alternating")
    print(f"# steady: median (min-max over rounds) of {args.repeats} calls, {how}; first call and extra peak "
          "memory: fresh process each")
    kernel = "attnkit's native kernel" if native.available() else f"PyTorch's fused kernel ({native.why_unavailable()})"
    print(f"# tiled forward runs {kernel}\n")
    rows = []
    for name, (structured, mask_mod) in mask_set(length, window).items():
        query, key, value = inputs(length, dtype)
        ours_out = attnkit.attention(query, key, value, mask=structured)  # how closely they agree
        errors = {"sdpa": (ours_out - F.scaled_dot_product_attention(
            query, key, value, attn_mask=structured.dense(length, length))).abs().max().item()}
        flex, flex_error = (None, "skipped (--no-flex)") if args.no_flex else flex_contender(
            mask_mod, query, key, value)
        if flex is not None:
            errors["flex"] = (ours_out - flex()).abs().max().item()
        del ours_out, flex, query, key, value
        contenders = ["ours", "sdpa", "matmul", "sdpa-causal"] + (["ours-fused"] if native.available() else []) + (
            ["flex"] if "flex" in errors else [])
        samples = steady_times(contenders, name, args)
        times = median_of(samples)
        first = {c: measure_first_call(c, name, length, window) for c in ("ours", "sdpa", "flex")
                 if c != "flex" or "flex" in errors}
        pairs = attended_pairs(structured, length)
        useful_flops = 4 * HEAD_DIM * pairs * HEADS
        useful = useful_flops / times["ours"] / 1e9
        peak = flops / times["matmul"] / 1e9
        rows.append(dict(name=name, share=pairs / length**2, times=times, samples=samples, first=first,
                         useful=useful, peak=peak, errors=errors, flex_error=flex_error,
                         versus_causal=_versus_causal(samples, "ours", useful_flops, length)))
    causal = [t for row in rows for t in row["samples"].get("sdpa-causal", [])]
    _print_tables(rows, _causal_rate(causal, length), dtype_name)


def _without_native(query, key, value, structured, dropout=0.0):
    with native.turned_off():
        return attnkit.attention(query, key, value, mask=structured, dropout=dropout)


def _fmt_ms(seconds: float | None) -> str:
    return "n/a" if seconds is None else f"{seconds * 1e3:,.0f}"


def _fmt_mib(result: dict) -> str:
    return result.get("error", "n/a") if "extra_bytes" not in result else f"{result['extra_bytes'] / MIB:,.0f}"


def _causal_flops(length: int) -> int:
    """SDPA's causal forward's useful flops: 4 x attended pairs x D x H."""
    return 4 * HEAD_DIM * HEADS * (length * (length + 1) // 2)


def _causal_rate(times: list[float], length: int) -> float | None:
    """SDPA's causal forward in useful GFLOP/s from its times (``sdpa-causal`` samples, every
    round's), by their median; None where it did not run."""
    return _causal_flops(length) / statistics.median(times) / 1e9 if times else None


def _versus_causal(samples: dict[str, list[float]], contender: str, useful_flops: float, length: int) -> str:
    """``contender``'s useful rate (``useful_flops`` a call) over SDPA's causal forward rate, round by
    round: the two ran in the same round, one right after the other (``steady_times`` alternates
    the order), so a machine that slows down between rounds slows both. ``median (min-max)`` of the
    rounds' ratios; n/a where either did not run. (The bar once came from a run of its own before
    the masks': on this shared machine its rate moved by half between runs, and one-run ratios read
    63% where the same step alternating with the bar in one process read 82%.)"""
    if not samples.get(contender) or not samples.get("sdpa-causal"):
        return "n/a"
    return _fmt_ratios([(useful_flops / ours) / (_causal_flops(length) / causal)
                        for ours, causal in zip(samples[contender], samples["sdpa-causal"])])


def _fmt_ratios(ratios: list[float]) -> str:
    """Rounds' ratios as ``median (min-max)`` in percent, or the one ratio alone."""
    median = statistics.median(ratios)
    return f"{median:.0%}" if len(ratios) == 1 else f"{median:.0%} ({min(ratios):.0%}-{max(ratios):.0%})"


def _versus_round_peak(samples: dict[str, list[float]], contender: str, useful_flops: float,
                       matmul_flops: float) -> str:
    """``contender``'s useful rate over the FMA peak measured in the same round (``FMA_PEAK``), round
    by round, as ``_versus_causal`` pairs the rounds: on this shared machine the peak itself moved
    from 313 to 352 GFLOP/s between hours and a step's time by half, so a peak read once for the
    whole run sets one round's step against another hour's cores. A round whose matmul beat its
    peak has no peak (``common.reliable_peak``'s rule) and is left out; n/a where none is left."""
    if not samples.get(contender) or not samples.get(FMA_PEAK) or not samples.get("matmul"):
        return "n/a"
    ratios = []
    for step, per_gflop, matmul in zip(samples[contender], samples[FMA_PEAK], samples["matmul"]):
        peak, _ = reliable_peak(1.0 / per_gflop, "", [matmul_flops / matmul / 1e9])
        if peak is not None:
            ratios.append(useful_flops / step / 1e9 / peak)
    return _fmt_ratios(ratios) if ratios else "n/a (a matmul beat every round's peak)"


def _print_tables(rows: list[dict], causal_rate: float | None, dtype_name: str) -> None:
    print("| mask | attended | ours = auto (ms) | ours, native kernel off (ms) | SDPA dense mask (ms) | SDPA / ours "
          "| Flex compiled (ms) | ours / Flex | ours first call (ms) | first / steady | Flex first call (s) |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for row in rows:
        t, samples, first = row["times"], row["samples"], row["first"]
        flex, ours = t.get("flex"), t["ours"]
        ours_first = first["ours"].get("seconds")
        flex_first = first.get("flex", {}).get("seconds")
        versus_flex = "n/a" if flex is None else f"{ours / flex:.2f}"
        first_ratio = "n/a" if ours_first is None else f"{ours_first / ours:.2f}"
        flex_first_s = "n/a" if flex_first is None else f"{flex_first:.1f}"
        sdpa_ratio = f"{t['sdpa'] / ours:.1f}x" if "sdpa" in t else "n/a"
        print(f"| {row['name']} | {row['share']:.1%} | {_fmt_spread(samples.get('ours'))} "
              f"| {_fmt_spread(samples.get('ours-fused'))} | {_fmt_spread(samples.get('sdpa'))} | {sdpa_ratio} "
              f"| {_fmt_spread(samples.get('flex'))} | {versus_flex} | {_fmt_ms(ours_first)} | {first_ratio} "
              f"| {flex_first_s} |")
    fma, how = reliable_peak(*machine_peak(), [row["peak"] for row in rows]) if dtype_name == "float32" else (None, "")
    print("\n| mask | extra peak memory: ours (MiB) | SDPA dense mask (MiB) | Flex (MiB) | ours / SDPA "
          "| ours useful GFLOP/s | ours / SDPA causal rate | matmul GFLOP/s | ours / matmul | ours / FMA peak "
          "| max abs diff vs SDPA, Flex |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|")
    for row in rows:
        first = row["first"]
        ours_mem, sdpa_mem = first["ours"].get("extra_bytes"), first["sdpa"].get("extra_bytes")
        ratio = "n/a" if not (ours_mem and sdpa_mem) else f"{ours_mem / sdpa_mem:.1%}"
        diffs = ", ".join(f"{row['errors'][c]:.1e}" for c in ("sdpa", "flex") if c in row["errors"])
        print(f"| {row['name']} | {_fmt_mib(first['ours'])} | {_fmt_mib(first['sdpa'])} | "
              f"{_fmt_mib(first.get('flex', {})) if 'flex' in first else 'n/a'} | {ratio} "
              f"| {row['useful']:.0f} | {row['versus_causal']} | {row['peak']:.0f} | {row['useful'] / row['peak']:.0%} "
              f"| {share_of_peak(row['useful'], fma)} | {diffs} |")
    if causal_rate is not None:
        print(f"\nSDPA's causal kernel, same length and dtype ({dtype_name}): {causal_rate:.0f} useful GFLOP/s "
              "(median over every round; each row's ratio pairs the rounds).")
    print(peak_note([row["peak"] for row in rows], dtype_name))
    for row in rows:
        if row["flex_error"]:
            print(f"\nFlexAttention ({row['name']}): {row['flex_error']}")
    print("\nGoals (issue 4): SDPA / ours >= 10x with ours / SDPA memory <= 5%; ours / Flex <= 1.0; "
          "first / steady <= 1.5; ours / matmul >= 60% at L >= 8192. (Issue 11): ours / matmul >= 85%. "
          "(Issue 26, bf16 with AMX): ours / SDPA causal rate >= 100%.")


@functools.cache
def machine_peak() -> tuple[float | None, str]:
    """The cores' FMA peak for this run's threads (see common.fma_peak), measured once, on first use."""
    return fma_peak(torch.get_num_threads())


def share_of_peak(gflops: float, fma: float | None) -> str:
    """``gflops`` as a share of the FMA peak ``fma``, or n/a where it was not measured."""
    return "n/a" if fma is None else f"{gflops / fma:.0%}"


def best_peak(round_peaks: list[float]) -> tuple[float | None, str]:
    """The run's FMA peak: the best of machine_peak() and the peaks measured in the rounds (issue 26:
    best of several; one sample read 315 GFLOP/s in a run whose rounds read 336-368)."""
    fma, how = machine_peak()
    if not round_peaks:
        return fma, how
    samples = round_peaks + ([fma] if fma is not None else [])
    return max(samples), f"benchmarks/fma_peak.c, {torch.get_num_threads()} threads, the best of the run's " \
        f"{len(samples)} samples"


def peak_note(matmul_rates: list[float], dtype_name: str = "float32",
              peak: tuple[float | None, str] | None = None) -> str:
    """One line: the FMA peak (``peak``, else machine_peak()), and the share of it the run's matmul
    reached (or why there is none)."""
    if dtype_name != "float32":
        return f"\nFMA peak: float32's, not a bound for {dtype_name} (half-precision units, or conversions)."
    fma, how = reliable_peak(*(peak or machine_peak()), matmul_rates)
    if fma is None:
        return f"\nFMA peak: not measured ({how})."
    shares = ", ".join(f"{rate / fma:.0%}" for rate in matmul_rates)
    return f"\nFMA peak: {fma:.0f} GFLOP/s ({how}); the matmul ran at {shares} of it."


# -- the long run and the threshold sweep ------------------------------------------------------------


def long_run(args: argparse.Namespace) -> None:
    length, window = 131072, args.window
    name = f"sliding window {window}"
    print(f"# L={length}, {name}, B=1, H={HEADS}, D={HEAD_DIM}, fp32 ({describe_machine()}); fresh process")
    result = measure_first_call("ours", name, length, window)
    if "error" in result:
        print(f"failed: {result['error']}")
        return
    inputs_mib = 3 * length * HEADS * HEAD_DIM * 4 / MIB
    extra = result["extra_bytes"] / MIB
    print(f"attention(backend='auto'): {result['seconds']:.2f} s (first call), extra peak memory {extra:,.0f} MiB "
          f"(inputs: {inputs_mib:,.0f} MiB; the output alone is {inputs_mib / 3:,.0f} MiB); "
          f"goal < 2048 MiB: {'met' if extra < 2048 else 'NOT met'}; output finite: {result['finite']}")
    print(f"(a dense boolean mask alone would take {length**2 / 2**30:.0f} GiB)")


def training(args: argparse.Namespace) -> None:
    """Forward + backward (from a fixed gradient of the output, as FlashAttention's benchmarks time
    it: no loss computed around the attention) for each mask: steady time of ours (what ``auto``
    runs), ours with the native kernel off (its alternative: PyTorch's kernels) and dense-mask
    SDPA, each in its own process (``steady_times``), useful GFLOP/s against a matmul; then first
    call and extra peak memory of ours and SDPA with the window, fresh process each."""
    length, window = args.length, args.window
    dtype_name = str(bench_dtype()).split(".")[-1]
    how = "one process, interleaved" if args.in_process else f"each in a fresh process, {args.rounds} rounds alternating"
    print(f"# forward + backward, B=1, H={HEADS}, D={HEAD_DIM}, {dtype_name}, L={length} ({describe_machine()})")
    print(f"# output.backward(fixed gradient) after each forward; steady: median (min-max over rounds) of "
          f"{args.repeats} calls, {how}; FlexAttention has no CPU backward in this torch\n")
    flops = square_matmul(bench_dtype())[0]
    print("| mask | ours = auto (ms) | ours, native kernel off (ms) | SDPA dense mask (ms) | SDPA / ours "
          "| ours useful GFLOP/s | ours / SDPA causal forward rate | matmul GFLOP/s | ours / matmul | ours / FMA peak "
          "| ours / FMA peak, round by round |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    matmul_rates, lines, causal_samples = [], [], []
    for name, (structured, _) in mask_set(length, window).items():
        # SDPA's causal forward in each round: issue 26's bar for half-precision training (80% of it);
        # in float32 the FMA peak in each round too (issue 26's bar there, 70% of it)
        contenders = ["ours-train", "sdpa-train", "matmul", "sdpa-causal"] + (
            ["ours-fused-train"] if native.available() else []) + ([FMA_PEAK] if dtype_name == "float32" else [])
        samples = steady_times(contenders, name, args)
        times = median_of(samples)
        # FlashAttention's count: the backward does 2.5x the forward's two products (it recomputes the scores)
        useful_flops = 3.5 * 4 * HEAD_DIM * attended_pairs(structured, length) * HEADS
        useful = useful_flops / times["ours-train"] / 1e9
        peak = flops / times["matmul"] / 1e9
        matmul_rates.append(peak)
        causal_samples.extend(samples.get("sdpa-causal", []))
        sdpa_ratio = f"{times['sdpa-train'] / times['ours-train']:.1f}x" if "sdpa-train" in times else "n/a"
        lines.append((name, samples, sdpa_ratio, useful, peak,
                      _versus_causal(samples, "ours-train", useful_flops, length),
                      _versus_round_peak(samples, "ours-train", useful_flops, flops)))
    round_peaks = [1.0 / s for _, samples, *_ in lines for s in samples.get(FMA_PEAK, [])]
    run_peak = best_peak(round_peaks)
    fma, _ = reliable_peak(*run_peak, matmul_rates) if dtype_name == "float32" else (None, "")
    for name, samples, sdpa_ratio, useful, peak, versus_causal, versus_round_peak in lines:
        print(f"| {name} | {_fmt_spread(samples.get('ours-train'))} | {_fmt_spread(samples.get('ours-fused-train'))} "
              f"| {_fmt_spread(samples.get('sdpa-train'))} | {sdpa_ratio} | {useful:.0f} "
              f"| {versus_causal} | {peak:.0f} | {useful / peak:.0%} | {share_of_peak(useful, fma)} "
              f"| {versus_round_peak} |", flush=True)

    # Dropout on the weights (SDPA would run its math path: 8 x L^2 weights, 8 GiB at 16384)
    name = f"sliding window {window}"
    contenders = ["ours-dropout-train"] + (["ours-fused-dropout-train"] if native.available() else [])
    samples = steady_times(contenders, name, args)
    print(f"| {name}, dropout 0.1 | {_fmt_spread(samples.get('ours-dropout-train'))} "
          f"| {_fmt_spread(samples.get('ours-fused-dropout-train'))} | n/a | | | | | | | |", flush=True)
    causal_rate = _causal_rate(causal_samples, length)
    if causal_rate is not None:
        print(f"\nSDPA's causal kernel (forward), same length and dtype ({dtype_name}): {causal_rate:.0f} useful GFLOP/s "
              "(median over every round; each row's ratio pairs the rounds).")
    print(peak_note(matmul_rates, dtype_name, run_peak))
    if round_peaks:
        print(f"The FMA peak measured in each mask's rounds (the last column's bar): {min(round_peaks):.0f}-"
              f"{max(round_peaks):.0f} GFLOP/s.")
    print("Goal (issue 11): ours / matmul >= 75%. (Issue 26): float32 training >= 70% of the FMA peak and never "
          "slower than the native kernel off; bf16 with AMX: training >= 80% of SDPA's causal forward rate.")

    print(f"\n{name}, fresh process each:\n")
    print("| contender | first call (s) | extra peak memory of the next call (MiB) |")
    print("|---|---:|---:|")
    for contender, label in (("ours-train", "attention(backend='auto')"), ("sdpa-train", "SDPA, dense mask")):
        result = measure_first_call(contender, name, length, window)
        if "error" in result:
            print(f"| {label} | failed: {result['error']} | |")
        else:
            print(f"| {label} | {result['seconds']:.2f} | {result['extra_bytes'] / MIB:,.0f} |")


def compile_table(args: argparse.Namespace) -> None:
    """Eager ``attention(backend="auto")`` against the same call compiled with
    ``torch.compile(fullgraph=True)`` (inductor), forward and forward + backward, each mask, plus
    the shape of issue 11's example (L = 4096, H = 4, window 256); steady times, interleaved."""
    length, window = args.length, args.window
    print(f"# torch.compile(fullgraph=True) vs eager, B=1, D={HEAD_DIM}, fp32 ({describe_machine()})")
    print(f"# steady: median of {args.repeats} interleaved runs after a compiling call\n")
    print("| mask | L | H | pass | eager (ms) | compiled (ms) | compiled speed / eager | auto runs |")
    print("|---|---:|---:|---|---:|---:|---:|---|")
    shapes = [(f"sliding window {window // 2}", masks.sliding_window(window // 2), 4096, 4)]
    shapes += [(name, mask, length, HEADS) for name, (mask, _) in mask_set(length, window).items()]
    for name, structured, size, heads in shapes:
        g = torch.Generator().manual_seed(0)
        query, key, value = (torch.randn(1, heads, size, HEAD_DIM, generator=g) for _ in range(3))
        call = make_call(query, key, value, mask=structured, causal=False, scale=None, dropout=0.0, generator=None,
                         return_weights=False)
        for train in (False, True):
            def run(q, k, v, structured=structured, train=train):
                out = attnkit.attention(q, k, v, mask=structured)
                return out.square().sum() if train else out

            compiled = torch.compile(run, fullgraph=True)
            inputs = [t.requires_grad_(train) for t in (query, key, value)]

            def step(fn):
                def go():
                    result = fn(*inputs)
                    if train:
                        result.backward()
                        for t in inputs:
                            t.grad = None
                return go

            step(compiled)()  # compile outside the timing
            times = median_times({"eager": step(run), "compiled": step(compiled)}, repeats=args.repeats)
            print(f"| {name} | {size} | {heads} | {'fwd+bwd' if train else 'forward'} | {_fmt_ms(times['eager'])} "
                  f"| {_fmt_ms(times['compiled'])} | {times['eager'] / times['compiled']:.2f}x | {auto_runs(call)} |",
                  flush=True)
    print("\nGoal (issue 11): compiled speed / eager >= 1.0.")


def threshold_sweep(args: argparse.Namespace) -> None:
    """Tiled vs the fused dense path (what auto would run otherwise) for short lengths; ``visited``
    is the share of pairs the block plan computes (PyTorch's kernel per block), ``computed`` the
    share the native kernel multiplies (each block over its rows' key span)."""
    print(f"# tiled / torch-with-dense-mask time, B=1, H={HEADS}, D={HEAD_DIM}, fp32, dropout {args.dropout} "
          f"({describe_machine()})")
    print("| L | mask | visited | computed | tiled (ms) | torch (ms) | tiled / torch | auto runs |")
    print("|---:|---|---:|---:|---:|---:|---:|---|")
    for length in args.sweep:
        query, key, value = inputs(length)
        sweep = {  # name: (mask, query rows: the last ones, as a chunk of a prefill)
            f"window {length // 8}": (masks.sliding_window(length // 8), length),
            "8 documents": (masks.document(document_lengths(length)), length),
            "causal + padding": (masks.causal() & masks.padding([length - length // 4]), length),
            "causal": (masks.causal(), length),
        }
        if args.dropout > 0:  # SDPA has no fused CPU kernel with dropout: even no mask is a contest
            sweep["no mask"] = (None, length)
        if args.dense_side:  # masks that keep most pairs: where tiled stops paying
            sweep |= {
                "prefix-LM L/2": (masks.prefix_lm(length // 2), length),
                f"symmetric window {length // 2}": (masks.sliding_window(length // 2, causal=False), length),
                "padding 7/8": (masks.padding([length - length // 8]), length),
                "causal, last L/4 rows": (masks.causal(), length // 4),
            }
        for name, (mask, rows) in sweep.items():
            q = query[..., length - rows:, :]
            fns = {b: (lambda b=b, mask=mask, q=q: attnkit.attention(q, key, value, mask=mask, backend=b,
                                                                      dropout=args.dropout))
                   for b in ("tiled", "torch")}
            times = median_times(fns, repeats=args.repeats, warmup=2)
            call = make_call(q, key, value, mask=mask, causal=False, scale=None, dropout=args.dropout,
                             generator=None, return_weights=False)
            lo, hi = tiled_plan.row_bounds(call)
            computed = native.computed_fraction(lo, hi, length)
            print(f"| {length} | {name} | {tiled.visited_fraction(call):.2f} | {computed:.2f} "
                  f"| {times['tiled'] * 1e3:.2f} | {times['torch'] * 1e3:.2f} | {times['tiled'] / times['torch']:.2f} "
                  f"| {auto_runs(call)} |", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--length", type=int, default=16384)
    parser.add_argument("--window", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--no-flex", action="store_true", help="skip FlexAttention")
    parser.add_argument("--long", action="store_true", help="L = 131072 with the window: memory check")
    parser.add_argument("--threshold", action="store_true", help="tiled vs fused at short lengths")
    parser.add_argument("--train", action="store_true", help="forward + backward, each mask")
    parser.add_argument("--compile", action="store_true", help="torch.compile(fullgraph=True) vs eager, each mask")
    parser.add_argument("--sweep", type=int, nargs="+", default=[256, 512, 1024, 2048, 4096])
    parser.add_argument("--dropout", type=float, default=0.0, help="with --threshold: dropout on the weights")
    parser.add_argument("--dense-side", action="store_true",
                        help="with --threshold: also masks that keep most pairs (prefix-LM, padding, ...)")
    parser.add_argument("--rounds", type=int, default=3, help="steady times: rounds of fresh processes")
    parser.add_argument("--in-process", action="store_true",
                        help="steady times interleaved in this process instead of a fresh process each")
    parser.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default=None,
                        help="the inputs' dtype (default float32)")
    parser.add_argument("--child", nargs=4, metavar=("CONTENDER", "MASK", "LENGTH", "WINDOW"), help=argparse.SUPPRESS)
    parser.add_argument("--steady", nargs=5, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.dtype:
        os.environ["BENCH_DTYPE"] = args.dtype  # children read it too
    if args.steady:
        contender, mask_name, length, window, repeats = args.steady
        steady_child(contender, mask_name, int(length), int(window), int(repeats))
    elif args.child:
        contender, mask_name, length, window = args.child
        child(contender, mask_name, int(length), int(window))
    elif args.long:
        long_run(args)
    elif args.threshold:
        threshold_sweep(args)
    elif args.train:
        training(args)
    elif args.compile:
        compile_table(args)
    else:
        main_table(args)


if __name__ == "__main__":
    main()
