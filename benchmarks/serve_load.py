"""Streaming clients against the servers, side by side: throughput, time to first token, inter-token
latency and end-to-end latency at several concurrencies.

    .venv/bin/python benchmarks/serve_load.py --model-uri models:/knnssd-smollm2@champion \
        --tracking-uri sqlite:///artifacts/mlflow.db --concurrency 1,4,16,64 --max-tokens 128

Targets, each a fresh server on 127.0.0.1, run one after another (never two at once):
- ``routed``: ``knnssd serve`` with the bank's drafters;
- ``plain``: the same server with ``--no-draft``;
- ``pyfunc``: ``mlflow models serve`` (answers whole: its first token is its last);
- ``llama-server``: llama.cpp's server on the BF16 copy of the same GGUF with ``-np`` slots, where
  ``benchmarks/llama_cpp_peer.py`` built it (it builds ``llama-server`` beside ``llama-bench``).

At concurrency C, C clients (one asyncio task each, in this process) take the mixed eval prompts
(round-robin over the five domains) from one queue until ``--requests`` of them are done (at least
C); every request is greedy, ``--max-tokens`` long, streamed where the server streams. ``--auto``
also runs ``knnssd bench-throughput``'s ``auto`` setting on the same prompts in this process, after
the servers, and the prefill time of each prompt, for the ratios the issue asks for.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from knnssd import prompts as prompt_sets  # noqa: E402
from knnssd.bench import markdown as md  # noqa: E402
from knnssd.bench import options  # noqa: E402
from knnssd.reachable import free_port  # noqa: E402
from knnssd.settings import cache_dir  # noqa: E402

DOMAINS = ("reasoning", "translation", "text_to_sql", "storytelling", "summarization")


def mixed_prompts(n: int) -> list[str]:
    rows = {d: prompt_sets.load(prompt_sets.default_data_dir() / f"{d}.jsonl", split="eval") for d in DOMAINS}
    return [rows[DOMAINS[i % len(DOMAINS)]][i // len(DOMAINS) % len(rows[DOMAINS[i % len(DOMAINS)]])].prompt
            for i in range(n)]


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))] if xs else float("nan")


async def one(client: httpx.AsyncClient, target: dict, prompt: str, max_tokens: int) -> dict:
    t0 = time.perf_counter()
    if target["kind"] == "pyfunc":
        body = {"dataframe_records": [{"prompt": prompt}], "params": {"max_new_tokens": max_tokens}}
        r = await client.post(target["url"] + "/invocations", json=body)
        r.raise_for_status()
        t = time.perf_counter() - t0
        return {"ttft": t, "e2e": t, "tokens": r.json()["predictions"][0]["new_tokens"]}
    body = {"model": target["model"], "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    first, tokens, chunks = None, None, 0
    async with client.stream("POST", target["url"] + "/v1/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if event.get("choices") and event["choices"][0].get("text") and first is None:
                first = time.perf_counter() - t0
            chunks += bool(event.get("choices"))
            if event.get("usage"):
                tokens = event["usage"]["completion_tokens"]
    e2e = time.perf_counter() - t0
    return {"ttft": first if first is not None else e2e, "e2e": e2e, "tokens": tokens if tokens is not None else chunks}


async def level(target: dict, prompts: list[str], concurrency: int, requests: int, max_tokens: int) -> dict:
    queue: asyncio.Queue = asyncio.Queue()
    for i in range(max(requests, concurrency)):
        queue.put_nowait(prompts[i % len(prompts)])
    results: list[dict] = []

    async def worker(client):
        while not queue.empty():
            results.append(await one(client, target, queue.get_nowait(), max_tokens))

    # a connection per request: llama-server closes idle keep-alive connections that a client would reuse
    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=0)
    async with httpx.AsyncClient(timeout=900, limits=limits) as client:
        t0 = time.perf_counter()
        await asyncio.gather(*(worker(client) for _ in range(concurrency)))
        wall = time.perf_counter() - t0
    tokens = sum(r["tokens"] for r in results)
    itl = [(r["e2e"] - r["ttft"]) / (r["tokens"] - 1) for r in results if r["tokens"] > 1 and r["e2e"] > r["ttft"]]
    return {"concurrency": concurrency, "requests": len(results), "tokens": tokens, "tok_s": tokens / wall,
            "ttft_p50": pct([r["ttft"] for r in results], 0.5), "ttft_p95": pct([r["ttft"] for r in results], 0.95),
            "itl_p50": pct(itl, 0.5), "itl_p95": pct(itl, 0.95),
            "e2e_p50": pct([r["e2e"] for r in results], 0.5), "e2e_p95": pct([r["e2e"] for r in results], 0.95)}


def start(cmd: list[str], env: dict, health: str, log: Path) -> subprocess.Popen:
    out = open(log, "w")
    proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.time() + 300
    while time.time() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"{cmd[0]} exited with {proc.returncode}; see {log}")
        try:
            if httpx.get(health, timeout=2).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise SystemExit(f"{cmd[0]} did not answer {health}")


def stop(proc: subprocess.Popen) -> None:
    from knnssd.processes import stop_group

    stop_group(proc, 30)


def targets(a, port: int) -> list[tuple[str, list[str], dict, str, dict]]:
    """(name, command, env, health URL, target) for each server to measure."""
    bin_dir = Path(sys.executable).parent
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}"}
    if a.tracking_uri:
        env["MLFLOW_TRACKING_URI"] = a.tracking_uri
    url = f"http://127.0.0.1:{port}"
    serve = [sys.executable, "-m", "knnssd.cli", "serve", "--model-uri", a.model_uri, "--port", str(port),
             "--dtype", a.dtype, "--max-queue", "1024", "--reload-s", "0"]
    model = a.model_uri.removeprefix("models:/").split("@")[0].split("/")[0]
    out = [("routed", serve, env, url + "/health", {"kind": "openai", "url": url, "model": model}),
           ("plain", [*serve, "--no-draft"], env, url + "/health", {"kind": "openai", "url": url, "model": model})]
    if "pyfunc" in a.targets:
        pyfunc_env = {**env, "KNNSSD_DTYPE": a.dtype}
        out.append(("pyfunc", [str(bin_dir / "mlflow"), "models", "serve", "-m", a.model_uri, "--env-manager", "local",
                               "-h", "127.0.0.1", "-p", str(port)], pyfunc_env, url + "/ping",
                    {"kind": "pyfunc", "url": url}))
    llama = sorted(cache_dir().glob("llama.cpp/*/src/build/bin/llama-server"))
    bf16 = sorted(cache_dir().glob("llama.cpp/*/*.BF16.gguf"))
    if "llama-server" in a.targets and llama and bf16:
        out.append(("llama-server", [str(llama[-1]), "-m", str(bf16[-1]), "--host", "127.0.0.1", "--port", str(port),
                                     "-np", str(a.llama_slots), "-c", str(a.llama_slots * 2048), "-t",
                                     str(os.cpu_count() or 2), "--no-webui"],
                    env, url + "/health", {"kind": "openai", "url": url, "model": "llama"}))
    elif "llama-server" in a.targets:
        print(f"serve_load: no llama-server row: {cache_dir() / 'llama.cpp'} holds no llama-server and BF16 GGUF; "
              "run benchmarks/llama_cpp_peer.py once to build them", file=sys.stderr)
    return [t for t in out if t[0] in a.targets]


def auto_figures(a, prompts: list[str]) -> dict:
    """``bench-throughput``'s ``auto`` on the same prompts (tokens/s) and each prompt's prefill time."""
    from knnssd.engine.spec.loop import GenerationConfig, prefill
    from knnssd.engine.spec.request_params import GenerateParams
    from knnssd.serving.routed import RoutedGenerator
    from knnssd.settings import tracking_uri

    gen = RoutedGenerator.from_model_uri(a.model_uri, dtype=a.dtype, tracking_uri=tracking_uri(a.tracking_uri))
    params = GenerateParams(max_new_tokens=a.max_tokens)
    plan = gen.plan(a.auto_slots, gen.positions(prompts, params))
    best = 0.0
    for _ in range(2):
        t0 = time.perf_counter()
        tokens = sum(len(r.tokens) for _, r in gen.generate_many(list(enumerate(prompts)), params, plan))
        best = max(best, tokens / (time.perf_counter() - t0))
    prefill_s = []
    for p in prompts[:16]:
        ids, _ = gen.tokenize(p, params)
        with gen.lm.busy:
            t0 = time.perf_counter()
            prefill(gen.decoder, ids, GenerationConfig(max_new_tokens=1))
            prefill_s.append(time.perf_counter() - t0)
    return {"auto_tok_s": best, "slots": plan.slots, "prefill_p50": statistics.median(prefill_s)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    options.bank(p)
    options.dtype(p)
    p.add_argument("--concurrency", default="1,4,16,64")
    p.add_argument("--requests", default="8,16,64,64", help="requests at each concurrency")
    options.prompts(p, 64)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--targets", default="routed,plain,pyfunc,llama-server")
    p.add_argument("--llama-slots", type=int, default=16)
    p.add_argument("--auto", action="store_true", help="also bench-throughput's auto and the prefill time")
    p.add_argument("--auto-slots", type=int, default=32)
    p.add_argument("--json", default=None, help="write every figure here")
    a = p.parse_args()
    a.targets = a.targets.split(",")
    levels = [int(x) for x in a.concurrency.split(",")]
    requests = [int(x) for x in a.requests.split(",")]
    prompts = mixed_prompts(a.prompts)
    rows = []
    logs = Path(os.environ.get("TMPDIR", "/tmp"))
    for name, cmd, env, health, target in targets(a, free_port()):
        proc = start(cmd, env, health, logs / f"serve_load-{name}.log")
        try:
            asyncio.run(level(target, prompts, 2, 2, 8))  # warm: the first requests pay one-time costs
            for c, n in zip(levels, requests):
                row = {"target": name, **asyncio.run(level(target, prompts, c, n, a.max_tokens))}
                rows.append(row)
                print(json.dumps(row), flush=True)
        finally:
            stop(proc)
    extra = auto_figures(a, prompts) if a.auto else {}
    print("\n".join(md.table(
        ["target", "C", "tok/s", "TTFT p50/p95 ms", "ITL p50/p95 ms", "e2e p50/p95 s", "tokens/request"],
        ([r["target"], r["concurrency"], f"{r['tok_s']:.0f}", f"{1e3 * r['ttft_p50']:.0f} / {1e3 * r['ttft_p95']:.0f}",
          f"{1e3 * r['itl_p50']:.1f} / {1e3 * r['itl_p95']:.1f}", f"{r['e2e_p50']:.2f} / {r['e2e_p95']:.2f}",
          f"{r['tokens'] / r['requests']:.0f}"] for r in rows), "lrrrrrr")))
    if extra:
        print(json.dumps(extra))
    if a.json:
        Path(a.json).write_text(json.dumps({"rows": rows, **extra}, indent=1))


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # servers are stopped by the finally blocks
    main()
