"""Static KV cache: one preallocated K and V buffer per layer.

Rolling back is free: a position past the committed length is never read (every read is the
slice ``[:start + T]`` of the call that wrote it), and the next call overwrites it. Drafts write
K/V for the layers they run; verification rewrites every layer for the same positions.
"""
from __future__ import annotations

import torch


class KVCache:
    def __init__(self, n_layers: int, n_kv: int, head_dim: int, dtype: torch.dtype, device: torch.device):
        self.shape = (n_layers, n_kv, head_dim)
        self.dtype, self.device = dtype, device
        self.capacity = 0
        self.k: list[torch.Tensor] = []
        self.v: list[torch.Tensor] = []

    def ensure(self, n: int) -> bool:
        """Make room for ``n`` positions (keeping contents); True if the buffers were reallocated."""
        if n <= self.capacity:
            return False
        cap = max(n, 2 * self.capacity, 256)
        n_layers, n_kv, d = self.shape
        k = [torch.empty(1, n_kv, cap, d, dtype=self.dtype, device=self.device) for _ in range(n_layers)]
        v = [torch.empty(1, n_kv, cap, d, dtype=self.dtype, device=self.device) for _ in range(n_layers)]
        for old, new in zip(self.k + self.v, k + v):
            new[:, :, : self.capacity] = old
        self.k, self.v, self.capacity = k, v, cap
        return True

    def write(self, layer: int, start: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store k, v (1, KV, T, D) at positions start..start+T-1; return views of positions 0..start+T-1."""
        end = start + k.shape[2]
        kc, vc = self.k[layer], self.v[layer]
        kc[:, :, start:end] = k
        vc[:, :, start:end] = v
        return kc[:, :, :end], vc[:, :, :end]

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v)
