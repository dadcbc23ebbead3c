"""Old vs new engine, side by side in one process: same model weights, dtype, threads and prompts.

    .venv/bin/python benchmarks/compare_revisions.py --rev f70dd47 --dtype bfloat16 --prompts 2

The engine of git revision ``--rev`` is extracted into a temporary package ``knnssd_rev`` and
both decoders are built over one loaded model. Each eval prompt runs own AR, n-gram and hybrid
(the engine bench's fixed configurations) on both, interleaved, the order rotating per prompt.
Prints tok/s, speedups vs each engine's own AR, and agreement with its own AR.

With ``--batched N``, all the prompts are also decoded together, N slots at a time, by each engine's
``scheduler.decode_batch`` (what ``bench-throughput``'s batched and ``auto`` rows and the served
batches run), plain and with n-gram drafts, twice with the engines' order swapped; each keeps its
best tokens/s, and each output is compared with its own AR's.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from knnssd.bench import options

ROOT = Path(__file__).resolve().parents[1]


def extract(rev: str, dest: Path) -> None:
    """The revision's engine as the package ``knnssd_rev``: ``knnssd/engine/`` with its rooms (``model/``,
    ``spec/``, ...; its ``knnssd.engine`` imports renamed, its C source kept), or the flat ``knnssd/`` of
    older revisions."""
    pkg = dest / "knnssd_rev"
    pkg.mkdir(parents=True)

    def ls(folder: str) -> list[str]:
        return subprocess.run(["git", "-C", str(ROOT), "ls-tree", "-r", "--name-only", rev, folder], check=True,
                              capture_output=True, text=True).stdout.split()

    root = "knnssd/engine/" if ls("knnssd/engine/") else "knnssd/"
    files = ls(root) if root != "knnssd/" else [f for f in ls(root) if f.count("/") == 1]
    for f in (f for f in files if f.endswith((".py", ".c"))):  # .c: the native kernels' source, built by native.py
        src = subprocess.run(["git", "-C", str(ROOT), "show", f"{rev}:{f}"], check=True, capture_output=True,
                             text=True).stdout
        if f.endswith(".py"):
            src = src.replace("from knnssd.engine import", "from knnssd_rev import").replace("knnssd.engine.",
                                                                                               "knnssd_rev.")
        out = pkg / f.removeprefix(root)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(src)


def old_config(drafters, cfg):
    """``cfg`` as the old revision's ``DrafterConfig``: fields it does not have yet are left out, and must hold
    their defaults, so that both revisions draft alike."""
    known = {f.name for f in dataclasses.fields(drafters.DrafterConfig)}
    default = {f.name: f.default_factory() if f.default is dataclasses.MISSING else f.default
               for f in dataclasses.fields(cfg)}
    differ = sorted(k for k in default if k not in known and getattr(cfg, k) != default[k])
    if differ:
        raise SystemExit(f"the old revision's DrafterConfig has no {differ}: they would be dropped")
    return drafters.DrafterConfig(**{k: v for k, v in cfg.to_dict().items() if k in known})


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rev", required=True)
    options.dtype(ap, "bfloat16")
    options.prompts(ap, 2, help="eval prompts per domain")
    options.max_new_tokens(ap)
    ap.add_argument("--batched", type=int, default=0, metavar="N", help="also decode all prompts N at a time (0: no)")
    ap.add_argument("--reps", type=int, default=2, help="batched runs of each engine, alternating; the best counts")
    a = ap.parse_args()
    if a.reps < 1:
        ap.error(f"--reps must be at least 1, got {a.reps}")
    from knnssd import models
    from knnssd import prompts as prompt_sets
    from knnssd.bench import engine as bench_engine
    from knnssd.engine.spec.loop import GenerationConfig, generate
    from knnssd.engine.spec.drafters import build
    from knnssd.engine.model.build import make_decoder

    with tempfile.TemporaryDirectory(prefix="knnssd-rev-") as tmp:
        extract(a.rev, Path(tmp))
        sys.path.insert(0, tmp)
        old_decode = _old_module(tmp, "spec.loop", "decode")
        old_drafters = _old_module(tmp, "spec.drafters", "drafters")
        # make_decoder's module: model/build.py, then its older homes
        old_skip = _old_module(tmp, "model.build", "model.decoder", "decoder", "skip")

        lm = models.load("smollm2", a.dtype)
        engines = {"old": (old_skip.make_decoder(lm.model), old_decode, old_drafters),
                   "new": (make_decoder(lm.model), None, None)}
        configs = bench_engine.fixed_drafters(engines["new"][0].n_layers, True)
        methods = ["ar", "ngram", "hybrid"]
        runs = {}
        for eng, (dec, dmod, drmod) in engines.items():
            for m in methods:
                if dmod is None:
                    runs[(eng, m)] = (lambda d=dec, m=m: (lambda ids, cfg: generate(
                        d, ids, build(configs[m], d.n_layers) if m != "ar" else None, cfg)))()
                else:
                    runs[(eng, m)] = (lambda d=dec, m=m, dm=dmod, drm=drmod: (lambda ids, cfg: dm.generate(
                        d, ids, drm.build(old_config(drm, configs[m]), d.n_layers) if m != "ar" else None,
                        dm.GenerationConfig(max_new_tokens=cfg.max_new_tokens, eos_ids=cfg.eos_ids))))()
        rows = prompt_sets.load_domains(prompt_sets.default_data_dir(), prompt_sets.DOMAINS, "eval", a.prompts)
        cfg = GenerationConfig(max_new_tokens=a.max_new_tokens, eos_ids=models.eos_ids(lm))
        keys = list(runs)
        warm = lm.tokenizer(rows[0].prompt).input_ids[:32]
        for k in keys:
            runs[k](warm, cfg)
        res = {k: [] for k in keys}
        for i, r in enumerate(rows):
            ids = lm.tokenizer(r.prompt).input_ids
            for k in keys[i % len(keys):] + keys[: i % len(keys)]:
                out, st = runs[k](ids, cfg)
                res[k].append((list(out), st.total_s))
            print(f"prompt {i + 1}/{len(rows)}", file=sys.stderr, flush=True)
        report = {"rev": a.rev, "dtype": a.dtype, "threads": torch.get_num_threads(), "prompts": len(rows),
                  "max_new_tokens": a.max_new_tokens, "new_step": engines["new"][0].exactness.to_dict()}
        report["ar_outputs_equal_old_new"] = sum(a == b for (a, _), (b, _) in zip(res[("old", "ar")],
                                                                                 res[("new", "ar")])) / len(rows)
        for eng in engines:
            ar_t = sum(t for _, t in res[(eng, "ar")])
            ar_tok = sum(len(o) for o, _ in res[(eng, "ar")])
            report[eng] = {"ar_tok_per_s": ar_tok / ar_t}
            for m in methods[1:]:
                t = sum(t for _, t in res[(eng, m)])
                agree = sum(o == ao for (o, _), (ao, _) in zip(res[(eng, m)], res[(eng, "ar")])) / len(rows)
                report[eng][m] = {"speedup_vs_own_ar": ar_t / t, "agreement_with_own_ar": agree}
        if a.batched:
            own_ar = {eng: [o for o, _ in res[(eng, "ar")]] for eng in engines}
            for eng, row in batched_runs(engines, configs, rows, lm, a, tmp).items():
                for m, (tok_s, outs) in row.items():
                    report[eng][f"batched {m} b={a.batched}"] = {
                        "tokens_per_s": tok_s, "agreement_with_own_ar": sum(
                            o == ar for o, ar in zip(outs, own_ar[eng])) / len(rows)}
            for m in ("ar", "ngram"):
                key = f"batched {m} b={a.batched}"
                report[f"{key}: new / old"] = report["new"][key]["tokens_per_s"] / report["old"][key]["tokens_per_s"]
        print(json.dumps(report, indent=1))


def _old_module(tmp, *names: str):
    """The old engine's module by the first of ``names`` it has (its rooms' names, then older flat ones)."""
    import importlib

    pkg = Path(tmp) / "knnssd_rev"
    name = next(n for n in names if (pkg / f"{n.replace('.', '/')}.py").exists())
    return importlib.import_module(f"knnssd_rev.{name}")


def batched_runs(engines: dict, configs: dict, rows, lm, a, tmp: str) -> dict:
    """{engine: {"ar" | "ngram": (best tokens/s of ``a.reps`` runs, outputs in prompt order)}}, the engines
    alternating."""
    import time

    old_batched = _old_module(tmp, "batch.scheduler", "batched")

    from knnssd import models
    from knnssd.engine.batch import plan as batch_plan
    from knnssd.engine.batch import scheduler as new_batched
    from knnssd.engine.spec.loop import GenerationConfig
    from knnssd.engine.spec.drafters import build

    mods = {"old": old_batched, "new": new_batched}
    planners = {"old": _old_module(tmp, "batch.plan", "batch_plan", "batched"), "new": batch_plan}
    ids = [lm.tokenizer(r.prompt).input_ids for r in rows]
    positions = max(map(len, ids)) + a.max_new_tokens
    plans = {eng: planners[eng].plan(engines[eng][0], a.batched, positions) for eng in engines}
    for eng, p in plans.items():
        print(f"plan {eng}: {p}", file=sys.stderr, flush=True)
    out: dict = {eng: {} for eng in engines}
    for rep in range(a.reps):
        for eng in ("old", "new") if rep % 2 == 0 else ("new", "old"):
            dec, dmod, drmod = engines[eng]
            for m in ("ar", "ngram"):
                if dmod is None:
                    cfg = GenerationConfig(max_new_tokens=a.max_new_tokens, eos_ids=models.eos_ids(lm))
                    drafter = (lambda: build(configs[m], dec.n_layers)) if m != "ar" else (lambda: None)
                else:
                    cfg = dmod.GenerationConfig(max_new_tokens=a.max_new_tokens, eos_ids=models.eos_ids(lm))
                    drafter = ((lambda: drmod.build(old_config(drmod, configs[m]), dec.n_layers))
                               if m != "ar" else (lambda: None))
                jobs = [mods[eng].PromptJob(x, drafter(), cfg) for x in ids]
                t0 = time.perf_counter()
                done = {id(f.job): f for f in mods[eng].decode_batch(dec, jobs, plans[eng])}
                wall = time.perf_counter() - t0
                outs = [list(done[id(j)].tokens) for j in jobs]
                tok_s = sum(map(len, outs)) / wall
                if m not in out[eng] or tok_s > out[eng][m][0]:
                    out[eng][m] = (tok_s, outs)
                print(f"batched {eng} {m}: {tok_s:.1f} tok/s", file=sys.stderr, flush=True)
    return out


if __name__ == "__main__":
    main()
