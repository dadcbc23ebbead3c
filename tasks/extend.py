"""Tasks for growing and promoting banks (add-domain, promote, the drop-folder watch)."""
from __future__ import annotations

from dataclasses import asdict
from pathlib import Path

from prefect import task
from prefect.cache_policies import NO_CACHE

from knnssd import prompts, tracking
from knnssd.routing import bank as banks
from knnssd.routing import router
from knnssd.search import extend
from knnssd.serving import promote, watch
from knnssd.tasks.retry import transient


@task(retries=2, retry_condition_fn=transient, retry_delay_seconds=3, cache_policy=NO_CACHE)
def fetch_bank(model_uri: str, tracking_uri: str | None) -> dict:
    """Download a registered bank (read only); returns its folder, model, version and domains."""
    mv = tracking.resolve(model_uri, tracking_uri)
    folder = tracking.download_bank(model_uri, uri=tracking_uri)
    bank = banks.load(folder)
    return {"dir": str(folder), "model": bank.model, "version": str(mv.version), "pooling": bank.pooling,
            "domains": [c.label for c in bank.clusters]}


@task(cache_policy=NO_CACHE)
def new_domain_rows(paths: list[str], name: str) -> tuple[list[prompts.Prompt], list[prompts.Prompt]]:
    rows = [r for p in paths for r in prompts.load(p)]
    return extend.split_rows(rows, name)


@task(cache_policy=NO_CACHE)
def new_clusters(bank_dir: str, vectors: str, name: str, k_per_domain: int, seed: int) -> list[router.Cluster]:
    return extend.new_clusters(banks.load(bank_dir), Path(vectors), name, k_per_domain, seed)


@task(cache_policy=NO_CACHE)
def warm_starts(bank_dir: str, cluster: router.Cluster, n: int) -> list[dict]:
    return extend.warm_start(banks.load(bank_dir), cluster, n) if n > 0 else []


@task(cache_policy=NO_CACHE)
def merge_bank(bank_dir: str, clusters: list[router.Cluster], results: list[banks.ClusterResult], vectors: str, out_dir: str,
               source: str) -> str:
    return str(extend.build(Path(bank_dir), clusters, results, Path(vectors), Path(out_dir), source))


@task(retries=2, retry_condition_fn=transient, cache_policy=NO_CACHE)
def eval_prompts(paths: list[str], per_file: int | None, extra: list[str] = ()) -> list[prompts.Prompt]:
    """Eval rows of each file (default: the five domains of the data folder) and of ``extra``."""
    return promote.eval_rows([*(paths or prompts.domain_files()), *extra], per_file)


@task(retries=1, retry_condition_fn=transient, cache_policy=NO_CACHE)
def compare_banks(candidate: dict, champion: dict, rows: list[prompts.Prompt], dtype: str, max_new_tokens: int,
                  tolerance: float, repeats: int) -> dict:
    c = promote.compare(candidate["dir"], champion["dir"], rows, (candidate["version"], champion["version"]), dtype,
                        max_new_tokens, tolerance, repeats)
    return asdict(c)


@task(retries=2, retry_condition_fn=transient, retry_delay_seconds=3, cache_policy=NO_CACHE)
def log_and_promote(model: str, comparison: dict, tracking_uri: str | None) -> dict:
    metrics = {"ratio": comparison["ratio"], "candidate_s": comparison["candidate_s"],
               "champion_s": comparison["champion_s"], "identical": float(comparison["identical"]),
               **{f"ratio_{tracking.slug(d)}": v for d, v in comparison["per_domain"].items()}}
    params = {k: comparison[k] for k in ("candidate", "champion", "prompts", "tolerance", "repeats", "promote")}
    run_id = tracking.log_run("knnssd-promote", params, metrics, uri=tracking_uri,
                              run_name=f"promote-v{comparison['candidate']}-over-v{comparison['champion']}")
    if comparison["promote"]:
        tracking.set_alias(model, "champion", comparison["candidate"], tracking_uri)
    return {**comparison, "mlflow_run_id": run_id}


@task(cache_policy=NO_CACHE)
def pending_inputs(drop: str, state: str, model: str, min_prompts: int, use_unmatched: bool) -> list[dict]:
    return [asdict(x) for x in watch.pending(Path(drop), Path(state), model, min_prompts, use_unmatched)]


@task(retries=2, retry_condition_fn=transient, cache_policy=NO_CACHE)
def mark_done(state: str, items: list[dict], result: dict) -> None:
    watch.mark(Path(state), [watch.Item(**x) for x in items], result)


@task(cache_policy=NO_CACHE)
def unpromoted(state: str) -> dict | None:
    return watch.unpromoted(Path(state))


@task(retries=2, retry_condition_fn=transient, cache_policy=NO_CACHE)
def mark_promoted(state: str) -> None:
    watch.promoted(Path(state))
