"""One generation's state: its tokens, the decoder it runs on, its sampling warp and generator.
``loop`` advances it; drafters read it to propose tokens."""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import torch

from knnssd.engine.spec.sampling import Warp
from knnssd.engine.model.decoder import Decoder
from knnssd.engine.model.hf_decoder import HFDecoder

_uids = itertools.count()


@dataclass
class Sequence:
    """One generation's state, shared with the drafter."""

    tokens: list[int]
    n_prompt: int
    decoder: Decoder | HFDecoder
    warp: Warp
    generator: torch.Generator | None
    device: torch.device
    uid: int = field(default_factory=lambda: next(_uids))
    # the last token, (1,) on the device: kept by the decode loop from the step's verdict, so a draft and
    # the next pass start from it with no host-to-device copy
    last: torch.Tensor | None = None
