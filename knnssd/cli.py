"""`knnssd ...` command line. Errors in inputs print one line and exit with status 2."""
from __future__ import annotations

import argparse
import contextlib
import errno
import json
import os
import signal
import sys
from pathlib import Path

from knnssd.settings import DTYPES

# What every knnssd process runs with unless its environment says otherwise: local and quiet
ENV_DEFAULTS = {"HF_HUB_OFFLINE": "1", "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "DO_NOT_TRACK": "true",
                "MLFLOW_DISABLE_TELEMETRY": "true", "TOKENIZERS_PARALLELISM": "false",
                # a tracking server that stops answering mid-run fails in seconds, not after minutes of retries
                "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "1", "MLFLOW_HTTP_REQUEST_TIMEOUT": "15",
                "MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR": "false"}
for _key, _value in ENV_DEFAULTS.items():
    os.environ.setdefault(_key, _value)


def _model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="smollm2", help="smollm2 | gemma3-270m | local folder | .gguf | hub id")
    _dtype_arg(p)
    _device_arg(p)


def _dtype_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dtype", default="auto", choices=DTYPES,
                   help="auto (bf16 where the CPU or GPU runs it fast, else fp32) | bfloat16 | float32 | gguf (a GGUF "
                        "file's own blocks) | q4_1 | q8_0 (blocks made at load)")


def _tracking_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tracking-uri", default=None,
                   help="MLflow tracking URI (default $MLFLOW_TRACKING_URI, else sqlite:///artifacts/mlflow.db)")


def _bank_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--bank", required=True, help="routed-drafters bank: models:/... URI or bank folder")


def _sampling_args(p: argparse.ArgumentParser) -> None:
    """What one generation takes besides its length (``engine.params.GenerateParams``)."""
    p.add_argument("--max-prompt-tokens", type=int, default=4096, help="longer prompts keep their last tokens (warned)")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None)


def _device_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", default="auto", help="auto (the GPU where CUDA has one, else the CPU) | cpu | cuda[:N]")


def _counts(a, *names: str) -> None:
    """Options that count something: integers >= 1, one line otherwise (0 or a negative one once meant
    'all', or a slice from the end, and ran for minutes)."""
    for name in names:
        value = getattr(a, name)
        if value is not None and value < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be an integer >= 1, got {value}")


def _sizes(text: str, option: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(",") if x)
    except ValueError:
        raise ValueError(f"{option} takes integers separated by commas, got '{text}'") from None


def _floats(text: str, option: str) -> tuple[float, ...]:
    try:
        out = tuple(float(x) for x in text.split(",") if x.strip())
    except ValueError:
        out = ()
    if not out:
        raise ValueError(f"{option} takes one or more numbers separated by commas, got '{text}'")
    return out


def _url(host: str, port: int) -> str:
    """The address a server listens on, as a URL (an IPv6 host in brackets)."""
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def _json_option(text: str, option: str) -> dict:
    try:
        value = json.loads(text)
    except ValueError as e:
        raise ValueError(f"{option} is not JSON ({e})") from None
    if not isinstance(value, dict):
        raise ValueError(f"{option} takes a JSON object, got {text!r:.60}")
    return value


def _check_tracking(uri: str | None, registered: bool = False) -> None:
    """The tracking store answers and can be written (and, with ``registered``, may hold a registered
    version): checked in seconds, before any slow work."""
    from knnssd import tracking

    from knnssd.settings import tracking_uri

    tracking.check_reachable(tracking_uri(uri), registered)


def _flow(fn, *args):
    """Run a flow (or a job that runs flows) against a Prefect API that answers, started here if none
    is set, so that it stops with this process however it ends."""
    from knnssd.flows.server import local_api

    with local_api():
        return fn(*args)


def cmd_bench_engine(a) -> int:
    from knnssd.bench import engine as bench_engine

    _counts(a, "prompts", "max_new_tokens", "repeats")
    cfg = bench_engine.EngineBench(
        model=a.model, dtype=a.dtype, device=a.device, prompts=a.prompts, max_new_tokens=a.max_new_tokens,
        domains=tuple(a.domains.split(",")), data=Path(a.data) if a.data else bench_engine.prompt_sets.default_data_dir(),
        repeats=a.repeats, hf=not a.no_hf,
    )
    report = bench_engine.run(cfg)
    print(json.dumps(report, indent=None if a.json else 2) if a.json else bench_engine.table(report))
    return 0


