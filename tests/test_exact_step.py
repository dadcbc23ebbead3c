"""The verify pass is exact: bitwise row-invariance of the chosen step, and speculative greedy
output token-identical to the decoder's own plain decoding, in bf16 as well as fp32.

A bf16 test skips (printing the probe's reason) only where the probe finds no row-invariant
implementation on this machine; fp32 must be exact everywhere.
"""
import dataclasses
import functools
import pickle

import pytest
import torch
import torch.nn.functional as F
from hypothesis import assume, given
from hypothesis import strategies as st

from knnssd.engine.model import attention
from knnssd.engine.model import exactness
from knnssd.engine.model import native, native_library
from knnssd.engine.model.attention import NATIVE, SDPA, Attention
from knnssd.engine.model.cache import SPAN
from knnssd.engine.spec.loop import GenerationConfig, generate
from knnssd.engine.spec.drafters import DrafterConfig, build
from knnssd.engine.model.build import make_decoder
from knnssd.engine.model.decoder import Decoder
from knnssd.engine.model.packed import forward_slots
from knnssd.engine.model.skip import SkipMask
from knnssd.engine.model.weights import Int8Linear, Linear, NativeLinear, from_hf
from test_device_step import set_early_stop
from tiny import ARCHS, prompt_ids, tiny

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
MAX_NEW = 24
STRADDLE = 2 * SPAN - 4  # a context whose passes of 5 tokens and more straddle a key-length boundary


@functools.lru_cache(maxsize=None)
def decoder(arch: str, dtype: str):
    return make_decoder(tiny(arch, dtype=DTYPES[dtype]))


def exact_or_skip(dec, dtype: str):
    ex = dec.exactness
    assert ex is not None
    if dtype == "float32":
        assert ex.exact, ex.note
    elif not ex.exact:
        pytest.skip(f"no exact bf16 step on this machine: {ex.note}")
    return ex


@pytest.mark.parametrize("dtype", sorted(DTYPES))
@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_chosen_step_is_row_invariant(arch, dtype):
    dec = decoder(arch, dtype)
    assert isinstance(dec, Decoder), f"{arch} {dtype} fell back to HF forwards"
    exact_or_skip(dec, dtype)
    # other random tokens than the probe's; at STRADDLE the longer passes cross a key-length boundary
    for seed, context in ((11, exactness.CONTEXT), (12, STRADDLE)):
        equal, total = exactness.row_check(dec, exactness.MAX_T, context, seed=seed)
        assert equal == total, f"{dec.exactness.step} at {context}: {equal}/{total} rows equal"


def test_positions_as_a_tensor_read_the_whole_reservation():
    """A step whose positions stay on the device (never read on the host) runs one shape for the whole
    generation: the reserved length, masked; the same logits as the step at its own key length, up to rounding."""
    dec = decoder("llama", "float32")
    ids = torch.tensor(prompt_ids("llama", 0, 12))
    by_int, by_tensor = dec.slot(), dec.slot()
    for d in (by_int, by_tensor):
        d.reserve(4 * 64)
        d.forward(ids[:10], 0)
    want = by_int.forward(ids[10:12], 10).logits
    got = by_tensor.forward(ids[10:12], torch.arange(10, 12)).logits
    assert torch.allclose(got, want, atol=1e-5, rtol=1e-5)


def _perturbed(impl: Attention) -> Attention:
    """An attention whose rows depend on how many there are: never row-invariant."""
    return Attention("perturbed", impl.mask, lambda q, k, v, m, s: impl.attend(q, k, v, m, s) * (1 + 0.01 * q.shape[0]),
                     impl.cache_fp32, impl.static)


def test_probe_reports_not_exact_for_an_implementation_that_is_not_row_invariant(caplog):
    dec = make_decoder(tiny("llama"))
    ex = exactness.choose(dec, candidates=(_perturbed(SDPA),))
    assert not ex.exact and ex.step == "perturbed" and "rows equal" in ex.note
    assert dec.exactness is not ex  # choose() reports; make_decoder stores
    dec.exactness = ex
    _, stats = generate(dec, prompt_ids("llama", 0), None, GenerationConfig(max_new_tokens=4))
    assert stats.exact is False and stats.step == "perturbed"


@pytest.mark.parametrize("dtype", sorted(DTYPES))
def test_native_rms_norm_is_row_invariant_and_computes_what_torch_does(dtype):
    if not native_library.available():
        pytest.skip("no C compiler here: norms run as torch ops")
    dt = DTYPES[dtype]
    g = torch.Generator().manual_seed(0)
    w = torch.randn(576, generator=g).to(dt)
    norm = native.RMSNorm.of(w, 1e-5)
    x = (torch.randn(1, 12, 576, generator=g) * 3).to(dt)
    rows = norm(x)
    assert rows.shape == x.shape and rows.dtype == dt
    assert all(torch.equal(rows[0, t], norm(x[:, t : t + 1])[0, 0]) for t in range(12))
    torch.testing.assert_close(rows, F.rms_norm(x, (576,), w, 1e-5), rtol=1e-5, atol=1e-5)
    heads = torch.randn(5, 15, 64, generator=g).to(dt)[:, 2:11]  # a q-norm's input: a strided slice of QKV
    qn = native.RMSNorm.of(torch.randn(64, generator=g).to(dt), 1e-6)
    torch.testing.assert_close(qn(heads), F.rms_norm(heads, (64,), qn.weight.to(dt), 1e-6), rtol=1e-5, atol=1e-5)
    assert norm(x.to(torch.float16)) is None  # a dtype the kernels do not take: the caller keeps torch ops


