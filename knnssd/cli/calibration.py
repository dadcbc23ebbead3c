"""Making and growing banks: `calibrate`, `search-worker`, `add-domain`, `promote`, `watch`."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from knnssd.cli.command import command
from knnssd.cli.options import (budget_args, budget_values, check_tracking, counts, dtype_arg, json_option, model_args,
                                run_flow, tracking_arg)


def _check_storage(storage: str | None) -> None:
    from knnssd.search.study import check_storage

    check_storage(storage)


def _check_search(a, registered: bool = False):
    """What calibrate, search-worker and add-domain share, checked before any server starts: the search
    budget, the study storage, the tracking store and the budget's new tokens against the model's
    context. Returns the model's config."""
    from knnssd import models
    from knnssd.engine.spec.request_params import GenerateParams
    from knnssd.search.budget import Budget

    budget = Budget(**budget_values(a))
    _check_storage(a.storage)
    check_tracking(a.tracking_uri, registered)
    config = models.config(a.model)
    dtype = models.resolve_dtype(a.dtype, models.resolve_device(a.device))
    models.config_limits(config, dtype).check(GenerateParams(max_new_tokens=budget.max_new_tokens))
    return config


def _calibrate_params(a) -> dict:
    return dict(
        model=a.model, dtype=a.dtype, device=a.device, inputs=a.input or [], domain_from_file=a.domain_from_file,
        labelled=not a.unlabelled, k_per_domain=a.k_per_domain, n_clusters=a.clusters, pooling=a.pooling,
        layer=a.layer, storage=a.storage, tracking_uri=a.tracking_uri, alias=a.alias, **budget_values(a),
    )


def _check_calibrate(a, params) -> list:
    """Calibrate's and search-worker's checks past their parameters' own (made first: they cost nothing),
    before any server starts. Returns the calib rows."""
    from knnssd import tracking
    from knnssd.routing.router import Pooling
    from knnssd.search.steps import load_prompts

    rows = load_prompts(params.paths(), "calib", domain_from_file=params.domain_from_file)
    if a.clusters is not None and not a.unlabelled:
        raise ValueError("--clusters sets an --unlabelled pool's clusters; labelled domains take --k-per-domain")
    tracking.check_alias(a.alias)
    pooling = Pooling(a.pooling, a.layer)
    pooling.check(_check_search(a).num_hidden_layers)
    return rows


def _calibrate_args(k: argparse.ArgumentParser) -> None:
    model_args(k)
    k.add_argument("--input", action="append", help="prompt file (jsonl/parquet/csv); repeat; default: the five domains")
    k.add_argument("--domain-from-file", action="store_true", help="rows without a domain take the file name")
    k.add_argument("--unlabelled", action="store_true", help="ignore domains: cluster the pool, K by silhouette")
    k.add_argument("--k-per-domain", type=int, default=10, help="anchors per labelled domain")
    k.add_argument("--clusters", type=int, default=None, help="clusters for an unlabelled pool (default: silhouette)")
    k.add_argument("--pooling", default="mean", choices=["mean", "last"])
    k.add_argument("--layer", type=int, default=-1, help="hidden state to pool (-1: after the final norm)")
    budget_args(k)
    k.add_argument("--storage", default=None, help="Optuna storage: journal file path or URL (sqlite:///, postgresql://)")
    tracking_arg(k)
    k.add_argument("--alias", default="candidate", help="alias for the new version (default candidate)")


@command("calibrate",
         "prompts -> anchors -> per-cluster search -> a new bank version (Prefect flow)",
         _calibrate_args)
