"""Pack SmolLM2 for the GPU check: its GGUF blocks as they are, in parts that each fit one device call.

    .venv/bin/python benchmarks/gpu_pack.py [--out artifacts/gpu] [--data ../shared/data] [--prompts 8]

A device call carries at most 64 MiB, and the GGUF holds 92 MiB of blocks (Q4_1 projections, a Q8_0
embedding, fp32 norms), which the GPU machine's Python could not read anyway (it has no ``gguf`` package).
So this writes, under ``--out``:

    a/  config.json, the tokenizer, prompts.jsonl (eval rows, round robin over the domains), blocks-0.pt
    b/  blocks-1.pt

Each ``blocks-N.pt`` maps HF parameter names to the file's raw blocks (uint8) with their type, the query and
key rows already in HF's order (``knnssd.bench.packed_blocks``, whose ``load_packed`` de-quantizes them in torch,
as ``gguf`` does: d q + m in fp32); this script checks that the result equals the converted model knnssd loads,
bitwise, before it writes anything. docs/gpu.md gives the two calls that carry ``a/`` and ``b/``.
"""
from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import torch

from knnssd.bench import options
from knnssd.bench.packed_blocks import dequantize, read_blocks

PART_MIB = 52  # a call also carries the working tree (about 2 MiB); leave room


def eval_prompts(data: Path, n: int) -> list[dict]:
    """``n`` eval rows, round robin over the domains (``bench.throughput.mixed_prompts``)."""
    from knnssd.bench.throughput import mixed_prompts

    try:
        return [dict(id=p.id, split="eval", prompt=p.prompt) for p in mixed_prompts(data, n)]
    except (ValueError, OSError) as e:
        raise SystemExit(str(e)) from None


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="artifacts/gpu")
    ap.add_argument("--data", default=str(Path(__file__).resolve().parents[2] / "shared" / "data"))
    options.prompts(ap, 8)
    a = ap.parse_args(argv)
    prompts = eval_prompts(Path(a.data), a.prompts)  # a bad --data or --prompts ends here, before the model loads
    from safetensors.torch import load_file

    from knnssd import conversion, models

    _, folder = models._source("smollm2")
    config = json.loads((folder / "config.json").read_text())
    blocks = read_blocks(conversion.embedded_gguf("smollm2"), config)
    want = load_file(folder / "model.safetensors")
    for name, w in want.items():
        if name not in blocks:
            raise SystemExit(f"{name} is not in the GGUF")
        if not torch.equal(dequantize(blocks[name]), w):
            raise SystemExit(f"{name}: de-quantized blocks differ from the converted model")
    print(f"{len(blocks)} tensors de-quantize to the converted model's weights, bitwise")
    final = Path(a.out)
    out = final.with_name(final.name + ".partial")  # the last pack stays until this one fits
    shutil.rmtree(out, ignore_errors=True)
    (out / "a").mkdir(parents=True)
    (out / "b").mkdir()
    for f in ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (folder / f).exists():
            shutil.copy(folder / f, out / "a" / f)
    (out / "a" / "prompts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in prompts))
    parts, size = [{}, {}], 0
    budget = PART_MIB * 2**20 - sum(p.stat().st_size for p in (out / "a").iterdir())
    for name, b in blocks.items():
        size += b["data"].numel()
        parts[0 if size <= budget else 1][name] = b
    for i, part in enumerate(parts):
        torch.save(part, out / "ab"[i] / f"blocks-{i}.pt")
    for d in ("a", "b"):
        mib = sum(p.stat().st_size for p in (out / d).iterdir()) / 2**20
        print(f"{final / d}: {mib:.1f} MiB")
        if mib > PART_MIB:
            shutil.rmtree(out)
            raise SystemExit(f"{final / d} would not fit one device call ({mib:.1f} MiB)")
    shutil.rmtree(final, ignore_errors=True)
    out.rename(final)


if __name__ == "__main__":
    main()
