"""`knnssd complete` (one prompt) and `knnssd generate` (a prompt file into parquet)."""
from __future__ import annotations

import argparse

import json
import sys

from knnssd.cli.command import command
from knnssd.cli.options import (device_arg, dtype_arg, model_args, read_file, run_flow, sampling_args,
                                tracking_arg)


def _complete_options(p: argparse.ArgumentParser) -> None:
    model_args(p)
    p.add_argument("--prompt", required=True)
    p.add_argument("--drafter", default="hybrid", choices=["none", "layer_skip", "ngram", "hybrid", "suffix"])
    p.add_argument("--mask", default=None, help="skip mask JSON file")
    p.add_argument("--max-draft", type=int, default=6)
    p.add_argument("--threshold", type=float, default=0.5)
    p.add_argument("--int8", action="store_true", help="draft on int8 weights")
    p.add_argument("--max-new-tokens", type=int, default=64)
    sampling_args(p)


@command("complete", "generate for one prompt with a drafter", _complete_options, mlflow=False)
def cmd_complete(a) -> int:
    import dataclasses

    from knnssd import models
    from knnssd.engine.spec.loop import GenerationConfig, generate
    from knnssd.engine.spec.drafters import SKIPPING, DrafterConfig, build
    from knnssd.engine.spec.request_params import GenerateParams, check_prompt, prompt_ids
    from knnssd.engine.model.skip import SkipMask

    # what the user typed is checked before the model loads, with the checks and truncation of `generate`
    p = GenerateParams.from_dict(dict(max_new_tokens=a.max_new_tokens, temperature=a.temperature, top_k=a.top_k,
                                      top_p=a.top_p, seed=a.seed, max_prompt_tokens=a.max_prompt_tokens))
    check_prompt(a.prompt)
    cfg = DrafterConfig(kind=a.drafter, max_len=a.max_draft, threshold=a.threshold, int8=a.int8)
    mask = SkipMask.from_json(read_file(a.mask, "--mask")) if a.mask else None
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


def _generate_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model-uri", required=True, help="models:/knnssd-<model>@<alias> | models:/<name>/<version> | bank folder")
    p.add_argument("--input", required=True, help="jsonl/parquet/csv with a 'prompt' field (and optional 'id')")
    p.add_argument("--output", required=True, help="parquet file; an existing one is resumed (finished ids skipped)")
    p.add_argument("--overwrite", action="store_true", help="start the output over instead of resuming it")
    p.add_argument("--split", default=None, help="only rows of this split (e.g. eval)")
    dtype_arg(p)
    device_arg(p)
    p.add_argument("--max-new-tokens", type=int, default=128)
    sampling_args(p)
    p.add_argument("--batch-size", default="auto", metavar="auto|N",
                   help="sequences decoded together, one full-model pass per step for all (default auto: measured; "
                        "1: one at a time)")
    p.add_argument("--shards", type=int, default=1, metavar="N",
                   help="cut the input into N shards, each a flow run on --pool's workers, joined into --output (needs "
                        "$PREFECT_API_URL; docs/cluster.md)")
    p.add_argument("--pool", default="knnssd-process", help="the Prefect work pool whose workers run the shards")
    p.add_argument("--worker-wait", type=float, default=600.0, metavar="S",
                   help="with --shards: how long to wait for a worker in --pool before giving up (seconds)")
    tracking_arg(p)


@command("generate", "routed generation over a prompt file into parquet (Prefect flow, resumable)", _generate_options)
def cmd_generate(a) -> int:
    from knnssd.flows.generate import generate

    from knnssd.engine.spec.request_params import GenerateParams, batch_size
    from knnssd.serving.batch import already_complete
    from knnssd.serving.prepare import pin_version, prepared
    from knnssd.serving.request import GenerateRequest

    # every check runs here once, in seconds, before any server starts or model loads; the flow and its
    # tasks take the same prepared job (``serving.prepare``)
    params = GenerateParams.from_dict(dict(max_new_tokens=a.max_new_tokens, temperature=a.temperature, top_k=a.top_k,
                                           top_p=a.top_p, seed=a.seed, max_prompt_tokens=a.max_prompt_tokens))
    request = GenerateRequest(a.model_uri, a.input, a.output, params, a.split, a.dtype, a.device,
                              batch_size(a.batch_size), a.overwrite, a.tracking_uri, a.shards)
    if request.sharded:
        check_shared_api(a.worker_wait)
        request = pin_version(request)  # every shard on the version the alias names now
    with prepared(request) as job:
        complete = None if request.overwrite else already_complete(job.output, list(job.rows), job.done)
        if complete is not None:  # nothing to do: no Prefect server, no model load, no MLflow run
            print(f"knnssd: every prompt of {request.input} is in {job.output} already", file=sys.stderr)
            summary = complete.report(None)
        else:
            summary = run_flow(generate, request, a.pool, a.worker_wait)
    print(json.dumps(summary))
    return 0


def check_shared_api(worker_wait: float) -> None:
    """A sharded run needs a Prefect server its workers reach (a temporary one has none)."""
    from prefect.settings import PREFECT_API_URL

    if not worker_wait > 0:
        raise ValueError(f"--worker-wait must be above 0 seconds, got {worker_wait:g}")
    if not PREFECT_API_URL.value():  # the environment's, or the Prefect profile's
        raise ValueError("--shards runs each shard on a work pool's workers: set PREFECT_API_URL to the Prefect server "
                         "they use (docs/cluster.md)")


# in the order `knnssd --help` lists them
COMMANDS = (cmd_complete, cmd_generate)