def cmd_complete(a) -> int:
    import dataclasses

    from knnssd import models
    from knnssd.engine.decode import GenerationConfig, generate
    from knnssd.engine.drafters import SKIPPING, DrafterConfig, build
    from knnssd.engine.params import GenerateParams, check_prompt, prompt_ids
    from knnssd.engine.skip import SkipMask

    # what the user typed is checked before the model loads, with the checks and truncation of `generate`
    p = GenerateParams.from_dict(dict(max_new_tokens=a.max_new_tokens, temperature=a.temperature, top_k=a.top_k,
                                      top_p=a.top_p, seed=a.seed, max_prompt_tokens=a.max_prompt_tokens))
    check_prompt(a.prompt)
    cfg = DrafterConfig(kind=a.drafter, max_len=a.max_draft, threshold=a.threshold, int8=a.int8)
    mask = SkipMask.from_json(_read(a.mask, "--mask")) if a.mask else None
    if mask is not None and a.drafter not in SKIPPING:  # it would be ignored
        raise ValueError(f"--mask is for the layer_skip and hybrid drafters; --drafter {a.drafter} does not skip")
    if mask is not None:  # the model's config has its layer count: a mask for another model fails before the load
        mask.validate(models.config(a.model).num_hidden_layers)
    models.limits(a.model, a.dtype, a.device).check(p)
    lm = models.load(a.model, a.dtype, a.device)
    ids, _ = prompt_ids(lm.tokenizer, a.prompt, p, lm.limits)
    dec = lm.decoder_for(len(ids) + p.max_new_tokens, int8=a.int8)
    cfg = dataclasses.replace(cfg, mask=(mask or SkipMask.none(dec.n_layers)).to_dict())
    gen = GenerationConfig(max_new_tokens=p.max_new_tokens, warp=p.warp, seed=p.seed, eos_ids=models.eos_ids(lm))
    out, stats = generate(dec, ids, build(cfg, dec.n_layers, dec.can_skip), gen)
    print(lm.tokenizer.decode(out, skip_special_tokens=True))
    s = stats.to_dict()
    s.pop("accepted")
    print(json.dumps(s), file=sys.stderr)
    return 0


def _read(path: str, option: str) -> str:
    """The text of a file an option names; a one-line error for a folder, a missing or unreadable file."""
    try:
        return Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"{option} {path}: cannot read it ({getattr(e, 'strerror', None) or e})") from None


def _check_storage(storage: str | None) -> None:
    from knnssd.search.study import check_storage

    check_storage(storage)


def _check_search(a, registered: bool = False):
    """What calibrate, search-worker and add-domain share, checked before any server starts: the search
    budget, the study storage, the tracking store and the budget's new tokens against the model's
    context. Returns the model's config."""
    from knnssd import models
    from knnssd.engine.params import GenerateParams
    from knnssd.search.budget import Budget

    budget = Budget(**budget_values(a))
    _check_storage(a.storage)
    _check_tracking(a.tracking_uri, registered)
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


def cmd_calibrate(a) -> int:
    import time

    from knnssd.flows.calibrate import CalibrateParams, calibrate

    from knnssd import tracking
    from knnssd.routing import bank as banks

    params = CalibrateParams(**_calibrate_params(a))
    _check_calibrate(a, params)
    t0 = time.perf_counter()
    registered = _flow(calibrate, params)
    wall = time.perf_counter() - t0
    searched = banks.load(tracking.bank_folder(registered["uri"], a.tracking_uri)).searched()
    margin = searched["margin_over_fixed"]
    print(f"knnssd: calibrated in {wall:.0f} s ({searched['search_s']:.0f} s of cluster searches); the chosen drafters "
          f"over the best fixed one on their clusters' calib prompts: "
          f"{'not timed' if margin is None else f'{margin:.3f}x'}", file=sys.stderr)
    print(json.dumps({**registered, "wall_s": round(wall, 1), **searched}))
    return 0


def cmd_search_worker(a) -> int:
    from knnssd.flows.search_worker import WorkerParams, search_worker

    _counts(a, "worker_trials")  # before the model's own check, which names calibrate's --trials
    params = WorkerParams(**_calibrate_params(a), trials=a.worker_trials, clusters=a.cluster or [])
    rows = _check_calibrate(a, params)
    if params.clusters and params.labelled:  # a labelled pool's clusters are its domains (the flow checks the rest)
        params.check_clusters({r.domain for r in rows if r.domain})
    _worker_start(params)
    print(json.dumps(_flow(search_worker, params)))
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
    print(json.dumps(_flow(add_domain, params)))
    return 0


def cmd_promote(a) -> int:
    from knnssd.flows.promote import PromoteParams, promote

    from knnssd import models, prompts, tracking
    from knnssd.engine.params import GenerateParams
    from knnssd.serving import promote as promotion

    params = PromoteParams(model=a.model, candidate=a.candidate, champion=a.champion, inputs=a.input or [],
                           per_file=a.per_file, dtype=a.dtype, max_new_tokens=a.max_new_tokens,
                           tolerance=a.tolerance, repeats=a.repeats, tracking_uri=a.tracking_uri)
    files = a.input or prompts.domain_files()
    if not promotion.eval_rows(files, a.per_file):
        raise ValueError(f"no eval rows to time on in {', '.join(files)}")
    _check_tracking(a.tracking_uri, registered=True)
    for ref in (a.candidate, a.champion):  # an unknown alias or version fails in seconds, not after the server
        tracking.resolve(promotion.version_uri(a.model, ref), a.tracking_uri)
    models.limits(a.model, a.dtype).check(GenerateParams(max_new_tokens=a.max_new_tokens))
    print(json.dumps(_flow(promote, params), default=str))
    return 0


def cmd_watch(a) -> int:
    from knnssd.flows.watch import WatchParams, watch
    from knnssd.serving.watch import check_drop, load_state

    check_drop(Path(a.drop))
    params = WatchParams(drop=a.drop, model=a.model, min_prompts=a.min_prompts, use_unmatched=not a.no_unmatched,
                         dtype=a.dtype, search=_json_option(a.search, "--search"), promote=_json_option(a.promote, "--promote"),
                         tracking_uri=a.tracking_uri)
    load_state(Path(params.state_path()))  # a corrupt record fails here, not after the Prefect server starts
    _check_tracking(a.tracking_uri, registered=True)
    print(json.dumps(_flow(watch, params), default=str))
    return 0


