"""What every form of a model's forward pass offers the decoding loops and the drafters (``DecoderForm``).

There are four forms: the lean ``decoder.Decoder`` (and the slots it makes for batches), the plain HF
fallback ``hf_decoder.HFDecoder``, one sequence on the captured static step ``static.graphs.StaticDecoder``, and a
slot of the static step's batch ``static.slots.SlotView``. They share ``forward``, ``reserve`` and
``rollback``; what only some can do is declared as flags here, so that a loop asks a form instead of
probing it for methods.
"""
from __future__ import annotations

from typing import NamedTuple, Protocol

import torch

from knnssd.engine.model.skip import SkipMask
from knnssd.engine.model.weights import Stack


class Output(NamedTuple):
    logits: torch.Tensor  # (T, V), or (1, V) with last=True; float32
    hidden: torch.Tensor  # (T, E) final-normed hidden states
    tapped: torch.Tensor | None = None  # (T, E) residual stream after layer ``tap``, when asked for
    influence: torch.Tensor | None = None  # (2, L) when asked for: see ``Decoder.forward``


class DecoderForm(Protocol):
    n_layers: int
    device: torch.device
    exactness: object  # ``exactness.Exactness``: how its verify passes compare with one-token steps (None: unprobed)
    stack: Stack | None  # the lean weights it runs on (None: the HF fallback's own modules)
    can_skip: bool  # runs a skip mask's draft steps (layer-skip and hybrid drafters)
    can_tree: bool  # verifies a token tree in one pass (``tree_pass.forward_tree``, then ``settle``)
    can_batch: bool  # makes slots for batched decoding (``slot``, ``pooled_slots``)
    # plain greedy decoding may launch a step before the last one is read: its rollback never discards a
    # position, so a step launched past the one read keeps its K/V (the static step)
    runs_ahead: bool

    def int8_stack(self) -> Stack:
        """The int8 copy of its weights that int8 drafts run on (``skip.MaskError`` where it has none)."""

    def reserve(self, n: int) -> None:
        """Room for ``n`` positions (a request's prompt and new tokens)."""

    def rollback(self, length: int) -> None:
        """Forget positions from ``length`` on (rejected drafts)."""

    def forward(self, ids: torch.Tensor, start: int, mask: SkipMask | None = None, stack: Stack | None = None,
                last: bool = False, tap: int | None = None, influence: bool = False) -> Output:
        """Logits of ``ids`` (T,) at positions ``start``..``start + T - 1``, reading the cache for earlier ones."""
