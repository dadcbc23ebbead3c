"""What token trees could add to suffix drafting here: plain outputs replayed against chains and trees.

    .venv/bin/python benchmarks/tree_replay.py --mixed 30 --repetitive text_to_sql:20 --max-new-tokens 128

A ceiling, measured before building tree verification. Plain greedy decoding gives each prompt's tokens.
The replay then walks them as the greedy loop would: at each step the drafter sees the prompt and the
tokens so far, a chain's accepted tokens are its longest prefix equal to the plain output, and a tree's
its longest root path equal to it (what tree verification would accept); the step emits those and one
more token. Nothing is verified by the model, so the replay says what a tree could accept, not what it
costs to check; the cost side is the full pass timed at each row count on this machine.

    chain      the suffix drafter's chain (``SequenceIndex.draft``: 8 tokens at most, floor 0.1, 4x the match)
    tree B     the suffix drafter's tree of B nodes (``suffix.draft_tree``): below the earlier occurrences of
               the sequence's last token with the longest matches, each a path of its continuation (8 tokens
               at most); a node ranks by the longest match among the occurrences through it, then by how
               many of those share that match (SuffixDecoding's frequency), so it never ranks above its parent

Prints, per stream, mean accepted length (tokens a pass) and rows verified a pass, and an estimate of
tokens/s against the chain: each step's tokens over the pass cost of its rows (the timed table), draft
time left out.
"""
from __future__ import annotations

import argparse
import json
import sys

import torch

from knnssd import models
from knnssd.bench import streams
from knnssd.engine.spec.loop import GenerationConfig, generate
from knnssd.engine.spec.suffix import SequenceIndex, draft_tree
from knnssd.engine.model.timing import pass_timer

DEPTH = 8  # the longest draft, as the suffix drafter's ``max_len`` in the benchmarks
BUDGETS = (4, 8, 16, 32, 64)
ROWS = (1, 2, 3, 4, 5, 6, 8, 9, 12, 16, 17, 24, 32, 33, 48, 64, 65)


def tree(toks: list[int], budget: int) -> list[tuple[int, int]]:
    """The ``budget`` best nodes as (parent index, token), parents first (-1: the last token)."""
    index = SequenceIndex()
    index.extend(toks)
    tokens, parents = draft_tree(index, budget, DEPTH)
    return [(p - 1, t) for p, t in zip(parents, tokens)]


def chain_accepted(draft: list[int], truth: list[int]) -> int:
    n = 0
    while n < len(draft) and n < len(truth) and draft[n] == truth[n]:
        n += 1
    return n


def tree_accepted(nodes: list[tuple[int, int]], truth: list[int]) -> int:
    children: dict[int, dict[int, int]] = {}
    for j, (parent, token) in enumerate(nodes):
        children.setdefault(parent, {})[token] = j
    at, n = -1, 0
    while n < len(truth) and truth[n] in children.get(at, {}):
        at, n = children[at][truth[n]], n + 1
    return n


def replay(prompt: list[int], out: list[int], draft) -> list[tuple[int, int]]:
    """(tokens emitted, rows verified) per step of the greedy loop over ``out`` with ``draft``."""
    steps, i = [], 1  # the prefill emits out[0]
    while i < len(out):
        toks = prompt + out[:i]
        accepted, rows = draft(toks, out[i:])
        accepted = min(accepted, len(out) - i - 1)
        steps.append((accepted + 1, rows))
        i += accepted + 1
    return steps


def suffix_chain(toks: list[int], truth: list[int]) -> tuple[int, int]:
    index = SequenceIndex()
    index.extend(toks)
    d = index.draft(DEPTH, 0.1, 4.0)
    return chain_accepted(d, truth), 1 + len(d)


def suffix_tree(budget: int):
    def draft(toks: list[int], truth: list[int]) -> tuple[int, int]:
        nodes = tree(toks, budget)
        return tree_accepted(nodes, truth), 1 + len(nodes)
    return draft


def pass_costs(dec, context: int, repeats: int) -> dict[int, float]:
    """Seconds of one full pass of R rows at position ``context`` (``timing.pass_timer``'s median of ``repeats``)."""
    ms = pass_timer(dec, context, max(ROWS), repeats)
    return {r: ms(r) / 1e3 for r in ROWS}


def cost(table: dict[int, float], rows: int) -> float:
    """The timed cost of ``rows``, linear between the row counts timed."""
    below = max(r for r in table if r <= rows)
    above = min((r for r in table if r >= rows), default=below)
    if above == below:
        return table[below] * rows / below if rows > below else table[below]
    return table[below] + (table[above] - table[below]) * (rows - below) / (above - below)


def stream(lm, texts: list[str], max_new: int, table: dict[int, float]) -> dict:
    config = GenerationConfig(max_new_tokens=max_new, eos_ids=models.eos_ids(lm))
    methods = {"chain": suffix_chain, **{f"tree {b}": suffix_tree(b) for b in BUDGETS}}
    steps: dict[str, list[tuple[int, int]]] = {m: [] for m in methods}
    for i, text in enumerate(texts):
        prompt = lm.tokenizer(text).input_ids
        out, _ = generate(lm.decoder, prompt, None, config)
        for m, draft in methods.items():
            steps[m] += replay(prompt, list(out), draft)
        print(f"  {i + 1}/{len(texts)}", file=sys.stderr)
    report = {}
    for m, s in steps.items():
        tokens, passes = sum(t for t, _ in s), len(s)
        seconds = sum(cost(table, rows) for _, rows in s)
        report[m] = dict(mean_accepted=tokens / passes, rows=sum(r for _, r in s) / passes, est_tok_s=tokens / seconds)
    chain = report["chain"]["est_tok_s"]
    for r in report.values():
        r["est_vs_chain"] = r["est_tok_s"] / chain
    return report


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    streams.add_arguments(ap, mixed=30)
    ap.add_argument("--context", type=int, default=300, help="the position the pass costs are timed at")
    a = ap.parse_args()
    texts, _ = streams.from_arguments(ap, a)
    lm = models.load(dtype=a.dtype)
    costs = pass_costs(lm.decoder, a.context, 9)
    print("pass cost (ms) by rows: " + ", ".join(f"{r}: {1e3 * s:.2f}" for r, s in costs.items()), file=sys.stderr)
    report = dict(model=lm.name, dtype=lm.dtype_name, threads=torch.get_num_threads(), max_new_tokens=a.max_new_tokens,
                  pass_ms={r: 1e3 * s for r, s in costs.items()})
    for name, stream_texts in texts.items():
        print(f"{name}: {len(stream_texts)} prompts", file=sys.stderr)
        report[name] = stream(lm, stream_texts, a.max_new_tokens, costs)
    print(json.dumps(report, indent=1))
    for name in texts:
        print(streams.table(name, "draft", report[name], [("mean accepted", "mean_accepted", ".2f"),
                                                          ("rows a pass", "rows", ".1f"),
                                                          ("est. x chain", "est_vs_chain", ".2f")]))


if __name__ == "__main__":
    main()
