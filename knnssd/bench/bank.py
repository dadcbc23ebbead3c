"""``knnssd bench``: the paper's experiment, side by side, on real prompts.

Terms, defined once:

- *method*: one way to generate greedily (``METHODS``). Own-engine methods share one model and
  one decoder; HF methods call ``model.generate`` on the same weights.
- *pass*: every prompt once, every method on it back to back (the method order rotates from
  pass to pass). Pass ``j`` visits the in-domain prompts in the order of a *stream* with mix ratio
  ``r = ratios[j % len(ratios)]``: after each prompt the next one switches domain with probability
  ``r`` (the paper's Table 2). A prompt's time is its median over passes.
- *speedup* of a method over a set of prompts: the reference's summed time / the method's summed
  time (times are whole generations: tokenize-free prefill + routing + decoding).
- *agreement*: fraction of prompts whose tokens equal own AR's in every pass.
- *mask ablation*: ``knn_unmasked`` routes like ``knn_routed`` but runs each cluster's drafter
  with its skip mask cleared (same kind, precision, lengths); the ablation table compares the two
  cluster by cluster, on the eval prompts routed there (run when the bank has a mask).

The router is a pure function of the prompt. The one state kept from prompt to prompt is suffix
drafting's cache of earlier outputs (``suffix.SuffixCache``): the routed bank's, shared by its suffix
clusters, and the fixed suffix drafter's own, as a server keeps them. Both are emptied at the start of
each pass, which would otherwise find its own prompts' outputs of the last pass there. So a stream's
speedup depends mostly on which prompts it holds, and a little on their order; the per-``r`` numbers
are each measured on their own pass.

Measurements are appended to ``<out>/measurements-<key>.jsonl`` as they are taken, so a killed bench
resumes where it stopped (same settings) and a finished one just re-summarises.

``throughput`` > 0 adds ``bench-throughput``'s table (``bench.throughput``: whole batches' tokens/s,
routed one at a time, batched plain and routed, auto) over that many mixed eval prompts of the same
domains, on the same loaded model, after the per-prompt passes; it is kept in
``<out>/throughput-<key>.json`` once measured.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import random
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from knnssd import models, prompts
from knnssd.bench import markdown as md
from knnssd.bench import throughput
from knnssd.bench.bank_summary import best_fixed, summarise
from knnssd.bench.hf import hf_generate
from knnssd.bench.throughput import SIZES, ThroughputBench
from knnssd.engine.model import exactness
from knnssd.engine.spec.loop import GenerationConfig, generate
from knnssd.engine.spec.drafters import FIXED, fixed_drafters
from knnssd.routing import bank as banks
from knnssd.settings import work_dir

# ngram and suffix: the untuned lookup drafters (``drafters.untuned``, bench-engine's too), every prompt the same
METHODS = ("ar", "hf_generate", "hf_pld", "ngram", "suffix", "static_ssd", "oracle", "knn_masks", "knn_unmasked",
           "knn_routed")
OOD_METHODS = ("ar", "hf_pld", "ngram", "suffix", "static_ssd", "knn_masks", "knn_routed")
RATIOS = (0.0, 0.3, 0.7, 1.0)


@dataclass
class BenchConfig:
    bank: str  # routed-drafters bank: model URI or folder
    masks_bank: str | None = None  # layer-skip-only bank (the paper's method)
    static_bank: str | None = None  # one configuration for every prompt (a single-cluster bank)
    model: str | None = None  # default: the bank's model
    dtype: str = "auto"
    device: str = "auto"
    data: Path = field(default_factory=prompts.default_data_dir)
    domains: tuple[str, ...] = prompts.DOMAINS
    ood: tuple[str, ...] = prompts.OOD
    prompts: int = 4  # eval prompts per domain
    ood_prompts: int = 2  # prompts per out-of-domain set
    max_new_tokens: int = 128
    repeats: int = 4  # passes (>= len(ratios) so every ratio gets its own pass)
    ratios: tuple[float, ...] = RATIOS
    pld_tokens: int = 10  # HF prompt_lookup_num_tokens
    hf: bool = True
    seed: int = 0
    out: Path = field(default_factory=lambda: work_dir() / "bench")  # $KNNSSD_WORK/bench, else artifacts/bench
    tracking_uri: str | None = None
    throughput: int = 0  # mixed eval prompts for bench-throughput's table in the report (0: no table)
    throughput_sizes: tuple[int, ...] = SIZES

    def key(self) -> str:
        """The measurement journal's key: the settings the per-prompt measurements depend on."""
        d = {k: str(v) for k, v in asdict(self).items()
             if k not in ("out", "tracking_uri", "throughput", "throughput_sizes")}
        return hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()[:12]

    def check(self) -> None:
        """One-line errors for settings that cannot run, before any server starts or model loads; the results
        folder (``out``) must be one this process can make, but is made only once the bank has loaded (trial 6,
        D6: a bench that failed on its bank left an empty folder)."""
        if self.repeats < 1 or not self.ratios:
            raise ValueError("repeats must be >= 1 and ratios non-empty")
        if not all(0.0 <= r <= 1.0 for r in self.ratios):  # NaN fails both
            raise ValueError(f"ratios are probabilities of switching domain, each in [0, 1], got "
                             f"{','.join(map(str, self.ratios))}")
        tp = self.throughput_bench()
        if tp is not None:
            throughput.check(tp)
        made, folder = [], self.out.absolute()
        while not folder.exists() and folder != folder.parent:
            made.append(folder)
            folder = folder.parent
        try:  # made and taken back: only a real mkdir tells (root may "access" /proc, and cannot make folders there)
            self.make_out()
        finally:
            for f in made:
                with contextlib.suppress(OSError):
                    f.rmdir()

    def make_out(self) -> None:
        """The results folder, made (with its parents), or a one-line ``ValueError`` naming ``--out``."""
        try:
            self.out.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise ValueError(f"cannot make the results folder {self.out} (--out): {e.strerror or e}") from None

    def throughput_bench(self) -> ThroughputBench | None:
        """bench-throughput's settings for the report's table: ``throughput`` mixed eval prompts of this
        bench's domains, its new tokens, model, dtype and device."""
        if not self.throughput:
            return None
        return ThroughputBench(bank=self.bank, dtype=self.dtype, device=self.device, data=self.data,
                               domains=self.domains, prompts=self.throughput, max_new_tokens=self.max_new_tokens,
                               sizes=self.throughput_sizes, tracking_uri=self.tracking_uri)