def cmd_bench(a) -> int:
    from knnssd.bench.bank import BenchConfig, markdown, run

    _counts(a, "prompts", "max_new_tokens")
    cfg = BenchConfig(
        bank=a.bank, masks_bank=a.masks_bank, static_bank=a.static_bank, model=a.model, dtype=a.dtype,
        data=Path(a.data) if a.data else BenchConfig.__dataclass_fields__["data"].default_factory(),
        domains=tuple(a.domains.split(",")), ood=tuple(x for x in a.ood.split(",") if x), prompts=a.prompts,
        ood_prompts=a.ood_prompts, max_new_tokens=a.max_new_tokens, repeats=a.repeats,
        ratios=_floats(a.ratios, "--ratios"), hf=not a.no_hf, seed=a.seed, out=Path(a.out),
        tracking_uri=a.tracking_uri, device=a.device, throughput=a.throughput,
        throughput_sizes=_sizes(a.throughput_sizes, "--throughput-sizes"),
    )
    cfg.check()
    if a.flow:
        from knnssd.flows.bench import bench

        print(json.dumps(_flow(bench, cfg)))
    else:
        print(markdown(run(cfg)))
    return 0


def cmd_bench_throughput(a) -> int:
    from knnssd.bench import throughput

    sizes = _sizes(a.sizes, "--sizes")
    cfg = throughput.ThroughputBench(bank=a.bank, dtype=a.dtype, prompts=a.prompts, max_new_tokens=a.max_new_tokens,
                                     sizes=sizes, repeats=a.repeats, tracking_uri=a.tracking_uri, device=a.device,
                                     data=Path(a.data) if a.data else throughput.prompts.default_data_dir())
    rep = throughput.run(cfg)
    print(json.dumps(rep) if a.json else throughput.markdown(rep))
    return 0


def cmd_plant(a) -> int:
    from knnssd import models
    from knnssd.bench.planted import plant, save

    out = Path(a.out)
    if a.layers < 1 or a.every < 1:
        raise ValueError("--layers and --every must be >= 1")
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ValueError(f"{out} exists and is not an empty folder")
    lm = models.load(a.model, "float32", "cpu")
    p = plant(lm.model, a.layers, a.every)
    save(p, lm.tokenizer, out)
    print(f"{out}: {lm.name} with {len(p.layers)} zero-output layers inserted at {list(p.layers)} ({p.n_layers} layers)")
    return 0


def cmd_demo(a) -> int:
    from knnssd.demo import DemoConfig, calibrate_params, run

    cfg = DemoConfig(model=a.model, dtype=a.dtype, device=a.device, trials=a.trials, candidates=a.candidates,
                     max_new_tokens=a.max_new_tokens)
    calibrate_params(cfg).budget()  # bad counts fail here, before the Prefect server starts
    _flow(run, cfg)
    return 0


def cmd_generate(a) -> int:
    from knnssd.flows.generate import generate

    from knnssd import models
    from knnssd.engine.params import GenerateParams, batch_size
    from knnssd.serving.batch import already_complete, check_output, check_paths, output_path, run_settings, writing
    from knnssd.serving.request import GenerateRequest

    # every check a retry cannot change runs here, in seconds, before any server starts or model loads; the
    # prompts and the bank read here are the ones the flow's tasks take (``GenerateRequest``: once a process)
    params = GenerateParams.from_dict(dict(max_new_tokens=a.max_new_tokens, temperature=a.temperature, top_k=a.top_k,
                                           top_p=a.top_p, seed=a.seed, max_prompt_tokens=a.max_prompt_tokens))
    request = GenerateRequest(a.model_uri, a.input, a.output, params, a.split, a.dtype, a.device,
                              batch_size(a.batch_size), a.overwrite, a.tracking_uri)
    rows = request.rows()
    output = output_path(request.output)
    check_paths(output, [request.input])
    with writing(output):  # one writer per output: a second run fails here, naming this process
        _check_tracking(request.tracking_uri, registered=request.model_uri.startswith(("models:/", "runs:/")))
        bank = request.bank()
        limits = models.limits(bank.model, request.dtype, request.device)
        limits.check(params)
        if request.batch_size is not None:  # each sequence takes its new tokens at least (prompts count after the load)
            limits.check_slots(min(request.batch_size, len(rows)), params.max_new_tokens + 1, "--batch-size")
        dtype = models.precision_name(request.dtype, request.device)
        done = check_output(output, request.overwrite, run_settings(params, dtype, bank))  # a resume: the same settings
        complete = None if request.overwrite else already_complete(output, rows, done)
        if complete is not None:  # nothing to do: no Prefect server, no model load, no MLflow run
            print(f"knnssd: every prompt of {request.input} is in {output} already", file=sys.stderr)
            summary = complete.report(None)
        else:
            summary = _flow(generate, request)
    print(json.dumps(summary))
    return 0


