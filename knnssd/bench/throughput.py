"""``knnssd bench-throughput``: tokens per second of whole batches, side by side in one process.

Settings, each over the same prompts (mixed eval prompts of every domain, round-robin), one model,
one decoder, one dtype and thread count (``knnssd bench --throughput N`` adds the same table to its
report, over its own loaded model and its domains):

- ``routed b=1``: today's routed decoding, one prompt after another;
- ``plain b=N``: N sequences decoded together with no drafter (``engine.batch.scheduler``);
- ``routed b=N``: N sequences together, each with its routed cluster's drafter, draft lengths from
  goodput;
- ``routed auto``: the batch size ``--batch-size auto`` picks;
- where ``llama-cpp-python`` is installed (the ``peers`` extra) and the model came from a GGUF file,
  ``llama.cpp b=1`` and ``llama.cpp b=1 lookup``: the peer a CPU user would pick instead, on that file
  (``peers``), one prompt after another, without and with prompt-lookup decoding.

Terms: *throughput* = all generated tokens / the setting's wall-clock seconds (prefills included);
*latency* = one request's seconds from its prefill to its last token (p50, p95 over the prompts;
waiting for a free slot is not counted); *prefill s* = the seconds its prefills took, one after
another or between the steps; *reused* = prompt positions whose K/V a batched run copied from another
prompt in the batch, or from one that finished in a slot still free (``prefixes.Prefixes``), instead of
computing them; *same* = the fraction of prompts whose tokens equal ``routed b=1``'s (greedy output is
exact, so 1.0 wherever the packed passes are exact; llama.cpp multiplies the quantized blocks instead,
so its fraction is lower).
The settings run in turn, in the order listed; ``--repeats`` runs the whole list again and keeps
each setting's best throughput.
"""
from __future__ import annotations

import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from knnssd import models, prompts
from knnssd.bench import markdown as md
from knnssd.bench import peers
from knnssd.engine.batch import plan as batch_plan
from knnssd.engine.batch.scheduler import BatchStats, PromptJob, decode_batch
from knnssd.engine.spec.loop import GenerationConfig
from knnssd.engine.spec.request_params import GenerateParams

SIZES = (4, 8, 16)


@dataclass
class ThroughputBench:
    bank: str  # model URI or bank folder
    dtype: str = "auto"
    device: str = "auto"
    data: Path = field(default_factory=prompts.default_data_dir)
    domains: tuple[str, ...] = prompts.DOMAINS
    prompts: int = 64
    max_new_tokens: int = 128
    sizes: tuple[int, ...] = SIZES
    repeats: int = 1
    tracking_uri: str | None = None


def mixed_prompts(data: Path, n: int, domains: tuple[str, ...] = prompts.DOMAINS) -> list[prompts.Prompt]:
    """n eval prompts, round-robin over ``domains`` (never calib rows)."""
    per = prompts.load_domains(data, domains, "eval", None)
    by: dict[str, list[prompts.Prompt]] = {}
    for r in per:
        by.setdefault(r.domain, []).append(r)
    out, i = [], 0
    while len(out) < n and any(i < len(v) for v in by.values()):
        out += [v[i] for v in by.values() if i < len(v)]
        i += 1
    if len(out) < n:
        raise ValueError(f"{data} holds {len(out)} eval prompts; {n} asked")
    return out[:n]


def _row(name: str, slots: int, results: list[tuple[list[int], float]], wall: float, stats: BatchStats | None,
         ref: list[list[int]] | None, prefill_s: float | None = 0.0) -> dict:
    """``prefill_s``: the prefills' seconds of a one-at-a-time setting (a batched one's are in ``stats``;
    None: not measured, a peer's)."""
    tokens = sum(len(t) for t, _ in results)
    lat = sorted(s for _, s in results)
    row = {"setting": name, "batch_size": slots, "tokens": tokens, "seconds": wall, "tokens_per_s": tokens / wall,
           "latency_p50_s": statistics.median(lat), "latency_p95_s": lat[min(len(lat) - 1, int(0.95 * len(lat)))],
           "same_as_b1": (sum(t == r for (t, _), r in zip(results, ref)) / len(ref)) if ref else 1.0,
           "prefill_s": prefill_s}
    if stats is not None:
        s = stats.summary()
        row.update(rows_per_step=s["rows_per_step"], draft_per_step=s["draft_per_step"], exact=s["exact"],
                   prefill_s=s["prefill_s"], reused=s["reused"])
    return row


def check(cfg: ThroughputBench) -> list[prompts.Prompt]:
    """The prompts, or a one-line error for settings that cannot run: before any model loads."""
    if cfg.prompts < 1 or cfg.max_new_tokens < 1 or cfg.repeats < 1:
        raise ValueError(f"throughput: prompts ({cfg.prompts}), max_new_tokens ({cfg.max_new_tokens}) and repeats "
                         f"({cfg.repeats}) must be >= 1")
    if not cfg.sizes or any(n < 2 for n in cfg.sizes):
        raise ValueError(f"batch sizes must be one or more, each >= 2 (routed b=1 is always measured), got {cfg.sizes}")
    return mixed_prompts(cfg.data, cfg.prompts, cfg.domains)


def run(cfg: ThroughputBench, log=lambda msg: print(msg, file=sys.stderr)) -> dict:
    from knnssd.serving.routed import RoutedGenerator

    check(cfg)
    gen = RoutedGenerator.from_model_uri(cfg.bank, dtype=cfg.dtype, device=cfg.device, tracking_uri=cfg.tracking_uri)
    return measure(gen, cfg, log)