def stream_order(rows: list[prompts.Prompt], r: float, seed: int) -> list[prompts.Prompt]:
    """All ``rows`` in an order where the next prompt switches domain with probability ``r``
    (it must switch when the current domain has none left)."""
    rng = random.Random(seed)
    left: dict[str, list[prompts.Prompt]] = {}
    for p in rows:
        left.setdefault(p.domain, []).append(p)
    out, cur = [], rng.choice(sorted(left))
    while left:
        others = sorted(d for d in left if d != cur)
        if cur not in left or (others and rng.random() < r):
            cur = rng.choice(others) if others else cur
        out.append(left[cur].pop(0))
        if not left[cur]:
            del left[cur]
    return out


class Runner:
    """Every method as ``run(method, prompt) -> measurement dict``, over one loaded model."""

    def __init__(self, cfg: BenchConfig):
        from knnssd import tracking
        from knnssd.serving.routed import RoutedGenerator

        def folder(uri):
            return tracking.bank_folder(uri, cfg.tracking_uri)

        # every bank before the model: a bad one is an error in seconds, not after the load
        bank = banks.load(folder(cfg.bank))
        masks = banks.load(folder(cfg.masks_bank)) if cfg.masks_bank else None
        static = banks.load(folder(cfg.static_bank)) if cfg.static_bank else None
        self.lm = models.load(cfg.model or bank.model, cfg.dtype, cfg.device)
        self.cfg = cfg
        self.routed = RoutedGenerator(self.lm, bank)
        self.dec = self.routed.decoder
        self.masks = RoutedGenerator(self.lm, masks) if masks is not None else None
        self.bank = bank
        self.unmasked = RoutedGenerator(self.lm, bank.unmasked()) if bank.masked() else None
        if static is not None:
            static.check_model(self.lm.fingerprint, self.dec.n_layers)
            if len(static.clusters) != 1:
                raise banks.BankError(f"static bank must hold one cluster, it holds {len(static.clusters)}")
        n, can = self.dec.n_layers, self.dec.can_skip
        self.drafters = {"ar": None, **fixed_drafters(n, can)}
        if static is not None:
            self.drafters["static_ssd"] = self.routed.build(static.clusters[0])
        self.oracle = {}  # domain -> drafter of its largest own-domain cluster
        for c in sorted(bank.clusters, key=lambda c: c.members):
            self.oracle[c.label] = self.routed.build(c)
        self.gen = GenerationConfig(max_new_tokens=cfg.max_new_tokens, eos_ids=self.routed.eos)
        self.methods = [m for m in METHODS if self.available(m)]
        self.ood_methods = [m for m in OOD_METHODS if self.available(m)]

    def forget(self) -> None:
        """Empty every suffix cache of earlier outputs: the fixed suffix drafter's and the routed banks'."""
        gens = (self.routed, self.masks, self.unmasked)
        for cache in [self.drafters["suffix"].cache, *(g.suffix_cache for g in gens if g is not None)]:
            cache.clear()

    def available(self, method: str) -> bool:
        return {"hf_generate": self.cfg.hf, "hf_pld": self.cfg.hf, "static_ssd": "static_ssd" in self.drafters,
                "knn_masks": self.masks is not None, "knn_unmasked": self.unmasked is not None}.get(method, True)

    @torch.inference_mode()
    def run(self, method: str, p: prompts.Prompt) -> dict:
        from knnssd.engine.spec.request_params import GenerateParams

        routed = {"knn_routed": self.routed, "knn_masks": self.masks, "knn_unmasked": self.unmasked}
        if method in routed:
            res = routed[method].generate(p.prompt, GenerateParams(max_new_tokens=self.cfg.max_new_tokens))
            s = res.stats
            return {"tokens": res.tokens, "s": res.latency_s, "route_s": res.route_s, "drafted": s.drafted,
                    "accepted": sum(s.accepted), "steps": s.steps, "label": res.label, "cluster": res.cluster}
        ids = self.lm.tokenizer(p.prompt).input_ids
        if method.startswith("hf_"):
            toks, s = hf_generate(self.lm, ids, self.cfg.max_new_tokens, self.routed.eos,
                                  self.cfg.pld_tokens if method == "hf_pld" else 0)
            return {"tokens": toks, "s": s}
        drafter = self.oracle.get(p.domain) if method == "oracle" else self.drafters[method]
        # the form the routed methods run on (the static step, where it runs): the same plain decoding
        toks, st = generate(self.routed.decoder_for(len(ids) + self.cfg.max_new_tokens), ids, drafter, self.gen)
        return {"tokens": toks, "s": st.total_s, "drafted": st.drafted, "accepted": sum(st.accepted),
                "steps": st.steps}