def test_native_linear_rows_do_not_depend_on_the_call_and_sum_in_fp32():
    w = (torch.randn(80, 96, generator=torch.Generator().manual_seed(0)) * 0.1).bfloat16()
    b = torch.randn(80, generator=torch.Generator().manual_seed(1)).bfloat16()
    lin = native.Linear.of(w, b)
    if lin is None:
        pytest.skip("no native bf16 linear here (no C compiler, no vector instruction set)")
    assert isinstance(Linear(w, b).packed(), NativeLinear)
    x = torch.randn(2, 20, 96, generator=torch.Generator().manual_seed(2)).bfloat16()
    rows = lin(x)
    assert rows.shape == (2, 20, 80) and rows.dtype == torch.bfloat16
    flat, want_rows = x.reshape(40, 96), rows.reshape(40, 80)
    assert all(torch.equal(lin(flat[a:e]), want_rows[a:e]) for a in range(0, 40, 7) for e in (a + 1, 40))
    wide = torch.cat((flat, flat[:, :32]), 1)[:, :96]  # rows 128 values apart
    assert wide.stride(0) == 128 and torch.equal(lin(wide[3:9]), want_rows[3:9])
    assert torch.equal(lin(flat[5:6].expand(3, 96)), want_rows[5:6].expand(3, 80))  # one row, stride 0
    assert torch.equal(pickle.loads(pickle.dumps(lin))(flat), want_rows)  # built again on load
    want = flat.float() @ w.float().T + b.float()  # summed in fp32, rounded once
    assert (lin(flat).float() - want).abs().max() <= 2 ** -7 * want.abs().max()
    assert lin(flat.float()) is None and native.Linear.of(w[:72], None) is None  # fp32; N not a multiple of 16
    one_core = dataclasses.replace(native_library.library(), openmp=False)  # a library built without OpenMP: only on one thread
    assert native_library.linear_preferred(one_core) == (torch.get_num_threads() == 1)


def test_native_int8_linear_computes_the_dequantized_product():
    w = (torch.randn(80, 96, generator=torch.Generator().manual_seed(0)) * 0.1).bfloat16()
    b = torch.randn(80, generator=torch.Generator().manual_seed(1)).bfloat16()
    lin = Int8Linear.from_weight(w, b)
    if lin.kernel is None:
        pytest.skip("no native bf16 linear here: int8 drafts run _weight_int8pack_mm")
    x = torch.randn(20, 96, generator=torch.Generator().manual_seed(2)).bfloat16()
    got = lin(x)
    assert all(torch.equal(lin(x[a : a + 1]), got[a : a + 1]) for a in range(20))
    want = x.float() @ (lin.q.float() * lin.scales.float()[:, None]).T + b.float()  # scaled, then the bias
    assert (got.float() - want).abs().max() <= 2 ** -7 * want.abs().max()
    scales = (w.float().abs().amax(1) / 127).clamp(min=1e-8)
    q = torch.round(w.float() / scales[:, None]).clamp(-127, 127).to(torch.int8)
    assert torch.equal(lin.q, q)  # the int8 weights, unpacked from the kernel's copy
    torch.testing.assert_close(lin(x.float()), got.float())  # fp32 rows run as bf16, as _weight_int8pack_mm's do