def cmd_serve(a) -> int:
    import math

    from knnssd import models, tracking
    from knnssd.engine.params import batch_size
    from knnssd.reachable import listen_error
    from knnssd.routing import bank as banks
    from knnssd.serving import access, openai_server
    from knnssd.serving.batcher import Batcher
    from knnssd.serving.quota import Caps
    from knnssd.serving.serve_config import ServeConfig

    keys = access.Keys.gather(a.api_key, a.api_key_file)
    _counts(a, "max_queue", "max_connections", "key_concurrency", "key_tokens_per_minute")
    caps = Caps(a.key_concurrency, a.key_tokens_per_minute)
    for name in ("request_timeout", "grace_s", "head_timeout"):
        if not (math.isfinite(getattr(a, name)) and getattr(a, name) > 0):
            raise ValueError(f"--{name.replace('_', '-')} must be a number of seconds > 0, got {getattr(a, name)}")
    if not (math.isfinite(a.reload_s) and a.reload_s >= 0):
        raise ValueError(f"--reload-s must be a number of seconds >= 0, got {a.reload_s}")
    slots = batch_size(a.batch_size)
    reason = listen_error(a.host, a.port)
    if reason is not None:
        raise ValueError(f"--host {a.host} --port {a.port}: cannot serve there ({reason})")
    refused = access.bind_error(a.host, keys, a.insecure_no_auth)  # an address that works, beyond loopback
    if refused is not None:
        raise ValueError(refused)
    version = None
    if a.model_uri.startswith("models:/"):
        _check_tracking(a.tracking_uri, registered=True)
        mv = tracking.resolve(a.model_uri, a.tracking_uri)  # the version served: the alias may move meanwhile
        version = str(mv.version)
        folder = tracking.download_bank(f"models:/{mv.name}/{version}", uri=a.tracking_uri)
    else:
        folder = tracking.bank_folder(a.model_uri, a.tracking_uri)
    bank = banks.load(folder)
    limits = models.limits(bank.model, a.dtype, a.device)  # from the config alone: before the model loads
    if a.max_model_len is not None and not 2 <= a.max_model_len <= limits.positions:
        raise ValueError(f"--max-model-len must be an integer from 2 to {limits.positions} ({limits.bound()}), "
                         f"got {a.max_model_len}")
    if slots is not None:
        limits.check_slots(slots, a.max_model_len or 2, "--batch-size")
    batcher = Batcher.routed(folder, None, a.dtype, a.device, slots, "--batch-size", plain=a.no_draft, always=True,
                             max_len=a.max_model_len, max_queue=a.max_queue)
    if not batcher.batching:
        raise ValueError(f"{bank.model} runs on the plain HF fallback, which knnssd serve cannot batch")
    batcher.version = version
    guard = (f"an API key asked on /v1 ({len(keys.digests)} taken)" if keys else
             "no API key asked" + ("" if access.loopback(a.host) else ": anyone who reaches it may use it"))
    print(f"knnssd: serving {a.model_uri} (bank version {batcher.version or folder}) with {batcher.slots} slots on "
          f"{_url(a.host, a.port)}/v1, {guard}", file=sys.stderr, flush=True)
    openai_server.run(batcher, ServeConfig(
        a.model_uri, a.host, a.port, a.tracking_uri, request_timeout_s=a.request_timeout, reload_s=a.reload_s,
        grace_s=a.grace_s, keys=keys, metrics_open=a.open_metrics, head_timeout_s=a.head_timeout,
        max_connections=a.max_connections, caps=caps))
    return 0


def cmd_ui(a) -> int:
    import subprocess

    from knnssd import processes
    from knnssd.settings import tracking_uri

    from knnssd.reachable import listen_error
    from knnssd.serving.access import loopback

    uri = tracking_uri(a.tracking_uri)
    reason = listen_error(a.host, a.port)
    if reason is not None:
        raise ValueError(f"--host {a.host} --port {a.port}: cannot serve there ({reason})")
    if not (loopback(a.host) or a.insecure_no_auth):
        raise ValueError(f"--host {a.host} lets other machines in, and the MLflow UI asks for no password: give "
                         "--insecure-no-auth if anyone who reaches it may read and change the runs and models")
    _check_tracking(uri)  # a mistyped sqlite path is an error, not a new database
    print(f"MLflow UI for {uri} on {_url(a.host, a.port)}  (Ctrl-C stops it)", file=sys.stderr)
    cmd = [sys.executable, "-m", "mlflow", "ui", "--backend-store-uri", uri, "--host", a.host, "--port", str(a.port)]
    # unless the caller sets them: one web worker and no job runner. A browser of runs and versions needs neither
    # MLflow's four workers nor its GenAI job consumers, which start three more processes and leave a folder in
    # /dev/shm at each start
    env = {"MLFLOW_WORKERS": "1", "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false", **os.environ}
    # a group of its own (its server and workers), stopped whole however this command ends
    # (Ctrl-C, SIGTERM, SIGHUP: the group gets neither the terminal's signals nor a stop sent to this one's
    # group); its leader also stops if this process is SIGKILLed
    proc = subprocess.Popen(cmd, env=env, start_new_session=True, preexec_fn=processes.die_with_parent())
    try:
        return proc.wait()
    finally:
        processes.stop_group(proc)


