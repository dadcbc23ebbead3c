"""One plain decoding step, op by op: where a token's time goes, in one process.

    .venv/bin/python benchmarks/step_profile.py --dtype bfloat16 --context 300

Times, at one position after a prefill of ``--context`` tokens, the decoder's whole one-token step
(``Decoder.forward(..., last=True)``), with its layers in one native call (``native.Layers``) where it
runs and on the per-op path, and each op of the per-op path as it calls them, swept over every
layer as a step sweeps them (so the weights stream from memory as they do in a step), each the
median of ``--repeats`` sweeps. For the linears it also times the bare C call (preallocated output,
no Python wrapper) where the native kernel runs. The gap between the step and the sum of its ops is
the glue: views, slices, masks, the cache write's indexing and the Python between calls.
"""
from __future__ import annotations

import argparse

import torch

from knnssd import models
from knnssd.bench import markdown as md
from knnssd.bench import options
from knnssd.engine.model import native, native_library
from knnssd.engine.model.layers import embed, heads, span_masks
from knnssd.engine.model.timing import median_ms


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    options.model(ap)
    options.dtype(ap, "bfloat16", choices=("bfloat16", "float32", "gguf"))
    ap.add_argument("--context", type=int, default=300)
    ap.add_argument("--repeats", type=int, default=200)
    options.threads(ap)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    try:
        lm = models.load(a.model, dtype=a.dtype)
    except models.ModelError as e:  # e.g. --dtype gguf where the block kernels do not run: one line
        raise SystemExit(f"step_profile.py: {e}") from None
    dec = lm.decoder
    s = dec.stack
    torch.manual_seed(0)
    ids = torch.randint(0, s.embed.shape[0], (a.context + 1,))
    dec.reserve(a.context + 64)
    dec.forward(ids[: a.context], 0, last=True)
    tok, start = ids[a.context :], a.context
    layers = s.layers
    L = len(layers)

    one_call = dec.layers_call(dec.stack) is not None
    fused = median_ms(lambda: dec.forward(tok, start, last=True), "cpu", a.repeats) if one_call else None
    dec._layers_call = lambda stack: None  # the per-op path from here on
    step = median_ms(lambda: dec.forward(tok, start, last=True), "cpu", a.repeats)

    # the step's own intermediate values, one per layer, to call each op on
    with torch.inference_mode():
        pos, at = torch.arange(start, start + 1), slice(start, start + 1)
        attn = dec.attention_for(1)
        spans = dec.spans(start, 1, attn)
        h = embed(s, tok)
        x = layers[0].attn_norm(h)
        qkv = layers[0].qkv(x)[0]
        rope = dec.rope_at(pos, h)
        masks = span_masks(attn, pos, spans, layers[0].window)
        q, k, v = heads(s, layers[0], qkv, rope[layers[0].rope])
        kc, vc = dec.cache.write(0, at, k.transpose(0, 1)[None], v.transpose(0, 1)[None])
        (sp, m), = masks
        att = attn.attend(q, kc[:, :, : sp.keys], vc[:, :, : sp.keys], m, s.scale)
        gu = layers[0].gate_up(x)
        gate, up = gu.chunk(2, dim=-1)
        act = layers[0].act(gate) * up
        hidden = s.norm(h)[0]

        def sweep(fn):
            return lambda: [fn(i, layer) for i, layer in enumerate(layers)]

        rows = []  # (op, calls per step, ms per step)

        def add(name, calls, fn):
            rows.append((name, calls, median_ms(fn, "cpu", a.repeats)))

        add("embed", 1, lambda: embed(s, tok))
        add("rope tables", 1, lambda: dec.rope_at(pos, h))
        add("attention masks", 1, lambda: span_masks(attn, pos, spans, layers[0].window))
        add("norms (attn, mlp)", 2 * L, sweep(lambda i, ly: (ly.attn_norm(h), ly.mlp_norm(h))))
        add("qkv linear", L, sweep(lambda i, ly: ly.qkv(x)))
        add("heads: view + RoPE", L, sweep(lambda i, ly: heads(s, ly, qkv, rope[ly.rope])))
        add("cache write", L, sweep(lambda i, ly: dec.cache.write(i, at, k.transpose(0, 1)[None],
                                                                  v.transpose(0, 1)[None])))
        add("attention", L, sweep(lambda i, ly: attn.attend(q, dec.cache.k[i][:, :, : sp.keys],
                                                            dec.cache.v[i][:, :, : sp.keys], m, s.scale)))
        add("o linear", L, sweep(lambda i, ly: ly.o(att)))
        add("residual adds", 2 * L, sweep(lambda i, ly: (h + h, h + h)))
        add("gate_up linear", L, sweep(lambda i, ly: ly.gate_up(x)))
        if layers[0].silu and native.silu_mul(gu) is not None:
            add("SiLU product (native)", L, sweep(lambda i, ly: native.silu_mul(gu)))
        else:
            add("chunk + act + mul", L, sweep(lambda i, ly: (lambda g, u: ly.act(g) * u)(*gu.chunk(2, dim=-1))))
        add("down linear", L, sweep(lambda i, ly: ly.down(act)))
        add("final norm", 1, lambda: s.norm(h))
        add("lm_head", 1, lambda: s.lm_head(hidden[-1:]))
        head = s.lm_head(hidden[-1:])
        add("logits to fp32", 1, lambda: head.float())

        bare, read = {}, 0  # read: the bytes the bare calls' packed weights and scales take (GGUF's blocks included)
        kernel = native_library.tiled("linear")
        if kernel is not None and all(hasattr(getattr(layers[0], n), "kernel") for n in ("qkv", "o", "gate_up", "down")):
            threads = torch.get_num_threads()
            for name, inp in (("qkv", x), ("o", att), ("gate_up", x), ("down", act)):
                kern = [getattr(ly, name).kernel for ly in layers]
                read += sum(_bytes(kk) for kk in kern)
                xin = inp.reshape(-1, inp.shape[-1]).contiguous()
                outs = [torch.empty(1, kk.n, dtype=torch.bfloat16) for kk in kern]
                bare[f"{name} linear"] = median_ms(
                    lambda: [kk.kernel(xin.data_ptr(), xin.stride(0), *kk.weights, o.data_ptr(), 1, kk.k, kk.n, threads)
                             for kk, o in zip(kern, outs)], "cpu", a.repeats)
            head = s.lm_head.kernel
            read += _bytes(head)
            hin = hidden[-1:].contiguous()
            hout = torch.empty(1, head.n, dtype=torch.bfloat16)
            bare["lm_head"] = median_ms(lambda: head.kernel(hin.data_ptr(), hin.stride(0), *head.weights,
                                                            hout.data_ptr(), 1, head.k, head.n, threads),
                                        "cpu", a.repeats)

    weight_bytes = sum(p.numel() * p.element_size() for p in lm.model.parameters())
    total = sum(ms for _, _, ms in rows)
    print(f"{a.model} {a.dtype}, {a.threads} threads, context {a.context}, step '{dec.exactness.step}', "
          f"weights {weight_bytes / 1e6:.0f} MB")
    table = [*([name, calls, f"{ms:.2f}", f"{ms / step:.0%}", f"{bare[name]:.2f}" if name in bare else ""]
               for name, calls, ms in rows),
             ["sum of the ops", "", f"{total:.2f}", f"{total / step:.0%}", ""],
             ["glue (step less the ops)", "", f"{step - total:.2f}", f"{(step - total) / step:.0%}", ""],
             ["**whole step, per-op path**", "", f"**{step:.2f}**", "100%", ""]]
    if fused is not None:
        table.append(["**whole step, one native call for the layers** (``native.Layers``)", "", f"**{fused:.2f}**",
                      f"{fused / step:.0%}", ""])
    print("\n".join(md.table(["op", "calls per step", "ms per step", "share of step", "bare C call, ms"], table)))
    if bare:
        print(f"bare C linears, head included: {sum(bare.values()):.2f} ms a step "
              f"({read / sum(bare.values()) / 1e6:.1f} GB/s of the {read / 1e6:.0f} MB they read)")


def _bytes(kernel: native.Linear) -> int:
    """What one call of a native linear reads of its weights: the packed tensor and its scales."""
    return sum(t.numel() * t.element_size() for t in (kernel.packed, kernel.scale) if t is not None)


if __name__ == "__main__":
    main()