MEASURED = ("data", "domains", "prompts", "max_new_tokens", "sizes", "repeats")  # what ``measure`` reads of a cfg


def measure(gen, cfg: ThroughputBench, log=lambda msg: print(msg, file=sys.stderr)) -> dict:
    """The table over ``gen`` (a ``RoutedGenerator``; of ``cfg``, only the fields in ``MEASURED`` are read)."""
    rows = check(cfg)
    dec = gen.decoder
    if not gen.can_batch:
        raise ValueError("this model runs on the plain HF fallback, which decodes one sequence at a time")
    params = GenerateParams(max_new_tokens=cfg.max_new_tokens)
    ids = [gen.tokenize(r.prompt, params)[0] for r in rows]
    positions = max(len(x) for x in ids) + cfg.max_new_tokens
    gguf = models.gguf_file(gen.lm.name) if peers.available() else None
    auto = batch_plan.auto_slots(dec, positions, len(rows))
    # largest first: where static slots are planned, the smaller sizes reuse the largest's
    plans = {n: gen.plan(n, positions) for n in sorted({*cfg.sizes, auto}, reverse=True) if n > 1}
    best: dict[str, dict] = {}
    ref: list[list[int]] | None = None

    def keep(row: dict) -> None:
        if row["setting"] not in best or row["tokens_per_s"] > best[row["setting"]]["tokens_per_s"]:
            best[row["setting"]] = row
        log(f"{row['setting']:>14}: {row['tokens_per_s']:7.1f} tok/s, p50 {row['latency_p50_s']:.2f} s")

    for rep in range(cfg.repeats):
        t0 = time.perf_counter()
        one = [gen.generate(r.prompt, params) for r in rows]
        ref = [r.tokens for r in one]
        keep(_row("routed b=1", 1, [(r.tokens, r.stats.total_s) for r in one], time.perf_counter() - t0, None, None,
                  sum(r.stats.prefill_s for r in one)))
        for name, lookup in (("llama.cpp b=1", False), ("llama.cpp b=1 lookup", True)) if gguf else ():
            res = peers.generate(gguf, ids, cfg.max_new_tokens, gen.eos, torch.get_num_threads(), lookup)
            keep(_row(name, 1, res, sum(s for _, s in res), None, ref, None))
        cfg_g = GenerationConfig(max_new_tokens=cfg.max_new_tokens, eos_ids=gen.eos)
        for n in cfg.sizes:
            stats = BatchStats(n)
            jobs = [PromptJob(x, None, cfg_g) for x in ids]
            t0 = time.perf_counter()
            done = {id(f.job): f for f in decode_batch(dec, jobs, plans[n], stats)}
            wall = time.perf_counter() - t0
            keep(_row(f"plain b={n}", n, [(done[id(j)].tokens, done[id(j)].stats.total_s) for j in jobs], wall, stats,
                      None))
        for name, n in [*((f"routed b={n}", n) for n in cfg.sizes), ("routed auto", auto)]:
            stats = BatchStats(n)
            t0 = time.perf_counter()
            if n == 1:
                res = {i: gen.generate(r.prompt, params) for i, r in enumerate(rows)}
            else:
                res = dict(gen.generate_many(enumerate(r.prompt for r in rows), params, plans[n], stats))
            wall = time.perf_counter() - t0
            keep(_row(name, n, [(res[i].tokens, res[i].stats.total_s) for i in range(len(rows))], wall,
                      stats if n > 1 else None, ref, sum(r.stats.prefill_s for r in res.values())))
    b1 = best["routed b=1"]["tokens_per_s"]
    table = [{**r, "vs_routed_b1": r["tokens_per_s"] / b1} for r in best.values()]
    fixed = max(r["tokens_per_s"] for r in table if r["setting"].startswith("routed b=") and r["batch_size"] > 1)
    return {"model": gen.lm.name, "dtype": gen.lm.dtype_name, "prompts": len(rows), "max_new_tokens": cfg.max_new_tokens,
            "auto_batch_size": auto, "exactness": dec.exactness.to_dict() if dec.exactness else None,
            # where the static step runs: its probe (routed b=1) and the batch sizes that ran on static slots
            "static_exactness": gen.static.exactness.to_dict() if gen.static is not None else None,
            "static_slots": sorted(n for n, p in plans.items() if p.decodes_on is not None),
            "table": table, "auto_vs_best_fixed": best["routed auto"]["tokens_per_s"] / fixed}


def markdown(rep: dict) -> str:
    lines = [f"{rep['model']} {rep['dtype']}, {rep['prompts']} mixed eval prompts x {rep['max_new_tokens']} tokens; "
             f"auto picked {rep['auto_batch_size']} slots", "",
             *md.head(["setting", "tok/s", "vs routed b=1", "p50 s", "p95 s", "rows/step", "draft/step", "prefill s",
                       "reused", "same as b=1"])]
    for r in rep["table"]:
        own = r["prefill_s"] is not None  # knnssd's, not a peer's
        steps = [f"{r.get('rows_per_step', 1.0):.1f}", f"{r.get('draft_per_step', 0.0):.1f}", f"{r['prefill_s']:.1f}",
                 r.get("reused", 0)] if own else ["-"] * 4
        lines.append(md.row([r["setting"], f"{r['tokens_per_s']:.1f}", f"{r['vs_routed_b1']:.2f}x",
                             f"{r['latency_p50_s']:.2f}", f"{r['latency_p95_s']:.2f}", *steps, f"{r['same_as_b1']:.2f}"]))
    lines.append(f"\nauto / best fixed batch size: {rep['auto_vs_best_fixed']:.2f}")
    return "\n".join(lines)