def cmd_route_eval(a) -> int:
    from knnssd.serving.evaluate import routing_accuracy

    _counts(a, "prompts", "max_new_tokens")
    _check_tracking(a.tracking_uri, registered=a.model_uri.startswith(("models:/", "runs:/")))
    print(json.dumps(routing_accuracy(a.model_uri, Path(a.data) if a.data else None, a.prompts, a.dtype,
                                      a.max_new_tokens, a.timed, a.tracking_uri), indent=2))
    return 0


def _calibrate_args(k: argparse.ArgumentParser) -> None:
    _model_args(k)
    k.add_argument("--input", action="append", help="prompt file (jsonl/parquet/csv); repeat; default: the five domains")
    k.add_argument("--domain-from-file", action="store_true", help="rows without a domain take the file name")
    k.add_argument("--unlabelled", action="store_true", help="ignore domains: cluster the pool, K by silhouette")
    k.add_argument("--k-per-domain", type=int, default=10, help="anchors per labelled domain")
    k.add_argument("--clusters", type=int, default=None, help="clusters for an unlabelled pool (default: silhouette)")
    k.add_argument("--pooling", default="mean", choices=["mean", "last"])
    k.add_argument("--layer", type=int, default=-1, help="hidden state to pool (-1: after the final norm)")
    budget_args(k)
    k.add_argument("--storage", default=None, help="Optuna storage: journal file path or URL (sqlite:///, postgresql://)")
    _tracking_arg(k)
    k.add_argument("--alias", default="candidate", help="alias for the new version (default candidate)")


def budget_args(p: argparse.ArgumentParser) -> None:
    """The search settings as options, made from ``search.budget.Budget`` (its one declaration): each
    option's dest is the field's name, so ``budget_values`` reads them back."""
    from knnssd.search.budget import settings

    for st in settings():
        metavar = st.flag.lstrip("-").replace("-", "_").upper()
        if isinstance(st.default, bool):  # a flag that turns a default-on setting off
            p.add_argument(st.flag, dest=st.name, action="store_false", help=st.help)
        elif isinstance(st.default, tuple):
            p.add_argument(st.flag, dest=st.name, default=list(st.default), type=lambda v: [x for x in v.split(",") if x],
                           metavar=metavar, help=f"{st.help} (comma-separated; default {','.join(st.default)})")
        else:
            p.add_argument(st.flag, dest=st.name, type=float if st.kind in (float, float | None) else int,
                           default=st.default, metavar=metavar,
                           help=f"{st.help} (default {'none' if st.default is None else st.default})")


def budget_values(a) -> dict:
    from knnssd.search.budget import settings

    return {st.name: getattr(a, st.name) for st in settings()}


class _Parser(argparse.ArgumentParser):
    """Usage errors in the one line every other error gets (argparse prints the usage first: 4-12 lines)."""

    def error(self, message: str):
        self.exit(2, f"knnssd: error: {message} (see: {self.prog} --help)\n")