@pytest.mark.parametrize("dtype", sorted(DTYPES))
@pytest.mark.parametrize("d", [64, 32])  # full and partial (Phi3-style) rotary
def test_native_rope_rounds_as_the_torch_ops_do(dtype, d):
    if not native_library.available():
        pytest.skip("no C compiler here: RoPE runs as torch ops")
    dt = DTYPES[dtype]
    g = torch.Generator().manual_seed(d)
    for T in (1, 5):
        x = torch.randn(T, 15, 64, generator=g).to(dt)[:, :12]  # the q and k heads of QKV rows
        cos, sin = (torch.randn(T, 1, d, generator=g).to(dt) for _ in range(2))
        xr = x[..., :d]
        want = torch.cat((xr * cos + xr.roll(d // 2, -1) * sin, x[..., d:]), dim=-1)
        got = native.rope(x, cos, sin)
        assert got.is_contiguous() and torch.equal(got, want)


@pytest.mark.parametrize("dtype", sorted(DTYPES))
@pytest.mark.parametrize("D", [64, 24])  # the AVX-512 form where built (D a multiple of 16), and the portable one
def test_native_attention_reads_each_rows_own_keys_alone(dtype, D):
    if not native_library.available():
        pytest.skip("no C compiler here: attention runs as torch ops")
    dt = DTYPES[dtype]
    g = torch.Generator().manual_seed(D)
    S, KV, H, C = 3, 2, 6, 96  # GQA: 3 query heads per KV head
    k, v = (torch.randn(S, KV, C, D, generator=g).to(dt) for _ in range(2))
    q = torch.randn(5, H + 2 * KV, D, generator=g).to(dt)[:, :H]  # the q heads of QKV rows (strided)
    slots, pos = torch.tensor([0, 2, 1, 1, 0]), torch.tensor([10, 90, 0, 95, 57])
    for window in (None, 16):
        rows = native.Rows(slots, pos, window)
        out = native.attention(q, k, v, rows, 0.25)
        want = []
        for r in range(5):
            s, p = int(slots[r]), int(pos[r])
            lo = max(0, p - window + 1) if window else 0
            kk, vv = (t[s, :, lo : p + 1].double().repeat_interleave(H // KV, 0) for t in (k, v))
            a = torch.softmax((q[r].double()[:, None] * kk).sum(-1) * 0.25, -1)
            want.append((a[..., None] * vv).sum(1).reshape(-1))
        tol = 1e-5 if dt == torch.float32 else 2e-2
        torch.testing.assert_close(out.double(), torch.stack(want), rtol=tol, atol=tol)
        # bitwise the same for each row alone, and over a cache with a longer key length
        longer = [torch.cat((t, t.new_zeros(S, KV, 64, D)), dim=2) for t in (k, v)]
        alone = [native.attention(q[r : r + 1], k, v, native.Rows(slots[r : r + 1], pos[r : r + 1], window), 0.25)
                 for r in range(5)]
        assert torch.equal(torch.cat(alone), out)
        assert torch.equal(native.attention(q, *longer, native.Rows(slots, pos, window), 0.25), out)
        for threads in (1, 3, 16):  # its work items shared out among other thread counts (more than items too)
            rows = native.Rows(slots, pos, window)
            rows.threads = threads
            assert torch.equal(native.attention(q, k, v, rows, 0.25), out)
    past = torch.tensor([10, 90, 0, 96, 57])  # a row past the cache's 96 positions: refused
    assert native.attention(q, k, v, native.Rows(slots, past, None), 0.25) is None


def test_native_causal_attention_reads_each_rows_own_keys_alone():
    """The native prefill attention: each query reads keys 0..its position (GQA, a cache longer than the
    keys, rows strided as QKV slices), close to fp64's causal attention, and a row's bits do not depend on
    where the call starts or ends (a prompt prefilled in parts, at any position, gets its one-call rows)."""
    g = torch.Generator().manual_seed(3)
    T, KV, H, D, L = 77, 2, 6, 32, 90
    q = torch.randn(T, H + 2 * KV, D, generator=g).to(torch.bfloat16)[:, :H]
    k, v = (torch.randn(1, KV, L, D, generator=g).to(torch.bfloat16) for _ in range(2))
    got = native.causal(q, k, v, 0.25, 0)
    if got is None:
        pytest.skip("no native causal attention here (it needs avx512_bf16 and a C compiler)")
    kk, vv = (t[0, :, :T].double().repeat_interleave(H // KV, 0) for t in (k, v))  # (H, T, D)
    s = torch.einsum("thd,hjd->htj", q.double(), kk) * 0.25
    s = s.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
    want = torch.einsum("htj,hjd->thd", s.softmax(-1), vv).reshape(1, T, H * D)
    torch.testing.assert_close(got.double(), want, rtol=3e-2, atol=3e-2)
    for start in (1, 16, 33, T - 1):
        assert torch.equal(native.causal(q[start:], k, v, 0.25, start), got[:, start:])
        assert torch.equal(native.causal(q[:start], k, v, 0.25, 0), got[:, :start])
    assert native.causal(q.float(), k.float(), v.float(), 0.25, 0) is None  # bf16 only
    assert native.causal(q, k[:, :, :T - 1], v[:, :, :T - 1], 0.25, 0) is None  # fewer keys than positions
    q24, k24, v24 = (t[..., :24].contiguous() for t in (q, k, v))
    assert native.causal(q24, k24, v24, 0.25, 0) is None  # D not a multiple of 16


@pytest.mark.parametrize("H, KV, D", [(6, 2, 64), (6, 1, 96), (9, 1, 128)])  # 3, 6 and 9 query heads per KV head
def test_a_native_step_row_is_a_native_prefill_row(H, KV, D):
    """Where both native kernels run (bf16), the step's attention gives each row the bits the prefill's
    gives it: the same products, in the same order, whatever the call's other rows."""
    g = torch.Generator().manual_seed(D)
    T, L = 70, 80
    q = torch.randn(T, H, D, generator=g).to(torch.bfloat16)
    k, v = (torch.randn(1, KV, L, D, generator=g).to(torch.bfloat16) for _ in range(2))
    prefill = native.causal(q, k, v, 0.25, 0)
    if prefill is None:
        pytest.skip("no native causal attention here (it needs avx512_bf16 and a C compiler)")
    rows = torch.tensor([69, 0, 31, 16, 15, 17, 50])
    step = native.attention(q[rows], k, v, native.Rows(torch.zeros_like(rows), rows, None), 0.25)
    assert torch.equal(step, prefill[0, rows])


@pytest.mark.parametrize("dtype", sorted(DTYPES))
def test_causal_blocks_compute_causal_attention(dtype):
    """The prefill's blocked form: each query reads keys 0..t, over blocks that do not divide T, with GQA;
    a CPU bf16 prefill of more than one block takes it, as does its rest from a block boundary, with the
    same rows bitwise."""
    dt = DTYPES[dtype]
    g = torch.Generator().manual_seed(1)
    T, KV, H, D = 45, 2, 6, 16
    q = torch.randn(T, H, D, generator=g).to(dt)
    k, v = (torch.randn(1, KV, T, D, generator=g).to(dt) for _ in range(2))
    kk, vv = (t[0].double().repeat_interleave(H // KV, 0) for t in (k, v))  # (H, T, D)
    s = torch.einsum("thd,hjd->htj", q.double(), kk) * 0.25
    s = s.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
    want = torch.einsum("htj,hjd->thd", s.softmax(-1), vv).reshape(1, T, H * D)
    tol = 1e-5 if dt == torch.float32 else 3e-2
    for block in (8, 16, 64):
        got = attention.causal_blocks(q, k, v, 0.25, block=block)
        torch.testing.assert_close(got.double(), want, rtol=tol, atol=tol)
        # the rest of a prompt from a block boundary (its first blocks' K/V reused): the same rows, bitwise
        start = block * (T // (2 * block))
        assert torch.equal(attention.causal_blocks(q[start:], k, v, 0.25, start, block), got[:, start:])
    with pytest.raises(ValueError, match="not a multiple"):
        attention.causal_blocks(q[3:], k, v, 0.25, 3, 8)
    T = attention.CAUSAL_BLOCK + attention.PREFILL_ROWS + 7
    q = torch.randn(T, H, D, generator=g).to(dt)
    k, v = (torch.randn(1, KV, T, D, generator=g).to(dt) for _ in range(2))
    mask = attention.SDPA_DYNAMIC.mask(torch.arange(T), T, None)
    got = attention.SDPA_DYNAMIC.attend(q, k, v, mask, 0.25)
    own = native.causal(q, k, v, 0.25, 0)  # where the native linear runs, its causal kernel is the prefill's form
    form = own if own is not None else attention.causal_blocks(q, k, v, 0.25)
    assert torch.equal(got, form) == (dt == torch.bfloat16)
    start = attention.CAUSAL_BLOCK  # the step's form of a prefill's rest, from a block boundary
    rest = attention.SDPA_DYNAMIC.attend(q[start:], k, v, attention.SDPA_DYNAMIC.mask(torch.arange(start, T), T, None),
                                         0.25)
    assert torch.equal(rest, got[:, start:]) or dt != torch.bfloat16
    torch.testing.assert_close(rest.double(), got[:, start:].double(), rtol=tol, atol=tol)
    # a verify pass at a block boundary (PREFILL_ROWS rows or fewer) keeps the step's position mask
    short = attention.SDPA_DYNAMIC.mask(torch.arange(start, start + 4), start + 4, None)
    assert not isinstance(short[1], attention.Causal)


@pytest.mark.parametrize("dtype", sorted(DTYPES))
@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_native_attention_step_is_exact_and_pools(arch, dtype):
    """The C attention as the step: the probe finds it exact, and packed passes over a pool (one call
    per layer, rows at different key lengths) give each sequence its own pass's logits."""
    if not native_library.available():
        pytest.skip("no C compiler here: attention runs as torch ops")
    dec = Decoder(from_hf(tiny(arch, dtype=DTYPES[dtype])))
    ex = exactness.choose(dec, candidates=(NATIVE,))
    assert ex.exact and dec.attention is NATIVE, ex.note
    equal, total = exactness.row_check(dec, exactness.MAX_T, STRADDLE, seed=13)
    assert equal == total
    prompts = [prompt_ids(arch, i, length) for i, length in enumerate((5, 21, 9, 12, 7))]
    _packed_equals_own(dec, prompts, rows=(1, 4, 12, 2, 3), pooled=True)


@pytest.mark.parametrize("arch", ["llama", "mistral", "phi3"])  # a bias, a sliding window, a partial rotary
def test_a_pass_in_one_native_call_has_the_per_op_bits(arch):
    """``native.Layers``: a step's or a verify pass's layers in one C call give the logits and K/V of the
    per-op path bit for bit, for T = 1..12 rows, under a skip mask, and over int8 draft weights."""
    dec = Decoder(from_hf(tiny(arch, dtype=torch.bfloat16)))
    dec.set_attention(NATIVE)
    if dec.layers_call(dec.stack) is None:
        pytest.skip("no one-call layers here (no C compiler, no vector instruction set)")
    per_op = dec.slot()
    per_op._layers_call = lambda stack: None
    ids = torch.tensor(prompt_ids(arch, 0, 40))
    for d in (dec, per_op):
        d.reserve(64)
        d.forward(ids[:25], 0)
    mask = SkipMask.from_layers(dec.n_layers, attn=[1], mlp=[2])
    for T, m, stack in ((1, None, None), (2, None, None), (5, mask, None), (12, None, None), (3, None, "int8")):
        runs = []
        for d in (dec, per_op):
            out = d.forward(ids[25 : 25 + T], 25, mask=m, stack=d.int8_stack() if stack else None)
            runs.append((out.logits, out.hidden, [c[:, :, 25 : 25 + T].clone() for c in d.cache.k + d.cache.v]))
        (la, ha, ka), (lb, hb, kb) = runs
        assert torch.equal(la, lb) and torch.equal(ha, hb), (T, m, stack)
        assert all(torch.equal(x, y) for x, y in zip(ka, kb)), (T, m, stack)


def test_one_call_layers_find_every_layers_buffers_of_a_new_cache():
    """A cache allocated after another was freed can take its first and last layers' memory and not the
    rest: ``native.Layers`` must pass the C call every layer's buffers anew (a key of the ends alone once
    had a batch on a tiny model read a freed cache's middle layers, and decode other tokens)."""
    dec = Decoder(from_hf(tiny("llama", dtype=torch.bfloat16)))
    layers = dec.layers_call(dec.stack)
    if layers is None:
        pytest.skip("no one-call layers here (no C compiler, no vector instruction set)")
    slot = dec.slot()
    slot.reserve(16)
    k, v = list(slot.cache.k), list(slot.cache.v)
    layers._pointers(k, v)
    moved_k, moved_v = [k[0], *(t.clone() for t in k[1:-1]), k[-1]], [v[0], *(t.clone() for t in v[1:-1]), v[-1]]
    kp, vp = layers._pointers(moved_k, moved_v)
    assert list(kp) == [t.data_ptr() for t in moved_k] and list(vp) == [t.data_ptr() for t in moved_v]


def test_native_silu_product_rounds_as_the_torch_ops_do():
    if not native_library.available():
        pytest.skip("no C compiler here")
    g = torch.Generator().manual_seed(5)
    gu = (torch.randn(3, 2 * 200, generator=g) * 6).to(torch.bfloat16)
    got = native.silu_mul(gu)
    gate, up = gu.chunk(2, dim=-1)
    want = F.silu(gate) * up
    ulps = (got.view(torch.int16).int() - want.view(torch.int16).int()).abs()
    assert ulps.max() <= 1 and (ulps == 0).float().mean() > 0.98  # its exp is within about an ulp of torch's
    assert torch.equal(native.silu_mul(gu[1:2]), got[1:2])  # rows alone


def test_silu_mul_vector_lanes_give_the_scalar_loops_bits_for_every_bf16_gate():
    """17 values a row: the first 16 take the SIMD loop, the last the scalar one; every bf16 bit pattern
    as the gate (NaNs, infinities and subnormals included) gives the same product both ways."""
    if not native_library.available():
        pytest.skip("no C compiler here")
    gate = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)[:, None].expand(-1, 17)
    up = (torch.randn(65536, 1, generator=torch.Generator().manual_seed(1)) * 3).to(torch.bfloat16).expand(-1, 17)
    out = native.silu_mul(torch.cat([gate, up], 1)).view(torch.int16)
    assert torch.equal(out[:, 0], out[:, 16]) and torch.equal(out[:, 0], out[:, 7])


def test_a_library_that_lacks_a_kernel_is_reported_removed_and_not_used(monkeypatch, tmp_path, caplog):
    if not native_library.available():
        pytest.skip("no C compiler here")
    monkeypatch.setenv("KNNSSD_CACHE", str(tmp_path))
    monkeypatch.setattr(native_library, "SIGNATURES", {**native_library.SIGNATURES, "no_such_kernel": ("p",)})
    native_library.library.cache_clear()
    try:
        assert native_library.library() is None and "could not build the native kernels" in caplog.text
        assert not list((tmp_path / "native").iterdir())  # the broken library is gone: the next load builds again
        x = torch.randn(3, 4, 64)
        assert native.rope(x, torch.ones(1, 1, 64), torch.ones(1, 1, 64)) is None  # broadcast cos/sin: torch ops
    finally:  # the last call of library() here: a None it kept would leave every later test without the kernels
        native_library.library.cache_clear()


def test_without_a_compiler_norms_run_as_torch_ops(monkeypatch):
    monkeypatch.setenv("KNNSSD_NATIVE", "0")
    native_library.library.cache_clear()
    try:
        assert native.RMSNorm.of(torch.ones(8), 1e-6) is None
        dec = make_decoder(tiny("llama"))
        assert dec.stack.norm.kernel is None and dec.exactness.exact
    finally:
        native_library.library.cache_clear()


def test_probe_timing_stops_timing_only_the_candidates_that_trail(monkeypatch):
    """After ``PRUNE_AFTER`` rounds a candidate over ``PRUNE_MARGIN`` x the best total is not timed again; a near
    tie gets every round; every candidate keeps its best times so far."""
    costs = {"fast": (1.0, 2.0), "near": (1.1, 2.1), "slow": (2.0, 3.0)}
    runs = {name: tuple((lambda: None) for _ in parts) for name, parts in costs.items()}
    ms = {run: c for name, parts in runs.items() for run, c in zip(parts, costs[name])}
    calls = {name: 0 for name in costs}

    def timed(run, device, repeats, warmup):
        calls[next(n for n, parts in runs.items() if run in parts)] += 1
        return ms[run]

    monkeypatch.setattr(exactness, "median_ms", timed)
    best = exactness._best_of_rounds(list(runs.values()), torch.device("cpu"))
    assert best == [costs["fast"], costs["near"], costs["slow"]]
    assert calls == {"fast": 2 * exactness.TIMING_ROUNDS, "near": 2 * exactness.TIMING_ROUNDS,
                     "slow": 2 * exactness.PRUNE_AFTER}


def test_probe_remembers_its_exact_choice_on_its_machine_key(tmp_path, monkeypatch):
    record = tmp_path / "probe" / "tiny.json"
    first = make_decoder(tiny("llama"), record=record).exactness  # probed, checked against HF, remembered
    assert first.exact and not first.from_record and record.is_file() and len(first.tried) > 1
    dec = make_decoder(tiny("llama"), record=record)
    again = dec.exactness  # taken from the record: no probe, no timing
    assert again.exact and again.from_record and again.step == first.step and dec.attention.name == first.step
    assert again.tried == ((first.step, exactness.RECALLED),)
    assert [p.name for p in record.parent.iterdir()] == ["tiny.json"]  # no temp file left
    # the record is named by what the rounding depends on: kernel settings in the environment among them
    key = exactness.machine_key(torch.device("cpu"))
    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")  # how idle threads wait changes no result
    assert exactness.machine_key(torch.device("cpu")) == key
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
    assert exactness.machine_key(torch.device("cpu")) != key
    # a record of other candidates, or an unreadable one, is probed again from the start
    renamed = tuple(dataclasses.replace(c, name=c.name + "-v2") for c in exactness.implementations(exactness.MAX_T))
    redo = exactness.choose(make_decoder(tiny("llama")), candidates=renamed, record=record)
    assert redo.exact and not redo.from_record and len(redo.tried) > 1
    record.write_text("{not json")
    redo = make_decoder(tiny("llama"), record=record).exactness
    assert redo.exact and not redo.from_record and len(redo.tried) > 1
    # a choice that is not exact is never remembered
    other = tmp_path / "probe" / "other.json"
    exactness.remember(other, exactness.choose(make_decoder(tiny("llama")), candidates=(_perturbed(SDPA),)))
    assert not other.exists()


def test_records_of_the_same_weights_under_another_config_are_apart(tmp_path, monkeypatch):
    """The same weights with an edited config (here the norms' epsilon) compute other rows: their probe and plan
    records must not be the other config's (the weights' fingerprint, the same for both, named them before;
    the prompt vectors' cache: test_router_bank)."""
    import copy

    from knnssd import models

    monkeypatch.setenv("KNNSSD_CACHE", str(tmp_path))
    model = tiny("llama")
    edited = copy.deepcopy(model)
    edited.config.rms_norm_eps = model.config.rms_norm_eps * 10
    a, b = (models.LoadedModel(name="tiny", model=m, tokenizer=None, source="tiny", fingerprint="abc")
            for m in (model, edited))
    assert models.weights_fingerprint(model) == models.weights_fingerprint(edited)
    assert a._record("json") != b._record("json") and a.batch_record != b.batch_record
    assert a.config_key != b.config_key
    # fields set per load (the folder, the dtype) name no other record
    moved = copy.deepcopy(model).to(torch.bfloat16)
    moved.config.name_or_path = "/elsewhere"
    assert models.config_digest(moved.config) == a.config_key


def _drafters(n_layers: int):
    @st.composite
    def make(draw):
        p = draw(st.sampled_from([0.0, 0.15, 0.5, 0.9]))
        bits = draw(st.lists(st.floats(0, 1), min_size=2 * n_layers, max_size=2 * n_layers))
        return DrafterConfig(
            kind=draw(st.sampled_from(["layer_skip", "ngram", "hybrid"])),
            mask=SkipMask.from_bits([b < p for b in bits]).to_dict(),
            max_len=draw(st.integers(1, 11)),
            threshold=draw(st.sampled_from([0.0, 0.0, 0.3, 0.8])),
            int8=draw(st.booleans()),
            ngram_sizes=draw(st.lists(st.integers(1, 4), min_size=1, max_size=3, unique=True)),
            adaptive=draw(st.booleans()),
        )

    return make()


@functools.lru_cache(maxsize=None)
def plain(arch: str, dtype: str, prompt: int) -> tuple[int, ...]:
    return tuple(generate(decoder(arch, dtype), prompt_ids(arch, prompt), None, GenerationConfig(max_new_tokens=MAX_NEW))[0])


@given(arch=st.sampled_from(sorted(ARCHS)), prompt=st.integers(0, 3), data=st.data())
def test_bf16_speculative_greedy_equals_own_plain_decoding(arch, prompt, data):
    dec = decoder(arch, "bfloat16")
    assume(dec.exactness.exact)  # architectures without an exact bf16 step here skip in the row-invariance test
    cfg = data.draw(_drafters(dec.n_layers))
    early = data.draw(st.booleans())  # False: draft on the device, cut at the threshold afterwards (the CUDA path)
    drafter = set_early_stop(build(cfg, dec.n_layers), early)
    out, stats = generate(dec, prompt_ids(arch, prompt), drafter, GenerationConfig(max_new_tokens=MAX_NEW))
    assert tuple(out) == plain(arch, "bfloat16", prompt), f"{cfg.describe()} early_stop={early}"
    assert stats.exact


def _inputs_as_blocks_take_them(x: torch.Tensor) -> torch.Tensor:
    """x (M, K) bf16 as the block kernels multiply it, in float64: each block of 32 in 8 bits (``native.c``'s
    ``quant_block``: d = max |x| / 127, x / d rounded half away from zero), on every instruction set."""
    xb = x.float().view(x.shape[0], -1, 32)
    d = xb.abs().amax(-1, keepdim=True) / 127
    v = (xb * torch.where(d != 0, 1 / d, torch.zeros_like(d))).double()  # fp32 products, as the kernel's
    return ((v.sign() * (v.abs() + 0.5).floor()).clamp(-127, 127) * d.double()).view(x.shape)


def test_native_4bit_linear_sums_blocks_in_fp32_row_by_row():
    """``native.Linear.q4``: w = d q + m per block of 32 inputs, the product within a bf16 rounding of fp64's (of the
    inputs as the kernel takes them: ``_inputs_as_blocks_take_them``), each row's bits the same whatever the call's
    rows; its packing round-trips and survives a pickle."""
    g = torch.Generator().manual_seed(0)
    N, K = 96, 256
    q = torch.randint(0, 16, (N, K), generator=g, dtype=torch.uint8)
    d = (torch.rand(N, K // 32, generator=g) * 0.02).half()
    m = (-torch.rand(N, K // 32, generator=g) * 0.1).half()
    b = torch.randn(N, generator=g)
    lin = native.Linear.q4(q, d, m, b)
    if lin is None:
        pytest.skip("no native 4-bit linear here (no C compiler, no vector instruction set)")
    assert all(torch.equal(x, y) for x, y in zip(lin.q4_parts(), (q, d, m)))
    w = (q.double().view(N, -1, 32) * d.double()[..., None] + m.double()[..., None]).view(N, K)
    x = torch.randn(13, K, generator=g).to(torch.bfloat16)
    y = lin(x)
    want = _inputs_as_blocks_take_them(x) @ w.T + b.double()
    assert ((y.double() - want).abs() <= want.abs() * 2**-8 + 1e-3).all()
    assert all(torch.equal(lin(x[i : i + 1]), y[i : i + 1]) for i in range(13)) and torch.equal(lin(x[3:9]), y[3:9])
    assert torch.equal(pickle.loads(pickle.dumps(lin))(x), y)
    assert native.Linear.q4(q[:, :48], d[:, :1], m[:, :1], None) is None  # K not a multiple of 32


def test_native_8bit_linear_sums_blocks_in_fp32_row_by_row():
    """``native.Linear.q8``: w = d q per block of 32 inputs (GGUF's Q8_0), as the 4-bit one: within a bf16
    rounding of fp64's (of the inputs as the kernel takes them), rows alone, its packing round-trips and survives a
    pickle."""
    g = torch.Generator().manual_seed(1)
    N, K = 80, 192
    q = torch.randint(-128, 128, (N, K), generator=g).to(torch.int8)
    d = (torch.rand(N, K // 32, generator=g) * 0.01).half()
    lin = native.Linear.q8(q, d, None)
    if lin is None:
        pytest.skip("no native 8-bit linear here (no C compiler, no vector instruction set)")
    assert all(torch.equal(x, y) for x, y in zip(lin.q8_parts(), (q, d)))
    w = (q.double().view(N, -1, 32) * d.double()[..., None]).view(N, K)
    assert torch.equal(lin.dense(), w.float().to(torch.bfloat16))
    x = torch.randn(11, K, generator=g).to(torch.bfloat16)
    y = lin(x)
    want = _inputs_as_blocks_take_them(x) @ w.T
    assert ((y.double() - want).abs() <= want.abs() * 2**-8 + 1e-3).all()
    assert all(torch.equal(lin(x[i : i + 1]), y[i : i + 1]) for i in range(11)) and torch.equal(lin(x[2:7]), y[2:7])
    assert torch.equal(pickle.loads(pickle.dumps(lin))(x), y)
    assert native.Linear.q8(q[:, :48], d[:, :1], None) is None  # K not a multiple of 32


@pytest.mark.parametrize("kind", ["q4_1", "q8_0"])
def test_quantize_makes_llama_cpps_blocks(kind):
    """Each weight is within half a step of its block's de-quantized value, and the step is llama.cpp's:
    (max - min) / 15 for Q4_1, max |w| / 127 for Q8_0."""
    from knnssd.engine.model.quantized import quantize

    w = torch.randn(48, 96, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    x = w.float().view(48, 3, 32)
    q, d, *m = quantize(w, kind)
    if kind == "q8_0":
        assert q.dtype == torch.int8 and torch.equal(d, (x.abs().amax(-1) / 127).half())
        back = q.float().view(48, 3, 32) * d.float()[..., None]
    else:
        assert int(q.max()) <= 15 and torch.equal(d, ((x.amax(-1) - x.amin(-1)) / 15).half())
        back = q.float().view(48, 3, 32) * d.float()[..., None] + m[0].float()[..., None]
    assert ((back - x).abs() <= d.float()[..., None] * 0.51 + x.abs() * 2e-3).all()


@pytest.mark.parametrize("kind", ["q4_1", "q8_0"])
def test_blocks_made_at_load_run_rows_alone_and_speculation_equals_plain(kind):
    """``--dtype q4_1`` / ``q8_0`` on a tiny Llama: every projection and the head on block kernels, the step
    row-invariant, and drafted decoding token-identical to plain decoding in that precision."""
    from knnssd.engine.model.quantized import quantize_stack

    if native_library.tiled("linear_q4") is None or native_library.tiled("linear_q8") is None:
        pytest.skip("no native block kernels here (no C compiler, no vector instruction set)")
    dec = make_decoder(tiny("llama", dtype=torch.bfloat16), weights=lambda s: quantize_stack(s, kind)[0])
    want = {"q4_1": "q4", "q8_0": "q8"}[kind]
    assert all(getattr(layer, n).kernel.kind == want for layer in dec.stack.layers for n in ("qkv", "o", "gate_up", "down"))
    assert dec.stack.lm_head.kernel.kind == "q8"
    exact_or_skip(dec, "bfloat16")
    equal, total = exactness.row_check(dec, exactness.MAX_T, STRADDLE, seed=17)
    assert equal == total
    ids, cfg = prompt_ids("llama", 1, 12), GenerationConfig(max_new_tokens=MAX_NEW)
    plain, _ = generate(dec, ids, None, cfg)
    for drafter in (DrafterConfig(kind="ngram", max_len=4), DrafterConfig(kind="layer_skip", int8=True, max_len=3)):
        assert generate(dec, ids, build(drafter, dec.n_layers), cfg)[0] == plain, drafter.describe()


def test_gguf_precision_needs_a_gguf_file_and_the_cpu(tmp_path):
    from knnssd import models

    with pytest.raises(models.ModelError, match="not one"):
        models.gguf_weights(str(tmp_path))
    with pytest.raises(models.ModelError, match="--device cpu"):
        models.resolve_dtype("gguf", torch.device("cuda"))
    assert models.precision_name("gguf") == "gguf" and models.resolve_dtype("gguf", torch.device("cpu")) == torch.bfloat16


# Several sequences in one pass (the batched engine's verify): each call's rows equal its own forward's.

def _packed_equals_own(dec: Decoder, prompts: list[list[int]], rows: tuple[int, ...], pooled: bool = False) -> None:
    """Packed passes (``pooled``: attention batched over a ``SlotPool``, at key lengths that differ
    between slots, and within the pass of a sequence whose rows straddle a key-length boundary) give
    each sequence the logits of its own pass, and the K/V its next steps read."""
    from knnssd.engine.model.packed import forward_slots

    # odd sequences one SPAN further on (two key lengths, interleaved); the first pass of the longest
    # draft starts 3 positions before a boundary
    longest = rows.index(max(rows))
    prompts = [p + p[:1] * ((b % 2) * SPAN + (b == longest) * ((SPAN - 3 - len(p)) % SPAN))
               for b, p in enumerate(prompts)]

    if pooled and not dec.attention.poolable:
        pytest.skip(f"{dec.attention.name} has no batched form")
    packed_slots, pool = dec.pooled_slots(len(prompts)) if pooled else ([dec.slot() for _ in prompts], None)
    own_slots = [dec.slot() for _ in prompts]
    vocab = dec.stack.embed.shape[0]
    g = torch.Generator().manual_seed(5)
    for slots in (packed_slots, own_slots):
        for b, (slot, p) in enumerate(zip(slots, prompts)):
            slot.reserve(len(p) + 2 * max(rows))
            slot.forward(torch.tensor(p), 0)
    starts = [len(p) for p in prompts]
    for step_rows in (rows, tuple(1 for _ in rows)):  # a pass, then one-token steps that read its K/V
        calls = [(torch.randint(0, vocab, (t,), generator=g), s) for t, s in zip(step_rows, starts)]
        packed = forward_slots(packed_slots, calls, pool)
        for b, (slot, (ids, start)) in enumerate(zip(own_slots, calls)):
            own = slot.forward(ids, start).logits
            assert torch.equal(packed[b], own), (b, len(ids), (packed[b] != own).any(-1).sum().item())
        starts = [s + t for s, t in zip(starts, step_rows)]


@pytest.mark.parametrize("pooled", [False, True], ids=["per_sequence", "pooled"])
@pytest.mark.parametrize("dtype", sorted(DTYPES))
@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_sequences_packed_in_one_pass_equal_their_own_passes(arch, dtype, pooled):
    dec = decoder(arch, dtype)
    exact_or_skip(dec, dtype)
    prompts = [prompt_ids(arch, i, length) for i, length in enumerate((5, 21, 9, 12, 7))]
    _packed_equals_own(dec, prompts, rows=(1, 4, 12, 2, 3), pooled=pooled)


def test_a_packed_pass_stays_one_native_call_after_another_slot_grows_the_pool(monkeypatch):
    """A slot that reserved before another grew the pool holds rotary tables shorter than the pool; the packed
    pass once passed them on, the native call refused them, and every later pass ran the per-op path."""
    dec = Decoder(from_hf(tiny("llama", dtype=torch.bfloat16)))
    dec.set_attention(NATIVE)
    if dec.layers_call(dec.stack) is None:
        pytest.skip("no one-call layers here (no C compiler, no vector instruction set)")
    taken, call = [], native.Layers.__call__
    monkeypatch.setattr(native.Layers, "__call__", lambda self, *a, **k: taken.append(call(self, *a, **k)) or taken[-1])
    (a, b), pool = dec.pooled_slots(2)
    ids = torch.tensor(prompt_ids("llama", 0, 40))
    a.reserve(20)
    a.forward(ids[:10], 0)
    b.reserve(300)  # the pool grows past a's tables
    b.forward(ids[:30], 0)
    taken.clear()
    forward_slots([a, b], [(ids[10:12], 10), (ids[30:33], 30)], pool)
    assert taken == [True]
