"""The fallback decoder: plain HF forwards over a ``DynamicCache``, cropped on rollback, for architectures the
lean forward does not know (any causal LM; no sub-layer skipping, no trees, no batches)."""
from __future__ import annotations

import torch

from knnssd.engine.model.forms import Output
from knnssd.engine.model.skip import MaskError, SkipMask


class HFDecoder:
    """Fallback: plain HF forwards over a DynamicCache (any causal LM; no sub-layer skipping)."""

    can_skip, can_tree, can_batch, runs_ahead = False, False, False, False  # ``forms.DecoderForm``
    stack = None  # the model's own modules: no lean weights

    def __init__(self, model: torch.nn.Module):
        from transformers import DynamicCache

        self.model = model
        self._new_cache = lambda: DynamicCache(config=model.config)
        self.cache = self._new_cache()
        self.n_layers = model.config.num_hidden_layers
        self.device = next(model.parameters()).device
        self.exactness = None

    def int8_stack(self):
        raise MaskError("this model runs on the plain HF fallback, which has no int8 draft weights")

    def reserve(self, n: int) -> None:
        pass

    def rollback(self, length: int) -> None:
        extra = self.cache.get_seq_length() - length
        if extra > 0:
            self.cache.crop(-extra)  # transformers 5.x: crop takes a negative count

    @torch.inference_mode()
    def forward(self, ids: torch.Tensor, start: int, mask: SkipMask | None = None, stack=None, last: bool = False,
                tap: int | None = None, influence: bool = False) -> Output:
        if mask is not None and mask.n_skipped or influence:
            raise MaskError("this model runs on the plain HF fallback, which cannot skip sub-layers")
        if start == 0:
            self.cache = self._new_cache()
        self.rollback(start)
        if self.cache.get_seq_length() != start:
            raise RuntimeError(f"HF cache holds {self.cache.get_seq_length()} positions, call starts at {start}")
        out = self.model(
            input_ids=ids[None], past_key_values=self.cache, use_cache=True, output_hidden_states=True,
            logits_to_keep=1 if last else 0,
        )
        tapped = out.hidden_states[tap + 1][0] if tap is not None and tap >= 0 else None
        return Output(out.logits[0].float(), out.hidden_states[-1][0], tapped)
