"""Engine benchmark: own AR vs HF generate vs fixed drafters, side by side in one process.

Every method runs on the same model, dtype, threads and prompts, interleaved prompt by prompt
(the method order rotates per repeat), and the median of the repeats is kept per prompt.
Speedups are ratios of summed end-to-end times (prefill included; ``decode_speedup_vs_ar``
leaves the prefill out). Nothing here asserts a speed: the numbers are printed, not tested.
"""
from __future__ import annotations

import statistics
import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch

from knnssd import models
from knnssd import prompts as prompt_sets
from knnssd.bench.hf import hf_generate
from knnssd.engine.spec.loop import GenerationConfig, generate
from knnssd.engine.spec.drafters import DrafterConfig, build, untuned
from knnssd.engine.model.decoder import Decoder
from knnssd.engine.model.skip import SkipMask
from knnssd.engine.model.timing import pass_timer


@dataclass
class EngineBench:
    model: str = models.DEFAULT_MODEL
    dtype: str = "auto"
    device: str = "auto"
    prompts: int = 2  # per domain, from the eval split
    max_new_tokens: int = 64
    domains: tuple[str, ...] = prompt_sets.DOMAINS
    data: Path = field(default_factory=prompt_sets.default_data_dir)
    repeats: int = 1
    hf: bool = True  # also time HF generate


