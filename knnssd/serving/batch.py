"""Batch generation over a prompt file into a parquet file: resumable and kill-safe.

Each finished prompt is appended (and fsync'ed) to ``<output>.progress.jsonl``; every
``flush_every`` rows and at the end the parquet output is rewritten atomically (temp file +
rename), so a kill never leaves a torn output and a rerun skips every id already finished.
An existing output is resumed, not replaced (``overwrite=True`` starts over). Prompts that
no anchor matches are recorded in ``<work>/unmatched/`` for later re-optimisation.

Each row records what identifies its work (``prompt_hash``, ``settings``: ``run_settings``), so a
resume never pairs an id with another prompt's answer: a row whose prompt changed is generated
again (warned), and an output made with other settings is refused in one line that names them.
The output is never one of the input files, whatever the path, link or hard link.
"""
from __future__ import annotations

import contextlib
import datetime as dt
import functools
import hashlib
import json
import logging
import math
import os
import sys
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

from knnssd import locks
from knnssd.engine.batch.plan import auto_slots, check_slots
from knnssd.engine.batch.scheduler import BatchStats
from knnssd.engine.spec.loop import acceptance_rate, mean_accepted
from knnssd.engine.spec.request_params import GenerateParams
from knnssd.prompts import Prompt
from knnssd.routing.bank import Bank
from knnssd.serving.output_paths import OutputError, lock_path, progress_path
from knnssd.serving.request import GenerateRequest, check_rows
from knnssd.serving.routed import Result, RoutedGenerator

log = logging.getLogger(__name__)

COLUMNS = ("id", "domain", "text", "tokens", "new_tokens", "cluster", "label", "similarity", "matched", "drafter",
           "acceptance_rate", "mean_accepted", "steps", "drafted", "accepted", "latency_s", "route_ms", "tokens_per_s", "prompt_tokens",
           "truncated", "stop", "prompt_hash", "settings")
RESUME_KEY = ("prompt_hash", "settings")  # the columns earlier versions did not write
_COUNTS = ("new_tokens", "steps", "drafted", "accepted", "prompt_tokens", "latency_s", "route_ms", "tokens_per_s",
           "acceptance_rate", "mean_accepted")
_NUMBER, _INT = (int, float), (int,)
_KINDS = {"id": (str,), "domain": (str, type(None)), "text": (str,), "tokens": (list,), "new_tokens": _INT,
          "cluster": (int, type(None)), "label": (str,), "similarity": (*_NUMBER, type(None)), "matched": (bool,),
          "drafter": (str,), "acceptance_rate": _NUMBER, "mean_accepted": _NUMBER, "steps": _INT, "drafted": _INT,
          "accepted": _INT, "latency_s": _NUMBER, "route_ms": _NUMBER, "tokens_per_s": _NUMBER, "prompt_tokens": _INT,
          "truncated": (bool,), "stop": (str, type(None)), "prompt_hash": (str,), "settings": (str,)}


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
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, str(os.getpid()).encode(), 0)
    except OSError as e:  # a full disk
        path.unlink(missing_ok=True)
        os.close(fd)
        raise OutputError(f"cannot write the lock file {path} ({e.strerror or e})") from None
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
        if not locks.try_lock(fd):
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


def prompt_hash(prompt: str) -> str:
    return hashlib.sha256(prompt.encode("utf-8", "surrogatepass")).hexdigest()[:16]


def run_settings(params: GenerateParams, dtype: str, bank: Bank) -> dict:
    """What decides a row's tokens and figures besides its prompt: the generation parameters, the
    dtype the model runs in, and the bank (its ``digest``). Sampling's parameters count only where
    the run samples (greedy decoding ignores them). The device does not count: the same dtype's
    tokens are the same generation on either."""
    p = params if not params.warp.greedy else GenerateParams(params.max_new_tokens, 0.0,
                                                              max_prompt_tokens=params.max_prompt_tokens)
    return {**{k: getattr(p, k) for k in ("max_new_tokens", "max_prompt_tokens", "temperature", "top_k", "top_p",
                                          "seed")}, "dtype": dtype, "bank": bank.digest}


def _settings_text(settings: dict) -> str:
    return json.dumps(settings, sort_keys=True)


def check_output(output: Path, overwrite: bool, settings: dict | None = None) -> dict[str, dict]:
    """Unless ``overwrite``, the output (its paths checked: ``check_paths``) is one this tool can resume:
    its finished rows, each generated with ``settings`` when given (else a one-line ``OutputError`` that
    names what differs and offers ``--overwrite``)."""
    if overwrite:
        return {}
    done = read_done(output)
    if settings is not None:
        want = _settings_text(settings)
        for row in done.values():
            if row["settings"] != want:
                raise OutputError(f"{output} was generated with other settings: "
                                  f"{_differences(_settings_of(row['settings']), settings)}; pass --overwrite to "
                                  "generate it again from the start, or choose another --output")
    return done


