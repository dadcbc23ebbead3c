"""16 requests to `mlflow models serve`: one after another, then all at once, same prompts.

    .venv/bin/python benchmarks/serve_concurrency.py --model-uri models:/knnssd-smollm2@champion \
        --tracking-uri sqlite:///artifacts/mlflow.db --requests 16 --max-new-tokens 64

Starts the server on 127.0.0.1 (the venv's bin on PATH), waits for /ping, sends each request (one
prompt: a mixed eval prompt of the five domains, round-robin) once sequentially and once from 16
threads at the same moment, and prints both wall times, their ratio and whether every answer's
tokens are identical (``--repeats``: that many of each, alternately; the medians and every run). The
server is stopped at the end, however the script ends.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from knnssd import prompts


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ask(port: int, prompt: str, max_new_tokens: int) -> list[int]:
    body = json.dumps({"dataframe_records": [{"prompt": prompt}], "params": {"max_new_tokens": max_new_tokens}}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}/invocations", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=900) as r:
        return json.loads(r.read())["predictions"][0]["tokens"]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model-uri", required=True)
    ap.add_argument("--tracking-uri", required=True)
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--batch-size", default="auto", help="the server's KNNSSD_BATCH_SIZE")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--repeats", type=int, default=1, help="sequential and concurrent runs, alternately (medians)")
    a = ap.parse_args()
    rows = prompts.load_domains(prompts.default_data_dir(), prompts.DOMAINS, "eval", None)
    by: dict[str, list[str]] = {}
    for r in rows:
        by.setdefault(r.domain, []).append(r.prompt)
    texts = [by[d][i // len(by)] for i, d in zip(range(a.requests), [*by] * a.requests)]
    port = free_port()
    bin_dir = str(Path(sys.executable).parent)
    env = {**os.environ, "MLFLOW_TRACKING_URI": a.tracking_uri, "KNNSSD_DTYPE": a.dtype,
           "KNNSSD_BATCH_SIZE": a.batch_size, "PATH": bin_dir + os.pathsep + os.environ.get("PATH", "")}
    log = tempfile.TemporaryFile()
    server = subprocess.Popen([str(Path(bin_dir) / "mlflow"), "models", "serve", "-m", a.model_uri, "--env-manager",
                               "local", "-h", "127.0.0.1", "-p", str(port)], env=env, stdout=log,
                              stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.time() + 300
        while time.time() < deadline:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/ping", timeout=2):
                    break
            except OSError:
                if server.poll() is not None:
                    log.seek(0)
                    sys.exit("server exited:\n" + log.read().decode()[-3000:])
                time.sleep(0.5)
        ask(port, texts[0], 4)  # warm up
        seq, conc, identical = [], [], True
        for _ in range(a.repeats):  # alternately, so both see the same drift of the machine
            t0 = time.perf_counter()
            one = [ask(port, t, a.max_new_tokens) for t in texts]
            seq.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            with ThreadPoolExecutor(len(texts)) as pool:
                many = list(pool.map(lambda t: ask(port, t, a.max_new_tokens), texts))
            conc.append(time.perf_counter() - t0)
            identical = identical and one == many
        seq_s, conc_s = statistics.median(seq), statistics.median(conc)
        print(json.dumps({"requests": len(texts), "max_new_tokens": a.max_new_tokens, "batch_size": a.batch_size,
                          "sequential_s": round(seq_s, 2), "concurrent_s": round(conc_s, 2),
                          "concurrent_over_sequential": round(conc_s / seq_s, 3),
                          "sequential_runs": [round(x, 2) for x in seq], "concurrent_runs": [round(x, 2) for x in conc],
                          "identical": identical, "tokens": sum(map(len, one))}))
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(30)
        log.close()


if __name__ == "__main__":
    main()