def _journal(path: Path) -> dict[tuple, dict]:
    done = {}
    if path.is_file():
        for line in path.read_text().splitlines():
            try:
                m = json.loads(line)
            except json.JSONDecodeError:  # a line torn by a kill
                continue
            done[(m["phase"], m["pass"], m["id"], m["method"])] = m
    return done


def run(cfg: BenchConfig, log=lambda msg: print(msg, file=sys.stderr)) -> dict:
    from tqdm import tqdm

    cfg.check()
    tp = cfg.throughput_bench()
    rows = prompts.load_domains(cfg.data, cfg.domains, "eval", cfg.prompts)
    ood_rows = prompts.load_domains(cfg.data, cfg.ood, None, cfg.ood_prompts) if cfg.ood_prompts else []
    runner = Runner(cfg)
    if tp is not None and not runner.routed.can_batch:
        raise ValueError(f"--throughput: {runner.lm.name} runs on the plain HF fallback, which decodes one sequence "
                         "at a time (no batched table)")
    cfg.make_out()  # once the bank has loaded (``BenchConfig.check``)
    jpath = cfg.out / f"measurements-{cfg.key()}.jsonl"
    done = _journal(jpath)
    log(f"bench: {runner.lm.name} ({runner.lm.dtype}, {runner.lm.device}, {torch.get_num_threads()} threads); "
        f"{len(rows)} eval prompts x {len(runner.methods)} methods x {cfg.repeats} passes, {len(ood_rows)} OOD prompts, "
        f"{cfg.max_new_tokens} new tokens; {len(done)} measurements resumed from {jpath}")
    warm = prompts.Prompt("warm", rows[0].prompt[:200], rows[0].domain)
    for m in runner.methods:
        runner.run(m, warm)

    plan = []
    for j in range(cfg.repeats):
        order = stream_order(rows, cfg.ratios[j % len(cfg.ratios)], cfg.seed + j)
        plan += [("eval", j, p, runner.methods) for p in order]
        plan += [("ood", j, p, runner.ood_methods) for p in ood_rows] if j < 3 else []
    with open(jpath, "a") as fh:
        current = None
        for phase, j, p, methods in tqdm(plan, desc="bench", file=sys.stderr, mininterval=5):
            if j != current:  # each pass from empty suffix caches (the warm-up's output too)
                runner.forget()
                current = j
            rot = j % len(methods)
            for m in methods[rot:] + methods[:rot]:
                if (phase, j, p.id, m) in done:
                    continue
                meas = {"phase": phase, "pass": j, "id": p.id, "domain": p.domain, "method": m, **runner.run(m, p)}
                fh.write(json.dumps(meas) + "\n")
                fh.flush()
                done[(phase, j, p.id, m)] = meas
    report = summarise(done, cfg, runner)
    if tp is not None:
        report["throughput"] = _throughput(tp, runner, cfg.out / f"throughput-{cfg.key()}.json", log)
    write_outputs(report, cfg)
    return report


