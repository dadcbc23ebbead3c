"""The KV cache (``engine/model/cache.py``): static buffers per generation, and key lengths set by the
query's position."""
import pytest
import torch

from knnssd.engine.model.cache import BUCKET, SPAN, CacheFull, KVCache, Span


def test_kv_cache_is_static_per_generation():
    c = KVCache(2, 1, 4, torch.float32, torch.device("cpu"))
    assert c.reserve(3) and c.length == c.capacity == BUCKET  # one bucket, zeroed
    assert torch.count_nonzero(c.k[0]) == 0
    k = torch.arange(12.0).view(1, 1, 3, 4)
    kc, vc = c.write(1, torch.arange(5, 8), k, -k)
    assert kc.shape[2] == BUCKET and torch.equal(kc[:, :, 5:8], k) and torch.equal(vc[:, :, 5:8], -k)
    kc, _ = c.write(0, slice(9, 12), k, -k)  # positions known on the host: a plain copy, the same values
    assert torch.equal(kc[:, :, 9:12], k) and torch.count_nonzero(kc[:, :, :9]) == 0
    wide = KVCache(1, 1, 4, torch.float32, torch.device("cpu"))  # fp32 K/V of a bf16 model: stored exactly
    wide.reserve(3)
    kb = torch.randn(1, 1, 3, 4).bfloat16()
    assert torch.equal(wide.write(0, slice(0, 3), kb, kb)[0][:, :, :3], kb.float())
    assert not c.reserve(BUCKET - 1) and c.length == BUCKET  # same bucket: buffers reused
    assert c.reserve(4 * BUCKET + 1) and c.length == 5 * BUCKET
    assert not c.reserve(2 * BUCKET) and c.length == 2 * BUCKET  # a shorter generation may write fewer
    with pytest.raises(CacheFull):
        c.check(2 * BUCKET + 1)


def test_key_length_is_set_by_the_query_position():
    c = KVCache(1, 1, 4, torch.float32, torch.device("cpu"))
    c.reserve(2 * BUCKET + 5)  # may write 3 * BUCKET positions
    assert [c.keys(end) for end in (1, SPAN, SPAN + 1, 2 * SPAN, 3 * BUCKET)] == [SPAN, SPAN, 2 * SPAN, 2 * SPAN,
                                                                                   3 * BUCKET]
    assert c.spans(3, 5) == (Span(0, 5, SPAN),)  # one length: one attention call
    # a pass straddling a boundary: each row reads what a one-token step at its position reads
    start, rows = SPAN - 3, 12
    spans = c.spans(start, rows)
    assert spans == (Span(0, 3, SPAN), Span(3, 12, 2 * SPAN))
    for sp in spans:
        assert all(c.keys(start + r + 1) == sp.keys for r in range(sp.lo, sp.hi))
    assert c.spans(3 * BUCKET - 2, 2) == (Span(0, 2, 3 * BUCKET),)  # the last positions read the whole reservation
    with pytest.raises(CacheFull):
        c.spans(3 * BUCKET - 2, 3)
