"""Suffix drafting against n-gram lookup and today's routing, on streams of eval prompts, in one process.

    .venv/bin/python benchmarks/suffix_stream.py --tracking-uri sqlite:///artifacts/mlflow.db \\
        --mixed 20 --repetitive text_to_sql:20 --max-new-tokens 128 [--batched 8]

Two streams, each decoded one prompt after another, greedy: ``--mixed`` eval prompts round robin over the
five domains, and ``--repetitive`` eval prompts of one domain (the same task again and again, as a batch
flow runs it). Each prompt runs every method, the order rotating prompt by prompt:

    plain          own plain decoding, the reference
    ngram          prompt lookup, n = 3, 2, 1, up to 8 tokens, adaptive (bench-engine's)
    ngram-tree     the same drafter's token trees of ``--tree`` nodes (8), verified in one pass each
    suffix         the suffix drafter over the prompt and its own tokens only
    suffix+cache   the same with one cache of the stream's earlier outputs (its own runs' only)
    suffix-tree    the suffix drafter's token trees, as ngram-tree's
    suffix-tree+cache  the same, with a cache of its own (the chain after a cache match where a tree has none)
    routed         the registered bank (``--model-uri``) as ``knnssd generate`` runs it

Prints tokens/s (prefill included) against plain and against routed, mean accepted length (tokens a
full-model pass) and agreement with plain's tokens, per stream, as JSON and as a Markdown table.

``--batched N`` also decodes the repetitive stream as one batch run of N slots (``generate_many``), with
the bank as it is and with every cluster's drafter replaced by plain decoding, n-gram lookup or the
suffix drafter, as chains and as trees of ``--tree`` nodes (a tree bank's sequences draft trees where
the packed pass verifies them: the native layers over a slot pool); the suffix banks' caches are shared
by the run's sequences, as in a batch flow. Tokens/s is the run's tokens over its wall time, best of two
runs in rotating order.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import replace

import torch

from knnssd.bench import options, streams
from knnssd.engine.spec.loop import GenerationConfig, generate, mean_accepted
from knnssd.engine.spec.drafters import DrafterConfig, build, untuned
from knnssd.engine.spec.request_params import GenerateParams
from knnssd.engine.spec.suffix import SuffixCache
from knnssd.serving.routed import RoutedGenerator

METHODS = ("plain", "ngram", "ngram-tree", "suffix", "suffix+cache", "suffix-tree", "suffix-tree+cache", "routed")
DRAFTERS = {kind: untuned(kind) for kind in ("ngram", "suffix")}
BANKS = ("plain", "ngram", "ngram-tree", "suffix", "suffix-tree")  # the batched run's banks besides the routed one


def drafters(tree: int) -> dict[str, DrafterConfig]:
    """The lookup drafters as chains and as trees of ``tree`` nodes, by method name."""
    return {**DRAFTERS, **{f"{kind}-tree": replace(DRAFTERS[kind], tree=tree) for kind in DRAFTERS}}


def stream(gen: RoutedGenerator, texts: list[str], max_new: int, tree: int) -> dict:
    lm = gen.lm
    params = GenerateParams(max_new_tokens=max_new)
    config = GenerationConfig(max_new_tokens=max_new, eos_ids=gen.eos)
    configs = drafters(tree)
    caches = {m: SuffixCache() for m in METHODS if m.endswith("+cache")}
    totals = {m: dict(tokens=0, seconds=0.0, accepted=0, steps=0, equal=0) for m in METHODS}
    for i, text in enumerate(texts):
        ids, _ = gen.tokenize(text, params)
        dec = gen.decoder_for(len(ids) + max_new)  # the form the routed method runs on
        order = METHODS[i % len(METHODS):] + METHODS[: i % len(METHODS)]
        outs = {}
        for m in order:
            t0 = time.perf_counter()
            if m == "routed":
                r = gen.generate(text, params)
                new, st = r.tokens, r.stats
            else:
                drafter = None if m == "plain" else build(configs[m.split("+")[0]], dec.n_layers, dec.can_skip,
                                                          caches.get(m))
                with lm.busy:
                    new, st = generate(dec, ids, drafter, config)
            t = totals[m]
            t["seconds"] += time.perf_counter() - t0
            t["tokens"] += len(new)
            t["accepted"] += sum(st.accepted)
            t["steps"] += st.steps
            outs[m] = list(new)
        for m in METHODS:
            totals[m]["equal"] += outs[m] == outs["plain"]
        print(f"  {i + 1}/{len(texts)}", file=sys.stderr)
    rate = {m: t["tokens"] / t["seconds"] for m, t in totals.items()}
    return {m: dict(tok_s=rate[m], vs_plain=rate[m] / rate["plain"], vs_routed=rate[m] / rate["routed"],
                    mean_accepted=mean_accepted(t["accepted"], t["steps"]), agreement=t["equal"] / len(texts),
                    tokens=t["tokens"]) for m, t in totals.items()}


def batched(gen: RoutedGenerator, texts: list[str], max_new: int, slots: int, tree: int) -> dict:
    """The repetitive stream in one batch run of ``slots`` sequences, per bank (see the module's doc)."""
    params = GenerateParams(max_new_tokens=max_new)
    positions = max(len(gen.tokenize(t, params)[0]) for t in texts) + max_new
    plan = gen.plan(slots, positions)
    configs = {"plain": DrafterConfig(), **{m: drafters(tree)[m] for m in BANKS[1:]}}
    banks = {m: replace(gen.bank, clusters=[replace(c, config=cfg.to_dict()) for c in gen.bank.clusters])
             for m, cfg in configs.items()}
    banks["routed"] = gen.bank
    best: dict[str, dict] = {}
    outs: dict[str, list[list[int]]] = {}
    for rep in range(2):
        order = list(banks)[rep:] + list(banks)[:rep]
        for m in order:
            run = RoutedGenerator(gen.lm, banks[m])  # a new suffix cache: a second run would find its own outputs
            t0 = time.perf_counter()
            res = dict(run.generate_many(enumerate(texts), params, plan))
            wall = time.perf_counter() - t0
            rs = [res[i] for i in range(len(texts))]
            tokens = sum(len(r.tokens) for r in rs)
            accepted, steps = sum(sum(r.stats.accepted) for r in rs), sum(r.stats.steps for r in rs)
            row = dict(tok_s=tokens / wall, mean_accepted=mean_accepted(accepted, steps), tokens=tokens)
            if m not in best or row["tok_s"] > best[m]["tok_s"]:
                best[m] = row
            outs[m] = [r.tokens for r in rs]
    for m, row in best.items():
        row["vs_plain"] = row["tok_s"] / best["plain"]["tok_s"]
        row["vs_routed"] = row["tok_s"] / best["routed"]["tok_s"]
        row["agreement"] = sum(a == b for a, b in zip(outs[m], outs["plain"])) / len(texts)
    return dict(slots=slots, exact=plan.exact, methods=best)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    options.bank(ap)
    streams.add_arguments(ap, mixed=20)
    ap.add_argument("--batched", type=int, default=0, metavar="N", help="also the repetitive stream in N slots")
    ap.add_argument("--tree", type=int, default=8, metavar="N", help="nodes of the suffix-tree methods' trees")
    a = ap.parse_args()
    texts, repeated = streams.from_arguments(ap, a)
    if a.batched < 0 or a.batched == 1:
        ap.error("--batched must be 0 (none) or at least 2 slots")
    if not 1 <= a.tree <= 11:
        ap.error("--tree must be 1 to 11 nodes (the longest pass the exactness probe checks has 12 rows)")
    gen = RoutedGenerator.from_model_uri(a.model_uri, dtype=a.dtype, tracking_uri=a.tracking_uri)
    stream(gen, texts["mixed"][:1], 16, a.tree)  # warm-up: every method once
    report = dict(model=gen.lm.name, dtype=gen.lm.dtype_name, threads=torch.get_num_threads(),
                  max_new_tokens=a.max_new_tokens, bank=a.model_uri, tree=a.tree)
    for name, stream_texts in texts.items():
        print(f"{name}: {len(stream_texts)} prompts", file=sys.stderr)
        report[name] = stream(gen, stream_texts, a.max_new_tokens, a.tree)
    if a.batched:
        print(f"{repeated}, batched: {a.batched} slots", file=sys.stderr)
        report[f"{repeated}, batched"] = batched(gen, texts[repeated], a.max_new_tokens, a.batched, a.tree)
    print(json.dumps(report, indent=1))
    columns = [("tok/s", "tok_s", ".1f"), ("x plain", "vs_plain", ".2f"), ("mean accepted", "mean_accepted", ".2f"),
               ("agreement", "agreement", ".2f")]
    if a.batched:
        b = report[f"{repeated}, batched"]
        print(streams.table(f"{repeated}, one batch run of {b['slots']} slots", "bank's drafters", b["methods"],
                            [*columns[:2], ("x routed", "vs_routed", ".2f"), *columns[2:]]))
    for name in texts:
        print(streams.table(name, "method", report[name], [*columns[:2], ("x routed", "vs_routed", ".2f"),
                                                           *columns[2:]]))


if __name__ == "__main__":
    main()