def cmd_calibrate(a) -> int:
    import time

    from knnssd.flows.calibrate import CalibrateParams, calibrate

    from knnssd import tracking
    from knnssd.routing import bank as banks

    params = CalibrateParams(**_calibrate_params(a))
    _check_calibrate(a, params)
    t0 = time.perf_counter()
    registered = run_flow(calibrate, params)
    wall = time.perf_counter() - t0
    searched = banks.load(tracking.bank_folder(registered["uri"], a.tracking_uri)).searched()
    margin = searched["margin_over_fixed"]
    print(f"knnssd: calibrated in {wall:.0f} s ({searched['search_s']:.0f} s of cluster searches); the chosen drafters "
          f"over the best fixed one on their clusters' calib prompts: "
          f"{'not timed' if margin is None else f'{margin:.3f}x'}", file=sys.stderr)
    print(json.dumps({**registered, "wall_s": round(wall, 1), **searched}))
    return 0


def _search_worker_options(p: argparse.ArgumentParser) -> None:
    _calibrate_args(p)
    p.add_argument("--worker-trials", type=int, default=8, help="trials this worker adds per cluster")
    p.add_argument("--cluster", action="append", help="cluster label to work on (repeat; default all)")


@command("search-worker", "add stage-1 trials to a calibration's shared studies (scale-out)", _search_worker_options)
def cmd_search_worker(a) -> int:
    from knnssd.flows.search_worker import WorkerParams, search_worker

    counts(a, "worker_trials")  # before the model's own check, which names calibrate's --trials
    params = WorkerParams(**_calibrate_params(a), trials=a.worker_trials, clusters=a.cluster or [])
    rows = _check_calibrate(a, params)
    if params.clusters and params.labelled:  # a labelled pool's clusters are its domains (the flow checks the rest)
        params.check_clusters({r.domain for r in rows if r.domain})
    _worker_start(params)
    print(json.dumps(run_flow(search_worker, params)))
    return 0


def _worker_start(params) -> None:
    """The worker's first line, at once: the model's load, its probe and the prompts' embedding come
    before any trial, and a worker on a new storage said nothing for minutes (trial 6)."""
    from knnssd.search.study import is_new

    storage = params.storage_url()
    where = (f"{storage} is new: the studies are made there, and calibrate with the same --storage takes their "
             "trials" if is_new(storage) else f"the studies in {storage}")
    which = ", ".join(params.clusters) if params.clusters else "each cluster"
    print(f"knnssd search-worker: {params.trials} stage-1 trial(s) for {which}, into {where}; loading the model "
          "and embedding the calib prompts first", file=sys.stderr, flush=True)


def _add_domain_options(p: argparse.ArgumentParser) -> None:
    model_args(p)
    p.add_argument("--name", required=True, help="the new domain's name")
    p.add_argument("--input", action="append", required=True, help="the new domain's prompt file(s)")
    p.add_argument("--model-uri", default=None, help="base version (default models:/knnssd-<model>@champion)")
    p.add_argument("--k-per-domain", type=int, default=10)
    p.add_argument("--warm", type=int, default=3, help="nearest old clusters to warm-start from (0: cold)")
    budget_args(p)
    p.add_argument("--storage", default=None)
    tracking_arg(p)


@command("add-domain", "a new version = a base version + a new domain's clusters (Prefect flow)", _add_domain_options)
def cmd_add_domain(a) -> int:
    from knnssd.flows.add_domain import AddDomainParams, add_domain

    from knnssd import tracking
    from knnssd.prompts import load
    from knnssd.routing import bank as banks
    from knnssd.search.extend import check_label, check_name, split_rows
    from knnssd.serving.promote import version_uri

    check_label(a.name)
    params = AddDomainParams(name=a.name, inputs=a.input, model=a.model, model_uri=a.model_uri, dtype=a.dtype,
                             device=a.device, k_per_domain=a.k_per_domain, warm=a.warm, storage=a.storage,
                             tracking_uri=a.tracking_uri, **budget_values(a))
    if not split_rows([r for p in a.input for r in load(p)], a.name)[0]:
        raise ValueError(f"--input: no rows to calibrate {a.name!r} on (rows with split 'calib', or any rows "
                         "without a split field)")
    _check_search(a, registered=True)
    # the base version is fetched here (the flow reuses it): a wrong URI or a name it holds fails in seconds
    base = banks.load(tracking.bank_folder(a.model_uri or version_uri(a.model, "champion"), a.tracking_uri))
    check_name([c.label for c in base.clusters], a.name)
    print(json.dumps(run_flow(add_domain, params)))
    return 0