def _throughput(tp: ThroughputBench, runner: Runner, path: Path, log) -> dict:
    """bench-throughput's table over the runner's model, kept in ``path`` (a rerun of an interrupted bench
    takes it from there; it is measured again where its settings differ)."""
    key = {k: str(v) for k, v in asdict(tp).items() if k in throughput.MEASURED}  # the file's name has the rest
    kept = exactness.read_record(path)
    if kept.get("settings") == key:
        log(f"bench: throughput table resumed from {path}")
        return kept["table"]
    table = throughput.measure(runner.routed, tp, log)
    exactness.write_record(path, {"settings": key, "table": table})
    return table


def _exactness_line(ex: dict | None) -> str:
    if not ex:
        return "Verify pass: not probed."
    state = "exact (rows bitwise equal to one-token steps)" if ex["exact"] else f"NOT exact: {ex['note']}"
    return f"Verify pass: {state}; {ex['step']} attention, T = 1..{ex['max_t']}, {ex['dtype']} on {ex['device']}."


def markdown(rep: dict) -> str:
    methods = rep["settings"]["methods"]
    f = lambda v, p=2: "–" if v is None else f"{v:.{p}f}"  # noqa: E731
    lines = [f"# knnssd bench: {rep['settings']['model']} {rep['settings']['dtype_loaded']}, "
             f"{rep['settings']['max_new_tokens']} new tokens, {rep['settings']['threads']} threads", "",
             _exactness_line(rep.get("exactness")), "",
             "## Speedup vs own AR (eval prompts; mixed = all domains)", "",
             *md.table(["domain", *methods, "best fixed"],
                       ([d, *(f((row.get(m) or {}).get("speedup_vs_ar")) for m in methods), _fixed_cell(row)]
                        for d, row in [("**mixed**", rep["mixed"]), *rep["per_domain"].items()])),
             "", "## Mixed stream details", "",
             *md.table(["method", "tok/s", "vs HF generate", "mean accepted", "acceptance", "agreement",
                        "routing overhead %"],
                       ([m, f(x.get("tokens_per_s"), 1), f(x.get("speedup_vs_hf")), f(x.get("mean_accepted")),
                         f(x.get("acceptance_rate")), f(x.get("agreement_with_ar")),
                         f(x.get("routing_overhead_pct"), 3)] for m in methods for x in [rep["mixed"].get(m) or {}])),
             "", "## Streams by mix ratio r (speedup vs own AR, each its own pass)", "",
             *md.table(["r", *methods, "best fixed"],
                       ([f"{r} ({name})", *(f(row.get(m)) for m in methods), _fixed_cell(row)]
                        for r, passes in rep["streams"].items() for name, row in passes.items()))]
    if rep["ood"]:
        om = rep["settings"]["ood_methods"]
        lines += ["", "## Out of domain (bank calibrated on the five domains only)", "",
                  *md.table(["set", *om, "best fixed", "routed to"],
                            ([s, *(f((row.get(m) or {}).get("speedup_vs_ar")) for m in om), _fixed_cell(row),
                              row.get("routed_labels", {})] for s, row in rep["ood"].items()))]
    if rep.get("versus_best_fixed"):
        lines += ["", "## Routed against the best fixed drafter (" + ", ".join(FIXED) + ", untuned), per set", "",
                  *md.table(["set", "best fixed", "its speedup", "routed", "routed / best fixed"],
                            ([name, v["best_fixed"], f(v["best_fixed_speedup"]), f(v["routed_speedup"]),
                              f(v["routed_over_best_fixed"], 3)] for name, v in rep["versus_best_fixed"].items()))]
    if rep.get("mask_ablation"):
        lines += ["", "## Mask ablation (each masked cluster's drafter, with vs without its mask; eval prompts routed "
                  "there)", "",
                  *md.table(["cluster", "drafter", "skipped", "prompts", "speedup with mask", "without", "gain",
                             "mean accepted with / without"],
                            ([f"{r['cluster']} {r['label']}", r["drafter"], f"{r['skipped']}/{r['sublayers']}",
                              r["prompts"], f(r["speedup_with_mask"]), f(r["speedup_without_mask"]),
                              f(r["mask_gain"], 3), f"{f(r['mean_accepted_with'])} / {f(r['mean_accepted_without'])}"]
                             for r in rep["mask_ablation"]))]
    if rep.get("throughput"):
        lines += ["", "## Throughput (batched decoding, bench-throughput's table)", "",
                  throughput.markdown(rep["throughput"])]
    lines += ["", f"routing accuracy (eval): {f(rep['routing_accuracy'], 3)}", "",
              "## Targets", "", *[f"- {k}: {f(v, 3)}" for k, v in rep["targets"].items()]]
    return "\n".join(lines) + "\n"


