"""A sharded `knnssd generate` on a local work pool beside one process, on the same prompts, in one run.

    .venv/bin/python benchmarks/sharded_generate.py --prompts 120 --max-new-tokens 32 --shards 2 --workers 2

Starts a temporary Prefect server, a `process` work pool and ``--workers`` workers on this machine, then
times `knnssd generate` over the same eval prompts (round robin over the domains) once in one process and
once with ``--shards``; each output is compared token for token. Then both again over 8 one-token prompts
a shard, where nearly all the time is the fixed cost a run pays (for a shard: a flow run started by a
worker, the model loaded, the batch planned): the per-shard overhead. Prints rows/s, tokens/s and wall
times as a Markdown table. On one 2-core machine two workers share the cores one process already uses:
what this shows is the cost of spreading, not a gain.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

from knnssd import prompts
from knnssd.bench import markdown, options

BIN = Path(sys.executable).parent


def _input(path: Path, n: int, tokens_only: bool = False) -> Path:
    groups = [prompts.load(Path(prompts.default_data_dir()) / f"{d}.jsonl", split="eval") for d in prompts.DOMAINS]
    rows = [r for group in zip(*groups) for r in group][:n]
    path.write_text("".join(json.dumps({"id": r.id, "prompt": "Say yes." if tokens_only else r.prompt}) + "\n"
                            for r in rows))
    return path


def _generate(a, inp: Path, out: Path, tokens: int, env: dict, *extra: str) -> tuple[float, dict]:
    t0 = time.perf_counter()
    run = subprocess.run([str(BIN / "knnssd"), "generate", "--model-uri", a.model_uri, "--input", str(inp), "--output",
                          str(out), "--max-new-tokens", str(tokens), "--dtype", a.dtype, *extra,
                          *(["--tracking-uri", a.tracking_uri] if a.tracking_uri else [])],
                         env=env, capture_output=True, text=True)
    if run.returncode:
        raise SystemExit(run.stderr[-3000:])
    return time.perf_counter() - t0, json.loads(run.stdout.strip().splitlines()[-1])


def _tokens(path: Path) -> list:
    import pyarrow.parquet as pq

    return [(r["id"], r["tokens"]) for r in pq.read_table(path).to_pylist()]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    options.bank(ap)
    options.dtype(ap)
    options.prompts(ap, 120, help="eval prompts, round robin over the domains")
    options.max_new_tokens(ap, 32)
    ap.add_argument("--shards", type=int, default=2)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--worker-threads", type=int, default=None,
                    help="OMP_NUM_THREADS of each worker's shards (default: the cores shared out, as on machines of "
                         "their own); 0: torch's default")
    a = ap.parse_args()
    if a.worker_threads is None:
        a.worker_threads = max(1, (os.cpu_count() or 2) // a.workers)

    from knnssd.flows.server import local_api

    pool = f"bench-{uuid.uuid4().hex[:8]}"
    with tempfile.TemporaryDirectory(prefix="knnssd-sharded-") as tmp, local_api() as url:
        tmp = Path(tmp)
        env = {**os.environ, "PREFECT_API_URL": url, "PREFECT_WORKER_QUERY_SECONDS": "1"}
        subprocess.run([str(BIN / "prefect"), "work-pool", "create", pool, "--type", "process"], env=env, check=True,
                       capture_output=True)
        worker_env = {"OMP_NUM_THREADS": str(a.worker_threads)} if a.worker_threads else {}
        worker_env["TMPDIR"] = str(tmp)  # a flow run's runner leaves an empty runner_storage/<id> folder in its temp
        workers = [subprocess.Popen([str(BIN / "prefect"), "worker", "start", "--pool", pool],
                                    env={**env, **worker_env},
                                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
                   for _ in range(a.workers)]
        try:
            rows = []
            for label, inp, tokens in (("eval prompts", _input(tmp / "eval.jsonl", a.prompts), a.max_new_tokens),
                                       ("overhead: 1 token each", _input(tmp / "tiny.jsonl", 8 * a.shards, True), 1)):
                times = {}
                for how, extra in (("one process", ()), (f"{a.shards} shards, {a.workers} workers",
                                                         ("--shards", str(a.shards), "--pool", pool))):
                    out = tmp / f"{len(times)}-{inp.stem}.parquet"
                    wall, summary = _generate(a, inp, out, tokens, env, *extra)
                    times[how] = (wall, summary, _tokens(out))
                    rows.append([label, how, summary["rows"], f"{wall:.1f}", f"{summary['rows'] / wall:.2f}",
                                 f"{summary['new_tokens'] / wall:.1f}"])
                one, sharded = times.values()
                print(f"{label}: outputs equal: {one[2] == sharded[2]}", file=sys.stderr)
            print("\n".join(markdown.table(["prompts", "run", "rows", "wall s", "rows/s", "tokens/s"], rows,
                                           "llrrrr")))
        finally:
            for w in workers:
                w.terminate()
            for w in workers:
                w.wait(30)
            subprocess.run([str(BIN / "prefect"), "work-pool", "delete", pool], env=env, capture_output=True,
                           input="y\n", text=True)


if __name__ == "__main__":
    main()
