"""Batch generation over a prompt file into a parquet file: resumable and kill-safe.

Each finished prompt is appended (and fsync'ed) to ``<output>.progress.jsonl``; every
``flush_every`` rows and at the end the parquet output is rewritten atomically (temp file +
rename), so a kill never leaves a torn output and a rerun skips every id already finished.
An existing output is resumed, not replaced (``overwrite=True`` starts over). Prompts that
no anchor matches are recorded in ``<work>/unmatched/`` for later re-optimisation.
"""
from __future__ import annotations

import contextlib
import datetime as dt
import fcntl
import json
import logging
import os
import sys
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

from knnssd.engine.batched import BatchStats, auto_slots
from knnssd.engine.decode import acceptance_rate, mean_accepted
from knnssd.engine.params import GenerateParams
from knnssd.prompts import Prompt
from knnssd.serving.routed import Result, RoutedGenerator

log = logging.getLogger(__name__)

COLUMNS = ("id", "domain", "text", "tokens", "new_tokens", "cluster", "label", "similarity", "matched", "drafter",
           "acceptance_rate", "mean_accepted", "steps", "drafted", "accepted", "latency_s", "route_ms", "tokens_per_s", "prompt_tokens",
           "truncated", "stop")


class OutputError(ValueError):
    """The output path cannot be used; one line."""


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

    def metrics(self) -> dict:
        return {k: float(v) for k, v in asdict(self).items() if isinstance(v, (int, float)) and not isinstance(v, bool)}


def progress_path(output: Path) -> Path:
    return output.with_name(output.name + ".progress.jsonl")


def lock_path(output: Path) -> Path:
    return output.with_name(output.name + ".lock")


_held: dict[Path, int] = {}  # outputs this process holds: lock file descriptor


@contextlib.contextmanager
def writing(output: str | os.PathLike) -> Iterator[None]:
    """Hold ``<output>.lock`` while writing ``output``: a second writer (another process) fails at once
    with an ``OutputError`` naming the holder. The lock is an ``flock``, so the kernel releases it on
    any exit, SIGKILL included; the file itself is removed on a normal exit. Re-entrant in a process."""
    output = Path(output).resolve()
    if output in _held:
        yield
        return
    path = lock_path(output)
    fd = _lock(path)
    os.ftruncate(fd, 0)
    os.pwrite(fd, str(os.getpid()).encode(), 0)
    _held[output] = fd
    try:
        yield
    finally:
        del _held[output]
        path.unlink(missing_ok=True)  # while still holding it: a waiter then finds its file gone and retries
        os.close(fd)


def _lock(path: Path) -> int:
    """An fd holding ``flock`` on the file now at ``path`` (not one a finishing holder just unlinked)."""
    while True:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:
            raise OutputError(f"cannot create the lock file {path} ({e.strerror or e})") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "another process"
            os.close(fd)
            output = path.with_name(path.name[: -len(".lock")])
            raise OutputError(f"{output} is being written by process {holder}; wait for it or choose another "
                              "--output") from None
        try:
            same = os.fstat(fd).st_ino == os.stat(path).st_ino
        except FileNotFoundError:
            same = False
        if same:
            return fd
        os.close(fd)


def check_output(output: Path, overwrite: bool) -> dict[str, dict]:
    """The output is a file path, and (unless ``overwrite``) one this tool can resume: its finished rows."""
    if output.is_dir():
        raise OutputError(f"{output} is a folder; give a .parquet file path")
    return {} if overwrite else read_done(output)


def read_done(output: Path) -> dict[str, dict]:
    """Rows already finished: the parquet output plus the progress journal (a torn last line is ignored)."""
    done: dict[str, dict] = {}
    if output.exists():
        import pyarrow.parquet as pq

        try:
            table = pq.read_table(output)
        except Exception as e:  # noqa: BLE001
            raise OutputError(f"{output} exists and is not a parquet file ({type(e).__name__}); "
                              "choose another path or pass --overwrite") from None
        missing = set(COLUMNS) - set(table.column_names)
        if missing:
            raise OutputError(f"{output} exists and is not a knnssd generation output (no {sorted(missing)[0]!r} "
                              "column); choose another path or pass --overwrite")
        done.update({r["id"]: r for r in table.to_pylist()})
    journal = progress_path(output)
    if journal.exists():
        for line in journal.read_text(encoding="utf-8", errors="replace").splitlines():
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                continue  # the line being written when the process was killed
            done[row["id"]] = row
    return done


