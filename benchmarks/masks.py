"""Structured masks: attention(backend="auto") vs dense-mask SDPA vs compiled FlexAttention.

One run, B=1, H=8, D=64, fp32, L=16384 by default, three masks: a causal sliding window of 512,
8 packed documents (bidirectional within each, uneven lengths), causal + padding (the last
quarter of the keys is padding). For each contender it prints:

- steady-state time: median of interleaved repeats in this process (benchmarks/common.py);
  ours also with attnkit's native kernel turned off (the tiled forward on PyTorch's kernel),
  where the native kernel is built (`make native`);
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
  next to a square fp32 matmul timed in the same run and to the cores' FMA peak (fma_peak.c,
  built here: whether the matmul is near the peak depends on the CPU and the BLAS).

    python benchmarks/masks.py                 # the README table (several minutes)
    python benchmarks/masks.py --long          # L = 131072, window 512: ours only, memory check
    python benchmarks/masks.py --threshold     # tiled vs the fused dense path at short lengths
    python benchmarks/masks.py --train         # forward + backward, each mask
    python benchmarks/masks.py --compile       # torch.compile(fullgraph=True) vs eager, each mask
"""

from __future__ import annotations

import argparse
import functools
import json
import os
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
from common import describe_machine, fma_peak, median_times, square_matmul  # noqa: E402

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


