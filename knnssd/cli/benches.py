"""Measuring: `bench`, `bench-engine`, `bench-throughput`, `route-eval`, and `plant` (a test model)."""
from __future__ import annotations

import argparse

import json
from pathlib import Path

from knnssd.cli.command import command
from knnssd.cli.options import (bank_arg, check_tracking, counts, device_arg, dtype_arg, float_list, int_list,
                                model_args, run_flow, tracking_arg)


def _bench_options(p: argparse.ArgumentParser) -> None:
    from knnssd.prompts import DOMAINS, OOD

    bank_arg(p)
    p.add_argument("--masks-bank", default=None, help="layer-skip-only bank (calibrate --kinds layer_skip --no-int8)")
    p.add_argument("--static-bank", default=None, help="single-cluster bank (calibrate --unlabelled --clusters 1)")
    p.add_argument("--model", default=None, help="default: the bank's model")
    dtype_arg(p)
    device_arg(p)
    p.add_argument("--data", default=None, help="folder of <domain>.jsonl (default ../shared/data)")
    p.add_argument("--domains", default=",".join(DOMAINS))
    p.add_argument("--ood", default=",".join(OOD), help="out-of-domain sets (empty: none)")
    p.add_argument("--prompts", type=int, default=4, help="eval prompts per domain")
    p.add_argument("--ood-prompts", type=int, default=2, help="prompts per OOD set")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=4, help="passes; pass j runs the stream with ratio r[j %% len(r)]")
    p.add_argument("--ratios", default="0.0,0.3,0.7,1.0", help="mix ratios r (probability of switching domain)")
    p.add_argument("--no-hf", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="results folder, resuming its measurement journal "
                                              "(default $KNNSSD_WORK/bench, else artifacts/bench)")
    tracking_arg(p)
    p.add_argument("--throughput", type=int, default=0, metavar="N",
                   help="add bench-throughput's table over N mixed eval prompts of --domains (0: none)")
    p.add_argument("--throughput-sizes", default="4,8,16", help="its fixed batch sizes (>= 2)")
    p.add_argument("--flow", action="store_true", help="run as the Prefect flow `bench`")


@command("bench", "all methods side by side on eval streams and OOD sets (the paper's tables)", _bench_options)
def cmd_bench(a) -> int:
    from knnssd.bench.bank import BenchConfig, markdown, run

    counts(a, "prompts", "max_new_tokens")
    cfg = BenchConfig(
        bank=a.bank, masks_bank=a.masks_bank, static_bank=a.static_bank, model=a.model, dtype=a.dtype,
        data=Path(a.data) if a.data else BenchConfig.__dataclass_fields__["data"].default_factory(),
        domains=tuple(a.domains.split(",")), ood=tuple(x for x in a.ood.split(",") if x), prompts=a.prompts,
        ood_prompts=a.ood_prompts, max_new_tokens=a.max_new_tokens, repeats=a.repeats,
        ratios=float_list(a.ratios, "--ratios"), hf=not a.no_hf, seed=a.seed, out=Path(a.out) if a.out else BenchConfig.__dataclass_fields__["out"].default_factory(),
        tracking_uri=a.tracking_uri, device=a.device, throughput=a.throughput,
        throughput_sizes=int_list(a.throughput_sizes, "--throughput-sizes"),
    )
    cfg.check()
    if a.flow:
        from knnssd.flows.bench import bench

        print(json.dumps(run_flow(bench, cfg)))
    else:
        print(markdown(run(cfg)))
    return 0


def _bench_engine_options(p: argparse.ArgumentParser) -> None:
    from knnssd.prompts import DOMAINS

    model_args(p)
    p.add_argument("--prompts", type=int, default=2, help="eval prompts per domain")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--domains", default=",".join(DOMAINS))
    p.add_argument("--data", default=None, help="folder of <domain>.jsonl (default ../shared/data)")
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--no-hf", action="store_true", help="skip timing HF generate")
    p.add_argument("--json", action="store_true", help="print one JSON object")


