"""Prompt vectors, anchors (K-means) and the kNN router (faiss).

A prompt's vector is its final-normed hidden states pooled over the prompt tokens; the prefill
pass computes them anyway, so routing costs one faiss search. Anchors are K-means centroids:
``k`` per labelled domain (the paper uses 10), or, for an unlabelled pool, ``K`` clusters with
``K`` chosen by silhouette. A cluster is what gets its own drafting configuration.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

log = logging.getLogger(__name__)
POOLINGS = ("mean", "last")


def _faiss():
    try:
        import faiss
    except ImportError:
        raise ImportError("faiss is missing: pip install 'knnssd[cpu]' (or 'knnssd[gpu]' on CUDA machines)") from None
    return faiss


@dataclass(frozen=True)
class Pooling:
    """How a prompt becomes a vector: ``mode`` over the prompt tokens of layer ``layer``'s output
    (-1: after the final norm, the default; i: the residual stream after layer i)."""

    mode: str = "mean"
    layer: int = -1

    def __post_init__(self):
        if self.mode not in POOLINGS:
            raise ValueError(f"unknown pooling '{self.mode}' (choose {', '.join(POOLINGS)})")
        if isinstance(self.layer, bool) or not isinstance(self.layer, int) or self.layer < -1:
            raise ValueError(f"pooling layer must be -1 (after the final norm) or a layer's index, got {self.layer!r}")

    def check(self, n_layers: int) -> "Pooling":
        """A one-line error for a layer the model does not have (the prefill silently pooled the final
        norm's states instead, and the bank recorded the layer asked for)."""
        if self.layer >= n_layers:
            raise ValueError(f"pooling layer {self.layer} is outside the model's {n_layers} layers (0 to "
                             f"{n_layers - 1}, or -1: after the final norm)")
        return self

    def pool(self, hidden: torch.Tensor) -> np.ndarray:
        """(T, E) -> (E,) float32, L2-normalised."""
        v = hidden.float().mean(0) if self.mode == "mean" else hidden[-1].float()
        v = v / v.norm().clamp_min(1e-12)
        return v.cpu().numpy().astype(np.float32)


def normalize(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x, dtype=np.float32)
    return x / np.maximum(np.linalg.norm(x, axis=-1, keepdims=True), 1e-12)


def center_of(vectors: np.ndarray) -> np.ndarray:
    """The mean direction of a set of prompt vectors. Pooled hidden states share a large common
    component (cosine ~0.9 between unrelated prompts); routing subtracts it first."""
    return normalize(vectors).mean(0).astype(np.float32)


def centered(vectors: np.ndarray, center: np.ndarray | None) -> np.ndarray:
    x = normalize(vectors)
    return normalize(x - center) if center is not None else x


def content_key(*parts) -> str:
    h = hashlib.sha256()
    for p in parts:
        h.update(json.dumps(p, sort_keys=True, default=str).encode())
        h.update(b"\0")
    return h.hexdigest()[:20]


def kmeans(x: np.ndarray, k: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Spherical K-means (faiss): (centroids (k, E) normalised, assignment (N,))."""
    faiss = _faiss()
    x = normalize(x)
    if k > len(x):
        log.warning("%d clusters or anchors asked for %d prompts: %d made (one a prompt)", k, len(x), len(x))
    k = max(1, min(k, len(x)))
    km = faiss.Kmeans(x.shape[1], k, niter=50, seed=seed, spherical=True, min_points_per_centroid=1, verbose=False)
    km.train(x)
    _, assign = km.index.search(x, 1)
    return normalize(km.centroids), assign[:, 0]


def choose_k(x: np.ndarray, k_max: int = 12, seed: int = 0) -> int:
    """The K in 2..k_max with the best cosine silhouette (1 if there are too few points)."""
    from sklearn.metrics import silhouette_score

    x = normalize(x)
    best_k, best = 1, -1.0
    for k in range(2, min(k_max, len(x) - 1) + 1):
        _, assign = kmeans(x, k, seed)
        if len(set(assign.tolist())) < 2:
            continue
        s = silhouette_score(x, assign, metric="cosine")
        if s > best:
            best_k, best = k, s
    return best_k


@dataclass
class Cluster:
    id: int
    label: str  # the domain for labelled clusters, "cluster-<id>" otherwise
    anchors: np.ndarray  # (k, E) normalised centroids
    members: list[str] = field(default_factory=list)  # prompt ids
    domains: dict[str, int] = field(default_factory=dict)  # domain -> member count


def build_clusters(ids: list[str], domains: list[str | None], vectors: np.ndarray, k_per_domain: int = 10,
                   n_clusters: int | None = None, seed: int = 0, center: np.ndarray | None = None) -> list[Cluster]:
    """Labelled rows (every domain set): ``k_per_domain`` anchors per domain, one cluster per domain.
    Otherwise one pool: ``n_clusters`` clusters (chosen by silhouette when None), one anchor each.
    Anchors live in the ``center``-ed space (see ``center_of``) when a center is given."""
    vectors = centered(vectors, center)
    if all(domains):
        out = []
        for cid, dom in enumerate(sorted(set(domains))):
            rows = [i for i, d in enumerate(domains) if d == dom]
            anchors, _ = kmeans(vectors[rows], k_per_domain, seed)
            out.append(Cluster(cid, dom, anchors, [ids[i] for i in rows], {dom: len(rows)}))
        return out
    k = n_clusters or choose_k(vectors, seed=seed)
    centroids, assign = kmeans(vectors, k, seed)
    out = []
    for cid in range(len(centroids)):
        rows = [i for i in range(len(ids)) if assign[i] == cid]
        if not rows:
            continue
        counts: dict[str, int] = {}
        for i in rows:
            counts[domains[i] or "?"] = counts.get(domains[i] or "?", 0) + 1
        out.append(Cluster(len(out), f"cluster-{len(out)}", centroids[cid : cid + 1], [ids[i] for i in rows], counts))
    return out


def unmatched_threshold(ids: list[str], vectors: np.ndarray, clusters: list[Cluster]) -> float:
    """The similarity below which a prompt counts as unmatched: the 1% quantile of calib prompts'
    *held-out* similarity to their own cluster (each to the mean of the other members, since an
    anchor fit on a prompt flatters it: with few prompts per anchor, unseen in-domain prompts
    would fall below an in-sample threshold), minus a quarter of its distance to the median.
    ``vectors`` are normalised (and centered like the anchors)."""
    row = {pid: i for i, pid in enumerate(ids)}
    sims = []
    for c in clusters:
        v = vectors[[row[m] for m in c.members if m in row]]
        if len(v) < 2:
            sims.extend(float(np.max(c.anchors @ x)) for x in v)
            continue
        total = v.sum(0)
        sims.extend(float(x @ normalize(total - x)) for x in v)
    if not sims:
        return -1.0
    q01, q50 = np.quantile(sims, [0.01, 0.5])
    return float(q01 - 0.25 * (q50 - q01))


@dataclass(frozen=True)
class Route:
    cluster: int | None  # None: no anchor is close enough (use the fallback configuration)
    similarity: float  # cosine similarity to the nearest anchor
    votes: dict[int, float]


def stack_anchors(clusters: list[Cluster]) -> tuple[np.ndarray, np.ndarray]:
    """All clusters' anchors as one (N, E) matrix, and the cluster id of each row."""
    anchors = np.concatenate([c.anchors for c in clusters])
    owner = np.concatenate([np.full(len(c.anchors), c.id) for c in clusters])
    return anchors, owner


class Router:
    """kNN over normalised anchors (faiss inner product); the k nearest anchors vote by similarity."""

    def __init__(self, anchors: np.ndarray, anchor_cluster: np.ndarray, k: int = 3, min_similarity: float = -1.0,
                 center: np.ndarray | None = None):
        faiss = _faiss()
        self.center = center
        self.anchors = normalize(anchors)
        self.anchor_cluster = np.asarray(anchor_cluster, dtype=np.int64)
        self.k = max(1, min(k, len(self.anchors)))
        self.min_similarity = min_similarity
        self.index = faiss.IndexFlatIP(self.anchors.shape[1])
        self.index.add(self.anchors)

    @classmethod
    def from_clusters(cls, clusters: list[Cluster], k: int = 3, min_similarity: float = -1.0,
                      center: np.ndarray | None = None) -> "Router":
        return cls(*stack_anchors(clusters), k, min_similarity, center)

    def route(self, vector: np.ndarray) -> Route:
        sims, idx = self.index.search(centered(np.asarray(vector)[None], self.center), self.k)
        votes: dict[int, float] = {}  # insertion order = nearest first, which breaks ties
        for s, i in zip(sims[0], idx[0]):
            if i >= 0:
                c = int(self.anchor_cluster[i])
                votes[c] = votes.get(c, 0.0) + float(s)
        best_sim = float(sims[0, 0])
        if not votes or best_sim < self.min_similarity:
            return Route(None, best_sim, votes)
        return Route(max(votes, key=votes.__getitem__), best_sim, votes)


def save_vectors(path: Path, ids: list[str], domains: list[str | None], vectors: np.ndarray) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pa.table({"id": ids, "domain": domains, "vector": [v.tolist() for v in np.asarray(vectors, np.float32)]})
    tmp = Path(f"{path}.{os.getpid()}.tmp")  # concurrent writers (scale-out workers) never share a temp file
    pq.write_table(table, tmp)
    tmp.replace(path)


def load_vectors(path: Path) -> tuple[list[str], list[str | None], np.ndarray]:
    import pyarrow.parquet as pq

    t = pq.read_table(path).to_pydict()
    return t["id"], t["domain"], np.asarray(t["vector"], dtype=np.float32)