def _fixed_cell(row: dict) -> str:
    fixed = best_fixed(row)
    return f"{fixed[1]:.2f} ({fixed[0]})" if fixed else "–"


def plots(rep: dict, out: Path) -> list[Path]:
    from knnssd.routing.pictures import _plt

    plt = _plt()
    methods = rep["settings"]["methods"]
    rows = [("mixed", rep["mixed"]), *rep["per_domain"].items()]
    paths = []
    for metric, name, ms in (("speedup_vs_ar", "speedup.png", methods),
                             ("mean_accepted", "acceptance.png", [m for m in methods if m not in ("ar", "hf_generate", "hf_pld")])):
        fig, ax = plt.subplots(figsize=(10, 4.5))
        w = 0.8 / max(1, len(ms))
        for k, m in enumerate(ms):
            ax.bar([i + k * w for i in range(len(rows))], [((r.get(m) or {}).get(metric) or 0) for _, r in rows], w, label=m)
        ax.set_xticks([i + 0.4 - w / 2 for i in range(len(rows))], [d for d, _ in rows], fontsize=8)
        if metric == "speedup_vs_ar":
            ax.axhline(1.0, color="k", lw=0.8)
        ax.set_ylabel("speedup vs own AR" if metric == "speedup_vs_ar" else "mean accepted tokens per step")
        ax.legend(fontsize=7, ncol=4)
        ax.set_title(f"{rep['settings']['model']} {rep['settings']['dtype_loaded']}", fontsize=9)
        fig.tight_layout()
        fig.savefig(out / name, dpi=110)
        plt.close(fig)
        paths.append(out / name)
    return paths


def write_outputs(rep: dict, cfg: BenchConfig) -> None:
    from knnssd import tracking

    out = cfg.out
    (out / "bench.json").write_text(json.dumps(rep, indent=2))
    (out / "bench.md").write_text(markdown(rep))
    pics = plots(rep, out)
    metrics = {f"{m}_speedup": v["speedup_vs_ar"] for m, v in rep["mixed"].items() if v}
    metrics.update({f"{m}_agreement": v["agreement_with_ar"] for m, v in rep["mixed"].items() if v})
    metrics.update({f"target_{k}": v for k, v in rep["targets"].items() if v is not None})
    if rep.get("throughput"):
        auto = next(r for r in rep["throughput"]["table"] if r["setting"] == "routed auto")
        metrics.update(throughput_auto_tokens_per_s=auto["tokens_per_s"],
                       throughput_auto_vs_routed_b1=auto["vs_routed_b1"],
                       throughput_auto_vs_best_fixed=rep["throughput"]["auto_vs_best_fixed"])
    rep["mlflow_run_id"] = tracking.log_run("knnssd-bench", rep["settings"], metrics,
                                            [str(out / "bench.json"), str(out / "bench.md"), *map(str, pics)],
                                            cfg.tracking_uri, run_name=f"bench-{cfg.key()}")
    (out / "bench.json").write_text(json.dumps(rep, indent=2))
