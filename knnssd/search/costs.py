"""Measured step costs the proxy stage scores drafting policies with.

Terms: ``v(T)`` the measured time of one full-model pass over T tokens; ``c`` the measured time
of one draft step for a mask and precision, linear in the kept sub-layers; ``w(T)`` the measured time
of one token tree's pass over T nodes in two branches (``tree_pass.forward_tree``: one native call, or one
attention call a layer per leaf), and ``s`` what each further leaf adds.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from knnssd.engine.model import tree_pass
from knnssd.engine.model.decoder import Decoder

from knnssd.engine.model.skip import SkipMask
from knnssd.engine.model.timing import median_ms, pass_timer


@dataclass
class Costs:
    """Measured step times (ms) at a typical context; draft cost is linear in kept sub-layers."""

    verify: list[float]  # verify[T-1]: one full pass over T tokens; verify[0] is a plain AR step
    draft: dict[str, tuple[float, float, float]]  # precision -> (base, per attention, per MLP)
    tree: list[float] = field(default_factory=list)  # tree[T-2]: a two-leaf tree's pass over T >= 2 nodes; [] where none runs
    tree_leaf: float = 0.0  # each leaf past two adds this to a tree pass

    def draft_ms(self, mask: SkipMask, int8: bool) -> float:
        base, attn, mlp = self.draft["int8" if int8 else "full"]
        return base + attn * (mask.n_layers - sum(mask.attn)) + mlp * (mask.n_layers - sum(mask.mlp))

    def int8_pays(self, n_layers: int) -> bool:
        """An int8 draft step with nothing skipped was measured faster than a full-precision one."""
        none = SkipMask.none(n_layers)
        return "int8" in self.draft and self.draft_ms(none, True) < self.draft_ms(none, False)

    def verify_ms(self, t: int) -> float:
        return self.verify[min(t, len(self.verify)) - 1]

    def tree_ms(self, t: int, leaves: int) -> float:
        """A tree pass over ``t`` nodes with ``leaves`` leaves; infinite where none was measured (trees are
        then never chosen)."""
        if not self.tree:
            return float("inf")
        return self.tree[min(t, len(self.tree) + 1) - 2] + max(0, leaves - 2) * self.tree_leaf


def two_branches(nodes: int) -> tuple[int, ...]:
    """The parents of a tree of ``nodes`` drafted nodes in two branches from the root (the timed shape)."""
    half = (nodes + 1) // 2
    return tuple(range(half)) + tuple(0 if j == half else j for j in range(half, nodes))


@torch.inference_mode()
def measure_costs(dec: Decoder, max_t: int = 11, context: int = 128) -> Costs:
    ms = pass_timer(dec, context, max_t)
    verify = [ms(t) for t in range(1, max_t + 1)]
    n = dec.n_layers
    draft = {}
    for name, stack in (("full", None), ("int8", dec.int8_stack() if dec.can_skip else None)):
        if name == "int8" and stack is None:
            continue
        t = {}
        for key, mask in (("none", SkipMask.none(n)), ("attn", SkipMask.from_layers(n, attn=range(n))),
                          ("mlp", SkipMask.from_layers(n, mlp=range(n))),
                          ("all", SkipMask.from_layers(n, attn=range(n), mlp=range(n)))):
            t[key] = ms(1, mask, stack)
        attn = max(0.0, (t["none"] - t["attn"] + t["mlp"] - t["all"]) / (2 * n))
        mlp = max(0.0, (t["none"] - t["mlp"] + t["attn"] - t["all"]) / (2 * n))
        draft[name] = (t["all"], attn, mlp)
    tree, leaf = [], 0.0
    if dec.can_tree:
        ids = torch.zeros(max_t, dtype=torch.long, device=dec.device)
        tree = [median_ms(lambda t=t: tree_pass.forward_tree(dec, ids[:t], context, two_branches(t - 1)), dec.device, 5)
                for t in range(2, max_t + 1)]
        if max_t > 3:  # a star of max_t - 1 leaves against two branches of as many nodes
            star = median_ms(lambda: tree_pass.forward_tree(dec, ids, context, (0,) * (max_t - 1)), dec.device, 5)
            leaf = max(0.0, (star - tree[-1]) / (max_t - 3))
    return Costs(verify, draft, tree, leaf)
