"""The GPU check's report (``benchmarks/gpu_check.py``) in Markdown, from its ``gpu_check.json``: the engine's
probes and decoding table, then each later section's table or the line saying it failed."""
from __future__ import annotations

from knnssd.bench import markdown as md

SECTIONS = ("throughput", "batched", "choice", "big")  # after the engine section, each on its own


def markdown(r: dict) -> str:
    lines = [f"# GPU check, {r['when']}", "", f"{r['device']}; torch {r['torch']}, transformers {r['transformers']}; "
             f"code {r['commit']}.", ""]
    if "engine" in r:
        lines += engine_markdown(r["engine"])
    lines += [""] + [f"- The {k} section failed: {r[k]['error']}" for k in SECTIONS if "error" in r.get(k, {})]
    t = r.get("throughput", {})
    if t and "error" not in t:
        lines += ["", *md.table(["packed plain decoding (sequences, form)", "tok/s"],
                                ([k, f"{v['tok_s']:.1f}"] for k, v in t.items()), "lr")]
    if "error" not in r.get("batched", {"error": ""}):
        lines += ["", *md.table(["batched engine (form, drafter)", "slots", "tok/s", "plan s", "exact",
                                 "equal to eager plain"], map(_batched_row, r["batched"].items()), "lrrrlr")]
    c = r.get("choice", {})
    if c and "error" not in c:
        lines += ["", *md.table(["plan choice (slots x positions)", "eager pass, ms", "static pass, ms",
                                 "exact (eager, static)", "tapped prefill = untapped"],
                                (_choice_row(k, v) for k, v in c.items() if k != "key_buckets"), "lrrll")]
        kb = c.get("key_buckets", {})
        lines += ["", "- A row's logits at every key bucket equal those at the first: " + (
            f"failed: {kb['error']}" if "error" in kb else "; ".join(
                f"{form}: " + ", ".join(f"{K} {'yes' if same else 'no'}" for K, same in by.items())
                for form, by in kb.items())) + "."]
    if "big" in r:
        lines += [""] + big_markdown(r["big"])
    return "\n".join(lines + [""])


def _batched_row(item: tuple[str, dict]) -> list:
    k, v = item
    if "error" in v:
        return [k, f"failed: {v['error']}", "", "", "", ""]
    return [k, v["slots"], f"{v['tok_s']:.1f}", f"{v['plan_s']:.1f}", v["exact"], f"{v['equal_to_eager_plain']:.2f}"]


def _choice_row(k: str, v: dict) -> list:
    if "error" in v:
        return [k, f"failed: {v['error']}", "", "", ""]
    return [k, f"{v['eager_ms']:.2f}", f"{v['static_ms']:.2f}", f"{v['eager_exact']}, {v['static_exact']}",
            v.get("tap_equal")]


def engine_markdown(e: dict) -> list[str]:
    lines = [f"- Probe, eager engine: {e['probe_eager']}"]
    for form, f in e["forms"].items():
        caps = f["captures"]
        lines += [f"- {form}: probe {f['probe']}; "
                  + ("CUDA graphs captured" if f["cuda_graphs"] else "no CUDA graphs (not CUDA): it ran eagerly")
                  + f"; compiled: {f['compiled']} ({f['compile_s']:.1f} s); set-up {f['setup_s']:.1f} s; "
                  f"one-row step {f['one_row_step_ms']:.3f} ms over {f['keys']} keys, plain loop "
                  f"{f['loop_ms_per_token']:.3f} ms a token; T-row passes "
                  + ", ".join(f"{T}: {ms:.3f}" for T, ms in f["step_ms_by_rows"].items()) + " ms; "
                  f"{len(caps)} captures, {sum(c['seconds'] for c in caps):.2f} s, "
                  f"{sum(c['mib'] for c in caps):.1f} MiB."]
    lines += [f"- SmolLM2: {e['weights']}; {e['prompts']} prompt(s) x {e['max_new_tokens']} tokens. Graphed plain "
              "decoding's tokens equal the eager engine's in "
              f"{e['rows']['plain, graphed']['equal_to_eager_engine']:.0%} "
              "of the prompts; ratios and agreement are against plain decoding of the same form.", "",
              *md.table(["decoding", "tok/s", "x plain", "mean accepted", "agreement"],
                        ([name, f"{row['tok_s']:.1f}", f"{row['vs_plain']:.2f}" if "vs_plain" in row else "-",
                          f"{row['mean_accepted']:.2f}" if "mean_accepted" in row else "-",
                          f"{row['agreement']:.2f}" if "agreement" in row else "-"]
                         for name, row in e["rows"].items()), "lrrrr")]
    lines += [f"- {name}: first differs from plain at prompt {d['prompt']}, token {d['index']} ({d['drafted']} for "
              f"{d['plain']}; plain's top-two margin {d['margin']:.4g}); the deciding rows "
              + ("are bitwise equal" if d["rows_equal"] else f"differ by up to {d['max_abs_diff']:.4g}") + "."
              for name, row in e["rows"].items() if (d := row.get("divergence"))]
    return lines


def big_markdown(b: dict) -> list[str]:
    lines = [f"- {b['shape']}-shaped, random weights ({b['weight_gib']:.2f} GiB), floor {b['floor_ms']:.3f} ms at "
             f"{b['read_gb_s']:.0f} GB/s read. Its linears alone: {b['linears_ms']:.3f} ms "
             f"({b['linears_over_floor']:.2f}x the floor)."]
    if "step_ms" in b:
        lines.append(f"- One-row step {'graphed' if b['graphed'] else 'eager'} {b['step_ms']:.3f} ms at a "
                     f"256-position cache ({b['step_over_floor']:.2f}x the floor)"
                     + (f", {b['step_ms_2048']:.3f} ms at 2,048 ({b['step_over_floor_2048']:.2f}x)"
                        if "step_ms_2048" in b else "") + ".")
    for tag, name in (("", "Draft steps"), ("_compiled", "Compiled draft steps")):
        if f"draft_cost_vs_full{tag}" in b:
            lines.append(f"- {name} against the full step: " + ", ".join(
                f"{k} skipped {v:.2f}" for k, v in b[f"draft_cost_vs_full{tag}"].items()) + ".")
    if "step_ms_compiled" in b:
        lines.append(f"- Compiled ({b.get('compile_s', 0):.0f} s of compiling): one-row step "
                     f"{b['step_ms_compiled']:.3f} ms at 256 ({b['step_over_floor_compiled']:.2f}x the floor).")
    if "kernels" in b:
        k = b["kernels"]
        lines += [f"- One eager step's CUDA kernels: {k['count']}, {k['total_us'] / 1e3:.3f} ms of kernel time.", "",
                  *md.table(["kernel", "count", "us"],
                            ([f"`{x['name']}`", x["count"], f"{x['us']:.0f}"] for x in k["top"]), "lrr")]
    return lines
