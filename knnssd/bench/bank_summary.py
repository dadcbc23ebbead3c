"""What ``knnssd bench``'s measurements add up to (``bank.run`` journals them): per set of prompts, each method's
speedup over own AR (and over HF ``generate``), tokens/s, acceptance and agreement; the streams' passes, routing
accuracy, the out-of-domain sets, the mask ablation, routed decoding against the best fixed drafter, and the
issue's targets. The terms are defined in ``bank``'s docstring."""
from __future__ import annotations

import statistics
from dataclasses import asdict

import torch

from knnssd.engine.spec.drafters import FIXED
from knnssd.engine.spec.loop import acceptance_rate, mean_accepted

def _agg(ms: dict[str, list[dict]], ids: list[str], method: str, ref: str = "ar") -> dict | None:
    """Metrics of ``method`` over prompts ``ids`` (``ms[(id)][method]`` = per-pass measurements)."""
    if not ids or any(method not in ms[i] or ref not in ms[i] for i in ids):
        return None
    t = sum(statistics.median(x["s"] for x in ms[i][method]) for i in ids)
    t_ref = sum(statistics.median(x["s"] for x in ms[i][ref]) for i in ids)
    tokens = sum(len(ms[i][method][0]["tokens"]) for i in ids)
    first = [ms[i][method][0] for i in ids]
    drafted = sum(x.get("drafted", 0) for x in first)
    acc = sum(x.get("accepted", 0) for x in first)
    steps = sum(x.get("steps", 0) for x in first)
    agree = [all(x["tokens"] == ms[i]["ar"][0]["tokens"] for x in ms[i][method]) for i in ids]
    out = {"speedup_vs_ar": t_ref / t, "tokens_per_s": tokens / t, "seconds": t, "prompts": len(ids),
           "acceptance_rate": acceptance_rate(acc, drafted) if drafted else None,  # None: not a drafter
           "mean_accepted": mean_accepted(acc, steps) if steps else None, "agreement_with_ar": sum(agree) / len(agree)}
    if "route_s" in first[0]:
        route = sum(statistics.median(x["route_s"] for x in ms[i][method]) for i in ids)
        out["routing_overhead_pct"] = 100 * route / t
    if all("hf_generate" in ms[i] for i in ids):
        out["speedup_vs_hf"] = sum(statistics.median(x["s"] for x in ms[i]["hf_generate"]) for i in ids) / t
    return out


def summarise(done: dict, cfg, runner) -> dict:
    """The report of ``bank.run``'s measurements (``done``, by phase, pass, prompt and method) under ``cfg`` (its
    ``BenchConfig``), over ``runner`` (its ``Runner``: the model, methods and bank that took them)."""
    eval_ms: dict[str, dict[str, list[dict]]] = {}
    ood_ms: dict[str, dict[str, list[dict]]] = {}
    domain_of, set_of = {}, {}
    for (phase, _, pid, m), x in sorted(done.items(), key=lambda kv: kv[0][1]):
        (eval_ms if phase == "eval" else ood_ms).setdefault(pid, {}).setdefault(m, []).append(x)
        (domain_of if phase == "eval" else set_of)[pid] = x["domain"]
    methods, report = runner.methods, {}
    ids = sorted(eval_ms)
    report["settings"] = {**{k: str(v) for k, v in asdict(cfg).items()}, "model": runner.lm.name,
                          "dtype_loaded": runner.lm.dtype_name, "device": str(runner.lm.device),
                          "threads": torch.get_num_threads(), "methods": methods,
                          "ood_methods": runner.ood_methods}
    ex = runner.dec.exactness
    report["exactness"] = ex.to_dict() if ex is not None else None
    report["mixed"] = {m: _agg(eval_ms, ids, m) for m in methods}
    report["per_domain"] = {d: {m: _agg(eval_ms, [i for i in ids if domain_of[i] == d], m) for m in methods}
                            for d in cfg.domains}
    by_pass: dict[int, dict] = {}
    for (phase, j, pid, m), x in done.items():
        if phase == "eval":
            by_pass.setdefault(j, {}).setdefault(pid, {}).setdefault(m, []).append(x)
    report["streams"] = {}
    for j, ms in sorted(by_pass.items()):
        r = cfg.ratios[j % len(cfg.ratios)]
        report["streams"].setdefault(str(r), {})[f"pass{j}"] = {m: (_agg(ms, sorted(ms), m) or {}).get("speedup_vs_ar")
                                                                  for m in methods}
    routed = [eval_ms[i]["knn_routed"][0] for i in ids if "knn_routed" in eval_ms[i]]
    report["routing_accuracy"] = sum(x["label"] == domain_of[x["id"]] for x in routed) / len(routed) if routed else None
    oods = sorted(set(set_of.values()))
    report["ood"] = {s: {m: _agg(ood_ms, [i for i in ood_ms if set_of[i] == s], m) for m in runner.ood_methods}
                     for s in oods}
    for s in oods:
        rs = [ood_ms[i]["knn_routed"][0] for i in ood_ms if set_of[i] == s and "knn_routed" in ood_ms[i]]
        if rs:
            report["ood"][s]["routed_labels"] = {lab: sum(x["label"] == lab for x in rs) for lab in {x["label"] for x in rs}}
    report["mask_ablation"] = mask_ablation(eval_ms, ids, runner.bank) if runner.unmasked is not None else None
    report["versus_best_fixed"] = versus_best_fixed(report)
    report["targets"] = targets(report)
    return report