def parser() -> argparse.ArgumentParser:
    from knnssd.prompts import DOMAINS
    from knnssd.serving.promote import REPEATS, TOLERANCE

    p = _Parser(prog="knnssd", description=__doc__)
    p.add_argument("-v", "--verbose", action="store_true")
    sub = p.add_subparsers(dest="cmd", metavar="COMMAND", required=True)

    b = sub.add_parser("bench-engine", help="own AR vs HF generate vs fixed drafters, side by side")
    _model_args(b)
    b.add_argument("--prompts", type=int, default=2, help="eval prompts per domain")
    b.add_argument("--max-new-tokens", type=int, default=64)
    b.add_argument("--domains", default=",".join(DOMAINS))
    b.add_argument("--data", default=None, help="folder of <domain>.jsonl (default ../shared/data)")
    b.add_argument("--repeats", type=int, default=1)
    b.add_argument("--no-hf", action="store_true", help="skip timing HF generate")
    b.add_argument("--json", action="store_true", help="print one JSON object")
    b.set_defaults(fn=cmd_bench_engine)

    c = sub.add_parser("complete", help="generate for one prompt with a drafter")
    _model_args(c)
    c.add_argument("--prompt", required=True)
    c.add_argument("--drafter", default="hybrid", choices=["none", "layer_skip", "ngram", "hybrid", "suffix"])
    c.add_argument("--mask", default=None, help="skip mask JSON file")
    c.add_argument("--max-draft", type=int, default=6)
    c.add_argument("--threshold", type=float, default=0.5)
    c.add_argument("--int8", action="store_true", help="draft on int8 weights")
    c.add_argument("--max-new-tokens", type=int, default=64)
    _sampling_args(c)
    c.set_defaults(fn=cmd_complete)

    k = sub.add_parser("calibrate", help="prompts -> anchors -> per-cluster search -> a new bank version (Prefect flow)")
    _calibrate_args(k)
    k.set_defaults(fn=cmd_calibrate)

    w = sub.add_parser("search-worker", help="add stage-1 trials to a calibration's shared studies (scale-out)")
    _calibrate_args(w)
    w.add_argument("--worker-trials", type=int, default=8, help="trials this worker adds per cluster")
    w.add_argument("--cluster", action="append", help="cluster label to work on (repeat; default all)")
    w.set_defaults(fn=cmd_search_worker)

    n = sub.add_parser("add-domain", help="a new version = a base version + a new domain's clusters (Prefect flow)")
    _model_args(n)
    n.add_argument("--name", required=True, help="the new domain's name")
    n.add_argument("--input", action="append", required=True, help="the new domain's prompt file(s)")
    n.add_argument("--model-uri", default=None, help="base version (default models:/knnssd-<model>@champion)")
    n.add_argument("--k-per-domain", type=int, default=10)
    n.add_argument("--warm", type=int, default=3, help="nearest old clusters to warm-start from (0: cold)")
    budget_args(n)
    n.add_argument("--storage", default=None)
    _tracking_arg(n)
    n.set_defaults(fn=cmd_add_domain)

    o = sub.add_parser("promote", help="time candidate vs champion on eval prompts; move champion if not worse")
    o.add_argument("--model", default="smollm2")
    o.add_argument("--candidate", default="candidate", help="alias or version")
    o.add_argument("--champion", default="champion", help="alias or version")
    o.add_argument("--input", action="append", help="prompt files (eval rows; default: the five domains)")
    o.add_argument("--per-file", type=int, default=4)
    _dtype_arg(o)
    o.add_argument("--max-new-tokens", type=int, default=64)
    o.add_argument("--tolerance", type=float, default=TOLERANCE, help="promote when candidate >= (1 - tolerance) x champion speed")
    o.add_argument("--repeats", type=int, default=REPEATS, help="runs per prompt and bank; the best time counts")
    _tracking_arg(o)
    o.set_defaults(fn=cmd_promote)

    t = sub.add_parser("watch", help="once: add new drop-folder files / unmatched prompts as domains, then promote")
    t.add_argument("--drop", required=True, help="drop folder")
    t.add_argument("--model", default="smollm2")
    t.add_argument("--min-prompts", type=int, default=20)
    t.add_argument("--no-unmatched", action="store_true", help="ignore the unmatched-prompts log")
    _dtype_arg(t)
    t.add_argument("--search", default="{}", help='add-domain settings as JSON, e.g. \'{"proxy_trials": 16}\'')
    t.add_argument("--promote", default="{}", help='promote settings as JSON, e.g. \'{"per_file": 2}\'')
    _tracking_arg(t)
    t.set_defaults(fn=cmd_watch)

    d = sub.add_parser("demo", help="the main job: calibrate a small bank, register it, generate a mixed stream")
    _model_args(d)
    d.add_argument("--trials", type=int, default=6)
    d.add_argument("--candidates", type=int, default=2)
    d.add_argument("--max-new-tokens", type=int, default=64)
    d.set_defaults(fn=cmd_demo)

    g = sub.add_parser("generate", help="routed generation over a prompt file into parquet (Prefect flow, resumable)")
    g.add_argument("--model-uri", required=True, help="models:/knnssd-<model>@<alias> | models:/<name>/<version> | bank folder")
    g.add_argument("--input", required=True, help="jsonl/parquet/csv with a 'prompt' field (and optional 'id')")
    g.add_argument("--output", required=True, help="parquet file; an existing one is resumed (finished ids skipped)")
    g.add_argument("--overwrite", action="store_true", help="start the output over instead of resuming it")
    g.add_argument("--split", default=None, help="only rows of this split (e.g. eval)")
    _dtype_arg(g)
    _device_arg(g)
    g.add_argument("--max-new-tokens", type=int, default=128)
    _sampling_args(g)
    g.add_argument("--batch-size", default="auto", metavar="auto|N",
                   help="sequences decoded together, one full-model pass per step for all (default auto: measured; "
                        "1: one at a time)")
    _tracking_arg(g)
    g.set_defaults(fn=cmd_generate)

    v = sub.add_parser("serve", help="an OpenAI-compatible server (/v1/completions, /v1/chat/completions, streaming)")
    v.add_argument("--model-uri", required=True, help="models:/knnssd-<model>@<alias> (followed live) | "
                   "models:/<name>/<version> | bank folder")
    v.add_argument("--host", default="127.0.0.1")
    v.add_argument("--port", type=int, default=8000)
    _dtype_arg(v)
    _device_arg(v)
    v.add_argument("--batch-size", default="auto", metavar="auto|N", help="sequences decoded together (default auto)")
    v.add_argument("--max-model-len", type=int, default=None, metavar="N",
                   help="the most tokens of prompt and completion a request may take; more get 400 (default: the "
                        "model's context, and prompts of 4096 tokens at most). Bounded, batches may run on the static "
                        "step's slots (CUDA graphs on a GPU)")
    v.add_argument("--max-queue", type=int, default=256, help="requests that may wait for a slot; more get 503")
    v.add_argument("--request-timeout", type=float, default=600.0, help="seconds before a request is cancelled")
    v.add_argument("--reload-s", type=float, default=30.0,
                   help="seconds between checks of the alias for a new version to swap in (0: never)")
    v.add_argument("--grace-s", type=float, default=30.0, help="on SIGTERM, seconds requests in flight may finish in")
    v.add_argument("--no-draft", action="store_true", help="route, but decode without drafting (a baseline)")
    v.add_argument("--api-key", action="append", metavar="KEY",
                   help="a key /v1 asks for as Authorization: Bearer KEY (repeat for several; also $KNNSSD_API_KEY)")
    v.add_argument("--api-key-file", metavar="PATH", help="a file of keys, one a line (# starts a comment)")
    v.add_argument("--insecure-no-auth", action="store_true",
                   help="serve beyond loopback (--host 0.0.0.0) with no API key: anyone who reaches it may use it")
    v.add_argument("--open-metrics", action="store_true",
                   help="/metrics without the key from any address (default: only from loopback)")
    v.add_argument("--head-timeout", type=float, default=10.0,
                   help="seconds a request's line and headers may take to arrive; a slower connection is closed")
    v.add_argument("--max-connections", type=int, default=1024,
                   help="open connections past which a request gets 503 (slow clients cannot hold every socket)")
    v.add_argument("--key-concurrency", type=int, default=None, metavar="N",
                   help="requests one API key may have running or queued at once; more get 429 (default: no cap; "
                        "without keys, the cap is shared by all clients)")
    v.add_argument("--key-tokens-per-minute", type=int, default=None, metavar="N",
                   help="prompt and completion tokens one API key may use in any 60 s; more get 429 with "
                        "Retry-After (default: no cap)")
    _tracking_arg(v)
    v.set_defaults(fn=cmd_serve)

    u = sub.add_parser("ui", help="the MLflow UI on 127.0.0.1",
                       description="The MLflow UI on 127.0.0.1, with one worker and MLflow's GenAI jobs off "
                                   "(MLFLOW_WORKERS and MLFLOW_SERVER_ENABLE_JOB_EXECUTION, where set, win).")
    _tracking_arg(u)
    u.add_argument("--host", default="127.0.0.1")
    u.add_argument("--port", type=int, default=5000)
    u.add_argument("--insecure-no-auth", action="store_true",
                   help="serve beyond loopback: the UI asks for no password, so anyone who reaches it may use it")
    u.set_defaults(fn=cmd_ui)

    from knnssd.prompts import OOD

    e = sub.add_parser("bench", help="all methods side by side on eval streams and OOD sets (the paper's tables)")
    _bank_arg(e)
    e.add_argument("--masks-bank", default=None, help="layer-skip-only bank (calibrate --kinds layer_skip --no-int8)")
    e.add_argument("--static-bank", default=None, help="single-cluster bank (calibrate --unlabelled --clusters 1)")
    e.add_argument("--model", default=None, help="default: the bank's model")
    _dtype_arg(e)
    _device_arg(e)
    e.add_argument("--data", default=None, help="folder of <domain>.jsonl (default ../shared/data)")
    e.add_argument("--domains", default=",".join(DOMAINS))
    e.add_argument("--ood", default=",".join(OOD), help="out-of-domain sets (empty: none)")
    e.add_argument("--prompts", type=int, default=4, help="eval prompts per domain")
    e.add_argument("--ood-prompts", type=int, default=2, help="prompts per OOD set")
    e.add_argument("--max-new-tokens", type=int, default=128)
    e.add_argument("--repeats", type=int, default=4, help="passes; pass j runs the stream with ratio r[j %% len(r)]")
    e.add_argument("--ratios", default="0.0,0.3,0.7,1.0", help="mix ratios r (probability of switching domain)")
    e.add_argument("--no-hf", action="store_true")
    e.add_argument("--seed", type=int, default=0)
    e.add_argument("--out", default="artifacts/bench", help="results folder (resumes its measurement journal)")
    _tracking_arg(e)
    e.add_argument("--throughput", type=int, default=0, metavar="N",
                   help="add bench-throughput's table over N mixed eval prompts of --domains (0: none)")
    e.add_argument("--throughput-sizes", default="4,8,16", help="its fixed batch sizes (>= 2)")
    e.add_argument("--flow", action="store_true", help="run as the Prefect flow `bench`")
    e.set_defaults(fn=cmd_bench)

    t = sub.add_parser("bench-throughput", help="batch tokens/s: routed b=1, batched plain and routed, auto")
    _bank_arg(t)
    _dtype_arg(t)
    _device_arg(t)
    t.add_argument("--data", default=None, help="folder of <domain>.jsonl (default ../shared/data)")
    t.add_argument("--prompts", type=int, default=64, help="mixed eval prompts, round-robin over the domains")
    t.add_argument("--max-new-tokens", type=int, default=128)
    t.add_argument("--sizes", default="4,8,16", help="fixed batch sizes (>= 2) besides b=1 and auto")
    t.add_argument("--repeats", type=int, default=1, help="runs of the whole list; each setting keeps its best")
    t.add_argument("--json", action="store_true")
    _tracking_arg(t)
    t.set_defaults(fn=cmd_bench_throughput)

    pl = sub.add_parser("plant", help="a test model with planted redundancy: zero-output layers the mask search must skip")
    pl.add_argument("--model", default="smollm2")
    pl.add_argument("--layers", type=int, default=8, help="zero layers to insert")
    pl.add_argument("--every", type=int, default=3, help="insert one after every N-th original layer")
    pl.add_argument("--out", required=True, help="new model folder (for --model of other commands)")
    pl.set_defaults(fn=cmd_plant)

    r = sub.add_parser("route-eval", help="routing accuracy and overhead on the eval rows of the five domains")
    r.add_argument("--model-uri", required=True)
    r.add_argument("--data", default=None)
    r.add_argument("--prompts", type=int, default=None, help="eval prompts per domain (default all)")
    r.add_argument("--timed", type=int, default=2, help="prompts per domain generated to time the overhead")
    r.add_argument("--max-new-tokens", type=int, default=128)
    _dtype_arg(r)
    _tracking_arg(r)
    r.set_defaults(fn=cmd_route_eval)
    p.commands = sub.choices  # each command's parser, for its own usage errors
    return p