def _promote_options(p: argparse.ArgumentParser) -> None:
    from knnssd.serving.promote import REPEATS, TOLERANCE

    p.add_argument("--model", default="smollm2")
    p.add_argument("--candidate", default="candidate", help="alias or version")
    p.add_argument("--champion", default="champion", help="alias or version")
    p.add_argument("--input", action="append", help="prompt files (eval rows; default: the five domains)")
    p.add_argument("--per-file", type=int, default=4)
    dtype_arg(p)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--tolerance", type=float, default=TOLERANCE, help="promote when candidate >= (1 - tolerance) x champion speed")
    p.add_argument("--repeats", type=int, default=REPEATS, help="runs per prompt and bank; the best time counts")
    tracking_arg(p)


@command("promote", "time candidate vs champion on eval prompts; move champion if not worse", _promote_options)
def cmd_promote(a) -> int:
    from knnssd.flows.promote import PromoteParams, promote

    from knnssd import models, prompts, tracking
    from knnssd.engine.spec.request_params import GenerateParams
    from knnssd.serving import promote as promotion

    params = PromoteParams(model=a.model, candidate=a.candidate, champion=a.champion, inputs=a.input or [],
                           per_file=a.per_file, dtype=a.dtype, max_new_tokens=a.max_new_tokens,
                           tolerance=a.tolerance, repeats=a.repeats, tracking_uri=a.tracking_uri)
    files = a.input or prompts.domain_files()
    if not promotion.eval_rows(files, a.per_file):
        raise ValueError(f"no eval rows to time on in {', '.join(files)}")
    check_tracking(a.tracking_uri, registered=True)
    for ref in (a.candidate, a.champion):  # an unknown alias or version fails in seconds, not after the server
        tracking.resolve(promotion.version_uri(a.model, ref), a.tracking_uri)
    models.limits(a.model, a.dtype).check(GenerateParams(max_new_tokens=a.max_new_tokens))
    print(json.dumps(run_flow(promote, params), default=str))
    return 0


def _watch_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--drop", required=True, help="drop folder")
    p.add_argument("--model", default="smollm2")
    p.add_argument("--min-prompts", type=int, default=20)
    p.add_argument("--no-unmatched", action="store_true", help="ignore the unmatched-prompts log")
    dtype_arg(p)
    p.add_argument("--search", default="{}", help='add-domain settings as JSON, e.g. \'{"proxy_trials": 16}\'')
    p.add_argument("--promote", default="{}", help='promote settings as JSON, e.g. \'{"per_file": 2}\'')
    tracking_arg(p)


@command("watch", "once: add new drop-folder files / unmatched prompts as domains, then promote", _watch_options)
def cmd_watch(a) -> int:
    from knnssd.flows.watch import WatchParams, watch
    from knnssd.serving.watch import check_drop, load_state

    check_drop(Path(a.drop))
    params = WatchParams(drop=a.drop, model=a.model, min_prompts=a.min_prompts, use_unmatched=not a.no_unmatched,
                         dtype=a.dtype, search=json_option(a.search, "--search"), promote=json_option(a.promote, "--promote"),
                         tracking_uri=a.tracking_uri)
    load_state(Path(params.state_path()))  # a corrupt record fails here, not after the Prefect server starts
    check_tracking(a.tracking_uri, registered=True)
    print(json.dumps(run_flow(watch, params), default=str))
    return 0


# in the order `knnssd --help` lists them
COMMANDS = (cmd_calibrate, cmd_search_worker, cmd_add_domain, cmd_promote, cmd_watch)
