"""What the exactness probe costs at a first load, with and without pruning its timing rounds.

Each round builds a fresh decoder over the same loaded model (no record, so every probe measures)
and runs ``exactness.choose`` twice, once timing every candidate for ``TIMING_ROUNDS`` rounds and
once pruning after ``PRUNE_AFTER``, in turns. It prints each probe's seconds and choices: a pruned
candidate ranks after every candidate still timed, so the choices should be the same, and this shows it.

    .venv/bin/python benchmarks/probe_time.py --dtype bfloat16,float32 --rounds 3
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from knnssd import models
from knnssd.bench import markdown as md
from knnssd.bench import options
from knnssd.engine.model import exactness
from knnssd.engine.model.decoder import Decoder
from knnssd.engine.model.packed import forward_slots
from knnssd.engine.model.weights import from_hf


def probe(model, prune: bool) -> tuple[float, str]:
    dec = Decoder(from_hf(model))
    saved = exactness.PRUNE_AFTER
    exactness.PRUNE_AFTER = saved if prune else exactness.TIMING_ROUNDS + 1
    try:
        t = time.perf_counter()
        result = exactness.choose(dec, packed=forward_slots)
        return time.perf_counter() - t, result.step
    finally:
        exactness.PRUNE_AFTER = saved


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    options.model(ap)
    options.dtypes(ap, ("bfloat16", "float32"))
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args(argv)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    print("\n".join(md.head(["dtype", "every round, s", "pruned, s", "pruned / every", "choices"], "lrrrl")))
    for dtype in args.dtype:
        model = models.load(args.model, dtype).model
        secs: dict[bool, list[float]] = {False: [], True: []}
        chosen: dict[bool, set[str]] = {False: set(), True: set()}
        for _ in range(args.rounds):
            for prune in (False, True):
                s, step = probe(model, prune)
                secs[prune].append(s)
                chosen[prune].add(step)
        every, pruned = statistics.median(secs[False]), statistics.median(secs[True])
        print(md.row([dtype, f"{every:.2f}", f"{pruned:.2f}", f"{pruned / every:.2f}",
                      f"every: {', '.join(sorted(chosen[False]))}; pruned: {', '.join(sorted(chosen[True]))}"]))


if __name__ == "__main__":
    main()
