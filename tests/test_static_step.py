"""The static step (``engine/static/step.py``) and its runner (``engine/static/graphs.py``) on tiny random models.

It computes what the lean forward computes; it compiles whole (``fullgraph=True``: a graph break fails)
at fixed shapes, and the compiled step, run again on new inputs in the same buffers, matches the eager
one without compiling again. These run on every machine; the CUDA-graph cases skip without CUDA.
"""
from __future__ import annotations

import logging

import pytest
import torch

from knnssd.engine.model.decoder import Decoder
from knnssd.engine.spec.loop import GenerationConfig, generate
from knnssd.engine.spec.drafters import LayerSkip, NGram
from knnssd.engine.static.graphs import StaticDecoder, StepRunner
from knnssd.engine.model.skip import SkipMask
from knnssd.engine.model.weights import from_hf
from knnssd.engine.static.step import StaticCache, keys_bucket, keys_buckets, plain, rows_bucket, step
from tiny import COMMON, hf_greedy, prompt_ids, tiny

ARCHS = ("llama", "gemma3")  # gemma3: per-head norms, post norms, sliding windows, two rotary tables
TOL = 1e-4  # fp32: the two forms order a few sums differently
MASK = dict(attn=(1,), mlp=(2,))


def _ids(n: int, seed: int) -> torch.Tensor:
    return torch.randint(2, COMMON["vocab_size"], (n,), generator=torch.Generator().manual_seed(seed))


def _long(*values: int) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.long)


@pytest.mark.parametrize("arch", ARCHS)
def test_the_static_step_computes_what_the_lean_forward_does(arch):
    model = tiny(arch)
    runner = StepRunner(from_hf(model), StaticCache(from_hf(model), slots=2, length=64), graphs=False)
    ids = [_ids(24, 1), _ids(24, 2)]
    mine = [Decoder(from_hf(model)), Decoder(from_hf(model))]
    # a prefill each: 12 and 9 rows, padded to buckets of 16
    for b, n in enumerate((12, 9)):
        got = runner(ids[b][:n], torch.arange(n), torch.full((n,), b))[0]
        assert torch.allclose(got, mine[b].forward(ids[b][:n], 0).logits, atol=TOL)
    # a skip-mask draft step of sequence 0, then the full verify pass that rewrites its K/V
    mask = SkipMask.from_layers(4, **MASK)
    got = runner(ids[0][12:13], _long(12), _long(0), skip=mask)[0]
    assert torch.allclose(got, mine[0].forward(ids[0][12:13], 12, mask=mask).logits, atol=TOL)
    got = runner(ids[0][12:15], torch.arange(12, 15), torch.zeros(3, dtype=torch.long))[0]
    assert torch.allclose(got, mine[0].forward(ids[0][12:15], 12).logits, atol=TOL)
    # a packed pass: one row of sequence 1 and two of sequence 0, interleaved
    got = runner(torch.stack((ids[0][15], ids[1][9], ids[0][16])), _long(15, 9, 16), _long(0, 1, 0))[0]
    want0 = mine[0].forward(ids[0][15:17], 15).logits
    want1 = mine[1].forward(ids[1][9:10], 9).logits
    assert torch.allclose(got, torch.stack((want0[0], want1[0], want0[1])), atol=TOL)