UNWIND = (signal.SIGTERM, signal.SIGHUP)  # ``kill PID``, a scheduler's stop; the terminal closed


class Terminated(BaseException):
    """A signal of ``UNWIND``, raised in the main thread like Ctrl-C's KeyboardInterrupt, so the command
    unwinds as on Ctrl-C (an output's lock file is removed, servers and temporary folders are stopped and
    deleted) instead of ending where it stood."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)  # "Terminated: SIGHUP" where Prefect logs the crash
        self.signum = signum


@contextlib.contextmanager
def _signals_unwind():
    """While a command runs, each signal of ``UNWIND`` whose handler is the default raises ``Terminated``
    once (a second one ends the process at once, as before; an ignored signal or a host program's handler
    is left as it is, and so is every handler off the main thread). Within a flow Prefect's SIGTERM
    handler comes first (the run is marked Crashed), then sends the signal on to this one."""
    def terminated(signum, frame):
        signal.signal(signum, signal.SIG_DFL)
        raise Terminated(signum)

    installed = {}
    for sig in UNWIND:
        try:
            if signal.getsignal(sig) == signal.SIG_DFL:
                installed[sig] = signal.signal(sig, terminated)
        except ValueError:  # not the main thread
            break
    try:
        yield
    finally:
        for sig, before in installed.items():
            signal.signal(sig, before)


def main(argv: list[str] | None = None) -> int:
    from knnssd import console
    from knnssd.engine.skip import MaskError
    from knnssd.flows.server import PrefectUnavailable
    from knnssd.models import ModelError, resolve_device
    from knnssd.prompts import PromptError
    from knnssd.routing.bank import BankError
    from knnssd.serving.batch import OutputError
    from knnssd.settings import check_work_dir, graphs
    from knnssd.tracking import RegistryError

    p = parser()
    a, extra = p.parse_known_args(argv)
    if extra:  # named with the command's own --help, which lists what it takes
        p.commands[a.cmd].error(f"unrecognized arguments: {' '.join(extra)}")
    with _signals_unwind():
        try:
            check_work_dir()  # where the log file goes, before anything is written there
            console.setup(a.verbose)
            from transformers.utils import logging as hf_logging

            hf_logging.disable_progress_bar()
            if a.cmd not in ("complete", "bench-engine", "ui", "plant"):  # the commands that use MLflow
                console.adopt_library_loggers()
            if getattr(a, "device", None) is not None:  # every command that loads a model takes --device:
                graphs(resolve_device(a.device))  # a bad one (or $KNNSSD_GRAPHS) fails here, before
                # any server starts or model loads
            return a.fn(a)
        except (ModelError, PromptError, MaskError, BankError, RegistryError, OutputError, ValueError,
                FileNotFoundError, PrefectUnavailable) as e:
            return _error(e)
        except OSError as e:
            if e.errno not in (errno.ENOSPC, errno.EDQUOT, errno.EROFS):
                raise
            return _error(f"{e.strerror}{f' ({e.filename})' if e.filename else ''}; what was finished is kept: make "
                          "room (or make it writable) and run the same command again")
        except KeyboardInterrupt:
            console.end_progress()
            print("knnssd: interrupted", file=sys.stderr)
            return 130
        except Terminated as e:
            with contextlib.suppress(OSError):  # after SIGHUP the terminal may be gone
                console.end_progress()
                print(f"knnssd: terminated ({e})", file=sys.stderr)
            return 128 + e.signum
        except Exception as e:
            if not _is_mlflow_error(e):
                raise
            return _error(f"MLflow: {console.first_line(e)}")


def _error(e) -> int:
    """The one line a bad input or a fault gets (the traceback, where there is one, goes to the log file)."""
    import logging

    from knnssd import console

    logging.getLogger("knnssd").info("the error's traceback", exc_info=True)
    console.end_progress()
    errors = getattr(e, "errors", None)  # pydantic's ValidationError: a line per field and its input
    if callable(errors) and type(e).__name__ == "ValidationError":
        first = errors()[0]
        if first["type"] == "value_error":  # a validator's own message, which names what it got
            e = f"{'.'.join(map(str, first['loc']))}: {first['msg'].removeprefix('Value error, ')}"
        else:
            e = f"{'.'.join(map(str, first['loc']))}: {first['msg']} (got {first.get('input')!r})"
    print(f"knnssd: error: {e}", file=sys.stderr)
    return 2


def _is_mlflow_error(e: Exception) -> bool:
    """The tracking store failed under a command (a database that filled up or was damaged mid-run)."""
    mlflow_exceptions = sys.modules.get("mlflow.exceptions")
    return mlflow_exceptions is not None and isinstance(e, mlflow_exceptions.MlflowException)


if __name__ == "__main__":
    sys.exit(main())