def inputs(length: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return tuple(torch.randn(1, HEADS, length, HEAD_DIM, generator=g) for _ in range(3))


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
    query, key, value = (t.requires_grad_(train) for t in inputs(length))
    structured, mask_mod = mask_set(length, window)[mask_name]
    if train:
        forward = (lambda: attnkit.attention(query, key, value, mask=structured)) if contender == "ours" else (
            lambda: F.scaled_dot_product_attention(query, key, value, attn_mask=structured.dense(length, length)))

        grad_out = torch.randn(query.shape)

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
    print(json.dumps({"seconds": seconds, "extra_bytes": extra, "finite": bool(torch.isfinite(output).all())}))


def measure_first_call(contender: str, mask_name: str, length: int, window: int) -> dict:
    env = dict(os.environ, BENCH_THREADS=str(torch.get_num_threads()))
    with tempfile.TemporaryDirectory() as cache:
        env["TORCHINDUCTOR_CACHE_DIR"] = cache  # a cold compile, as a user's first run
        result = subprocess.run(
            [sys.executable, __file__, "--child", contender, mask_name, str(length), str(window)],
            capture_output=True, text=True, env=env, check=False,
        )
    if result.returncode != 0:
        return {"error": (result.stderr.strip().splitlines() or ["failed"])[-1]}
    return json.loads(result.stdout.strip().splitlines()[-1])


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
    query, key, value = inputs(length)
    flops, matmul = square_matmul()
    print(f"# Structured masks, B=1, H={HEADS}, D={HEAD_DIM}, fp32, L={length}  ({describe_machine()})")
    print(f"# steady: median of {args.repeats} interleaved runs; first call and extra peak memory: fresh process each")
    kernel = "attnkit's native kernel" if native.available() else f"PyTorch's fused kernel ({native.why_unavailable()})"
    print(f"# tiled forward runs {kernel}\n")
    rows = []
    for name, (structured, mask_mod) in mask_set(length, window).items():
        dense = structured.dense(length, length)
        contenders = {
            "ours": lambda: attnkit.attention(query, key, value, mask=structured),
            "sdpa": lambda: F.scaled_dot_product_attention(query, key, value, attn_mask=dense),
            "matmul": matmul,
        }
        if native.available():  # the same call with the tiled forward on PyTorch's fused kernel
            contenders["ours-fused"] = lambda: _without_native(query, key, value, structured)
        flex, flex_error = (None, "skipped (--no-flex)") if args.no_flex else flex_contender(
            mask_mod, query, key, value)
        if flex is not None:
            contenders["flex"] = flex
        ours_out = contenders["ours"]()  # the three compute the same thing: say how closely
        errors = {"sdpa": (ours_out - contenders["sdpa"]()).abs().max().item()}
        if flex is not None:
            errors["flex"] = (ours_out - contenders["flex"]()).abs().max().item()
        del ours_out
        times = median_times(contenders, repeats=args.repeats)
        contenders = dense = None  # free the L x L mask before the fresh-process measurements
        first = {c: measure_first_call(c, name, length, window) for c in ("ours", "sdpa", "flex")
                 if c != "flex" or flex is not None}
        pairs = attended_pairs(structured, length)
        useful = 4 * HEAD_DIM * pairs * HEADS / times["ours"] / 1e9
        peak = flops / times["matmul"] / 1e9
        rows.append((name, pairs / length**2, times, first, useful, peak, errors, flex_error))
    _print_tables(rows)


def _without_native(query, key, value, structured, dropout=0.0):
    with native.turned_off():
        return attnkit.attention(query, key, value, mask=structured, dropout=dropout)


def _fmt_ms(seconds: float | None) -> str:
    return "n/a" if seconds is None else f"{seconds * 1e3:,.0f}"


def _fmt_mib(result: dict) -> str:
    return result.get("error", "n/a") if "extra_bytes" not in result else f"{result['extra_bytes'] / MIB:,.0f}"


def _print_tables(rows: list) -> None:
    print("| mask | attended | ours (ms) | ours, PyTorch kernel (ms) | SDPA dense mask (ms) | SDPA / ours "
          "| Flex compiled (ms) | ours / Flex | ours first call (ms) | first / steady | Flex first call (s) |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for name, share, t, first, useful, peak, errors, flex_error in rows:
        flex, ours = t.get("flex"), t["ours"]
        ours_first = first["ours"].get("seconds")
        flex_first = first.get("flex", {}).get("seconds")
        versus_flex = "n/a" if flex is None else f"{ours / flex:.2f}"
        first_ratio = "n/a" if ours_first is None else f"{ours_first / ours:.2f}"
        flex_first_s = "n/a" if flex_first is None else f"{flex_first:.1f}"
        print(f"| {name} | {share:.1%} | {_fmt_ms(ours)} | {_fmt_ms(t.get('ours-fused'))} | {_fmt_ms(t['sdpa'])} "
              f"| {t['sdpa'] / ours:.1f}x "
              f"| {_fmt_ms(flex)} | {versus_flex} | {_fmt_ms(ours_first)} | {first_ratio} | {flex_first_s} |")
    print("\n| mask | extra peak memory: ours (MiB) | SDPA dense mask (MiB) | Flex (MiB) | ours / SDPA "
          "| ours useful GFLOP/s | matmul GFLOP/s | ours / matmul | ours / FMA peak | max abs diff vs SDPA, Flex |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---|")
    fma, _ = machine_peak()
    for name, share, t, first, useful, peak, errors, flex_error in rows:
        ours_mem, sdpa_mem = first["ours"].get("extra_bytes"), first["sdpa"].get("extra_bytes")
        ratio = "n/a" if not (ours_mem and sdpa_mem) else f"{ours_mem / sdpa_mem:.1%}"
        diffs = ", ".join(f"{errors[c]:.1e}" for c in ("sdpa", "flex") if c in errors)
        print(f"| {name} | {_fmt_mib(first['ours'])} | {_fmt_mib(first['sdpa'])} | "
              f"{_fmt_mib(first.get('flex', {})) if 'flex' in first else 'n/a'} | {ratio} "
              f"| {useful:.0f} | {peak:.0f} | {useful / peak:.0%} | {share_of_peak(useful, fma)} | {diffs} |")
    print(peak_note([row[5] for row in rows]))
    for row in rows:
        if row[-1]:
            print(f"\nFlexAttention ({row[0]}): {row[-1]}")
    print("\nGoals (issue 4): SDPA / ours >= 10x with ours / SDPA memory <= 5%; ours / Flex <= 1.0; "
          "first / steady <= 1.5; ours / matmul >= 60% at L >= 8192. (Issue 11): ours / matmul >= 85%.")


@functools.cache
def machine_peak() -> tuple[float | None, str]:
    """The cores' FMA peak for this run's threads (see common.fma_peak), measured once, on first use."""
    return fma_peak(torch.get_num_threads())


def share_of_peak(gflops: float, fma: float | None) -> str:
    """``gflops`` as a share of the FMA peak ``fma``, or n/a where it was not measured."""
    return "n/a" if fma is None else f"{gflops / fma:.0%}"


def peak_note(matmul_rates: list[float]) -> str:
    """One line: the FMA peak, and the share of it the run's matmul reached."""
    fma, how = machine_peak()
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
    it: no loss computed around the attention) for each mask: steady time of ours, ours
    on PyTorch's kernel and dense-mask SDPA (interleaved, in this process), useful GFLOP/s against
    a matmul; then first call and extra peak memory of ours and SDPA with the window, fresh
    process each."""
    length, window = args.length, args.window
    print(f"# forward + backward, B=1, H={HEADS}, D={HEAD_DIM}, fp32, L={length} ({describe_machine()})")
    print(f"# output.backward(fixed gradient) after each forward; steady: median of {args.repeats} interleaved runs; "
          "FlexAttention has no CPU backward in this torch\n")
    query, key, value = (t.requires_grad_() for t in inputs(length))
    grad_out = torch.randn(query.shape, generator=torch.Generator().manual_seed(1))
    flops, matmul = square_matmul()

    def step(forward):
        def run():
            forward().backward(grad_out)
            query.grad = key.grad = value.grad = None
        return run

    print("| mask | ours (ms) | ours, PyTorch kernel (ms) | SDPA dense mask (ms) | SDPA / ours | ours useful GFLOP/s "
          "| matmul GFLOP/s | ours / matmul | ours / FMA peak |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    fma, _ = machine_peak()
    matmul_rates = []
    for name, (structured, _) in mask_set(length, window).items():
        dense = structured.dense(length, length)
        contenders = {
            "ours": step(lambda: attnkit.attention(query, key, value, mask=structured)),
            "sdpa": step(lambda: F.scaled_dot_product_attention(query, key, value, attn_mask=dense)),
            "matmul": matmul,
        }
        if native.available():
            contenders["ours-fused"] = step(lambda: _without_native(query, key, value, structured))
        times = median_times(contenders, repeats=args.repeats)
        dense = contenders = None
        # FlashAttention's count: the backward does 2.5x the forward's two products (it recomputes the scores)
        useful = 3.5 * 4 * HEAD_DIM * attended_pairs(structured, length) * HEADS / times["ours"] / 1e9
        peak = flops / times["matmul"] / 1e9
        matmul_rates.append(peak)
        print(f"| {name} | {_fmt_ms(times['ours'])} | {_fmt_ms(times.get('ours-fused'))} | {_fmt_ms(times['sdpa'])} "
              f"| {times['sdpa'] / times['ours']:.1f}x | {useful:.0f} | {peak:.0f} | {useful / peak:.0%} "
              f"| {share_of_peak(useful, fma)} |", flush=True)

    # Dropout on the weights (SDPA would run its math path: 8 x L^2 weights, 8 GiB at 16384)
    structured, _ = mask_set(length, window)[f"sliding window {window}"]
    contenders = {"ours": step(lambda: attnkit.attention(query, key, value, mask=structured, dropout=0.1))}
    if native.available():
        contenders["ours-fused"] = step(lambda: _without_native(query, key, value, structured, dropout=0.1))
    times = median_times(contenders, repeats=args.repeats)
    print(f"| sliding window {window}, dropout 0.1 | {_fmt_ms(times['ours'])} | {_fmt_ms(times.get('ours-fused'))} "
          "| n/a | | | | | |", flush=True)
    print(peak_note(matmul_rates))
    print("Goal (issue 11): ours / matmul >= 75%.")

    name = f"sliding window {window}"
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
    parser.add_argument("--child", nargs=4, metavar=("CONTENDER", "MASK", "LENGTH", "WINDOW"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
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
