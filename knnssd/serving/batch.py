"""Batch generation over a prompt file into a parquet file: resumable and kill-safe.

Each finished prompt is appended (and fsync'ed) to ``<output>.progress.jsonl``; every
``flush_every`` rows and at the end the parquet output is rewritten atomically (temp file +
rename), so a kill never leaves a torn output and a rerun skips every id already finished
(``resume``: what an output holds, and whether a run may go on with it). An existing output is
resumed, not replaced (``overwrite=True`` starts over). Prompts that no anchor matches are
recorded in ``<work>/unmatched/`` for later re-optimisation. Every check runs before, once
(``prepare.prepared``).
"""
from __future__ import annotations

import contextlib
import datetime as dt
import json
import logging
import os
import sys
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

from knnssd.engine.batch.plan import auto_slots, check_slots
from knnssd.engine.batch.scheduler import BatchStats
from knnssd.engine.spec.loop import acceptance_rate, mean_accepted
from knnssd.prompts import Prompt
from knnssd.serving.output_paths import OutputError, progress_path
from knnssd.serving.prepare import PreparedGenerate, prepared
from knnssd.serving.request import GenerateRequest
from knnssd.serving.resume import prompt_hash, read_done, settings_text, to_generate, write_parquet
from knnssd.serving.routed import Result, RoutedGenerator

log = logging.getLogger(__name__)

@dataclass
class Summary:
    rows: int
    generated: int  # in this run (the rest were finished earlier)
    unmatched: int
    new_tokens: int
    seconds: float
    tokens_per_s: float
    acceptance_rate: float
    mean_accepted: float
    route_ms: float  # mean per prompt
    route_overhead_pct: float  # routing time / generation time
    output: str
    unmatched_log: str | None = None
    batch_size: int = 1  # sequences decoded together in this run
    wall_s: float = 0.0  # this run's generation, wall clock
    throughput: float = 0.0  # tokens generated in this run / wall_s (``tokens_per_s`` is per sequence)
    rows_per_step: float = 0.0  # packed rows per full-model pass
    reused_prompt_tokens: int = 0  # prompt positions whose K/V were copied from another prompt in the batch
    plan_s: float = 0.0  # choosing the batch size and checking its packed passes (timed once per machine)

    def metrics(self) -> dict:
        return {k: float(v) for k, v in asdict(self).items() if isinstance(v, (int, float)) and not isinstance(v, bool)}

    def report(self, mlflow_run_id: str | None) -> dict:
        """What `knnssd generate` prints: every field, and the MLflow run it was logged as (None: not logged)."""
        return {**asdict(self), "mlflow_run_id": mlflow_run_id}


def run(request: GenerateRequest, gen: RoutedGenerator | None = None, rows: list[Prompt] | None = None,
        flush_every: int = 8, unmatched_dir: Path | None = None) -> Summary:
    """Generate every prompt of ``request`` not yet in its output, ``request.batch_size`` sequences at a time
    (None: auto, ``engine.batch.plan.auto_slots``; 1: one at a time), on the job its caller prepared (else
    prepared here). ``gen`` and ``rows``: the request's own (``request.generator()``, ``request.rows()``,
    read once a process) unless given."""
    with prepared(request, gen, rows) as job:
        gen = gen or request.generator()
        done = job.done if not job.runs else read_done(job.output)  # a retry: what its first try finished too
        job.runs += 1
        return _run(job, gen, done, flush_every, unmatched_dir)


def already_complete(output: Path, rows: list[Prompt], done: dict[str, dict]) -> Summary | None:
    """The summary of a run over ``rows`` with nothing left to generate in ``output`` (``done``: its
    ``check_output``), or None where there is something, or a killed run's progress journal still waits
    to be written into the output."""
    if to_generate(rows, done) or progress_path(output).exists() or not output.exists():
        return None
    return summarize(in_order(list(done.values()), rows), 0, output, None)


def _results(gen: RoutedGenerator, todo: list[Prompt], request: GenerateRequest, stats: BatchStats, bar
             ) -> Iterator[tuple[Prompt, Result]]:
    """(prompt, result) as each finishes: batched when the decoder can run slots and the batch size
    (asked, or auto) is over 1, else one prompt at a time. ``bar``: the run's progress bar, which says
    what comes before the first row: the plan (minutes, the first time on a machine: trial 6 saw no row
    in 5:51), then the tokens made."""
    slots, positions, params, batch_size = 1, 0, request.params, request.batch_size
    bar.set_postfix_str("choosing the batch size", refresh=True)
    t0 = time.perf_counter()
    if gen.can_batch and todo and batch_size != 1:
        positions = gen.positions([r.prompt for r in todo], params)
        if batch_size is None:
            slots = auto_slots(gen.decoder, positions, len(todo), record=gen.lm.batch_record)
        else:  # no more slots than prompts, and no more than the KV-cache budget holds (100,000 ran out of memory)
            slots = min(batch_size, len(todo))
            check_slots(gen.decoder, slots, positions, "--batch-size")
    stats.slots = slots
    plan = gen.plan(slots, positions) if slots > 1 else None
    stats.plan_s = time.perf_counter() - t0
    log.info("%d slot(s), planned in %.1f s", slots, stats.plan_s)
    planned = f"{slots} slot{'s' if slots > 1 else ''}, planned in {stats.plan_s:.0f} s"
    bar.set_postfix_str(planned, refresh=True)
    if plan is None:
        t0 = time.perf_counter()
        for r in todo:
            res = gen.generate(r.prompt, params)
            stats.prefills += 1
            stats.emitted.append(len(res.tokens) - 1)
            stats.total_s = time.perf_counter() - t0
            yield r, res
        return

    def stepped(_runs) -> None:
        bar.set_postfix_str(f"{planned}, {stats.tokens} tokens", refresh=False)
        bar.update(0)  # shown at most every ``mininterval``

    yield from gen.generate_many(((r, r.prompt) for r in todo), params, plan, stats, stepped)


