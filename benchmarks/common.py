"""Timing helpers shared by the benchmark scripts: interleaved repeats, medians."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch


def median_times(fns: dict[str, Callable[[], object]], repeats: int, warmup: int = 1) -> dict[str, float]:
    """Median wall time (s) of each function, measured round-robin so that drift in machine
    load hits every contender alike."""
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    samples: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            samples[name].append(time.perf_counter() - start)
    return {name: statistics.median(ts) for name, ts in samples.items()}


def describe_machine() -> str:
    return f"torch {torch.__version__}, {torch.get_num_threads()} threads, device cpu"
