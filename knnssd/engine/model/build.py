"""Which decoder a model gets (``make_decoder``): the lean ``Decoder`` where its architecture is known and
matches HF on a probe, else the ``HFDecoder`` fallback; either way with its verify pass probed for
exactness."""
from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

import torch

from knnssd.engine.model import exactness
from knnssd.engine.model.decoder import Decoder
from knnssd.engine.model.hf_decoder import HFDecoder
from knnssd.engine.model.packed import forward_slots
from knnssd.engine.model.weights import Stack, UnsupportedArchitecture, from_hf

log = logging.getLogger(__name__)


def make_decoder(model: torch.nn.Module, check: bool = True, record: Path | None = None,
                 weights: Callable[[Stack], Stack] | None = None) -> Decoder | HFDecoder:
    """The lean ``Decoder`` when the architecture is known and matches HF on a probe, else ``HFDecoder``.

    Either way the verify pass is probed for exactness (``exactness.py``) and the result kept in
    ``decoder.exactness``; the lean decoder also takes the exact attention the probe ranks first.
    With a ``record``, a lean decoder that is exact and agrees with HF is remembered, and the next
    load on the same machine key takes both from the record instead of measuring them again.
    ``weights``: what the lean decoder runs instead of the model's own weights (``quantized``'s blocks); the
    lean forward is checked against HF on the model's own weights first (blocks made at load differ from them
    by design: a tiny model's Q4_1 logits moved by 1.8), and the probe measures the blocks.
    """
    try:
        dec = Decoder(from_hf(model))
    except UnsupportedArchitecture as e:
        log.warning("lean forward unavailable (%s); using plain HF forwards (no layer skipping)", e)
        return _fallback(model)
    checked = False
    if weights is not None:
        if check:
            err = probe_error(dec, model)
            if err is not None:
                log.warning("lean forward differs from HF on %s (%s); using plain HF forwards", type(model).__name__,
                            err)
                return _fallback(model)
            checked = True
        dec.use_stack(weights(dec.stack))
    dec.exactness = exactness.choose(dec, record=record, packed=forward_slots)
    if check and not checked and not dec.exactness.from_record:  # a record is written only after this check has passed
        err = probe_error(dec, model)
        if err is not None:
            log.warning("lean forward differs from HF on %s (%s); using plain HF forwards", type(model).__name__, err)
            return _fallback(model)
    if record is not None and check:
        exactness.remember(record, dec.exactness)
    return dec


def _fallback(model: torch.nn.Module) -> "HFDecoder":
    dec = HFDecoder(model)
    dec.exactness = exactness.probe_fixed(dec, "hf")
    return dec


@torch.inference_mode()
def probe_error(dec: Decoder, model: torch.nn.Module) -> str | None:
    """Compare lean and HF logits for a prefill, a one-token step and a 3-token step; None if they agree."""
    from transformers import DynamicCache

    vocab = dec.stack.embed.shape[0]
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (10,), generator=gen).to(dec.stack.device)
    cache = DynamicCache(config=model.config)
    tol = 1e-3 if dec.stack.dtype == torch.float32 else 5e-2
    for a, b in ((0, 6), (6, 7), (7, 10)):
        want = model(input_ids=ids[None, a:b], past_key_values=cache, use_cache=True).logits[0].float()
        got = dec.forward(ids[a:b], a).logits
        err = (got - want).abs().max().item()
        if not err <= tol * (1 + want.abs().max().item()):
            return f"max logit difference {err:.3g} at positions {a}..{b - 1}"
    return None