PROGRESS_S = 2.0  # the progress bar's least interval between redraws


def _run(job: PreparedGenerate, gen: RoutedGenerator, done: dict[str, dict], flush_every: int,
         unmatched_dir: Path | None) -> Summary:
    from tqdm import tqdm

    output, rows, request, settings = job.output, list(job.rows), job.request, settings_text(job.settings)
    todo = to_generate(rows, done)
    changed = {r.id for r in todo if r.id in done}
    if changed:
        log.warning("%s: %d row(s) hold the answer to another prompt under the same id (the input changed); they are "
                    "generated again", output, len(changed))
    wanted = {r.id for r in rows}
    finished = [done[r.id] for r in rows if r.id in done and r.id not in changed]
    if done.keys() - wanted:
        log.warning("%s holds %d ids that are not in this input; they are kept", output, len(done.keys() - wanted))
        finished += [row for i, row in done.items() if i not in wanted]
    unmatched: list[dict] = []
    generated = 0
    stats = BatchStats(1)
    journal_path = progress_path(output)
    try:
        with _writes(journal_path, len(finished)):  # unbuffered: a failed write leaves nothing to flush at close
            journal = open(journal_path, "ab", buffering=0)
        with journal, tqdm(total=len(todo), desc="generate", file=sys.stderr, mininterval=PROGRESS_S) as bar:
            for r, res in _results(gen, todo, request, stats, bar):
                bar.update(1)
                row = {"id": r.id, "domain": r.domain, **res.to_row(), "prompt_hash": prompt_hash(r.prompt),
                       "settings": settings}
                line = memoryview((json.dumps(row, allow_nan=False) + "\n").encode())
                with _writes(journal_path, len(finished)):
                    while line:
                        line = line[journal.write(line):]
                    os.fsync(journal.fileno())
                finished.append(row)
                generated += 1
                if res.cluster is None:
                    unmatched.append({"id": r.id, "prompt": r.prompt, "similarity": res.similarity,
                                      "vector": res.vector.tolist()})
                if generated % flush_every == 0:
                    with _writes(output, len(finished)):
                        write_parquet(in_order(finished, rows), output)
        with _writes(output, len(finished)):
            write_parquet(in_order(finished, rows), output)
    finally:
        if journal_path.exists() and journal_path.stat().st_size == 0:
            journal_path.unlink()  # nothing was finished: no journal to resume from
    journal_path.unlink(missing_ok=True)
    log_path = record_unmatched(unmatched, gen.bank.model, unmatched_dir) if unmatched else None
    return summarize(finished, generated, output, log_path, stats)


@contextlib.contextmanager
def _writes(path: Path, kept: int):
    """An ``OSError`` while writing the output (a full disk, a file system gone read-only) becomes one
    line that says what is kept: every finished row is in the output or its journal."""
    try:
        yield
    except OSError as e:
        raise OutputError(f"cannot write {path} ({e.strerror or e}); the {kept} row(s) finished so far are kept: make "
                          "room and run the same command again to resume") from None


def in_order(finished: list[dict], rows: list[Prompt]) -> list[dict]:
    """Output rows in the input's order (a batch finishes them in another); ids not in the input last."""
    order = {r.id: i for i, r in enumerate(rows)}
    return sorted(finished, key=lambda x: order.get(x["id"], len(order)))


def record_unmatched(rows: list[dict], model: str, folder: Path | None) -> str | None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    from knnssd.settings import work_dir

    folder = Path(folder or work_dir() / "unmatched" / model)
    stamp = dt.datetime.now(dt.timezone.utc).strftime("%Y%m%dT%H%M%S%f")
    path = folder / f"unmatched-{stamp}.parquet"
    tmp = path.with_name("." + path.name)
    try:
        folder.mkdir(parents=True, exist_ok=True)
        pq.write_table(pa.Table.from_pylist(rows), tmp)
        os.replace(tmp, path)
    except OSError as e:  # the output is complete: losing this log costs a later re-optimisation some prompts
        log.warning("cannot record %d unmatched prompt(s) in %s (%s)", len(rows), folder, e.strerror or e)
        return None
    finally:
        tmp.unlink(missing_ok=True)
    return str(path)


def summarize(rows: list[dict], generated: int, output: Path, unmatched_log: str | None,
              stats: BatchStats | None = None) -> Summary:
    n = len(rows)
    secs = sum(r["latency_s"] for r in rows)
    tokens = sum(r["new_tokens"] for r in rows)
    steps = sum(r["steps"] for r in rows)
    drafted = sum(r["drafted"] for r in rows)
    accepted = sum(r["accepted"] for r in rows)
    route = sum(r["route_ms"] for r in rows) / 1e3
    return Summary(
        rows=n, generated=generated, unmatched=sum(not r["matched"] for r in rows), new_tokens=tokens, seconds=secs,
        tokens_per_s=tokens / secs if secs else 0.0,
        acceptance_rate=acceptance_rate(accepted, drafted),
        mean_accepted=mean_accepted(accepted, steps), route_ms=1e3 * route / max(1, n),
        route_overhead_pct=100 * route / secs if secs else 0.0, output=str(output), unmatched_log=unmatched_log,
        batch_size=stats.slots if stats else 1, wall_s=stats.total_s if stats else 0.0,
        throughput=stats.tokens_per_s if stats else 0.0, rows_per_step=stats.summary()["rows_per_step"] if stats else 0.0,
        reused_prompt_tokens=stats.reused if stats else 0, plan_s=stats.plan_s if stats else 0.0)