@pytest.mark.parametrize("arch", ARCHS)
def test_the_step_compiles_whole_and_runs_again_on_new_inputs(arch):
    """``torch.compile(fullgraph=True, dynamic=False)`` of the full step (inductor), and of a draft step and a
    one-sequence step (aot_eager, which checks the same graph in less time). The second call's inputs are new
    values in the same buffers and must not compile again; each call's logits and K/V are checked against the
    eager step's on a copy of the cache."""
    s = plain(from_hf(tiny(arch)))
    cache = StaticCache(s, slots=2, length=64)
    prompt = _ids(10, 3)
    step(s, cache.k, cache.v, cache.tables, prompt, torch.arange(10), torch.zeros(10, dtype=torch.long))
    ids, pos, slots = torch.zeros(4, dtype=torch.long), torch.zeros(4, dtype=torch.long), torch.zeros(4, dtype=torch.long)
    mask = SkipMask.from_layers(4, **MASK)
    packed = [(_ids(4, 4), _long(10, 11, 12, 13), _long(0, 0, 0, 0)),
              (_ids(4, 5), _long(10, 3, 11, 12), _long(0, 1, 0, 2))]  # the second: other slots, a scratch row
    one = [(_ids(4, 6), _long(10, 11, 12, 13), _long(0, 0, 0, 0)),
           (_ids(4, 7), _long(12, 13, 14, 0), _long(0, 0, 0, 2))]  # one sequence's rows, read as a view of slot 0
    for skip, backend, slot, calls in ((None, "inductor", None, packed), (mask, "aot_eager", None, packed),
                                       (None, "aot_eager", 0, one)):
        torch._dynamo.reset()
        compiled = torch.compile(step, fullgraph=True, dynamic=False, backend=backend)
        for n, (i, p, sl) in enumerate(calls):
            ids.copy_(i), pos.copy_(p), slots.copy_(sl)
            k, v = [t.clone() for t in cache.k], [t.clone() for t in cache.v]
            with torch.inference_mode():
                want = step(s, k, v, cache.tables, ids, pos, slots, skip, slot)
                with torch.compiler.set_stance("fail_on_recompile" if n else "default"):
                    got = compiled(s, cache.k, cache.v, cache.tables, ids, pos, slots, skip, slot)
            assert all(torch.allclose(a, b, atol=1e-5) for a, b in zip(got, want)), (arch, skip, slot, n)
            for a, b in zip(cache.k + cache.v, k + v):
                assert torch.allclose(a, b, atol=1e-5)


def test_rows_go_to_buckets_and_scratch_rows_leave_the_slots_alone():
    assert [rows_bucket(n) for n in (1, 2, 3, 5, 64, 65)] == [1, 2, 4, 8, 64, 128]
    with pytest.raises(ValueError, match="at most"):
        rows_bucket(10**6)
    s = from_hf(tiny("llama"))
    cache = StaticCache(s, slots=1, length=64)
    runner = StepRunner(s, cache, graphs=False)
    runner(_ids(3, 6), torch.arange(3), torch.zeros(3, dtype=torch.long))  # 3 rows in a bucket of 4
    written = [(t[0, :, :3] != 0).any().item() for t in cache.k]
    assert all(written)
    assert all(not (t[0, :, 3:] != 0).any() for t in cache.k + cache.v)  # the padding row wrote only scratch


def test_without_cuda_the_runner_runs_eagerly_and_says_so(caplog):
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    s = from_hf(tiny("llama"))
    with caplog.at_level(logging.INFO, logger="knnssd.engine.static.graphs"):
        runner = StepRunner(s, StaticCache(s, slots=1, length=64))
    assert not runner.graphs
    assert "runs eagerly" in caplog.text
    runner(_ids(2, 7), torch.arange(2), torch.zeros(2, dtype=torch.long))
    assert runner.captures == []


@pytest.mark.parametrize("arch", ARCHS)
def test_the_static_decoder_runs_the_decoding_loop_as_the_lean_decoder_does(arch):
    """Plain decoding, an n-gram drafter and a skip-mask drafter on ``StaticDecoder`` give HF's greedy tokens;
    its exactness is probed on its own step."""
    dec = StaticDecoder(Decoder(from_hf(tiny(arch))), length=512, graphs=False)
    assert dec.exactness.step == "static" and isinstance(dec.exactness.exact, bool)
    config = GenerationConfig(max_new_tokens=24)
    for i in (0, 1):
        for drafter in (None, NGram(max_len=4), LayerSkip(SkipMask.from_layers(4, **MASK), max_len=3)):
            new, stats = generate(dec, prompt_ids(arch, i), drafter, config)
            assert tuple(new) == hf_greedy(arch, i, 24), (arch, i, drafter)
    with pytest.raises(ValueError, match="int8"):
        dec.int8_stack()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("arch", ARCHS)
