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


def read_bandwidth(device: torch.device | str = "cpu", mib: int = 256, dtype: torch.dtype = torch.float32,
                   repeats: int = 10) -> float:
    """Bytes per second of a sum over ``mib`` MiB of ``dtype`` on ``device``: the best of ``repeats`` sums after
    one, each timed to the device's end. Decoding reads every weight once a token, so weight bytes over this
    bound its tokens per second."""
    x = torch.ones(mib * 2**20 // dtype.itemsize, dtype=dtype, device=device)
    best = min(median_ms(lambda: x.sum(), device, repeats=1, warmup=1 if i == 0 else 0) for i in range(repeats))
    return x.nbytes / (best / 1e3)


def pass_timer(dec, context: int, max_t: int, repeats: int = 5) -> Callable[..., float]:
    """Fill ``dec``'s cache with ``context`` random tokens and return ``ms(t, mask=None, stack=None)``:
    the median milliseconds of a ``t``-token pass after them (``t`` = 1 keeps only the last logits,
    as a plain step does). The one setup behind the search's and the engine bench's step costs."""
    device = dec.device
    vocab = dec.stack.embed.shape[0]
    ids = torch.randint(0, vocab, (context + max_t,), generator=torch.Generator().manual_seed(0)).to(device)
    dec.reserve(context + max_t)
    dec.forward(ids[:context], 0)

    def ms(t: int, mask=None, stack=None) -> float:
        return median_ms(lambda: dec.forward(ids[context : context + t], context, mask, stack, t == 1), device, repeats)

    return ms
