"""A model with planted redundancy, to prove the mask search where masks pay.

``plant`` copies a Llama-layout model (SmolLM2 by default) and inserts ``count`` extra decoder
layers, one after every ``every``-th layer, each a copy of the layer before it with its attention
and MLP output projections set to zero: they add nothing to the residual stream, so skipping them
changes no output, and every one of their 2 * ``count`` sub-layers is pure cost. A search that
works must skip them.

    knnssd plant --out /tmp/planted            # SmolLM2 + 8 zero layers, saved as a model folder
    knnssd calibrate --model /tmp/planted ...  # then the bank's masks should skip them
"""
from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path

import torch


@dataclass(frozen=True)
class Planted:
    model: torch.nn.Module
    layers: tuple[int, ...]  # indices of the inserted (zero) layers in the new model

    @property
    def n_layers(self) -> int:
        return len(self.model.model.layers)


def plant(model: torch.nn.Module, count: int = 8, every: int = 3) -> Planted:
    """A copy of ``model`` with ``count`` zero-output layers inserted (the original is not changed)."""
    src = model.model.layers
    if count < 1 or every < 1 or count * every > len(src):
        raise ValueError(f"cannot plant {count} layers, one every {every}, in a model of {len(src)} layers")
    model = copy.deepcopy(model)
    layers, planted, sources = [], [], []  # sources[j]: the original layer new layer j copies
    for i, layer in enumerate(model.model.layers):
        layers.append(layer)
        sources.append(i)
        if len(planted) < count and (i + 1) % every == 0:
            extra = copy.deepcopy(layer)
            with torch.no_grad():
                for lin in (extra.self_attn.o_proj, extra.mlp.down_proj):
                    lin.weight.zero_()
                    if lin.bias is not None:
                        lin.bias.zero_()
            planted.append(len(layers))
            layers.append(extra)
            sources.append(i)
    for j, layer in enumerate(layers):
        layer.self_attn.layer_idx = j
    model.model.layers = torch.nn.ModuleList(layers)
    cfg = model.config
    if getattr(cfg, "layer_types", None):
        cfg.layer_types = [cfg.layer_types[i] for i in sources]
    cfg.num_hidden_layers = len(layers)
    return Planted(model, tuple(planted))


def save(planted: Planted, tokenizer, out: Path) -> Path:
    """Write the model folder ``knnssd calibrate --model`` reads (weights, config, tokenizer, and the
    planted layer indices in ``planted.txt``)."""
    out.mkdir(parents=True, exist_ok=True)
    planted.model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    (out / "planted.txt").write_text(" ".join(map(str, planted.layers)) + "\n")
    return out
