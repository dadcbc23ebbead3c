"""The goodput cut (``draft_policy.Goodput``) beside the fixed lookup drafters, on the same prompts side by side:

    .venv/bin/python benchmarks/goodput_ablation.py [--per-set 3] [--dtype bfloat16] [--max-new-tokens 96]

For ``--per-set`` eval rows of each of ``../shared/data``'s five domains and three OOD sets, in one process, each
prompt decodes with plain decoding, the untuned n-gram and suffix drafters (``drafters.untuned``: what routing is
measured against), and the same two drafters with goodput lengths (10 tokens at most, no adaptive rule), in a
shuffled order. Every output must equal plain decoding's. Prints decode-time speedups over plain decoding per set
and over all prompts: what the cut alone buys, apart from any routing.
"""
from __future__ import annotations

import argparse
import random
from pathlib import Path

import torch

from knnssd import models, prompts
from knnssd.bench import options
from knnssd.engine.spec import suffix
from knnssd.engine.spec.loop import GenerationConfig, generate
from knnssd.engine.spec.drafters import DrafterConfig, build, untuned
from knnssd.engine.model.pass_costs import sequence_costs

DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data"
SETS = ("summarization", "reasoning", "translation", "storytelling", "text_to_sql", "ood_xsum", "ood_math",
        "ood_alpaca")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--per-set", type=int, default=3)
    options.dtype(ap, "bfloat16")
    options.max_new_tokens(ap, 96)
    ap.add_argument("--skip", type=int, default=10, help="eval rows of each set to pass over first")
    a = ap.parse_args()
    lm = models.load(dtype=a.dtype)
    dec = lm.decoder
    print("v(R):", sequence_costs(dec).describe(), flush=True)
    rows = [p for name in SETS for p in prompts.load(DATA / f"{name}.jsonl", split="eval")[a.skip : a.skip + a.per_set]]
    gen = GenerationConfig(max_new_tokens=a.max_new_tokens, eos_ids=models.eos_ids(lm))
    configs = {"plain": DrafterConfig(), "ngram": untuned("ngram"), "suffix": untuned("suffix"),
               "ngram goodput": DrafterConfig(kind="ngram", max_len=10, goodput=True),
               "suffix goodput": DrafterConfig(kind="suffix", max_len=10, goodput=True)}
    drafters = {name: build(c, dec.n_layers, dec.can_skip, suffix.SuffixCache()) for name, c in configs.items()}
    seconds: dict[str, dict[str, float]] = {}
    rng = random.Random(0)
    for p in rows:
        ids = lm.tokenizer(p.prompt).input_ids
        plain = None
        for name in rng.sample(list(drafters), len(drafters)):
            with torch.inference_mode():
                out, st = generate(dec, ids, drafters[name], gen)
            if plain is None:
                plain = out
            assert out == plain, f"{name} differs from the first output on {p.id}"
            for key in (p.domain, "all"):
                seconds.setdefault(key, {}).setdefault(name, 0.0)
                seconds[key][name] += st.decode_s
    names = [n for n in configs if n != "plain"]
    print(f"{'set':14s} " + " ".join(f"{n:>15s}" for n in names))
    for key, by in seconds.items():
        print(f"{key:14s} " + " ".join(f"{by['plain'] / by[n]:15.3f}" for n in names))


if __name__ == "__main__":
    main()
