"""The skip bank: anchors + one drafting configuration per cluster, as stored in a registry version.

A bank folder holds ``bank.json`` (clusters, their configurations and measured speedups, the
base model's name and weights fingerprint, the knnssd version), ``anchors.parquet`` (one row
per anchor: cluster id and vector) and pictures. ``load`` validates everything and reports a
corrupt or foreign bank in one line.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
from dataclasses import asdict, dataclass, field, replace
from functools import cached_property
from pathlib import Path

import numpy as np

from knnssd import __version__
from knnssd.engine.spec.drafters import FIXED, DrafterConfig, fixed_kind, untuned
from knnssd.engine.model.skip import MaskError, SkipMask
from knnssd.routing.router import Cluster, Pooling, Router, stack_anchors

FORMAT = 1


class BankError(ValueError):
    """A bank folder is missing, corrupt or does not fit the model; one line."""


@dataclass
class BankCluster:
    id: int
    label: str
    config: dict  # DrafterConfig.to_dict()
    speedup: float = 1.0  # measured on calib prompts
    acceptance_rate: float = 0.0
    mean_accepted: float = 1.0
    members: int = 0
    domains: dict[str, int] = field(default_factory=dict)
    search: dict = field(default_factory=dict)  # trials, seconds, proxy speedup, candidates

    @cached_property
    def drafter(self) -> DrafterConfig:
        """``config`` parsed (once: a bank's clusters are read on every request)."""
        return DrafterConfig.from_dict(self.config)

    @cached_property
    def mask(self) -> SkipMask | None:
        """The drafter's skip mask (None for n-gram drafting and plain AR)."""
        return SkipMask.from_dict(self.drafter.mask) if self.drafter.mask else None


@dataclass(frozen=True)
class ClusterResult:
    """One cluster's search, measured: what the bank keeps of it (``search.optimize.search_cluster``)."""

    cluster: int
    config: dict  # DrafterConfig.to_dict() of the winner ("none" = plain AR)
    speedup: float  # measured on calib prompts (>= 1.0: plain AR is a candidate)
    acceptance_rate: float = 0.0
    mean_accepted: float = 1.0
    ms_per_token: float = math.nan
    ar_ms_per_token: float = math.nan
    proxy_speedup: float = 1.0
    proxy_trials: int = 0
    real_trials: int = 0
    search_s: float = 0.0
    candidates: list[dict] = field(default_factory=list)  # every measured candidate
    best_fixed_speedup: float = math.nan  # the fastest fixed drafter's (``drafters.FIXED``), NaN: none measured
    timing_noise: float = math.nan  # ``objective.timing_noise``


@dataclass
class Bank:
    model: str
    fingerprint: str
    n_layers: int
    dtype: str
    clusters: list[BankCluster]
    anchors: np.ndarray  # (N, E) normalised
    anchor_cluster: np.ndarray  # (N,) cluster id per anchor
    pooling: Pooling = Pooling()
    router_k: int = 3
    min_similarity: float = -1.0  # below: unmatched, use the fallback
    fallback: int | None = None  # cluster whose configuration serves unmatched prompts, without ``fallback_config``
    created: str = ""
    knnssd_version: str = __version__
    extra: dict = field(default_factory=dict)
    center: np.ndarray | None = None  # subtracted from prompt vectors before routing (router.center_of)
    digest: str = ""  # of the files it was loaded from (``load``): what an output row records of its bank
    fallback_config: dict | None = None  # what serves them where every cluster timed the fixed drafters
    fallback_speedup: float = 1.0  # its speedup over every cluster's calib prompts

    def router(self) -> Router:
        return Router(self.anchors, self.anchor_cluster, self.router_k, self.min_similarity, self.center)

    def masked(self) -> list[BankCluster]:
        """The clusters whose drafter skips sub-layers."""
        return [c for c in self.clusters if c.mask is not None and c.mask.n_skipped]

    def searched(self) -> dict:
        """What its searches cost and bought: ``search_s``, their seconds summed, and ``margin_over_fixed``, each
        cluster's choice over the best fixed drafter on its own calib prompts, weighted by members (None where no
        search timed the fixed drafters)."""
        timed = [(c.members, c.search["margin_over_fixed"]) for c in self.clusters if "margin_over_fixed" in c.search]
        weight = sum(m for m, _ in timed)
        return {"search_s": sum(c.search.get("search_s", 0.0) for c in self.clusters),
                "margin_over_fixed": sum(m * x for m, x in timed) / weight if weight else None}

    def unmasked(self) -> "Bank":
        """The same bank with every mask cleared (the mask ablation: same drafters, no skipped sub-layers)."""
        return replace(self, clusters=[replace(c, config={**c.config, "mask": None}) for c in self.clusters])

    @cached_property
    def unmatched(self) -> BankCluster:
        """What drafts for a prompt no anchor is close to: ``fallback_config``, else the fallback cluster."""
        if self.fallback_config is not None:
            return BankCluster(-1, "unmatched", self.fallback_config, self.fallback_speedup)
        return self.cluster(self.fallback) if self.fallback is not None else self.cluster(-1)

    def cluster(self, cid: int | None) -> BankCluster:
        if cid is None:
            return self.unmatched
        for c in self.clusters:
            if c.id == cid:
                return c
        return BankCluster(-1, "plain AR", DrafterConfig().to_dict())

    def check_model(self, fingerprint: str, n_layers: int) -> None:
        if fingerprint != self.fingerprint:
            raise BankError(f"bank was tuned for {self.model} with weights fingerprint {self.fingerprint}; "
                            f"the loaded model's is {fingerprint}")
        if n_layers != self.n_layers:
            raise BankError(f"bank is for a {self.n_layers}-layer model; the loaded model has {n_layers}")

    def to_json(self) -> dict:
        return {
            "format": FORMAT, "knnssd_version": self.knnssd_version, "created": self.created,
            "model": {"name": self.model, "fingerprint": self.fingerprint, "n_layers": self.n_layers, "dtype": self.dtype},
            "pooling": asdict(self.pooling),
            "router": {"k": self.router_k, "min_similarity": self.min_similarity, "fallback": self.fallback,
                       "fallback_config": self.fallback_config, "fallback_speedup": self.fallback_speedup,
                       "center": None if self.center is None else [float(x) for x in self.center]},
            "clusters": [asdict(c) for c in self.clusters],
            "extra": self.extra,
        }

    def save(self, folder: str | os.PathLike) -> Path:
        import pyarrow as pa
        import pyarrow.parquet as pq

        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        pq.write_table(pa.table({"cluster": self.anchor_cluster.astype(np.int64),
                                 "vector": [v.tolist() for v in self.anchors.astype(np.float32)]}),
                       folder / "anchors.parquet")
        tmp = folder / "bank.json.tmp"
        tmp.write_text(json.dumps(self.to_json(), indent=2))
        tmp.replace(folder / "bank.json")
        return folder


def load(folder: str | os.PathLike) -> Bank:
    folder = Path(folder)
    if not (folder / "bank.json").is_file():
        raise BankError(f"no bank.json in {folder}")
    try:
        d = json.loads((folder / "bank.json").read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise BankError(f"{folder / 'bank.json'} is corrupt: {e}") from None
    try:
        import pyarrow.parquet as pq

        t = pq.read_table(folder / "anchors.parquet").to_pydict()
        anchors = np.asarray(t["vector"], dtype=np.float32)
        owner = np.asarray(t["cluster"], dtype=np.int64)
    except Exception as e:  # noqa: BLE001
        raise BankError(f"{folder / 'anchors.parquet'} is missing or corrupt: {type(e).__name__}") from None
    bank = from_json(d, anchors, owner)
    validate(bank)
    h = hashlib.sha256()
    for name in ("bank.json", "anchors.parquet"):
        h.update((folder / name).read_bytes())
    bank.digest = h.hexdigest()[:16]
    return bank


def from_json(d: dict, anchors: np.ndarray, owner: np.ndarray) -> Bank:
    try:
        if d.get("format") != FORMAT:
            raise BankError(f"bank format {d.get('format')!r} is not {FORMAT}")
        m, r = d["model"], d["router"]
        clusters = [BankCluster(**c) for c in d["clusters"]]
        return Bank(model=m["name"], fingerprint=m["fingerprint"], n_layers=int(m["n_layers"]), dtype=m["dtype"],
                    clusters=clusters, anchors=anchors, anchor_cluster=owner, pooling=Pooling(**d["pooling"]),
                    router_k=r["k"], min_similarity=float(r["min_similarity"]), fallback=r.get("fallback"),
                    fallback_config=r.get("fallback_config"), fallback_speedup=float(r.get("fallback_speedup", 1.0)),
                    created=d.get("created", ""), knnssd_version=d.get("knnssd_version", "?"), extra=d.get("extra", {}),
                    center=None if r.get("center") is None else np.asarray(r["center"], dtype=np.float32))
    except BankError:
        raise
    except (KeyError, TypeError, ValueError) as e:
        raise BankError(f"bank.json does not follow format {FORMAT}: {type(e).__name__}: {e}") from None


def validate(bank: Bank) -> None:
    """Every cluster has a valid configuration for the model and anchors; every anchor has a cluster."""
    ids = {c.id for c in bank.clusters}
    if not bank.clusters:
        raise BankError("bank has no clusters")
    if len(ids) != len(bank.clusters):
        raise BankError("bank has duplicate cluster ids")
    if bank.anchors.ndim != 2 or len(bank.anchors) != len(bank.anchor_cluster) or not len(bank.anchors):
        raise BankError("anchors are not an (N, E) matrix with one cluster id each")
    if not np.isfinite(bank.anchors).all():
        raise BankError("anchors contain NaN or infinite values")
    if set(bank.anchor_cluster.tolist()) - ids:
        raise BankError("an anchor points to a cluster the bank does not have")
    if bank.center is not None and bank.center.shape != bank.anchors.shape[1:]:
        raise BankError(f"router center has shape {bank.center.shape}, the anchors' dimension is "
                        f"{bank.anchors.shape[1:]}")
    if bank.center is not None and not np.isfinite(bank.center).all():
        raise BankError("router center contains NaN or infinite values")
    if not (isinstance(bank.router_k, int) and not isinstance(bank.router_k, bool) and bank.router_k >= 1):
        raise BankError(f"router.k must be an integer >= 1, got {bank.router_k!r}")
    # finite, not in [-1, 1]: a threshold computed from held-out prompts may lie below -1 (nothing unmatched)
    if not (isinstance(bank.min_similarity, (int, float)) and math.isfinite(bank.min_similarity)):
        raise BankError(f"router.min_similarity must be a finite number, got {bank.min_similarity!r}")
    if bank.fallback is not None and bank.fallback not in ids:
        raise BankError(f"fallback cluster {bank.fallback} is not in the bank")
    if bank.fallback_config is not None:
        try:
            cfg = DrafterConfig.from_dict(bank.fallback_config)
            if cfg.mask is not None:
                SkipMask.from_dict(cfg.mask).validate(bank.n_layers)
        except (MaskError, ValueError, TypeError) as e:
            raise BankError(f"router.fallback_config is not a drafting configuration for this model: {e}") from None
    for c in bank.clusters:
        try:
            cfg = c.drafter
            if cfg.mask is not None:
                SkipMask.from_dict(cfg.mask).validate(bank.n_layers)
        except (MaskError, ValueError, TypeError) as e:
            raise BankError(f"cluster {c.id} ({c.label}): {e}") from None
        if not (math.isfinite(c.speedup) and c.speedup > 0):
            raise BankError(f"cluster {c.id} ({c.label}): speedup {c.speedup} is not a positive number")


def from_clusters(clusters: list[Cluster], results: list[ClusterResult], model: str, fingerprint: str, n_layers: int,
                  dtype: str, pooling: Pooling, min_similarity: float, created: str, extra: dict | None = None,
                  center: np.ndarray | None = None) -> Bank:
    """Assemble a bank from clusters and their search results."""
    by_id = {r.cluster: r for r in results}
    bcs = []
    for c in clusters:
        r = by_id[c.id]
        bcs.append(BankCluster(
            id=c.id, label=c.label, config=r.config, speedup=r.speedup, acceptance_rate=r.acceptance_rate,
            mean_accepted=r.mean_accepted, members=len(c.members), domains=c.domains,
            search=_search_record(r)))
    anchors, owner = stack_anchors(clusters)
    return Bank(model, fingerprint, n_layers, dtype, bcs, anchors, owner, pooling, 3, min_similarity,
                fallback_cluster(bcs), created, extra=extra or {}, center=center, **fallback_fields(bcs))


def _search_record(r: ClusterResult) -> dict:
    """What a bank cluster keeps of its search: trials, seconds, speedups, the fixed drafters' timings and the
    choice's margin over the fastest of them (NaN, not measured, is left out: a JSON round trip would not keep
    it equal)."""
    out = {k: v for k, v in (("proxy_speedup", r.proxy_speedup), ("proxy_trials", r.proxy_trials),
                             ("real_trials", r.real_trials), ("search_s", r.search_s),
                             ("ms_per_token", r.ms_per_token), ("ar_ms_per_token", r.ar_ms_per_token),
                             ("best_fixed_speedup", r.best_fixed_speedup), ("timing_noise", r.timing_noise),
                             ("margin_over_fixed", r.speedup / r.best_fixed_speedup))
           if not math.isnan(v)}
    fixed = {}
    for c in r.candidates:
        kind = fixed_kind(c["config"])
        if kind and all(math.isfinite(c.get(k, math.nan)) for k in ("ms_per_token", "ar_ms_per_token")):
            fixed[kind] = {"speedup": c["speedup"], "ms_per_token": c["ms_per_token"],
                           "ar_ms_per_token": c["ar_ms_per_token"]}
    if fixed:
        out["fixed"] = fixed
    return out


def fallback_fields(clusters: list[BankCluster]) -> dict:
    """``fallback_config`` and ``fallback_speedup``: the fixed drafter fastest over every cluster's calib
    prompts (each cluster's measured times weighted by its members), or plain decoding where none is faster.
    An unmatched prompt is like none of the clusters, so their own configurations, each measured on its own
    prompts only, say nothing of it. Empty where some cluster did not time the fixed drafters (a search
    without lookups, or a bank from before them): the fallback cluster serves then."""
    speed = {}
    for kind in FIXED:
        got = [(c.members or 1, c.search["fixed"][kind]) for c in clusters if kind in c.search.get("fixed", {})]
        if got and len(got) == len(clusters):
            speed[kind] = sum(w * f["ar_ms_per_token"] for w, f in got) / sum(w * f["ms_per_token"] for w, f in got)
    if not speed:
        return {}
    kind, sp = max(speed.items(), key=lambda kv: kv[1])
    if sp <= 1.0:
        return {"fallback_config": DrafterConfig(kind="none").to_dict(), "fallback_speedup": 1.0}
    return {"fallback_config": untuned(kind).to_dict(), "fallback_speedup": sp}


def fallback_cluster(clusters: list[BankCluster]) -> int:
    """The cluster whose configuration serves unmatched prompts: the one fastest over the most prompts."""
    return max(clusters, key=lambda b: (b.speedup - 1.0) * b.members).id