def write_parquet(rows: list[dict], output: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    tmp = output.with_name(f".{output.name}.{os.getpid()}.tmp")
    pq.write_table(pa.Table.from_pylist([{c: r.get(c) for c in COLUMNS} for r in rows]), tmp)
    os.replace(tmp, output)


def check(rows: list[Prompt]) -> None:
    """Reject the batch before generating anything if a prompt is empty or an id repeats."""
    seen = set()
    for r in rows:
        if not r.prompt.strip():
            raise ValueError(f"prompt '{r.id}' is empty")
        if r.id in seen:
            raise ValueError(f"duplicate id '{r.id}'")
        seen.add(r.id)


def run(gen: RoutedGenerator, rows: list[Prompt], output: str | os.PathLike, params: GenerateParams = GenerateParams(),
        overwrite: bool = False, flush_every: int = 8, unmatched_dir: Path | None = None,
        batch_size: int | None = None) -> Summary:
    """Generate every prompt not yet in ``output``; ``batch_size`` sequences at a time (None: auto,
    ``engine.batched.auto_slots``; 1: one at a time)."""
    output = Path(output)
    check(rows)
    if batch_size is not None and batch_size < 1:
        raise ValueError(f"batch size must be >= 1, got {batch_size}")
    with writing(output):  # creates the output's folder
        done = check_output(output, overwrite)  # read under the lock: no other writer is mid-flush
        if overwrite:
            output.unlink(missing_ok=True)
            progress_path(output).unlink(missing_ok=True)
        return _run(gen, rows, output, done, params, flush_every, unmatched_dir, batch_size)


def _results(gen: RoutedGenerator, todo: list[Prompt], params: GenerateParams, batch_size: int | None,
             stats: BatchStats) -> Iterator[tuple[Prompt, Result]]:
    """(prompt, result) as each finishes: batched when the decoder can run slots and the batch size
    (asked, or auto) is over 1, else one prompt at a time."""
    slots, positions = 1, 0
    if gen.can_batch and todo and batch_size != 1:
        positions = gen.positions([r.prompt for r in todo], params)
        slots = batch_size or auto_slots(gen.decoder, positions, len(todo))
    stats.slots = slots
    if slots == 1:
        t0 = time.perf_counter()
        for r in todo:
            res = gen.generate(r.prompt, params)
            stats.prefills += 1
            stats.emitted.append(len(res.tokens) - 1)
            stats.total_s = time.perf_counter() - t0
            yield r, res
        return
    yield from gen.generate_many(((r, r.prompt) for r in todo), params, gen.plan(slots, positions), stats)


def _run(gen: RoutedGenerator, rows: list[Prompt], output: Path, done: dict[str, dict], params: GenerateParams,
         flush_every: int, unmatched_dir: Path | None, batch_size: int | None) -> Summary:
    from tqdm import tqdm

    wanted = {r.id for r in rows}
    finished = [done[r.id] for r in rows if r.id in done]
    todo = [r for r in rows if r.id not in done]
    if done.keys() - wanted:
        log.warning("%s holds %d ids that are not in this input; they are kept", output, len(done.keys() - wanted))
        finished += [row for i, row in done.items() if i not in wanted]
    unmatched: list[dict] = []
    generated = 0
    stats = BatchStats(1)
    with open(progress_path(output), "a", encoding="utf-8") as journal, \
            tqdm(total=len(todo), desc="generate", file=sys.stderr, mininterval=2) as bar:
        for r, res in _results(gen, todo, params, batch_size, stats):
            bar.update(1)
            row = {"id": r.id, "domain": r.domain, **res.to_row()}
            journal.write(json.dumps(row) + "\n")
            journal.flush()
            os.fsync(journal.fileno())
            finished.append(row)
            generated += 1
            if res.cluster is None:
                unmatched.append({"id": r.id, "prompt": r.prompt, "similarity": res.similarity,
                                  "vector": res.vector.tolist()})
            if generated % flush_every == 0:
                write_parquet(in_order(finished, rows), output)
    write_parquet(in_order(finished, rows), output)
    progress_path(output).unlink(missing_ok=True)
    log_path = record_unmatched(unmatched, gen.bank.model, unmatched_dir) if unmatched else None
    return summarize(finished, generated, output, log_path, stats)


def in_order(finished: list[dict], rows: list[Prompt]) -> list[dict]:
    """Output rows in the input's order (a batch finishes them in another); ids not in the input last."""
    order = {r.id: i for i, r in enumerate(rows)}
    return sorted(finished, key=lambda x: order.get(x["id"], len(order)))


def record_unmatched(rows: list[dict], model: str, folder: Path | None) -> str:
    import pyarrow as pa
    import pyarrow.parquet as pq

    from knnssd.settings import work_dir

    folder = Path(folder or work_dir() / "unmatched" / model)
    folder.mkdir(parents=True, exist_ok=True)
    stamp = dt.datetime.now(dt.timezone.utc).strftime("%Y%m%dT%H%M%S%f")
    path = folder / f"unmatched-{stamp}.parquet"
    tmp = path.with_name("." + path.name)
    pq.write_table(pa.Table.from_pylist(rows), tmp)
    os.replace(tmp, path)
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
        reused_prompt_tokens=stats.reused if stats else 0)
