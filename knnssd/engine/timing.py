"""Wall-clock timing that waits for the device: a CUDA call returns at launch, not at the end."""
from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch


def sync(device: torch.device | str) -> None:
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median_ms(fn: Callable[[], object], device: torch.device | str, repeats: int = 5, warmup: int = 1) -> float:
    """Median milliseconds of ``fn()`` over ``repeats`` runs after ``warmup`` runs, each timed to the device's end."""
    for _ in range(warmup):
        fn()
    sync(device)
    ts = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        sync(device)
        ts.append(time.perf_counter() - t)
    return statistics.median(ts) * 1e3