def best_fixed(row: dict) -> tuple[str, float] | None:
    """The fastest of ``FIXED`` in one row of speedups (a method's ``_agg``, or a stream pass's speedup),
    as (method, speedup vs own AR); None where none of them ran."""
    sp = {m: row[m] if isinstance(row.get(m), float) else (row.get(m) or {}).get("speedup_vs_ar") for m in FIXED}
    sp = {m: v for m, v in sp.items() if v}
    return max(sp.items(), key=lambda kv: kv[1]) if sp else None


def versus_best_fixed(rep: dict) -> dict:
    """Routed decoding over the best fixed drafter of each set (mixed stream, each domain, each OOD set):
    {set: {"best_fixed": method, "best_fixed_speedup", "routed_speedup", "routed_over_best_fixed"}}."""
    out = {}
    for name, row in [("mixed", rep["mixed"]), *rep["per_domain"].items(), *rep["ood"].items()]:
        fixed, routed = best_fixed(row), (row.get("knn_routed") or {}).get("speedup_vs_ar")
        if fixed and routed:
            out[name] = {"best_fixed": fixed[0], "best_fixed_speedup": fixed[1], "routed_speedup": routed,
                         "routed_over_best_fixed": routed / fixed[1]}
    return out


def mask_ablation(eval_ms: dict, ids: list[str], bank) -> list[dict]:
    """Per masked cluster: its drafter with and without its mask, on the eval prompts routed to it."""
    rows = []
    for c in bank.masked():
        mine = [i for i in ids if "knn_routed" in eval_ms[i] and eval_ms[i]["knn_routed"][0].get("cluster") == c.id]
        with_mask, without = _agg(eval_ms, mine, "knn_routed"), _agg(eval_ms, mine, "knn_unmasked")
        rows.append({"cluster": c.id, "label": c.label, "drafter": c.drafter.describe(), "skipped": c.mask.n_skipped,
                     "sublayers": 2 * c.mask.n_layers, "prompts": len(mine),
                     "speedup_with_mask": (with_mask or {}).get("speedup_vs_ar"),
                     "speedup_without_mask": (without or {}).get("speedup_vs_ar"),
                     "mask_gain": with_mask["speedup_vs_ar"] / without["speedup_vs_ar"] if with_mask and without else None,
                     "mean_accepted_with": (with_mask or {}).get("mean_accepted"),
                     "mean_accepted_without": (without or {}).get("mean_accepted")})
    return rows


def targets(rep: dict) -> dict:
    """The issue's targets, checked on what was measured (None where a method is missing)."""
    mix = rep["mixed"]
    kr = mix.get("knn_routed") or {}
    sp = lambda m: (mix.get(m) or {}).get("speedup_vs_ar")  # noqa: E731
    worst = min(((v.get("knn_routed") or {}).get("speedup_vs_ar", 0) for v in rep["per_domain"].values()), default=None)
    r1 = rep["streams"].get("1.0", {})
    vs = rep.get("versus_best_fixed", {})
    r1_gap = None
    if r1:
        p = next(iter(r1.values()))
        if p.get("knn_routed") and p.get("static_ssd"):
            r1_gap = p["knn_routed"] - p["static_ssd"]
    return {
        "routed_mixed_speedup": sp("knn_routed"), "routed_worst_domain": worst,
        "routed_over_pld": sp("knn_routed") / sp("hf_pld") if sp("knn_routed") and sp("hf_pld") else None,
        "routed_minus_static_r1": r1_gap,
        "routed_over_oracle": sp("knn_routed") / sp("oracle") if sp("knn_routed") and sp("oracle") else None,
        "routed_over_best_fixed": (vs.get("mixed") or {}).get("routed_over_best_fixed"),
        "routed_over_best_fixed_worst_set": min((v["routed_over_best_fixed"] for k, v in vs.items() if k != "mixed"),
                                                default=None),
        "routing_overhead_pct": kr.get("routing_overhead_pct"), "masks_only_mixed_speedup": sp("knn_masks"),
    }
