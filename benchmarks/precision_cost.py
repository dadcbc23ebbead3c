"""What a precision costs against bf16: greedy-token agreement and perplexity, in one process.

    .venv/bin/python benchmarks/precision_cost.py --dtype gguf --prompts 20

For ``--prompts`` mixed eval prompts, each precision decodes ``--max-new-tokens`` greedy tokens (plain
decoding, no EOS stop); the table gives the share of prompts whose tokens all equal bf16's, and the
mean share of tokens before the first one that differs. Perplexity is teacher-forced over a held text:
the eval prompts of every domain after the first ``--prompts``, joined, cut into windows of
``--window`` tokens, each scored from an empty cache.
"""
from __future__ import annotations

import argparse
import math

import torch

from knnssd import models, prompts
from knnssd.bench import markdown as md
from knnssd.bench import options
from knnssd.engine.spec.loop import GenerationConfig, generate


def perplexity(dec, windows: list[list[int]]) -> float:
    nll, count = 0.0, 0
    for ids in windows:
        dec.reserve(len(ids))
        logits = dec.forward(torch.tensor(ids), 0).logits  # (T, V) fp32
        logp = torch.log_softmax(logits[:-1].double(), -1)
        nll -= float(logp.gather(1, torch.tensor(ids[1:])[:, None]).sum())
        count += len(ids) - 1
    return math.exp(nll / count)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    options.model(ap)
    options.dtypes(ap, ("gguf", "float32"), help="precisions to compare with bf16 (default: gguf and float32)")
    options.prompts(ap, 20)
    options.max_new_tokens(ap, 64)
    ap.add_argument("--window", type=int, default=512)
    ap.add_argument("--windows", type=int, default=8)
    options.threads(ap)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    per_domain = -(-a.prompts // len(prompts.DOMAINS))
    rows = prompts.load_domains(prompts.default_data_dir(), prompts.DOMAINS, "eval", per_domain + 20)
    chosen = [r for i, r in enumerate(rows) if i % (per_domain + 20) < per_domain][: a.prompts]
    held = [r for r in rows if r not in chosen]
    results = {}
    for dtype in ["bfloat16", *a.dtype]:
        lm = models.load(a.model, dtype=dtype)
        dec, tok = lm.decoder, lm.tokenizer
        ids = [tok.apply_chat_template([{"role": "user", "content": r.prompt}], add_generation_prompt=True,
                                       tokenize=True, return_dict=False) for r in chosen]
        outs = [generate(dec, x, None, GenerationConfig(max_new_tokens=a.max_new_tokens))[0] for x in ids]
        text = tok("\n\n".join(r.prompt for r in held)).input_ids
        windows = [text[i : i + a.window] for i in range(0, len(text) - a.window, a.window)][: a.windows]
        results[dtype] = (outs, perplexity(dec, windows), sum(len(w) for w in windows))
        del lm, dec
    base = results["bfloat16"][0]
    print(f"{a.model}: {len(chosen)} mixed eval prompts x {a.max_new_tokens} greedy tokens; perplexity over "
          f"{results['bfloat16'][2]} held eval tokens ({a.window}-token windows)")
    print("\n".join(md.head(["precision", "prompts all equal to bf16", "tokens before the first difference",
                             "perplexity"])))
    for dtype, (outs, ppl, _) in results.items():
        same = sum(o == b for o, b in zip(outs, base))
        prefix = [next((i for i, (x, y) in enumerate(zip(o, b)) if x != y), len(b)) / len(b) for o, b in zip(outs, base)]
        print(md.row([dtype, f"{same}/{len(outs)}", f"{sum(prefix) / len(prefix):.0%}", f"{ppl:.3f}"]))


if __name__ == "__main__":
    main()