def _differences(old: dict, new: dict) -> str:
    return ", ".join(f"{k} {old.get(k, 'unset')} (this run: {new.get(k, 'unset')})"
                     for k in sorted(set(old) | set(new)) if old.get(k) != new.get(k))


def read_done(output: Path) -> dict[str, dict]:
    """Rows already finished: the parquet output plus the progress journal. A row that is not a
    knnssd row (a torn last line, a hand-edited or foreign one) is skipped with a warning, and so
    generated again."""
    done: dict[str, dict] = {}
    if output.exists():
        import pyarrow.parquet as pq

        try:
            table = pq.read_table(output)
        except Exception as e:  # noqa: BLE001
            raise OutputError(f"{output} exists and is not a parquet file ({type(e).__name__}); "
                              "choose another path or pass --overwrite") from None
        missing = set(COLUMNS) - set(table.column_names)
        if missing and missing <= set(RESUME_KEY) and "id" in table.column_names:
            raise OutputError(f"{output} was written by an earlier knnssd, which did not record what each row was "
                              "generated with; pass --overwrite to generate it again, or choose another --output")
        if missing:
            raise OutputError(f"{output} exists and is not a knnssd generation output (no {sorted(missing)[0]!r} "
                              "column); choose another path or pass --overwrite")
        _take(done, table.to_pylist(), output)
    journal = progress_path(output)
    if journal.exists():
        rows = []
        for line in journal.read_text(encoding="utf-8", errors="replace").splitlines():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                rows.append(None)  # the line being written when the process was killed
        _take(done, rows, journal)
    return done


def _take(done: dict[str, dict], rows: list, source: Path) -> None:
    bad = 0
    for row in rows:
        if _is_row(row):
            done[row["id"]] = row
        else:
            bad += 1
    if bad:
        log.warning("%s: %d row(s) are not knnssd rows (torn, edited or foreign) and are skipped; their prompts are "
                    "generated again", source, bad)


def _is_row(row) -> bool:
    """Every column of its type, counts and times >= 0, numbers finite, as many tokens as ``new_tokens``
    and settings that are an object (a hand-edited ``"new_tokens": -1`` skewed the summary)."""
    if not (isinstance(row, dict) and all(
            k in row and isinstance(row[k], kinds) and not (isinstance(row[k], bool) and bool not in kinds)
            for k, kinds in _KINDS.items())):
        return False
    numbers = [row[k] for k, kinds in _KINDS.items() if kinds[0] in _NUMBER and row[k] is not None]
    return (all(math.isfinite(v) for v in numbers) and all(row[k] >= 0 for k in _COUNTS)
            and row["new_tokens"] == len(row["tokens"]) and _settings_of(row["settings"]) is not None)


@functools.lru_cache(maxsize=64)  # every row of a run holds the same text
def _settings_of(text: str) -> dict | None:
    try:
        settings = json.loads(text)
    except json.JSONDecodeError:
        return None
    return settings if isinstance(settings, dict) else None


def write_parquet(rows: list[dict], output: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    tmp = output.with_name(f".{output.name}.{os.getpid()}.tmp")
    try:
        pq.write_table(pa.Table.from_pylist([{c: r.get(c) for c in COLUMNS} for r in rows]), tmp)
        os.replace(tmp, output)
    finally:
        tmp.unlink(missing_ok=True)


def run(request: GenerateRequest, gen: RoutedGenerator | None = None, rows: list[Prompt] | None = None,
        flush_every: int = 8, unmatched_dir: Path | None = None) -> Summary:
    """Generate every prompt of ``request`` not yet in its output, ``request.batch_size`` sequences at a time
    (None: auto, ``engine.batch.plan.auto_slots``; 1: one at a time). ``gen`` and ``rows``: the request's own
    (``request.generator()``, ``request.rows()``, read once a process) unless given."""
    output = request.output_path()
    if rows is None:
        rows = request.rows()  # checked as it was read
    else:
        check_rows(rows)
    gen = gen or request.generator()
    params = request.params
    gen.lm.limits.check(params)
    settings = run_settings(params, gen.lm.dtype_name, gen.bank)
    with writing(output):  # creates the output's folder
        done = check_output(output, request.overwrite, settings)  # read under the lock: no other writer is mid-flush
        if request.overwrite:
            output.unlink(missing_ok=True)
            progress_path(output).unlink(missing_ok=True)
        return _run(request, gen, rows, done, _settings_text(settings), flush_every, unmatched_dir)


def to_generate(rows: list[Prompt], done: dict[str, dict]) -> list[Prompt]:
    """The rows a resumed run generates: those not ``done``, and those whose id now holds another prompt."""
    return [r for r in rows if r.id not in done or done[r.id]["prompt_hash"] != prompt_hash(r.prompt)]


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


def _run(request: GenerateRequest, gen: RoutedGenerator, rows: list[Prompt], done: dict[str, dict], settings: str,
         flush_every: int, unmatched_dir: Path | None) -> Summary:
    from tqdm import tqdm

    output = request.output_path()
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
