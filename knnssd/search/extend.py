"""Growing a bank with a new domain: new clusters beside the old ones, searched warm-started from
the nearest old clusters' configurations. The base version is only read; the result is a new bank.

    base bank + new prompts -> embed (the base bank's pooling) -> new clusters (anchors in the base
    router's space) -> warm starts -> search new clusters only -> merged bank
"""
from __future__ import annotations

import datetime as dt
from pathlib import Path

import numpy as np

from knnssd import prompts
from knnssd.routing import bank as banks
from knnssd.routing import router
from knnssd.search import optimize


def new_clusters(bank: banks.Bank, vectors: Path, name: str, k_per_domain: int = 10, seed: int = 0
                 ) -> list[router.Cluster]:
    """One cluster for domain ``name`` (``k_per_domain`` anchors), its id after the bank's last."""
    check_name([c.label for c in bank.clusters], name)
    ids, _, x = router.load_vectors(vectors)
    anchors, _ = router.kmeans(router.centered(x, bank.center), k_per_domain, seed)
    cid = max(c.id for c in bank.clusters) + 1
    return [router.Cluster(cid, name, anchors, list(ids), {name: len(ids)})]


MAX_NAME = 100  # a cluster label: it names studies, runs, metrics and lines of the bench's tables


def check_label(name: str) -> None:
    """A new domain's name on its own (before anything loads): printable, no '/', at most ``MAX_NAME``
    characters. A 3,000-character name was taken, and its search began before anything looked."""
    if len(name) > MAX_NAME:
        raise banks.BankError(f"domain name of {len(name)} characters: at most {MAX_NAME}")
    if "/" in name or not name.isprintable():
        raise banks.BankError(f"domain name {name!r} cannot hold '/' or control characters")


def check_name(domains: list[str], name: str) -> None:
    """A new domain's name is refused where it would be taken for another's: promotion logs a metric
    per domain under its ``tracking.slug``, which ignores case and punctuation and keeps only what
    follows a '/'."""
    from knnssd.tracking import slug

    check_label(name)
    same = [d for d in domains if slug(d) == slug(name)]
    if same:
        also = "" if same[0] == name else f" (as '{same[0]}': names differing only in case or punctuation are one)"
        raise banks.BankError(f"domain '{name}' is already in the bank{also}; pick another name or recalibrate")


def nearest(bank: banks.Bank, cluster: router.Cluster, n: int = 3) -> list[tuple[int, float]]:
    """The bank's clusters nearest to ``cluster`` (mean best anchor similarity), nearest first."""
    sims = cluster.anchors @ bank.anchors.T  # (k_new, N), both normalised in the same space
    out = []
    for c in bank.clusters:
        own = sims[:, bank.anchor_cluster == c.id]
        out.append((c.id, float(own.max(1).mean())))
    return sorted(out, key=lambda t: -t[1])[:n]


def warm_start(bank: banks.Bank, cluster: router.Cluster, n: int = 3) -> list[dict]:
    """Stage-1 trial parameters of the nearest clusters' configurations (those with a mask)."""
    out = []
    for cid, _ in nearest(bank, cluster, n):
        p = optimize.warm_params(bank.cluster(cid).config, bank.n_layers)
        if p is not None and p not in out:
            out.append(p)
    return out


def merged(bank: banks.Bank, clusters: list[router.Cluster], results: list[banks.ClusterResult], source: str) -> banks.Bank:
    """The base bank plus the new clusters (router space, threshold and pooling kept)."""
    add = banks.from_clusters(clusters, results, bank.model, bank.fingerprint,
                              bank.n_layers, bank.dtype, bank.pooling, bank.min_similarity, "", None, bank.center)
    all_clusters = [*bank.clusters, *add.clusters]
    extra = {**bank.extra, "extended_from": source, "added": [*bank.extra.get("added", []), *[c.label for c in add.clusters]]}
    out = banks.Bank(bank.model, bank.fingerprint, bank.n_layers, bank.dtype, all_clusters,
                     np.concatenate([bank.anchors, add.anchors]), np.concatenate([bank.anchor_cluster, add.anchor_cluster]),
                     bank.pooling, bank.router_k, bank.min_similarity, banks.fallback_cluster(all_clusters),
                     dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"), extra=extra, center=bank.center,
                     **banks.fallback_fields(all_clusters))
    banks.validate(out)
    return out


def split_rows(rows: list, name: str) -> tuple[list, list]:
    """(calib, eval) rows of a new domain's files (``prompts.of_split``), every row labelled ``name``."""
    from dataclasses import replace

    rows = [replace(r, domain=name) for r in rows]
    return prompts.of_split(rows, "calib"), prompts.of_split(rows, "eval")


def build(base_dir: Path, clusters: list[router.Cluster], results: list[banks.ClusterResult], vectors: Path, out_dir: Path,
          source: str) -> Path:
    """Write the merged bank (and its pictures) to ``out_dir``."""
    from knnssd.routing import pictures

    base = banks.load(base_dir)
    bank = merged(base, clusters, results, source)
    out_dir = Path(out_dir)
    bank.save(out_dir)
    _, domains, x = router.load_vectors(vectors)
    pictures.draw(bank, router.centered(x, bank.center), domains, out_dir)
    return out_dir
