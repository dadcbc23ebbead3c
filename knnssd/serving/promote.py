"""Promotion: time the ``candidate`` bank against the ``champion`` on eval prompts, side by side.

Both banks route and draft over one loaded model; each prompt runs under both (alternating which
goes first), ``repeats`` times, and each side keeps its best time per prompt: on a machine that also
serves, one run slowed by the neighbour for seconds would otherwise decide the promotion.
*ratio* = champion time / candidate time over all prompts (> 1: the candidate is faster). The
candidate is promoted when ``ratio >= 1 - tolerance``; greedy outputs of both must be identical
(they are exact), which is checked too.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass, replace
from pathlib import Path

from knnssd import prompts

REPEATS = 3  # runs per prompt and bank (the best time counts)
TOLERANCE = 0.03  # promoted when candidate speed >= (1 - TOLERANCE) x champion speed


@dataclass
class Comparison:
    candidate: str  # version
    champion: str
    ratio: float  # champion time / candidate time
    candidate_s: float
    champion_s: float
    prompts: int
    identical: bool  # every greedy output equal
    per_domain: dict[str, float]  # ratio per domain
    promote: bool
    tolerance: float
    repeats: int  # runs per prompt and side; the best counts


def compare(candidate_dir, champion_dir, rows: list[prompts.Prompt], versions: tuple[str, str], dtype: str = "auto",
            max_new_tokens: int = 64, tolerance: float = TOLERANCE, repeats: int = REPEATS) -> Comparison:
    from tqdm import tqdm

    from knnssd import models
    from knnssd.engine.spec.request_params import GenerateParams
    from knnssd.routing import bank as banks
    from knnssd.serving.routed import RoutedGenerator

    if not rows:
        raise ValueError("no eval prompts to compare on")
    cand_bank, champ_bank = banks.load(candidate_dir), banks.load(champion_dir)
    lm = models.load(cand_bank.model, dtype)
    gens = {"candidate": RoutedGenerator(lm, cand_bank), "champion": RoutedGenerator(lm, champ_bank)}
    params = GenerateParams(max_new_tokens=max_new_tokens)
    for g in gens.values():  # warm up
        g.generate(rows[0].prompt[:200], GenerateParams(max_new_tokens=4))
    t, identical = best_times(gens, tqdm(rows, desc="promote", file=sys.stderr, mininterval=5), params, repeats)
    per_domain = {}
    for d in sorted({r.domain or "?" for r in rows}):
        ids = [r.id for r in rows if (r.domain or "?") == d]
        per_domain[d] = sum(t["champion"][i] for i in ids) / sum(t["candidate"][i] for i in ids)
    cs, hs = sum(t["candidate"].values()), sum(t["champion"].values())
    ratio = hs / cs
    return Comparison(versions[0], versions[1], ratio, cs, hs, len(rows), identical, per_domain,
                      ratio >= 1 - tolerance and identical, tolerance, repeats)


def best_times(gens: dict, rows, params, repeats: int) -> tuple[dict[str, dict[str, float]], bool]:
    """Each row under ``gens["candidate"]`` and ``gens["champion"]`` (anything with ``generate``),
    ``repeats`` times, alternating which goes first: each side's best latency per row id, and whether
    every pair of outputs was identical."""
    t = {"candidate": {}, "champion": {}}
    identical = True
    for i, r in enumerate(rows):
        for k in range(repeats):
            order = ("candidate", "champion") if (i + k) % 2 == 0 else ("champion", "candidate")
            out = {}
            for name in order:
                res = gens[name].generate(r.prompt, params)
                t[name][r.id] = min(res.latency_s, t[name].get(r.id, float("inf")))
                out[name] = res.tokens
            identical &= out["candidate"] == out["champion"]
    return t, identical


def eval_rows(paths: list[str], per_file: int | None) -> list[prompts.Prompt]:
    """Eval prompts of each file: its ``eval`` rows, or (no split field) its last third; at most
    ``per_file`` each. A row without a domain takes the file's name."""
    from knnssd.search.extend import split_rows

    out = []
    for p in paths:
        rows = prompts.load(p)
        if not any(r.split for r in rows):
            rows = split_rows(rows, Path(p).stem)[1] or rows
        else:
            rows = [r for r in rows if r.split == "eval"]
        rows = [r if r.domain else replace(r, domain=Path(p).stem) for r in rows]
        out.extend(rows[:per_file] if per_file else rows)
    return out


def version_uri(model: str, ref: str) -> str:
    """``models:/knnssd-<model>@<alias>`` or ``.../<version>`` for a digit string."""
    from knnssd.tracking import registered_name

    return f"models:/{registered_name(model)}/{ref}" if ref.isdigit() else f"models:/{registered_name(model)}@{ref}"
