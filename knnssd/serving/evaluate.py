"""Routing accuracy and overhead on labelled eval prompts."""
from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

from knnssd import prompts
from knnssd.engine.spec.loop import GenerationConfig


@torch.inference_mode()
def routing_accuracy(model_uri: str, data: Path | None = None, per_domain: int | None = None, dtype: str = "auto",
                     max_new_tokens: int = 128, timed: int = 2, tracking_uri: str | None = None) -> dict:
    """Fraction of eval prompts routed to a cluster of their own domain, and routing time as % of the
    time to generate ``max_new_tokens`` (measured on ``timed`` prompts per domain)."""
    from tqdm import tqdm

    from knnssd.engine.spec.request_params import GenerateParams

    from knnssd.serving.routed import RoutedGenerator

    gen = RoutedGenerator.from_model_uri(model_uri, dtype=dtype, tracking_uri=tracking_uri)
    labels = {c.id: c.label for c in gen.bank.clusters}
    domains = tuple(d for d in prompts.DOMAINS if d in set(labels.values())) or prompts.DOMAINS
    rows = prompts.load_domains(data or prompts.default_data_dir(), domains, "eval", per_domain)
    hits: dict[str, list[int]] = {}
    route_s = []
    for r in tqdm(rows, desc="route", file=sys.stderr, mininterval=2):
        ids, _ = gen.tokenize(r.prompt, GenerateParams(max_new_tokens=1))
        with gen.lm.busy:
            *_, route, t = gen.prefill_route(ids, GenerationConfig(max_new_tokens=1))
        route_s.append(time.perf_counter() - t)
        got = labels.get(route.cluster, "unmatched")
        hits.setdefault(r.domain, []).append(got == r.domain)
    gen_s, routed_s = [], []
    for d in domains:
        for r in [x for x in rows if x.domain == d][:timed]:
            res = gen.generate(r.prompt, GenerateParams(max_new_tokens=max_new_tokens))
            gen_s.append(res.latency_s)
            routed_s.append(res.route_s)
    return {
        "prompts": len(rows),
        "accuracy": sum(sum(v) for v in hits.values()) / len(rows),
        "per_domain": {d: sum(v) / len(v) for d, v in hits.items()},
        "route_ms_mean": 1e3 * sum(route_s) / len(route_s),
        "overhead_pct_of_generation": 100 * sum(routed_s) / sum(gen_s) if gen_s else None,
        "generation_s_mean": sum(gen_s) / len(gen_s) if gen_s else None,
        "max_new_tokens": max_new_tokens,
    }
