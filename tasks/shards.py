"""A sharded generate's tasks on the Prefect API: the shard deployment, a worker to run it, each shard as a
flow run of it (``run_deployment``), and the watch that waits for them all, restarting a shard whose
process died.

A shard's flow run is today's ``generate`` flow on a request of one shard (``GenerateRequest.shard``)
into its own part, on any worker of the pool. Prefect retries nothing when a worker's machine dies: its
flow run stays Running. The watch knows a shard's process is gone when its part's writer lock is free
while its run says Running (the lock is an ``flock``: the kernel drops it with the process, on any
machine that shares the folder), marks that run Crashed and starts the shard again, on whichever worker
takes it; it resumes from the part's journal and never redoes a finished row.
"""
from __future__ import annotations

import dataclasses
import logging
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from prefect import task
from prefect.cache_policies import NO_CACHE

from knnssd import tracking
from knnssd.prompts import Prompt
from knnssd.reachable import NoWorker
from knnssd.serving import batch, resume, shards
from knnssd.serving.output_paths import ShardFailed, held
from knnssd.serving.prepare import PreparedGenerate
from knnssd.serving.request import GenerateRequest
from knnssd.settings import tracking_uri

DEPLOYMENT = "knnssd-shard-{pool}"  # of the ``generate`` flow, one a pool (a deployment names its pool)
ENTRYPOINT = "knnssd.flows.generate.generate"  # a module path: the installed package, no checkout or storage
POLL_S = 1.0
PROGRESS_S = 5.0  # the parts are read for the progress bar this often: each read parses every part
GONE_S = 10.0  # Running with its part's lock free this long: the shard's process is gone
STARTING_S = 180.0  # Pending this long (a worker took it, its process never started): gone too
RETRIES = 2  # starts of a shard after its first, for processes that died or runs that failed

log = logging.getLogger(__name__)


@dataclass
class Shard:
    """One shard of the watch: its request, its rows, its flow run and how often it was started."""

    request: GenerateRequest
    rows: list[Prompt]
    before: int = 0  # rows its part held when the run began
    figures: dict = field(default_factory=dict)  # its part's tokens and speed, read when the parts are joined
    run_id: str | None = None
    starts: int = 0
    gone_since: float | None = None
    worker: str | None = None
    done: bool = False
    notes: list[str] = field(default_factory=list)

    @property
    def part(self) -> Path:
        return Path(self.request.output)


@task(cache_policy=NO_CACHE)
def plan(job: PreparedGenerate) -> list[Shard]:
    """The shards of a prepared sharded request (checked there), each a request of its own into a part
    beside the output, on the version the parent pinned and its tracking store."""
    rows, output, n = list(job.rows), job.output.resolve(), job.request.shards
    base = _portable(job.request)
    plan = [Shard(dataclasses.replace(base, output=str(shards.part_path(output, i, n)), shard=i),
                  shards.rows_of(rows, i, n)) for i in range(n)]
    for s in plan:
        s.before = shards.finished(s.part)
    return plan


def _portable(request: GenerateRequest) -> GenerateRequest:
    """``request`` as a worker reads it from another folder: its input, a bank folder and a sqlite store by
    absolute paths, and the tracking store named (not left to the worker's environment)."""
    uri = tracking_uri(request.tracking_uri)
    if uri.startswith("sqlite:///"):
        uri = "sqlite:///" + str(Path(uri[len("sqlite:///"):]).resolve())
    model = request.model_uri if request.model_uri.startswith("models:/") else str(Path(request.model_uri).resolve())
    inp = request.input if request.input.startswith("hf:") else str(Path(request.input).resolve())
    return dataclasses.replace(request, input=inp, model_uri=model, tracking_uri=uri, overwrite=False)


@task(cache_policy=NO_CACHE)
def join(job: PreparedGenerate, plan: list[Shard]) -> batch.Summary:
    """The final output from the parts (``shards.join``), then the parts removed; its summary (the rows
    the parts held when this run began were generated before it)."""
    output, n = job.output, len(plan)
    rows = shards.join(output, list(job.rows), n)
    for s in plan:
        part = batch.summarize(list(resume.read_done(s.part).values()), 0, s.part, None)
        s.figures = {"new_tokens": part.new_tokens, "tokens_per_s": round(part.tokens_per_s, 2),
                     "mean_accepted": round(part.mean_accepted, 3)}
    shards.remove_parts(output, n)
    return batch.summarize(rows, len(rows) - sum(s.before for s in plan), output, None)


@task(cache_policy=NO_CACHE)
def log_summary(summary: batch.Summary, job: PreparedGenerate, plan: list[Shard]) -> str:
    """One MLflow run for the whole file; the shards' figures as a table artifact (``shards.json``)."""
    import json
    import tempfile

    table = [{"shard": s.request.shard, "rows": len(s.rows), **s.figures, "starts": s.starts, "worker": s.worker,
              "flow_run": s.run_id, "restarts": s.notes} for s in plan]
    with tempfile.TemporaryDirectory(prefix="knnssd-shards-") as tmp:
        path = Path(tmp) / "shards.json"
        path.write_text(json.dumps(table, indent=1))
        return tracking.log_run("knnssd-generation", {"model_uri": job.request.model_uri, "input": job.request.input,
                                                      "shards": len(plan), **job.request.params.__dict__},
                                summary.metrics(), [str(path)], job.request.tracking_uri, run_name="generate-sharded")


