"""Timing helpers shared by the benchmark scripts: interleaved repeats, medians, the machine's
matmul rate and its FMA peak."""

from __future__ import annotations

import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch


def native_library_loaded() -> str:
    """The native CPU library this process loaded ("" for none, or where attnkit is not imported).
    A benchmark's child reports it with its times, and the parent counts those times only where it
    is the library the parent loads: each library is keyed by a digest of the kernel's sources, so
    a child started after an edit of them finds none built and runs PyTorch's kernels."""
    if "attnkit" not in sys.modules:
        return ""
    from attnkit._backends import native

    return str(native.loaded_from() or "")


def median_times(fns: dict[str, Callable[[], object]], repeats: int, warmup: int = 1) -> dict[str, float]:
    """Median wall time (s) of each function, measured round-robin so that drift in machine
    load hits every contender alike. The order is reversed every other round: whoever runs
    right after another contender inherits its memory state (freed pages, caches), and that
    must not always favour the same one."""
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    samples: dict[str, list[float]] = {name: [] for name in fns}
    items = list(fns.items())
    for round_ in range(repeats):
        for name, fn in (items if round_ % 2 == 0 else items[::-1]):
            start = time.perf_counter()
            fn()
            samples[name].append(time.perf_counter() - start)
    return {name: statistics.median(ts) for name, ts in samples.items()}


def cuda_median(fn: Callable[[], object], repeats: int) -> float:
    """Median seconds of ``repeats`` calls of ``fn`` on the current CUDA stream (CUDA events)."""
    times = []
    for _ in range(repeats):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        stop.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(stop) / 1000)
    return statistics.median(times)


def square_matmul(dtype: torch.dtype = torch.float32) -> tuple[float, Callable[[], object]]:
    """Flops and a callable of a 2048^3 matrix product in ``dtype``: PyTorch's own matmul rate on
    this machine. In fp32, near the cores' FMA peak where the BLAS uses their widest vectors (MKL on
    Intel and on AMD Zen 4: 85-100%), far below it where it does not (MKL on AMD Zen 5: 40%, and
    attention kernels then beat it): :func:`fma_peak` says which. In bf16, what the CPU's
    half-precision units give (AMX, AVX512-BF16) or a conversion path's rate where it has none: on
    an AVX2 CPU without them about 1 GFLOP/s (0.2 s at 512^3, 2.5 s at 1024^3, a minute at 2048^3),
    so half precision times a 512^3 product, whose rate is within a few per cent of 1024^3's there."""
    size = 2048 if dtype == torch.float32 else 512
    a, b = torch.randn(size, size, dtype=dtype), torch.randn(size, size, dtype=dtype)
    return 2 * size**3, (lambda: a @ b)


def fma_peak(threads: int) -> tuple[float | None, str]:
    """``(GFLOP/s, how)``: the cores' float32 FMA peak on ``threads`` threads, measured by
    ``fma_peak.c`` (built here with the system C compiler for this CPU, ``-march=native``), or
    ``(None, why not)`` where it cannot be built or run."""
    compiler = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
    if compiler is None:
        return None, "no C compiler"
    source = Path(__file__).with_name("fma_peak.c")
    with tempfile.TemporaryDirectory() as folder:
        program = Path(folder) / "fma_peak"
        built = subprocess.run([compiler, "-O2", "-march=native", "-fopenmp", str(source), "-o", str(program)],
                               capture_output=True, text=True)
        if built.returncode != 0:
            return None, f"fma_peak.c did not build: {(built.stderr.strip().splitlines() or ['?'])[-1]}"
        ran = subprocess.run([str(program), "1.0"], capture_output=True, text=True,
                             env={**os.environ, "OMP_NUM_THREADS": str(threads)})
    if ran.returncode != 0:
        return None, f"fma_peak exited with {ran.returncode}"
    gflops, _, lanes, _ = ran.stdout.split()
    return float(gflops), f"benchmarks/fma_peak.c, {threads} threads, {lanes}-lane FMA, best of 7 one-second runs"


def reliable_peak(peak: float | None, how: str, matmul_rates: list[float]) -> tuple[float | None, str]:
    """The FMA peak where no matmul of the same run exceeded it; else ``(None, why)``: a peak some
    product beats is no peak, and shares of it would flatter every kernel."""
    if peak is None:
        return None, how
    fastest = max(matmul_rates, default=0.0)
    if fastest > peak:
        return None, (f"could not be measured: fma_peak.c read {peak:.0f} GFLOP/s ({how}) and a matmul of the "
                      f"same run reached {fastest:.0f}")
    return peak, how


def describe_machine(device: torch.device | str = "cpu") -> str:
    device = torch.device(device)
    if device.type == "cuda":
        return f"torch {torch.__version__}, device {torch.cuda.get_device_name(device)}"
    return f"torch {torch.__version__}, {torch.get_num_threads()} threads, device cpu"