def even_mask(n_layers: int, fraction: float) -> SkipMask:
    """Skip ~fraction of the sub-layers, spread evenly over the upper two thirds (first layers kept)."""
    n = round(fraction * 2 * n_layers)
    slots = [(kind, i) for i in range(n_layers // 3, n_layers) for kind in ("mlp", "attn")]
    chosen = [slots[round(j * (len(slots) - 1) / max(1, n - 1))] for j in range(n)] if n else []
    return SkipMask.from_layers(n_layers, [i for k, i in chosen if k == "attn"], [i for k, i in chosen if k == "mlp"])


def fixed_drafters(n_layers: int, can_skip: bool) -> dict[str, DrafterConfig]:
    """The untuned drafters the engine benchmark compares (search.py tunes them per cluster)."""
    out = {kind: untuned(kind) for kind in ("ngram", "suffix")}  # suffix with no cache: each prompt its own
    if can_skip:
        none = SkipMask.none(n_layers).to_dict()
        out["int8_draft"] = DrafterConfig(kind="layer_skip", mask=none, max_len=8, threshold=0.3, int8=True,
                                          adaptive=True)
        out["skip_25"] = DrafterConfig(kind="layer_skip", mask=even_mask(n_layers, 0.25).to_dict(), max_len=4,
                                       threshold=0.5)
        out["hybrid"] = DrafterConfig(kind="hybrid", mask=none, max_len=8, threshold=0.5, int8=True, adaptive=True)
    return out


def step_costs(dec: Decoder, context: int = 128, max_k: int = 12) -> dict:
    """ms per full step, per draft step for several mask sizes, and verify cost for k = 1..max_k tokens."""
    ms = pass_timer(dec, context, max_k, repeats=7)
    full = ms(1)
    verify = {k: ms(k) for k in range(1, max_k + 1)}
    draft = {}
    for frac in (0.0, 0.25, 0.5):
        mask = even_mask(dec.n_layers, frac)
        draft[f"skip_{int(frac * 100)}"] = ms(1, mask=mask)
        draft[f"int8_skip_{int(frac * 100)}"] = ms(1, mask=mask, stack=dec.int8_stack())
    return {
        "context": context,
        "ms_per_full_step": full,
        "ms_per_draft_step": draft,
        "draft_cost_vs_full": {k: v / full for k, v in draft.items()},
        "verify_ms": verify,
        "verify_cost_vs_one": {k: v / verify[1] for k, v in verify.items()},
    }


def run(cfg: EngineBench, log=lambda msg: print(msg, file=sys.stderr)) -> dict:
    from tqdm import tqdm

    lm = models.load(cfg.model, cfg.dtype, cfg.device)
    dec = lm.decoder
    rows = prompt_sets.load_domains(cfg.data, cfg.domains, "eval", cfg.prompts)
    gen_cfg = GenerationConfig(max_new_tokens=cfg.max_new_tokens, eos_ids=models.eos_ids(lm))
    configs = fixed_drafters(dec.n_layers, dec.can_skip)
    drafters = {name: build(c, dec.n_layers, dec.can_skip) for name, c in configs.items()}
    methods = ["ar", *(["hf_generate"] if cfg.hf else []), *drafters]
    log(f"model {lm.name} ({type(lm.model).__name__}, {lm.dtype}, {lm.device}, {torch.get_num_threads()} threads), "
        f"{len(rows)} prompts x {len(methods)} methods x {cfg.repeats} repeats, {cfg.max_new_tokens} new tokens")

    def one(method: str, ids: list[int]):
        if method == "hf_generate":
            toks, s = hf_generate(lm, ids, cfg.max_new_tokens, gen_cfg.eos_ids)
            return toks, None, s
        out, st = generate(dec, ids, drafters.get(method), gen_cfg)
        return out, st, st.total_s

    warm = lm.tokenizer(rows[0].prompt).input_ids[:32]
    for m in methods:
        one(m, warm)
    results = {m: [] for m in methods}  # per prompt: (tokens, stats, median seconds)
    for p in tqdm(rows, desc="bench-engine", file=sys.stderr, mininterval=5):
        ids = lm.tokenizer(p.prompt).input_ids
        runs = {m: [] for m in methods}
        for r in range(cfg.repeats):
            order = methods[r % len(methods):] + methods[: r % len(methods)]
            for m in order:
                runs[m].append(one(m, ids))
        for m in methods:
            out, st, _ = runs[m][0]
            results[m].append((out, st, statistics.median(x[2] for x in runs[m]), p.domain))
    report = {
        "model": lm.name, "dtype": lm.dtype_name, "device": str(lm.device),
        "threads": torch.get_num_threads(), "backend": type(dec).__name__, "prompts": len(rows),
        "exactness": dec.exactness.to_dict() if dec.exactness is not None else None,
        "domains": list(cfg.domains), "max_new_tokens": cfg.max_new_tokens, "repeats": cfg.repeats,
        **({"steps": step_costs(dec)} if isinstance(dec, Decoder) else {}),
    }
    report.update(_summary(results, configs, methods))
    return report


def _summary(results: dict, configs: dict, methods: list[str]) -> dict:
    ar = results["ar"]
    ar_time = sum(x[2] for x in ar)
    ar_decode = sum(x[1].decode_s for x in ar)
    ar_tokens = sum(len(x[0]) for x in ar)
    out = {"ar": {"tokens_per_s": ar_tokens / ar_time, "ms_per_token": 1e3 * ar_time / ar_tokens,
                  "decode_tokens_per_s": ar_tokens / ar_decode}}
    if "hf_generate" in results:
        hf = results["hf_generate"]
        hf_time = sum(x[2] for x in hf)
        out["hf_generate"] = {"tokens_per_s": sum(len(x[0]) for x in hf) / hf_time,
                              "own_ar_speedup_vs_hf": hf_time / ar_time,
                              "agreement_with_ar": _agreement(hf, ar)}
    out["drafters"] = {}
    for m in methods:
        if m in ("ar", "hf_generate"):
            continue
        res = results[m]
        t = sum(x[2] for x in res)
        stats = [x[1] for x in res]
        drafted = sum(s.drafted for s in stats)
        steps = sum(len(s.accepted) for s in stats)
        out["drafters"][m] = {
            "config": configs[m].describe(),
            "speedup_vs_ar": ar_time / t,
            "decode_speedup_vs_ar": ar_decode / sum(s.decode_s for s in stats),
            **({"speedup_vs_hf": sum(x[2] for x in results["hf_generate"]) / t} if "hf_generate" in results else {}),
            "tokens_per_s": sum(len(x[0]) for x in res) / t,
            "acceptance_rate": sum(sum(s.accepted) for s in stats) / drafted if drafted else 0.0,
            "mean_accepted": (sum(sum(s.accepted) for s in stats) + steps) / steps if steps else 1.0,
            "agreement_with_ar": _agreement(res, ar),
            "per_domain_speedup": _per_domain(res, ar),
        }
    return out


def _agreement(res, ar) -> float:
    return sum(a[0] == b[0] for a, b in zip(res, ar)) / len(ar)


def _per_domain(res, ar) -> dict:
    out = {}
    for d in dict.fromkeys(x[3] for x in ar):
        t_ar = sum(x[2] for x in ar if x[3] == d)
        t = sum(x[2] for x in res if x[3] == d)
        out[d] = t_ar / t
    return out


def table(report: dict) -> str:
    """A human-readable summary of ``run``'s report."""
    lines = [
        f"{report['model']} · {report['dtype']} · {report['device']} · {report['threads']} threads · "
        f"{report['prompts']} prompts x {report['max_new_tokens']} tokens · backend {report['backend']}",
        f"own AR: {report['ar']['tokens_per_s']:.1f} tok/s"
        + (f"   HF generate: {report['hf_generate']['tokens_per_s']:.1f} tok/s "
           f"(own AR {report['hf_generate']['own_ar_speedup_vs_hf']:.2f}x)" if "hf_generate" in report else ""),
    ]
    if report.get("exactness"):
        ex = report["exactness"]
        lines.append(f"verify pass: {'exact' if ex['exact'] else 'NOT exact'} ({ex['step']} attention); "
                     + "probe: " + "; ".join(f"{k} {v}" for k, v in ex["tried"].items()))
    if "steps" in report:
        s = report["steps"]
        lines.append(f"full step {s['ms_per_full_step']:.1f} ms; draft step / full: "
                     + ", ".join(f"{k} {v:.2f}" for k, v in s["draft_cost_vs_full"].items()))
        lines.append("verify cost (k tokens / 1 token): "
                     + ", ".join(f"{k}:{v:.2f}" for k, v in s["verify_cost_vs_one"].items()))
    lines.append(f"{'drafter':<12} {'speedup':>8} {'accept':>7} {'mean acc':>9} {'agree':>6}  config")
    for name, d in report["drafters"].items():
        lines.append(f"{name:<12} {d['speedup_vs_ar']:>7.2f}x {d['acceptance_rate']:>7.2f} {d['mean_accepted']:>9.2f} "
                     f"{d['agreement_with_ar']:>6.2f}  {d['config']}")
    return "\n".join(lines)