def test_graphed_steps_replay_what_the_eager_step_computes(arch):
    model = tiny(arch, dtype=torch.bfloat16).to("cuda")
    s = from_hf(model)
    graphed = StepRunner(s, StaticCache(s, slots=2, length=64))
    eager = StepRunner(s, StaticCache(s, slots=2, length=64), graphs=False)
    ids = _ids(16, 10).cuda()
    for runner in (graphed, eager):
        runner(ids[:10], torch.arange(10, device="cuda"), torch.zeros(10, dtype=torch.long, device="cuda"))
    mask = SkipMask.from_layers(4, **MASK)
    for t in range(10, 16):
        for skip in (mask, None):
            args = (ids[t : t + 1], torch.tensor([t], device="cuda"), torch.zeros(1, dtype=torch.long, device="cuda"))
            assert all(torch.equal(a, b) for a, b in zip(graphed(*args, skip=skip), eager(*args, skip=skip)))
    assert {(c.skip, c.rows, c.slot) for c in graphed.captures} == {(None, 1, None), (mask, 1, None)}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_the_graphed_static_decoder_drafts_to_its_own_plain_tokens():
    dec = StaticDecoder(Decoder(from_hf(tiny("llama", dtype=torch.bfloat16).to("cuda"))), length=512)
    assert dec.exactness.step == "static_graphed"
    config = GenerationConfig(max_new_tokens=24)
    for i in (0, 1):
        own, _ = generate(dec, prompt_ids("llama", i), None, config)
        if dec.exactness.exact:
            for drafter in (NGram(max_len=4), LayerSkip(SkipMask.from_layers(4, **MASK), max_len=3)):
                assert generate(dec, prompt_ids("llama", i), drafter, config)[0] == own
    assert {c.rows for c in dec.runner.captures} >= {1, 4}


def test_a_long_prefill_runs_in_chunks_of_the_largest_captured_bucket(monkeypatch):
    """Each chunk's outputs are kept before the next chunk runs: here, as a replayed graph's are, they live in one
    buffer per bucket that every call of the bucket overwrites."""
    buffers = {}
    eager = StepRunner.__call__

    @torch.inference_mode()
    def replayed(self, ids, pos, slots, skip=None, slot=None, keys=None):
        logits, hidden = eager(self, ids, pos, slots, skip, slot, keys)
        n, key = ids.shape[0], (skip, rows_bucket(ids.shape[0]), slot, keys)
        if key not in buffers:
            buffers[key] = (logits.new_empty(key[1], logits.shape[1]), hidden.new_empty(key[1], hidden.shape[1]))
        bl, bh = buffers[key]
        bl[:n].copy_(logits), bh[:n].copy_(hidden)
        return bl[:n], bh[:n]

    monkeypatch.setattr(StepRunner, "__call__", replayed)
    s = from_hf(tiny("llama"))
    dec, lean = StaticDecoder(Decoder(s), length=512, graphs=False), Decoder(from_hf(tiny("llama")))
    ids = _ids(150, 11)  # three chunks: 64, 64 and 22 rows
    got, want = dec.forward(ids, 0), lean.forward(ids, 0)
    assert torch.allclose(got.logits, want.logits, atol=TOL) and torch.allclose(got.hidden, want.hidden, atol=TOL)
    got = dec.forward(ids[:100], 0, last=True)  # two chunks: the last row's logits, every row's hidden state
    assert torch.allclose(got.logits, want.logits[99:100], atol=TOL)
    assert torch.allclose(got.hidden, want.hidden[:100], atol=TOL)
    with pytest.raises(ValueError, match="at least 312 positions"):
        StaticDecoder(Decoder(s), length=256, graphs=False)


