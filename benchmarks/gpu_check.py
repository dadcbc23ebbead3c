"""The prepared GPU check (issue 44): the static step, eager and on CUDA graphs, in one short run.

    python3 benchmarks/gpu_check.py --out "$OUT" [--weights artifacts/gpu]

It needs torch and transformers only, as a GPU machine's own Python has them (``gpu_pack.py`` packs the real
weights for it), and writes ``gpu_check.json`` and ``gpu_check.md`` to ``--out``:

- the exactness probe's choice for the eager engine and for the graphed static step;
- SmolLM2-135M in bf16, one prompt at a time: own plain decoding eager (``decoder.Decoder``) and graphed
  (``graphs.StaticDecoder``), each drafter graphed (n-gram, layer-skip at 25% and 50% of the sub-layers,
  hybrid, suffix with a cache of the earlier prompts' outputs), HF ``generate``, and each drafter's
  agreement with graphed plain decoding (where it differs: where, and whether the deciding rows do);
- packed plain decoding on the static step at 1, 16 and 64 sequences, eager and graphed;
- the batched engine over 64 jobs: eagerly at the size ``auto`` picks, and on 64 static slots;
- what routed generation's plan weighs: the eager and the static slots' packed pass at a few sizes, and a
  tapped prefill on static slots;
- a random-weight Llama-2-7B-shaped model: its graphed one-row step against the bandwidth floor of its
  weights, and its 25% and 50% skip draft steps.

Without ``--weights`` SmolLM2's shape gets random weights: the speeds hold, the drafters' acceptance does not.
``--smoke`` runs tiny shapes on any device, to check the script itself (a test runs it on the CPU).
docs/gpu.md says how to carry the weights and the prompts to a GPU machine.
"""
from __future__ import annotations

import argparse
import copy
import gc
import json
import platform
import sys
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the checkout, where knnssd is not installed

from knnssd.bench import options  # noqa: E402
from knnssd.bench.gpu_report import SECTIONS, markdown  # noqa: E402
from knnssd.bench.packed_blocks import load_packed  # noqa: E402
from knnssd.bench.shapes import LLAMA2_7B, SMOLLM2, TINY, llama  # noqa: E402
from knnssd.engine.spec.loop import GenerationConfig, generate, mean_accepted  # noqa: E402
from knnssd.engine.model.build import make_decoder  # noqa: E402
from knnssd.engine.model.decoder import Decoder  # noqa: E402
from knnssd.engine.spec.drafters import Hybrid, LayerSkip, NGram, Suffix  # noqa: E402
from knnssd.engine.model import exactness  # noqa: E402
from knnssd.engine.batch.plan import auto_slots, slot_bytes  # noqa: E402
from knnssd.engine.model.cache import BUCKET  # noqa: E402
from knnssd.engine.batch.plan import plan as eager_plan  # noqa: E402
from knnssd.engine.batch.scheduler import PromptJob, decode_batch  # noqa: E402
from knnssd.engine.static.graphs import StaticDecoder, StepRunner  # noqa: E402
from knnssd.engine.model.skip import SkipMask  # noqa: E402
from knnssd.engine.spec.suffix import SuffixCache  # noqa: E402
from knnssd.engine.model.weights import from_hf  # noqa: E402
from knnssd.engine.static.slots import StaticSlots  # noqa: E402
from knnssd.engine.static.slots import plan as static_plan  # noqa: E402
from knnssd.engine.static.slots import slots_length  # noqa: E402
from knnssd.engine.spec.request_params import KV_MEMORY  # noqa: E402
from knnssd.models import STATIC_POSITIONS  # noqa: E402
from knnssd.engine.static.step import StaticCache, keys_buckets, step  # noqa: E402
from knnssd.engine.model.timing import median_ms, read_bandwidth, sync  # noqa: E402
from knnssd.search.proxy import least_influential  # noqa: E402


def smollm2(a, device: torch.device):
    """SmolLM2 from ``--weights`` (``gpu_pack.py``'s folder) and its tokenizer, else its shape with random
    weights (no tokenizer)."""
    if a.weights is None:
        return llama(TINY if a.smoke else SMOLLM2, device), None, "random weights, SmolLM2's shape"
    model, tok = load_packed(Path(a.weights), device)
    return model, tok, "SmolLM2-135M-Instruct's Q4_1 GGUF, de-quantized to bf16 as knnssd loads it"


