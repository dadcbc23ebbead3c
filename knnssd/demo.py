"""The main job (`make demo`): calibrate a small bank on the bundled prompts, register it, then
generate a mixed stream with routed drafting next to plain decoding and the fixed drafters (n-gram and
suffix lookup, untuned: what routing must beat), and print what happened."""
from __future__ import annotations

import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from knnssd import prompts


@dataclass
class DemoConfig:
    model: str = "smollm2"
    dtype: str = "auto"
    device: str = "auto"
    trials: int = 6
    candidates: int = 2
    max_new_tokens: int = 64
    seed: int = 0
    # a cluster's search stops taking new candidates after this (--minutes), but for the fixed drafters: the
    # demo's searches took 5-20 s a cluster on a 2-core Zen 5 and 46 s on an AVX2-only Zen 3, which put its run
    # past 4 minutes there
    search_s: float = 15.0


def say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def calibrate_params(cfg: DemoConfig):
    """The demo's calibration, on the bundled prompts; made (and so checked) before any server starts."""
    from knnssd.flows.calibrate import CalibrateParams

    files = sorted(prompts.samples_dir().glob("*.jsonl"))
    return CalibrateParams(model=cfg.model, dtype=cfg.dtype, device=cfg.device, inputs=[str(f) for f in files],
                           k_per_domain=2, proxy_trials=cfg.trials, real_candidates=cfg.candidates, proxy_prompts=4,
                           real_prompts=2, max_new_tokens=cfg.max_new_tokens, seed=cfg.seed, minutes=cfg.search_s / 60)


def run(cfg: DemoConfig) -> dict:
    """Calibrate a bank, race it on a mixed stream, print the results (the three steps it says as it goes);
    returns the registered version and the speedups it printed."""
    from knnssd.engine.spec.drafters import FIXED
    from knnssd.serving.routed import RoutedGenerator

    t0 = time.time()
    reg, domains = calibrate_bank(cfg)
    t1 = time.time()
    say(f"      registered {reg['name']} version {reg['version']} (aliases: {', '.join(reg['aliases'])}) in {t1 - t0:.0f} s")

    say("[2/3] generating a mixed stream: routed speculative decoding vs plain decoding and the fixed drafters "
        f"({', '.join(FIXED)}), prompt by prompt ...")
    gen = RoutedGenerator.from_model_uri(reg["uri"], dtype=cfg.dtype, device=cfg.device)
    rows = prompts.load_domains(prompts.samples_dir(), tuple(domains), "eval", None)
    random.Random(cfg.seed).shuffle(rows)
    per, fixed_s = race(gen, rows, cfg.max_new_tokens)
    t2 = time.time()

    say("[3/3] results")
    ar_total, spec_total = sum(d["ar_s"] for d in per.values()), sum(d["spec_s"] for d in per.values())
    total = ar_total / spec_total
    best = min(fixed_s, key=fixed_s.get)
    lines = [*domain_lines(gen, per, domains), f"{'all':<14} {'':<22} {'':<44} {total:>7.2f}x"]
    lines.append("\nfixed drafters on the same stream: " + ", ".join(f"{k} {ar_total / s:.2f}x" for k, s in fixed_s.items())
                 + f"; routed / best fixed ({best}): {fixed_s[best] / spec_total:.2f}")
    print("\n".join(lines))
    print(f"\n{cfg.model} · {gen.lm.dtype_name} · {len(rows)} eval prompts x {cfg.max_new_tokens} tokens · "
          f"calibration {t1 - t0:.0f} s, stream {t2 - t1:.0f} s")
    ex = gen.decoder.exactness
    if ex is not None:
        print(f"verify pass: {ex.describe()}" + ("" if ex.exact else f" — {ex.note}"))
    print("Browse the bank (masks, speedups, pictures) in the MLflow UI:  .venv/bin/knnssd ui   "
          "then open http://127.0.0.1:5000")
    return {"registered": reg, "per_domain": per, "speedup": total,
            "fixed": {k: ar_total / s for k, s in fixed_s.items()},
            "routed_over_best_fixed": fixed_s[best] / spec_total}


