"""Timing helpers shared by the benchmark scripts: interleaved repeats, medians."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch


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


def square_matmul() -> tuple[float, Callable[[], object]]:
    """Flops and a callable of a 2048^3 fp32 matrix product: the machine's practical peak, the rate
    no attention kernel's two products can beat."""
    a, b = torch.randn(2048, 2048), torch.randn(2048, 2048)
    return 2 * 2048**3, (lambda: a @ b)


def describe_machine(device: torch.device | str = "cpu") -> str:
    device = torch.device(device)
    if device.type == "cuda":
        return f"torch {torch.__version__}, device {torch.cuda.get_device_name(device)}"
    return f"torch {torch.__version__}, {torch.get_num_threads()} threads, device cpu"
