"""Pictures stored with each bank version (browsable in the MLflow UI)."""
from __future__ import annotations

from pathlib import Path

import numpy as np

from knnssd.engine.spec.drafters import SKIPPING


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def draw(bank, vectors: np.ndarray | None, domains: list[str | None] | None, folder: Path) -> None:
    """The bank's pictures, saved beside it: ``skip_heatmap.png`` and ``anchor_map.png`` (``vectors``
    in the router's space: centered like the anchors)."""
    skip_heatmap(bank, Path(folder) / "skip_heatmap.png")
    anchor_map(bank, vectors, domains, Path(folder) / "anchor_map.png")


def skip_heatmap(bank, path: Path) -> Path:
    """Rows: clusters; columns: sub-layers (attention | MLP); dark = skipped while drafting."""
    plt = _plt()
    n = bank.n_layers
    grid = np.zeros((len(bank.clusters), 2 * n))
    labels = []
    for r, c in enumerate(bank.clusters):
        cfg = c.drafter
        if c.mask is not None and cfg.kind in SKIPPING:
            grid[r] = c.mask.bits
        labels.append(f"{c.label} · {cfg.kind}{' int8' if cfg.int8 else ''} · {c.speedup:.2f}x")
    fig, ax = plt.subplots(figsize=(max(6, 0.18 * 2 * n + 3), 0.45 * len(labels) + 1.6))
    ax.imshow(grid, aspect="auto", cmap="Greys", vmin=0, vmax=1, interpolation="nearest")
    ax.axvline(n - 0.5, color="tab:red", lw=1)
    ax.set_yticks(range(len(labels)), labels, fontsize=8)
    ticks = list(range(0, n, max(1, n // 10)))
    ax.set_xticks(ticks + [n + t for t in ticks], [f"a{t}" for t in ticks] + [f"m{t}" for t in ticks], fontsize=7)
    ax.set_title(f"{bank.model}: skipped sub-layers per cluster (attention | MLP)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def anchor_map(bank, vectors: np.ndarray | None, domains: list[str | None] | None, path: Path) -> Path:
    """2-D PCA of the calib prompt vectors (dots, coloured by domain) and anchors (crosses, by cluster)."""
    plt = _plt()
    pts = bank.anchors if vectors is None else np.concatenate([vectors, bank.anchors])
    mean = pts.mean(0)
    _, _, vt = np.linalg.svd(pts - mean, full_matrices=False)
    proj = lambda x: (x - mean) @ vt[:2].T  # noqa: E731
    fig, ax = plt.subplots(figsize=(7, 5.5))
    cmap = plt.get_cmap("tab10")
    labels = {c.id: c.label for c in bank.clusters}
    names = sorted({d or "?" for d in (domains or [])} | set(labels.values()))
    colour = {n: cmap(i % 10) for i, n in enumerate(names)}  # a domain and its cluster share a colour
    if vectors is not None and domains is not None:
        xy = proj(vectors)
        for d in sorted({d or "?" for d in domains}):
            sel = [j for j, x in enumerate(domains) if (x or "?") == d]
            ax.scatter(xy[sel, 0], xy[sel, 1], s=9, alpha=0.45, color=colour[d], label=f"prompts: {d}")
    axy = proj(bank.anchors)
    for cid in sorted(labels):
        sel = bank.anchor_cluster == cid
        ax.scatter(axy[sel, 0], axy[sel, 1], marker="X", s=70, edgecolor="black", linewidth=0.6,
                   color=colour[labels[cid]], label=f"anchors: {labels[cid]}")
    ax.set_title(f"{bank.model}: prompt vectors and anchors (PCA)", fontsize=9)
    ax.legend(fontsize=7, loc="best", ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