@task(cache_policy=NO_CACHE)
def ensure_deployment(pool: str) -> str:
    """The shard deployment on ``pool`` (made once, from the installed package): its full name."""
    from prefect.client.orchestration import get_client
    from prefect.exceptions import ObjectNotFound

    with get_client(sync_client=True) as client:
        try:
            client.read_work_pool(pool)
        except ObjectNotFound:
            raise ValueError(f"there is no work pool '{pool}': make one with `prefect work-pool create {pool} --type "
                             "process` and start workers on it") from None
        name = DEPLOYMENT.format(pool=pool)
        try:
            client.read_deployment_by_name(f"generate/{name}")
        except ObjectNotFound:
            client.create_deployment(client.create_flow_from_name("generate"), name, work_pool_name=pool,
                                     entrypoint=ENTRYPOINT, pull_steps=[],
                                     description="one shard of a sharded `knnssd generate` (made by the parent)")
    return f"generate/{name}"


@task(cache_policy=NO_CACHE)
def wait_for_worker(pool: str, wait_s: float) -> int:
    """The number of workers online in ``pool``, once there is one; a line says what is awaited, and
    ``NoWorker`` comes after ``wait_s``."""
    from prefect.client.orchestration import get_client

    deadline, said = time.monotonic() + wait_s, False
    with get_client(sync_client=True) as client:
        while True:
            online = [w for w in client.read_workers_for_work_pool(pool) if str(w.status).upper().endswith("ONLINE")]
            if online:
                return len(online)
            if time.monotonic() > deadline:
                raise NoWorker(f"no worker came online in pool '{pool}' within {wait_s:g} s; start one with "
                               f"`prefect worker start --pool {pool}`")
            if not said:  # a warning: the terminal shows it (the flow's prints are logged at INFO)
                log.warning("waiting up to %g s for a worker in pool '%s' (start one: prefect worker start --pool %s)",
                            wait_s, pool, pool)
                said = True
            time.sleep(POLL_S)


@task(cache_policy=NO_CACHE)
def watch(deployment: str, plan: list[Shard]) -> list[Shard]:
    """Start each shard not complete yet, then wait for them all, with one progress bar over every
    shard's rows (fed by the parts' journals). A shard whose process died (``GONE_S``) or whose run
    failed is started again, ``RETRIES`` times at most; then ``ShardFailed`` names it and why."""
    from prefect.client.orchestration import get_client
    from tqdm import tqdm

    total = sum(len(s.rows) for s in plan)
    with get_client(sync_client=True) as client, tqdm(total=total, desc="generate", unit="row",
                                                      file=sys.stderr, mininterval=2.0) as bar:
        counted = 0.0
        while not all(s.done for s in plan):
            for s in plan:
                if not s.done:
                    _step(client, deployment, s)
            if time.monotonic() - counted >= PROGRESS_S or all(s.done for s in plan):
                bar.n, counted = sum(shards.finished(s.part) for s in plan), time.monotonic()  # reads every part
                bar.set_postfix_str(f"{sum(s.done for s in plan)}/{len(plan)} shards done", refresh=False)
                bar.refresh()
            if not all(s.done for s in plan):
                time.sleep(POLL_S)
    return plan


def _step(client, deployment: str, s: Shard) -> None:
    """One look at shard ``s``: start it, see it finished, or start it again."""
    if s.run_id is None:
        if held(s.part):  # an earlier parent's run of it is still writing: wait for that one
            return
        if shards.complete(s.rows, s.part):
            s.done = True
            return
        _start(deployment, s)
        return
    run = client.read_flow_run(s.run_id)
    state = run.state
    s.worker = run.infrastructure_pid or s.worker
    if state.is_completed():
        s.done = True
        return
    if state.is_final():
        why = (state.message or state.name).strip().splitlines()[0][:300]
        _again(s, f"{state.name}: {why}")
        return
    lost = ((state.is_running() and not held(s.part)) or
            (state.is_pending() and time.monotonic() - state.timestamp.timestamp() > STARTING_S))
    if not lost:
        s.gone_since = None
        return
    s.gone_since = s.gone_since or time.monotonic()
    if time.monotonic() - s.gone_since >= GONE_S:
        from prefect.states import Crashed

        client.set_flow_run_state(s.run_id, Crashed(message="its process is gone (the part's lock is free)"),
                                  force=True)
        _again(s, "its process died")


def _again(s: Shard, why: str) -> None:
    s.notes.append(why)
    if s.starts > RETRIES:
        raise ShardFailed(f"shard {s.request.shard} of {s.request.shards} failed after {s.starts} start(s) ({why}); "
                          f"its part {s.part} is kept: run the same command again to finish it")
    log.warning("shard %d of %d: %s; starting it again", s.request.shard, s.request.shards, why)
    s.run_id, s.gone_since = None, None


def _start(deployment: str, s: Shard) -> None:
    from prefect.deployments import run_deployment

    run = run_deployment(deployment, parameters={"request": dataclasses.asdict(s.request)}, timeout=0,
                         flow_run_name=f"shard-{s.request.shard}-of-{s.request.shards}")
    s.run_id, s.starts, s.gone_since = str(run.id), s.starts + 1, None