def test_plain_greedy_decoding_runs_a_step_ahead_and_stops_where_the_lean_loop_does():
    """On a ``runs_ahead`` decoder, plain greedy decoding launches each step before reading the last one: one
    step past an EOS, none past max_new_tokens; the step past the stop leaves the next request's tokens as
    they were."""
    dec = StaticDecoder(Decoder(from_hf(tiny("llama"))), length=512, graphs=False)
    lean = Decoder(from_hf(tiny("llama")))
    prompt = prompt_ids("llama", 0)
    want = generate(lean, prompt, None, GenerationConfig(max_new_tokens=24))[0]
    eos = want[10]
    stop = want.index(eos)
    launched = []
    forward = dec.forward
    dec.forward = lambda ids, start, **kw: (launched.append(start) if start >= len(prompt) else None,
                                            forward(ids, start, **kw))[1]
    assert generate(dec, prompt, None, GenerationConfig(max_new_tokens=24, eos_ids=(eos,)))[0] == want[: stop + 1]
    assert launched == list(range(len(prompt), len(prompt) + stop + 1))  # the last one past the EOS
    launched.clear()
    assert generate(dec, prompt, None, GenerationConfig(max_new_tokens=24))[0] == want
    assert len(launched) == 23  # the first token comes from the prefill
    other = prompt_ids("llama", 1)
    assert generate(dec, other, None, GenerationConfig(max_new_tokens=24))[0] == \
        generate(lean, other, None, GenerationConfig(max_new_tokens=24))[0]


def test_key_buckets_double_from_the_least_up_to_the_cache_length():
    assert keys_buckets(2048) == [512, 1024, 2048] and keys_buckets(700) == [512, 700]
    assert keys_bucket(513, 2048) == 1024 and keys_bucket(1, 400) == 400
    with pytest.raises(ValueError, match="do not fit"):
        keys_bucket(2049, 2048)


def test_a_request_reads_the_key_bucket_its_reserve_chose():
    """A request's steps attend over the bucket of its prompt plus max_new_tokens, not the whole cache, and
    give the lean decoder's tokens; a forward past the reserve takes a bigger bucket."""
    dec = StaticDecoder(Decoder(from_hf(tiny("llama"))), length=1100, graphs=False)
    lean = Decoder(from_hf(tiny("llama")))
    config = GenerationConfig(max_new_tokens=24)
    for drafter in (None, NGram(max_len=4)):
        assert generate(dec, prompt_ids("llama", 0), drafter, config)[0] == \
            generate(lean, prompt_ids("llama", 0), None, config)[0]
        assert dec.keys == 512
    dec.reserve(600)
    assert dec.keys == 1024
    dec.reserve(10)
    dec.forward(torch.zeros(3, dtype=torch.long), 700)
    assert dec.keys == 1024


def test_warm_runs_every_captured_bucket_at_every_key_bucket(monkeypatch):
    dec = StaticDecoder(Decoder(from_hf(tiny("llama"))), length=1100, graphs=False)
    seen = []
    call = StepRunner.__call__
    monkeypatch.setattr(StepRunner, "__call__", lambda self, ids, pos, slots, skip=None, slot=None, keys=None: (
        seen.append((ids.shape[0], keys, skip is not None)), call(self, ids, pos, slots, skip, slot, keys))[1])
    dec.warm((SkipMask.from_layers(4, **MASK),))
    assert sorted(set(seen)) == sorted({(r, k, False) for r in (1, 2, 4, 8, 16, 32, 64) for k in (512, 1024, 1100)}
                                       | {(1, k, True) for k in (512, 1024, 1100)})
    assert dec.keys == 1100 and not dec._pinned


