"""Own plain decoding against this machine's memory-bandwidth floor, in one process.

    .venv/bin/python benchmarks/bandwidth_floor.py --prompts 4 --max-new-tokens 128

Plain decoding reads every weight once per token, so no single-sequence decoder can beat
(read bandwidth) / (weight bytes per token). The bandwidth is the best of 10 sums over 256 MiB
of fp32 (far above the caches); the weight bytes count every parameter once (a tied lm_head
once). Own AR is decode-only tokens/s over eval prompts (no EOS stop), after a warm-up.
"""
from __future__ import annotations

import argparse

import torch

from knnssd import models, prompts
from knnssd.bench import markdown as md
from knnssd.bench import options
from knnssd.engine.spec.loop import GenerationConfig, generate
from knnssd.engine.model.timing import read_bandwidth


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    options.model(ap)
    options.dtypes(ap, ("bfloat16", "float32"), choices=("bfloat16", "float32"))
    options.prompts(ap, 4, help="eval prompts: up to ceil(n / 5) per domain, domain by domain")
    options.max_new_tokens(ap)
    options.threads(ap)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    per_domain = -(-a.prompts // len(prompts.DOMAINS))
    rows = prompts.load_domains(prompts.default_data_dir(), prompts.DOMAINS, "eval", per_domain)[: a.prompts]
    bw = read_bandwidth()
    print(f"read bandwidth {bw / 1e9:.1f} GB/s ({a.threads} threads)")
    print("\n".join(md.head(["dtype", "step", "weight MB per token", "floor tok/s", "own AR tok/s", "own AR / floor"])))
    for dtype in a.dtype:
        lm = models.load(a.model, dtype=dtype)
        dec = lm.decoder
        weight_bytes = sum(p.numel() * p.element_size() for p in lm.model.parameters())
        ids = [lm.tokenizer(r.prompt).input_ids for r in rows]
        generate(dec, ids[0], None, GenerationConfig(max_new_tokens=8))  # warm-up
        tokens = seconds = 0.0
        for x in ids:
            _, st = generate(dec, x, None, GenerationConfig(max_new_tokens=a.max_new_tokens))
            tokens, seconds = tokens + st.new_tokens - 1, seconds + st.decode_s  # the first token is the prefill's
        floor, own = bw / weight_bytes, tokens / seconds
        print(md.row([dtype, dec.exactness.step, f"{weight_bytes / 1e6:.0f}", f"{floor:.1f}", f"{own:.1f}",
                      f"{own / floor:.2f}"]))


if __name__ == "__main__":
    main()