def calibrate_bank(cfg: DemoConfig) -> tuple[dict, list[str]]:
    """Step 1: calibrate and register the demo's bank (``calibrate_params``); its registered version and the
    domains it was calibrated on."""
    from knnssd.flows.calibrate import calibrate

    params = calibrate_params(cfg)
    domains = [Path(f).stem for f in params.inputs]
    say(f"[1/3] calibrating a small skip bank for {cfg.model} on {len(domains)} domains of bundled prompts "
        f"({', '.join(domains)}) ...")
    return calibrate(params), domains


def race(gen, rows: list, max_new_tokens: int) -> tuple[dict[str, dict], dict[str, float]]:
    """Step 2: each row generated routed (``gen``), plainly and by each fixed drafter, in an order rotated row
    by row so that none always runs on a warmer cache. Returns each domain's tallies (``tally``) and each
    fixed drafter's seconds."""
    from knnssd.engine.spec.drafters import FIXED, fixed_drafters
    from knnssd.engine.spec.loop import GenerationConfig, decode, prefill
    from knnssd.engine.spec.request_params import GenerateParams

    p = GenerateParams(max_new_tokens=max_new_tokens)
    g = GenerationConfig(max_new_tokens=p.max_new_tokens, eos_ids=gen.eos)
    fixed = fixed_drafters(gen.decoder.n_layers, gen.decoder.can_skip)

    def timed_run(text, drafter=None):  # plain decoding, or a fixed drafter's
        ts = time.perf_counter()
        ids = gen.tokenize(text, p)[0]
        seq, logits, _ = prefill(gen.decoder_for(len(ids) + p.max_new_tokens), ids, g)  # the form routed runs on
        return decode(seq, logits, drafter, g)[0], time.perf_counter() - ts

    per: dict[str, dict] = {}
    fixed_s = dict.fromkeys(FIXED, 0.0)
    runs = ["routed", "plain", *FIXED]
    for i, r in enumerate(rows):
        for what in runs[i % len(runs):] + runs[: i % len(runs)]:
            if what == "routed":
                res = gen.generate(r.prompt, p)
            elif what == "plain":
                plain, ar_s = timed_run(r.prompt)
            else:
                fixed_s[what] += timed_run(r.prompt, fixed[what])[1]
        tally(per, r.domain, res, plain, ar_s)
    return per, fixed_s


def tally(per: dict[str, dict], domain: str, res, plain: list[int], ar_s: float) -> None:
    """Add one row to its domain's tallies: its routed and plain seconds, drafted and accepted tokens, whether
    routed decoding gave plain decoding's tokens, and where it was routed."""
    d = per.setdefault(domain, {"n": 0, "spec_s": 0.0, "ar_s": 0.0, "drafted": 0, "accepted": 0, "same": 0,
                                "routes": {}})
    d["n"] += 1
    d["spec_s"] += res.latency_s
    d["ar_s"] += ar_s
    d["drafted"] += res.stats.drafted
    d["accepted"] += sum(res.stats.accepted)
    d["same"] += plain == res.tokens
    # unmatched: the bank's fallback (its "unmatched" drafter, or in older banks a cluster's)
    where = res.label if res.cluster is not None or res.label == "unmatched" else f"unmatched→{res.label}"
    d["routes"][where] = d["routes"].get(where, 0) + 1


def domain_lines(gen, per: dict[str, dict], domains: list[str]) -> list[str]:
    """Step 3's table: a domain a line, with the route most of its rows took, that route's drafter, its
    speedup over plain decoding, its acceptance, and how many rows gave plain decoding's tokens."""
    lines = [f"{'domain':<14} {'routed to':<22} {'drafter':<44} {'speedup':>8} {'accept':>7} {'same as plain':>14}"]
    for dom in domains:
        d = per[dom]
        label = max(d["routes"], key=d["routes"].get)
        c = next((c for c in gen.bank.clusters if c.label == label), gen.bank.cluster(None))
        routed = f"{label} ({d['routes'][label]}/{d['n']})"
        lines.append(f"{dom:<14} {routed:<22} {c.drafter.describe()[:44]:<44} {d['ar_s'] / d['spec_s']:>7.2f}x "
                     f"{d['accepted'] / d['drafted'] if d['drafted'] else 0:>7.2f} {d['same']:>8}/{d['n']}")
    return lines
