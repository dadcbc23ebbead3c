"""Measuring: `bench`, `bench-engine`, `bench-throughput`, `route-eval`, and `plant` (a test model)."""
from __future__ import annotations

import json
from pathlib import Path

from knnssd.cli.options import (bank_arg, check_tracking, counts, device_arg, dtype_arg, float_list, int_list,
                                model_args, run_flow, tracking_arg)


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


def cmd_bench_throughput(a) -> int:
    from knnssd.bench import throughput

    sizes = int_list(a.sizes, "--sizes")
    cfg = throughput.ThroughputBench(bank=a.bank, dtype=a.dtype, prompts=a.prompts, max_new_tokens=a.max_new_tokens,
                                     sizes=sizes, repeats=a.repeats, tracking_uri=a.tracking_uri, device=a.device,
                                     data=Path(a.data) if a.data else throughput.prompts.default_data_dir())
    rep = throughput.run(cfg)
    print(json.dumps(rep) if a.json else throughput.markdown(rep))
    return 0


def cmd_route_eval(a) -> int:
    from knnssd.serving.evaluate import routing_accuracy

    counts(a, "prompts", "max_new_tokens")
    check_tracking(a.tracking_uri, registered=a.model_uri.startswith(("models:/", "runs:/")))
    print(json.dumps(routing_accuracy(a.model_uri, Path(a.data) if a.data else None, a.prompts, a.dtype,
                                      a.max_new_tokens, a.timed, a.tracking_uri), indent=2))
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


def add(sub) -> None:
    from knnssd.prompts import DOMAINS, OOD

    e = sub.add_parser("bench", help="all methods side by side on eval streams and OOD sets (the paper's tables)")
    bank_arg(e)
    e.add_argument("--masks-bank", default=None, help="layer-skip-only bank (calibrate --kinds layer_skip --no-int8)")
    e.add_argument("--static-bank", default=None, help="single-cluster bank (calibrate --unlabelled --clusters 1)")
    e.add_argument("--model", default=None, help="default: the bank's model")
    dtype_arg(e)
    device_arg(e)
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
    e.add_argument("--out", default=None, help="results folder, resuming its measurement journal "
                                              "(default $KNNSSD_WORK/bench, else artifacts/bench)")
    tracking_arg(e)
    e.add_argument("--throughput", type=int, default=0, metavar="N",
                   help="add bench-throughput's table over N mixed eval prompts of --domains (0: none)")
    e.add_argument("--throughput-sizes", default="4,8,16", help="its fixed batch sizes (>= 2)")
    e.add_argument("--flow", action="store_true", help="run as the Prefect flow `bench`")
    e.set_defaults(fn=cmd_bench)

    b = sub.add_parser("bench-engine", help="own AR vs HF generate vs fixed drafters, side by side")
    model_args(b)
    b.add_argument("--prompts", type=int, default=2, help="eval prompts per domain")
    b.add_argument("--max-new-tokens", type=int, default=64)
    b.add_argument("--domains", default=",".join(DOMAINS))
    b.add_argument("--data", default=None, help="folder of <domain>.jsonl (default ../shared/data)")
    b.add_argument("--repeats", type=int, default=1)
    b.add_argument("--no-hf", action="store_true", help="skip timing HF generate")
    b.add_argument("--json", action="store_true", help="print one JSON object")
    b.set_defaults(fn=cmd_bench_engine, mlflow=False)

    t = sub.add_parser("bench-throughput", help="batch tokens/s: routed b=1, batched plain and routed, auto")
    bank_arg(t)
    dtype_arg(t)
    device_arg(t)
    t.add_argument("--data", default=None, help="folder of <domain>.jsonl (default ../shared/data)")
    t.add_argument("--prompts", type=int, default=64, help="mixed eval prompts, round-robin over the domains")
    t.add_argument("--max-new-tokens", type=int, default=128)
    t.add_argument("--sizes", default="4,8,16", help="fixed batch sizes (>= 2) besides b=1 and auto")
    t.add_argument("--repeats", type=int, default=1, help="runs of the whole list; each setting keeps its best")
    t.add_argument("--json", action="store_true")
    tracking_arg(t)
    t.set_defaults(fn=cmd_bench_throughput)

    r = sub.add_parser("route-eval", help="routing accuracy and overhead on the eval rows of the five domains")
    r.add_argument("--model-uri", required=True)
    r.add_argument("--data", default=None)
    r.add_argument("--prompts", type=int, default=None, help="eval prompts per domain (default all)")
    r.add_argument("--timed", type=int, default=2, help="prompts per domain generated to time the overhead")
    r.add_argument("--max-new-tokens", type=int, default=128)
    dtype_arg(r)
    tracking_arg(r)
    r.set_defaults(fn=cmd_route_eval)

    pl = sub.add_parser("plant", help="a test model with planted redundancy: zero-output layers the mask search must skip")
    pl.add_argument("--model", default="smollm2")
    pl.add_argument("--layers", type=int, default=8, help="zero layers to insert")
    pl.add_argument("--every", type=int, default=3, help="insert one after every N-th original layer")
    pl.add_argument("--out", required=True, help="new model folder (for --model of other commands)")
    pl.set_defaults(fn=cmd_plant, mlflow=False)