def prompt_ids(a, tok, vocab: int) -> list[list[int]]:
    """Eval rows of ``--prompts`` (jsonl with ``prompt``; rows marked calib are skipped) in the chat template,
    or random ids whose second half repeats the first (so n-gram lookup finds matches)."""
    path = a.prompts or (Path(a.weights) / "a" / "prompts.jsonl" if a.weights else None)
    if tok is not None and path:
        rows = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
        rows = [r for r in rows if r.get("split") != "calib"][: a.n_prompts]
        return [tok.apply_chat_template([{"role": "user", "content": r["prompt"]}], add_generation_prompt=True,
                                        tokenize=True, return_dict=False) for r in rows]
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(a.n_prompts):
        half = torch.randint(2, vocab, (a.prompt_len // 2,), generator=g).tolist()
        out.append(half + half)
    return out


def decode_rows(dec, prompts: list[list[int]], drafter_of, config: GenerationConfig, before=None
                ) -> tuple[float, list[list[int]], float]:
    """(decode tokens/s over the prompts after a warm-up, each prompt's tokens, mean accepted length).
    ``before``: called with each prompt's index just before it runs (outside the timed decoding)."""
    generate(dec, prompts[0], drafter_of(), GenerationConfig(max_new_tokens=8))  # warm-up: captures, kernels
    tokens, new, secs, acc, steps = [], 0, 0.0, 0, 0
    for k, ids in enumerate(prompts):
        if before is not None:
            before(k)
        out, stats = generate(dec, ids, drafter_of(), config)
        tokens.append(out)
        new += stats.new_tokens
        secs += stats.total_s - stats.prefill_s
        acc += sum(stats.accepted)
        steps += stats.steps
    return new / secs, tokens, mean_accepted(acc, steps)


def divergence(dec, prompt: list[int], drafter_of, config: GenerationConfig, plain: list[int],
               drafted: list[int]) -> dict:
    """Where a drafter's tokens first leave plain decoding's (``plain``, ``drafted``: new tokens): the index,
    both tokens, plain's top-two logit margin there, and whether the full-model row that chose the
    drafter's token equals the one that chose plain's, bitwise. Unequal rows: the verify pass is not
    row-invariant there (a near tie shows in the margin); equal rows: something else differs."""
    i = next(j for j, (x, y) in enumerate(zip(plain, drafted)) if x != y)
    pos = len(prompt) + i - 1  # new token i is chosen by the row at this position

    def rows_at(drafter) -> torch.Tensor:
        seen = {}
        forward = dec.forward

        def record(ids, start, mask=None, **kw):
            out = forward(ids, start, mask=mask, **kw)
            if mask is None:  # a full-model pass: its rows' logits by position (the last pass over one decides)
                first = start + ids.shape[0] - out.logits.shape[0]
                for j in range(out.logits.shape[0]):
                    seen[first + j] = out.logits[j].clone()
            return out

        dec.forward = record
        try:
            generate(dec, prompt, drafter, config)
        finally:
            del dec.forward
        return seen[pos]

    mine, theirs = rows_at(None), rows_at(drafter_of())
    top = mine.float().topk(2).values
    return dict(index=i, plain=plain[i], drafted=drafted[i], margin=float(top[0] - top[1]),
                rows_equal=bool(torch.equal(mine, theirs)),
                max_abs_diff=float((mine.float() - theirs.float()).abs().max()))


def influence_masks(dec: Decoder, fractions: tuple[float, ...]) -> dict[float, SkipMask]:
    """For each fraction, the mask that skips that share of sub-layers with the smallest updates relative to
    the residual stream (``Decoder.forward(influence=True)``, as the search's first masks are chosen)."""
    ids = torch.arange(2, 66, device=dec.device)
    dec.reserve(64)
    sizes = dec.forward(ids, 0, influence=True).influence.cpu()  # (2, L)
    return {f: least_influential(sizes, round(f * 2 * dec.n_layers)) for f in fractions}


def engine_section(a, device: torch.device) -> tuple[dict, Decoder, list[list[int]]]:
    model, tok, weights = smollm2(a, device)
    vocab = model.config.vocab_size
    prompts = prompt_ids(a, tok, vocab)
    config = GenerationConfig(max_new_tokens=a.max_new_tokens, eos_ids=())  # every prompt decodes the same length
    eager = make_decoder(model)
    if not isinstance(eager, Decoder):
        raise SystemExit(f"the lean forward did not take {type(model).__name__} (plain HF fallback): no static step")
    masks = influence_masks(eager, (0.25, 0.5))
    rows, base, forms = {}, None, {}
    eager_tps, eager_tokens, _ = decode_rows(eager, prompts, lambda: None, config)
    rows["plain, eager engine"] = dict(tok_s=eager_tps, mean_accepted=1.0)
    drafters = {
        "plain": lambda: None,
        "n-gram": lambda: NGram(max_len=8),
        "layer-skip 25%": lambda: LayerSkip(masks[0.25], max_len=4),
        "layer-skip 50%": lambda: LayerSkip(masks[0.5], max_len=4),
        "hybrid (n-gram, 25%)": lambda: Hybrid(NGram(max_len=8), LayerSkip(masks[0.25], max_len=4)),
        # the earlier prompts' outputs in one cache, per form (made anew below), as a server keeps them
        "suffix (max 11)": lambda: Suffix(max_len=11, cache=caches[-1]),
    }
    caches: list[SuffixCache] = []
    kept: dict[int, SuffixCache] = {}  # the cache as each prompt found it, so that a divergence can be replayed

    def keep(k: int) -> None:
        kept[k] = copy.deepcopy(caches[-1])
    one = torch.tensor([7], device=device)
    for form, compiled in (("graphed", False), ("graphed+compiled", True))[: 2 if "engine" in a.compiled else 1]:
        caches.append(SuffixCache())
        t0 = time.perf_counter()
        static = StaticDecoder(eager, length=a.length, compiled=compiled)
        warm_s = static.warm(tuple(masks.values()))  # every bucket a prompt's decoding reads, before any is timed
        setup_s = time.perf_counter() - t0
        plain_name = f"plain, {form}"
        for name, make in drafters.items():
            suffix = name.startswith("suffix")
            tps, tokens, mean_acc = decode_rows(static, prompts, make, config, keep if suffix else None)
            if name == "plain":
                base = (tps, tokens)
            rows[f"{name}, {form}"] = dict(tok_s=tps, mean_accepted=mean_acc, vs_plain=tps / base[0],
                                          agreement=sum(x == y for x, y in zip(tokens, base[1])) / len(prompts))
            apart = [k for k, (x, y) in enumerate(zip(tokens, base[1])) if x != y]
            if apart:  # the first prompt where they differ: where, and why
                k = apart[0]
                again = (lambda: Suffix(max_len=11, cache=copy.deepcopy(kept[k]))) if suffix else make
                rows[f"{name}, {form}"]["divergence"] = dict(
                    prompt=k, **divergence(static, prompts[k], again, config, base[1][k], tokens[k]))
        rows[plain_name]["equal_to_eager_engine"] = sum(x == y for x, y in zip(base[1], eager_tokens)) / len(prompts)
        # a one-row step alone, through the decoder's forward (buffer copies, replay, clones), each to its end
        static.reserve(400)  # the key bucket of a short request
        step_ms = median_ms(lambda: static.forward(one, 300, last=True), device, repeats=50, warmup=3)
        # a verify pass's cost by rows: with the one-row step, the ceiling a drafter's acceptance allows
        by_rows = {T: median_ms(lambda T=T: static.forward(one.expand(T), 300), device, repeats=30, warmup=3)
                   for T in (2, 4, 8, 9, 16)}
        forms[form] = dict(probe=static.exactness.describe(), exact=static.exactness.exact,
                           cuda_graphs=static.runner.graphs, compiled=static.runner.compiled, setup_s=setup_s,
                           compile_s=static.runner.compile_s, one_row_step_ms=step_ms, step_ms_by_rows=by_rows,
                           loop_ms_per_token=1e3 / rows[plain_name]["tok_s"],
                           keys=static.keys, warm_s=warm_s,
                           captures=[dict(mask=c.skip.n_skipped if c.skip else 0, rows=c.rows, slot=c.slot, keys=c.keys,
                                          seconds=c.seconds, mib=c.bytes / 2**20) for c in static.runner.captures])
    t0 = time.perf_counter()
    n = 0
    for ids in prompts if a.hf else ():
        x = torch.tensor([ids], device=device)
        out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=a.max_new_tokens, do_sample=False,
                             min_new_tokens=a.max_new_tokens)
        n += out.shape[1] - x.shape[1]
    sync(device)
    if n:
        rows["HF generate (prefill included)"] = dict(tok_s=n / (time.perf_counter() - t0))
    return dict(weights=weights, prompts=len(prompts), max_new_tokens=a.max_new_tokens,
                probe_eager=eager.exactness.describe(), forms=forms,
                masks={str(f): m.to_dict() for f, m in masks.items()}, rows=rows), eager, prompts


def batched_section(a, eager: Decoder, prompts: list[list[int]], device: torch.device) -> dict:
    """The batched engine (``scheduler.decode_batch``) over ``a.jobs`` jobs (the prompts in turn): eagerly at the
    batch size ``auto`` picks (``bench-throughput``'s ``auto``), and on 64 static slots (graphed on CUDA),
    plain and with n-gram drafts; tokens/s over the whole run, plans included, and how many outputs equal
    the eager engine's plain ones."""
    config = GenerationConfig(max_new_tokens=a.max_new_tokens, eos_ids=())
    jobs = [prompts[i % len(prompts)] for i in range(a.jobs)]
    positions = max(len(p) for p in jobs) + a.max_new_tokens
    out, want = {}, None
    for form in ("eager auto", "static"):
        try:  # a form that fails keeps the other's figures
            t0 = time.perf_counter()
            if form == "eager auto":
                slots = auto_slots(eager, positions, len(jobs))
                decoder, p = eager, eager_plan(eager, slots, positions)
            else:
                slots = min(a.slots, len(jobs))
                decoder = StaticSlots(eager, slots, length=max(positions, exactness.PROBE_POSITIONS))
                p = static_plan(decoder, slots)
            plan_s = time.perf_counter() - t0
            for name, make in (("plain", lambda: None), ("n-gram", lambda: NGram(max_len=8))):
                batch = [PromptJob(ids, make(), config) for ids in jobs]
                t0 = time.perf_counter()
                done = {id(f.job): f.tokens for f in decode_batch(decoder, batch, p)}
                secs = time.perf_counter() - t0
                tokens = [done[id(j)] for j in batch]
                if want is None:
                    want = tokens
                equal = sum(x == y for x, y in zip(tokens, want)) / len(jobs)
                out[f"{form}, {name}"] = dict(slots=slots, tok_s=sum(map(len, tokens)) / secs, plan_s=plan_s,
                                              exact=p.exact, equal_to_eager_plain=equal)
        except Exception as e:
            traceback.print_exc()
            out[form] = dict(error=f"{type(e).__name__}: {e}".splitlines()[0])
        decoder = p = None
        gc.collect()  # a StaticSlots and its views refer to each other: free its cache and graphs before the next
    return out


def choice_section(a, eager: Decoder, device: torch.device) -> dict:
    """What ``RoutedGenerator.plan`` weighs where the static step runs: the eager plan's packed pass of one row a
    sequence (timed over a short context) against that of the static slots it would make (over their whole
    length), for a few (slots, positions); and whether a routed prefill on static slots (tapped at the middle
    layer) gives the untapped pass's logits, bitwise."""
    out: dict = {}
    sizes = ((2, 320),) if a.smoke else ((16, 512), (64, 512), (64, 1536))
    for slots, positions in sizes:
        try:  # the slots routed generation makes (SmolLM2's context is longer than a static decoder holds)
            length = slots_length(slots, positions, STATIC_POSITIONS, slot_bytes(eager, BUCKET) // BUCKET,
                                  KV_MEMORY)
            key = f"{slots} x {positions} ({length} a slot)"
            p = eager_plan(eager, slots, positions)
            static = StaticSlots(eager, slots, length=length)
            f = static_plan(static, slots)
            out[key] = dict(eager_ms=1e3 * p.costs(slots), static_ms=1e3 * f.costs(slots), eager_exact=p.exact,
                            static_exact=f.exact)
            view, ids = static.views[0], torch.tensor(prompt_ids(a, None, eager.stack.embed.shape[0])[0],
                                                      device=device)
            tapped = view.forward(ids, 0, last=True, tap=eager.n_layers // 2)
            untapped = view.forward(ids, 0, last=True)
            out[key]["tap_equal"] = bool(torch.equal(tapped.logits, untapped.logits))
        except Exception as e:  # noqa: BLE001 - one size's failure keeps the others'
            traceback.print_exc()
            out[f"{slots} x {positions}"] = dict(error=f"{type(e).__name__}: {e}".splitlines()[0])
        p = f = static = view = None
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    try:
        out["key_buckets"] = bucket_invariance(eager.stack, 512 if a.smoke else 2048)
    except Exception as e:  # noqa: BLE001
        traceback.print_exc()
        out["key_buckets"] = dict(error=f"{type(e).__name__}: {e}".splitlines()[0])
    return out


def bucket_invariance(stack, length: int) -> dict:
    """Does a row's step give the same logits, bitwise, whatever key bucket it attends over (the positions
    past its own masked)? Where it does, static slots could pick a bucket each step by their longest active
    sequence and stay exact. One row at position 300 after a 300-token prefill, at every key bucket of a
    ``length`` cache, for one sequence's graph (``slot`` 0) and a packed one's (``slot`` None)."""
    runner = StepRunner(stack, StaticCache(stack, slots=1, length=length))
    dev = stack.device
    ids = torch.randint(2, stack.embed.shape[0], (301,), generator=torch.Generator().manual_seed(3)).to(dev)
    zero = torch.zeros(301, dtype=torch.long, device=dev)
    runner.chunked(ids[:300], torch.arange(300, device=dev), zero[:300], slot=0)
    out = {}
    for slot in (0, None):
        rows = {K: runner(ids[300:], torch.tensor([300], device=dev), zero[:1], slot=slot, keys=K)[0].clone()
                for K in keys_buckets(length)}
        first = next(iter(rows.values()))
        out["one sequence" if slot == 0 else "packed"] = {str(K): bool(torch.equal(x, first)) for K, x in rows.items()}
    return out


def throughput_section(a, stack, device: torch.device) -> dict:
    """Packed plain decoding on the static step: B sequences, one row each a step, greedy on the device."""
    out = {}
    steps = 8 if a.smoke else 64
    for B in a.sizes:
        for form in ("eager", "graphed", "graphed+compiled")[: 3 if "throughput" in a.compiled else 2]:
            cache = StaticCache(stack, slots=B, length=a.prompt_len + steps + 16)
            runner = StepRunner(stack, cache, graphs=form != "eager", compiled=form == "graphed+compiled")
            slots = torch.arange(B, device=device)
            ids = torch.randint(2, stack.embed.shape[0], (B,), device=device)
            for b in range(B):  # a prompt each
                p = torch.randint(2, stack.embed.shape[0], (a.prompt_len,), device=device)
                runner(p, torch.arange(a.prompt_len, device=device), slots[b : b + 1].expand(a.prompt_len))
            pos = torch.full((B,), a.prompt_len, device=device)

            def run(n: int) -> None:
                nonlocal ids
                for _ in range(n):
                    logits, _ = runner(ids, pos, slots)
                    ids = logits.argmax(-1)
                    pos.add_(1)

            run(2)  # capture
            pos.fill_(a.prompt_len)
            sync(device)
            t0 = time.perf_counter()
            run(steps)
            sync(device)
            out[f"{B} {form}"] = dict(tok_s=B * steps / (time.perf_counter() - t0))
    return out


def big_section(a, device: torch.device, note=lambda section: None) -> dict:
    """The large shape's one-row step (one sequence, graphed on CUDA) at a short and a long cache, against the
    bandwidth floor of its weights; its 25% and 50% skip draft steps, against the full one; where its time goes
    (the step's linears alone, graphed, and on CUDA the kernels of one eager step by time). ``note(out)`` gets
    what is measured so far after each part, so a run cut off keeps it."""
    model = llama(LLAMA2_7B if a.big == "7b" else TINY, device)
    s = from_hf(model)
    weight_bytes = sum(t.numel() * t.element_size() for layer in s.layers
                       for t in (layer.qkv.weight, layer.o.weight, layer.gate_up.weight, layer.down.weight))
    weight_bytes += s.lm_head.weight.numel() * s.lm_head.weight.element_size()
    del model
    bandwidth = read_bandwidth(device, 2048 if a.big == "7b" else 64, torch.bfloat16)
    floor_ms = weight_bytes / bandwidth * 1e3
    out = dict(shape="Llama-2-7B" if a.big == "7b" else "tiny", weight_gib=weight_bytes / 2**30,
               read_gb_s=bandwidth / 1e9, floor_ms=floor_ms, graphed=device.type == "cuda")
    linears = linears_ms(s, device)
    out.update(linears_ms=linears, linears_over_floor=linears / floor_ms)
    note(out)
    L = s.n_layers
    masks = {"25%": SkipMask.from_layers(L, attn=range(1, L, 4), mlp=range(3, L, 4)),
             "50%": SkipMask.from_layers(L, attn=range(1, L, 2), mlp=range(0, L, 2))}
    runs = [(256, False), (2048, False)] + [(256, True)] * ("big" in a.compiled)
    for length, compiled in runs:  # the keys a step reads grow with the cache; the floor counts the weights alone
        runner = StepRunner(s, StaticCache(s, slots=1, length=length), graphs=device.type == "cuda", compiled=compiled)
        ids = torch.randint(2, s.embed.shape[0], (128,), device=device)
        zero = torch.zeros(128, dtype=torch.long, device=device)
        runner(ids, torch.arange(128, device=device), zero, slot=0)
        one = (ids[:1], torch.tensor([128], device=device), zero[:1])
        tag = "_compiled" if compiled else ("" if length == 256 else f"_{length}")
        ms = median_ms(lambda: runner(*one, slot=0), device, repeats=20, warmup=3)
        out.update({f"step_ms{tag}": ms, f"step_over_floor{tag}": ms / floor_ms})
        if compiled:
            out["compile_s"] = runner.compile_s
        note(out)
        if length == 256:
            out[f"draft_cost_vs_full{tag}"] = {
                name: median_ms(lambda m=m: runner(*one, skip=m, slot=0), device, repeats=20, warmup=3) / ms
                for name, m in masks.items()}
            note(out)
        if length == 256 and not compiled and device.type == "cuda":
            out["kernels"] = kernel_profile(lambda: step(runner.stack, runner.cache.k, runner.cache.v,
                                                         runner.cache.tables, *one, slot=0, keys=256))
            note(out)
        runner = None  # its cache and graphs, before the next one's
    return out


def linears_ms(s, device: torch.device) -> float:
    """Milliseconds of a one-row step's linears alone (every layer's, and the head), each on a fixed input,
    graphed on CUDA: what its weights' reads cost with nothing else between them."""
    xs = {}

    def run() -> None:
        for layer in s.layers:
            for lin in (layer.qkv, layer.o, layer.gate_up, layer.down):
                w = lin.weight.shape[1]
                if w not in xs:
                    xs[w] = torch.randn(1, w, dtype=lin.weight.dtype, device=device)
                lin(xs[w])
        x = xs.setdefault(s.lm_head.weight.shape[1], torch.randn(1, s.lm_head.weight.shape[1], dtype=s.dtype,
                                                                  device=device))
        s.lm_head(x)

    with torch.inference_mode():
        run()
        if device.type != "cuda":
            return median_ms(run, device, repeats=20, warmup=2)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            run()
        torch.cuda.current_stream().wait_stream(side)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            run()
        return median_ms(g.replay, device, repeats=20, warmup=3)


def kernel_profile(fn, top: int = 14) -> dict:
    """The CUDA kernels of one eager call of ``fn`` (after two unprofiled ones): how many, their summed time,
    and the ``top`` names by time (a name cut to 90 characters, its count and microseconds)."""
    from torch.profiler import ProfilerActivity, profile

    with torch.inference_mode():
        fn(), fn()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            fn()
            torch.cuda.synchronize()
    kernels = [e for e in prof.key_averages() if e.device_type.name == "CUDA" and e.count]
    total = sum(e.device_time_total for e in kernels)
    kernels.sort(key=lambda e: -e.device_time_total)
    return dict(count=sum(e.count for e in kernels), total_us=total,
                top=[dict(name=e.key[:90], count=e.count, us=e.device_time_total) for e in kernels[:top]])


def names(value: str) -> list[str]:
    """A comma-separated list of section names (``engine`` and ``SECTIONS``), checked."""
    out = [v for v in value.split(",") if v]
    unknown = sorted(set(out) - {"engine", *SECTIONS})
    if unknown:
        raise argparse.ArgumentTypeError(f"no section {', '.join(unknown)} (of engine, {', '.join(SECTIONS)})")
    return out


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="folder for gpu_check.json and gpu_check.md")
    ap.add_argument("--weights", help="gpu_pack.py's folder (SmolLM2's weights, tokenizer and prompts); without it, "
                    "random weights of SmolLM2's shape")
    ap.add_argument("--prompts", help="a jsonl of prompts (field 'prompt'; rows with split 'calib' are skipped); "
                    "default: the one in --weights")
    ap.add_argument("--n-prompts", type=int, default=5, help="prompts (the packed ones: one per domain)")
    options.max_new_tokens(ap)
    ap.add_argument("--prompt-len", type=int, default=128, help="length of random prompts")
    ap.add_argument("--length", type=int, default=2048, help="positions of the static cache")
    ap.add_argument("--sizes", type=lambda v: [int(x) for x in v.split(",")], default=[1, 16, 64])
    ap.add_argument("--jobs", type=int, default=64, help="jobs of the batched section (the prompts in turn)")
    ap.add_argument("--slots", type=int, default=64, help="static slots of the batched section")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--big", choices=["7b", "tiny"], default="7b", help="the large shape: Llama-2-7B, or a tiny one "
                    "(a CPU run: 7B random weights take 13.5 GB)")
    ap.add_argument("--compiled", nargs="?", const=["engine", "throughput", "big"], default="", type=names,
                    help="also the static step compiled by torch.compile (inductor) before capture, in these "
                    "sections (default: engine,throughput,big, those that run it): each form, bucket and mask "
                    "compiles once")
    ap.add_argument("--no-hf", dest="hf", action="store_false", help="leave out HF generate (its eager loop is slow)")
    ap.add_argument("--sections", type=names, default=["engine", *SECTIONS],
                    help=f"which to run, of engine,{','.join(SECTIONS)} (default: all); the others take SmolLM2 "
                    "from the engine's set-up")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes: check the script, not the GPU")
    a = ap.parse_args(argv)
    if a.smoke:
        a.n_prompts, a.max_new_tokens, a.prompt_len, a.length, a.sizes, a.big = 2, 12, 24, 512, [1, 4], "tiny"
        a.jobs, a.slots = 4, 2
    device = torch.device(a.device)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    import transformers

    t0 = time.perf_counter()
    report = dict(when=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), host=platform.node(),
                  device=torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
                  torch=torch.__version__, transformers=transformers.__version__, commit=_commit(), smoke=a.smoke)

    def done(name: str, section: dict, quiet: bool = False) -> None:
        # each section is written as it ends (and the big one part by part), so a run cut off by the machine's
        # time limit keeps what it measured
        report[name] = dict(section)
        report["seconds"] = time.perf_counter() - t0
        (out / "gpu_check.json").write_text(json.dumps(report, indent=2))
        print(f"[{report['seconds']:.0f} s] {name}: {json.dumps(section) if not quiet else sorted(section)}",
              flush=True)

    eager = prompts = None
    if {"engine", "throughput", "batched", "choice"} & set(a.sections):
        engine, eager, prompts = engine_section(a, device)  # the others' SmolLM2: its figures are kept too
        done("engine", engine)
    sections = {"throughput": lambda: throughput_section(a, eager.stack, device),
                "batched": lambda: batched_section(a, eager, prompts, device),
                "choice": lambda: choice_section(a, eager, device),
                "big": lambda: big_section(a, device, note=lambda part: done("big", part, quiet=True))}
    for name in SECTIONS:
        if name not in a.sections:
            continue
        if name == "big" and eager is not None:
            eager = None  # the 7B shape's weights need the room
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
        try:
            section = sections[name]()
        except Exception as e:  # one section's failure must not cost the others their device time
            traceback.print_exc()
            section = dict(report.get(name, {}), error=f"{type(e).__name__}: {e}".splitlines()[0])
        done(name, section)
    (out / "gpu_check.json").write_text(json.dumps(report, indent=2))
    (out / "gpu_check.md").write_text(markdown(report))
    print(markdown(report))
    return report


def _commit() -> str:
    head = Path(__file__).resolve().parents[1] / ".git" / "HEAD"
    try:
        ref = head.read_text().strip()
        if ref.startswith("ref: "):
            ref = (head.parent / ref[5:]).read_text().strip()
        return ref[:7]
    except OSError:
        return "unknown"


if __name__ == "__main__":
    main()
