"""`knnssd serve` (the OpenAI-compatible server) and `knnssd ui` (the MLflow UI)."""
from __future__ import annotations

import argparse

import os
import sys

from knnssd.cli.command import command
from knnssd.cli.options import check_tracking, counts, device_arg, dtype_arg, tracking_arg, url


def _serve_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model-uri", required=True, help="models:/knnssd-<model>@<alias> (followed live) | "
                   "models:/<name>/<version> | bank folder")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    dtype_arg(p)
    device_arg(p)
    p.add_argument("--batch-size", default="auto", metavar="auto|N", help="sequences decoded together (default auto)")
    p.add_argument("--max-model-len", type=int, default=None, metavar="N",
                   help="the most tokens of prompt and completion a request may take; more get 400 (default: the "
                        "model's context, and prompts of 4096 tokens at most). Bounded, batches may run on the static "
                        "step's slots (CUDA graphs on a GPU)")
    p.add_argument("--max-queue", type=int, default=256, help="requests that may wait for a slot; more get 503")
    p.add_argument("--request-timeout", type=float, default=600.0, help="seconds before a request is cancelled")
    p.add_argument("--reload-s", type=float, default=30.0,
                   help="seconds between checks of the alias for a new version to swap in (0: never)")
    p.add_argument("--grace-s", type=float, default=30.0, help="on SIGTERM, seconds requests in flight may finish in")
    p.add_argument("--no-draft", action="store_true", help="route, but decode without drafting (a baseline)")
    p.add_argument("--api-key", action="append", metavar="KEY",
                   help="a key /v1 asks for as Authorization: Bearer KEY (repeat for several; also $KNNSSD_API_KEY)")
    p.add_argument("--api-key-file", metavar="PATH", help="a file of keys, one a line (# starts a comment)")
    p.add_argument("--insecure-no-auth", action="store_true",
                   help="serve beyond loopback (--host 0.0.0.0) with no API key: anyone who reaches it may use it")
    p.add_argument("--open-metrics", action="store_true",
                   help="/metrics without the key from any address (default: only from loopback)")
    p.add_argument("--head-timeout", type=float, default=10.0,
                   help="seconds a request's line and headers may take to arrive; a slower connection is closed")
    p.add_argument("--max-connections", type=int, default=1024,
                   help="open connections past which a request gets 503 (slow clients cannot hold every socket)")
    p.add_argument("--key-concurrency", type=int, default=None, metavar="N",
                   help="requests one API key may have running or queued at once; more get 429 (default: no cap; "
                        "without keys, the cap is shared by all clients)")
    p.add_argument("--key-tokens-per-minute", type=int, default=None, metavar="N",
                   help="prompt and completion tokens one API key may use in any 60 s; more get 429 with "
                        "Retry-After (default: no cap)")
    tracking_arg(p)


@command("serve", "an OpenAI-compatible server (/v1/completions, /v1/chat/completions, streaming)", _serve_options)
def cmd_serve(a) -> int:
    import math

    from knnssd import models, tracking
    from knnssd.engine.spec.request_params import batch_size
    from knnssd.reachable import listen_error
    from knnssd.routing import bank as banks
    from knnssd.serving import access, openai_server
    from knnssd.serving.batcher import Batcher
    from knnssd.serving.quota import Caps
    from knnssd.serving.serve_config import ServeConfig

    keys = access.Keys.gather(a.api_key, a.api_key_file)
    counts(a, "max_queue", "max_connections", "key_concurrency", "key_tokens_per_minute")
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
        check_tracking(a.tracking_uri, registered=True)
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
          f"{url(a.host, a.port)}/v1, {guard}", file=sys.stderr, flush=True)
    openai_server.run(batcher, ServeConfig(
        a.model_uri, a.host, a.port, a.tracking_uri, request_timeout_s=a.request_timeout, reload_s=a.reload_s,
        grace_s=a.grace_s, keys=keys, metrics_open=a.open_metrics, head_timeout_s=a.head_timeout,
        max_connections=a.max_connections, caps=caps))
    return 0


def _ui_options(p: argparse.ArgumentParser) -> None:
    tracking_arg(p)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=5000)
    p.add_argument("--insecure-no-auth", action="store_true",
                   help="serve beyond loopback: the UI asks for no password, so anyone who reaches it may use it")


@command("ui",
         "the MLflow UI on 127.0.0.1",
         _ui_options,
         mlflow=False,
         description="The MLflow UI on 127.0.0.1, with one worker and MLflow's GenAI jobs off "
                                   "(MLFLOW_WORKERS and MLFLOW_SERVER_ENABLE_JOB_EXECUTION, where set, win).")
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
    check_tracking(uri)  # a mistyped sqlite path is an error, not a new database
    print(f"MLflow UI for {uri} on {url(a.host, a.port)}  (Ctrl-C stops it)", file=sys.stderr)
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


# in the order `knnssd --help` lists them
COMMANDS = (cmd_serve, cmd_ui)