@command("bench-engine", "own AR vs HF generate vs fixed drafters, side by side", _bench_engine_options, mlflow=False)
def cmd_bench_engine(a) -> int:
    from knnssd.bench import engine as bench_engine

    counts(a, "prompts", "max_new_tokens", "repeats")
    cfg = bench_engine.EngineBench(
        model=a.model, dtype=a.dtype, device=a.device, prompts=a.prompts, max_new_tokens=a.max_new_tokens,
        domains=tuple(a.domains.split(",")), data=Path(a.data) if a.data else bench_engine.prompt_sets.default_data_dir(),
        repeats=a.repeats, hf=not a.no_hf,
    )
    report = bench_engine.run(cfg)
    print(json.dumps(report, indent=None if a.json else 2) if a.json else bench_engine.table(report))
    return 0


def _bench_throughput_options(p: argparse.ArgumentParser) -> None:
    bank_arg(p)
    dtype_arg(p)
    device_arg(p)
    p.add_argument("--data", default=None, help="folder of <domain>.jsonl (default ../shared/data)")
    p.add_argument("--prompts", type=int, default=64, help="mixed eval prompts, round-robin over the domains")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--sizes", default="4,8,16", help="fixed batch sizes (>= 2) besides b=1 and auto")
    p.add_argument("--repeats", type=int, default=1, help="runs of the whole list; each setting keeps its best")
    p.add_argument("--json", action="store_true")
    tracking_arg(p)


@command("bench-throughput", "batch tokens/s: routed b=1, batched plain and routed, auto", _bench_throughput_options)
def cmd_bench_throughput(a) -> int:
    from knnssd.bench import throughput

    sizes = int_list(a.sizes, "--sizes")
    cfg = throughput.ThroughputBench(bank=a.bank, dtype=a.dtype, prompts=a.prompts, max_new_tokens=a.max_new_tokens,
                                     sizes=sizes, repeats=a.repeats, tracking_uri=a.tracking_uri, device=a.device,
                                     data=Path(a.data) if a.data else throughput.prompts.default_data_dir())
    rep = throughput.run(cfg)
    print(json.dumps(rep) if a.json else throughput.markdown(rep))
    return 0


def _route_eval_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model-uri", required=True)
    p.add_argument("--data", default=None)
    p.add_argument("--prompts", type=int, default=None, help="eval prompts per domain (default all)")
    p.add_argument("--timed", type=int, default=2, help="prompts per domain generated to time the overhead")
    p.add_argument("--max-new-tokens", type=int, default=128)
    dtype_arg(p)
    tracking_arg(p)


@command("route-eval", "routing accuracy and overhead on the eval rows of the five domains", _route_eval_options)
def cmd_route_eval(a) -> int:
    from knnssd.serving.evaluate import routing_accuracy

    counts(a, "prompts", "max_new_tokens")
    check_tracking(a.tracking_uri, registered=a.model_uri.startswith(("models:/", "runs:/")))
    print(json.dumps(routing_accuracy(a.model_uri, Path(a.data) if a.data else None, a.prompts, a.dtype,
                                      a.max_new_tokens, a.timed, a.tracking_uri), indent=2))
    return 0


def _plant_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="smollm2")
    p.add_argument("--layers", type=int, default=8, help="zero layers to insert")
    p.add_argument("--every", type=int, default=3, help="insert one after every N-th original layer")
    p.add_argument("--out", required=True, help="new model folder (for --model of other commands)")


@command("plant",
         "a test model with planted redundancy: zero-output layers the mask search must skip",
         _plant_options,
         mlflow=False)
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


# in the order `knnssd --help` lists them
COMMANDS = (cmd_bench, cmd_bench_engine, cmd_bench_throughput, cmd_route_eval, cmd_plant)
