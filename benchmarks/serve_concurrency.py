"""16 requests to `mlflow models serve`: one after another, then all at once, same prompts.

    .venv/bin/python benchmarks/serve_concurrency.py --model-uri models:/knnssd-smollm2@champion \
        --tracking-uri sqlite:///artifacts/mlflow.db --requests 16 --max-new-tokens 64

Sends each request (one prompt: a mixed eval prompt of the five domains, round-robin) once
sequentially and once from 16 threads at the same moment, each run on a fresh server on 127.0.0.1
(the venv's bin on PATH) that answers /ping and has served one other prompt, and prints both wall
times, their ratio and whether every answer's tokens are identical (``--repeats``: that many of each,
alternately; the medians and every run). Each server is stopped after its run, however the script ends.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from knnssd import prompts
from knnssd.bench import options
from knnssd.reachable import free_port

WARM_UP = "Say hello."
BIN = Path(sys.executable).parent  # the venv's bin: mlflow, and the server's PATH


def ask(port: int, prompt: str, max_new_tokens: int) -> list[int]:
    body = json.dumps({"dataframe_records": [{"prompt": prompt}], "params": {"max_new_tokens": max_new_tokens}}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}/invocations", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=900) as r:
        return json.loads(r.read())["predictions"][0]["tokens"]


def main() -> None:
    ap = argparse.ArgumentParser()
    options.bank(ap, required=True)
    ap.add_argument("--requests", type=int, default=16)
    options.max_new_tokens(ap, 64)
    ap.add_argument("--batch-size", default="auto", help="the server's KNNSSD_BATCH_SIZE")
    options.dtype(ap)
    ap.add_argument("--repeats", type=int, default=1, help="sequential and concurrent runs, alternately (medians)")
    a = ap.parse_args()
    rows = prompts.load_domains(prompts.default_data_dir(), prompts.DOMAINS, "eval", None)
    by: dict[str, list[str]] = {}
    for r in rows:
        by.setdefault(r.domain, []).append(r.prompt)
    texts = [by[d][i // len(by)] for i, d in zip(range(a.requests), [*by] * a.requests)]
    env = {**os.environ, "MLFLOW_TRACKING_URI": a.tracking_uri, "KNNSSD_DTYPE": a.dtype,
           "KNNSSD_BATCH_SIZE": a.batch_size, "PATH": str(BIN) + os.pathsep + os.environ.get("PATH", "")}
    seq, conc, answers = [], [], []
    for _ in range(a.repeats):  # alternately, so both see the same drift of the machine
        for runs in (seq, conc):
            with serving(a.model_uri, env) as port:
                t0 = time.perf_counter()
                if runs is seq:
                    answers.append([ask(port, t, a.max_new_tokens) for t in texts])
                else:
                    with ThreadPoolExecutor(len(texts)) as pool:
                        answers.append(list(pool.map(lambda t: ask(port, t, a.max_new_tokens), texts)))
                runs.append(time.perf_counter() - t0)
    seq_s, conc_s = statistics.median(seq), statistics.median(conc)
    print(json.dumps({"requests": len(texts), "max_new_tokens": a.max_new_tokens, "batch_size": a.batch_size,
                      "sequential_s": round(seq_s, 2), "concurrent_s": round(conc_s, 2),
                      "concurrent_over_sequential": round(conc_s / seq_s, 3),
                      "sequential_runs": [round(x, 2) for x in seq], "concurrent_runs": [round(x, 2) for x in conc],
                      "identical": all(x == answers[0] for x in answers), "tokens": sum(map(len, answers[0]))}))


@contextlib.contextmanager
def serving(model_uri: str, env: dict) -> Iterator[int]:
    """A fresh server on a free port, answering and warmed up by one request that is none of the timed
    prompts; stopped at the end, however the block ends. Each run gets its own: a server's free slots
    keep the prompts they last held for the next prompts to reuse (``prefixes.Prefixes``), so a run
    after another on one server would reuse that run's prompts, its very own among them."""
    port = free_port()
    log = tempfile.TemporaryFile()
    server = subprocess.Popen([str(BIN / "mlflow"), "models", "serve", "-m", model_uri, "--env-manager",
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
        ask(port, WARM_UP, 4)
        yield port
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(30)
        log.close()


if __name__ == "__main__":
    main()