def test_a_step_that_fails_to_compile_runs_uncompiled_with_a_warning(monkeypatch, caplog):
    import knnssd.engine.static.graphs as graphs

    def broken(*args, **kwargs):
        raise RuntimeError("no compiler here")

    monkeypatch.setattr(graphs, "_compiled_step", lambda: broken)
    s = from_hf(tiny("llama"))
    runner = StepRunner(s, StaticCache(s, slots=1, length=64), graphs=False, compiled=True)
    with caplog.at_level(logging.WARNING, logger="knnssd.engine.static.graphs"):
        got = runner(_ids(3, 8), torch.arange(3), torch.zeros(3, dtype=torch.long))[0]
    want = StepRunner(s, StaticCache(s, slots=1, length=64), graphs=False)(_ids(3, 8), torch.arange(3),
                                                                            torch.zeros(3, dtype=torch.long))[0]
    assert torch.equal(got, want) and not runner.compiled
    assert "compiling the static step failed (RuntimeError: no compiler here); it runs uncompiled" in caplog.text
    dec = StaticDecoder(Decoder(s), length=512, graphs=False, compiled=True)
    assert not dec.runner.compiled and dec.exactness.step == "static"  # the form its probe measured


def test_the_step_ahead_keeps_the_stats_of_the_ordinary_loop():
    dec = StaticDecoder(Decoder(from_hf(tiny("llama"))), length=512, graphs=False)
    prompt = prompt_ids("llama", 1)
    want = generate(dec, prompt, None, GenerationConfig(max_new_tokens=24))[0]
    for config in (GenerationConfig(max_new_tokens=24), GenerationConfig(max_new_tokens=24, eos_ids=(want[7],)),
                   GenerationConfig(max_new_tokens=1)):
        ahead = generate(dec, prompt, None, config)
        dec.runs_ahead = False  # the ordinary loop, on the same decoder
        try:
            ordinary = generate(dec, prompt, None, config)
        finally:
            del dec.runs_ahead
        assert ahead[0] == ordinary[0]
        for field in ("new_tokens", "steps", "accepted", "drafted", "stop", "drafted_at", "accepted_at"):
            assert getattr(ahead[1], field) == getattr(ordinary[1], field), (config, field)


def test_a_row_at_the_last_position_of_its_key_bucket_sees_its_own_key():
    s = from_hf(tiny("llama"))
    runner = StepRunner(s, StaticCache(s, slots=1, length=1024), graphs=False)
    ids = _ids(512, 12)
    zeros = torch.zeros(512, dtype=torch.long)
    runner(ids[:511], torch.arange(511), zeros[:511], slot=0, keys=512)
    got = runner(ids[511:], _long(511), zeros[:1], slot=0, keys=512)[0].clone()
    want = runner(ids[511:], _long(511), zeros[:1], slot=0)[0]  # over all 1,024 positions
    assert torch.allclose(got, want, atol=TOL)


def test_a_warm_that_fails_part_way_leaves_reserve_choosing_buckets(monkeypatch):
    dec = StaticDecoder(Decoder(from_hf(tiny("llama"))), length=1100, graphs=False)
    calls = []

    def failing(self, *args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("out of memory")
        return call(self, *args, **kwargs)

    call = StepRunner.__call__
    monkeypatch.setattr(StepRunner, "__call__", failing)
    with pytest.raises(RuntimeError, match="out of memory"):
        dec.warm()
    assert not dec._pinned
    dec.reserve(600)
    assert dec.keys == 1024


def test_a_tapped_prefill_on_the_static_step_is_the_eager_decoders_residual_stream():
    """A routed prompt's prefill asks for the residual stream after the router's pooling layer."""
    dec = Decoder(from_hf(tiny("llama")))
    static = StaticDecoder(dec, length=512, graphs=False)
    ids = torch.tensor(prompt_ids("llama", 0, length=70))  # two chunks of the captured buckets
    static.reserve(80)
    out = static.forward(ids, 0, last=True, tap=2)
    plain = static.forward(ids, 0, last=True)
    assert torch.equal(out.logits, plain.logits) and torch.equal(out.hidden, plain.hidden)
    dec.reserve(80)
    want = dec.forward(ids, 0, last=True, tap=2)
    assert out.tapped.shape == want.tapped.shape == (70, COMMON["hidden_size"])
    torch.testing.assert_close(out.tapped, want.tapped, rtol=TOL, atol=TOL)
