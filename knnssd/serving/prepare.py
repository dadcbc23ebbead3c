"""A ``generate`` request prepared: every check it needs, run once, in seconds, before any model loads.

The CLI prepares its request before any Prefect server starts; the flow, its task and the batch each
ask again, and take the job already open on the same request (``prepared``), so a layer never checks
what another has. A deployment's run has no CLI above it: its flow prepares, once. What is checked:

1. the prompts (read once a process and checked: ``request.check_rows``), a sharded run's count of
   shards against them (``shards.check_shards``), and the output's paths (``output_paths.check_paths``:
   never the input);
2. the output's writer lock (``output_paths.writing``): a second writer is refused here; a sharded
   run's parts folder is writable and holds no other cut's parts (``shards.check_parts``);
3. the tracking store answers (``tracking.check_reachable``), and the bank is fetched;
4. the new tokens against the model's context, and a fixed ``--batch-size`` against the KV budget
   (``Limits``, from the model's config, without loading it);
5. an output to resume was made with the same settings (``resume.check_output``), and so was each part
   of a sharded run already there (``shards.check_part_settings``).
"""
from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from knnssd.engine.spec.request_params import Limits
from knnssd.prompts import Prompt
from knnssd.routing.bank import Bank
from knnssd.serving import resume, shards
from knnssd.serving.output_paths import progress_path, writing
from knnssd.serving.request import GenerateRequest, check_rows


@dataclass
class PreparedGenerate:
    """A ``GenerateRequest`` that passed every check, under its output's lock."""

    request: GenerateRequest
    output: Path  # ``request.output_path()``
    rows: tuple[Prompt, ...]  # its prompts, checked
    bank: Bank
    settings: dict  # ``resume.run_settings``: what every row of the output is made with
    done: dict[str, dict]  # the output's finished rows, read under the lock ({} with ``overwrite``)
    runs: int = 0  # ``batch.run``s over it: a task's retry reads ``done`` again, for what its first try finished


_open: list[PreparedGenerate] = []  # the jobs this process is preparing or running


@contextlib.contextmanager
def prepared(request: GenerateRequest, gen=None, rows: list[Prompt] | None = None) -> Iterator[PreparedGenerate]:
    """``request``, checked, for as long as the block runs, holding its output's lock. Inside another
    block on an equal request, the open job is taken as it is: no check runs twice. ``gen`` and ``rows``
    (a library caller's, or a test's): a ``RoutedGenerator`` and prompts to use instead of the request's,
    whose bank, limits and precision count; the tracking store is then not checked (nothing is logged)."""
    job = next((j for j in _open if j.request == request), None)
    if job is not None:
        yield job
        return
    if rows is None:
        rows = request.rows()  # checked as it was read
    else:
        check_rows(rows)
    if request.sharded:
        shards.check_shards(request.shards, rows)
    output = request.output_path()
    with writing(output):  # one writer per output: a second fails here, naming the first
        if request.sharded:  # every worker writes its part there
            shards.check_parts(output, request.shards, request.overwrite)
        bank, limits, dtype = _bank(request, gen)
        limits.check(request.params)
        if request.batch_size is not None:  # each sequence takes its new tokens at least (prompts count after the load)
            limits.check_slots(min(request.batch_size, len(rows)), request.params.max_new_tokens + 1, "--batch-size")
        settings = resume.run_settings(request.params, dtype, bank)
        done = resume.check_output(output, request.overwrite, settings)  # read under the lock: no writer is mid-flush
        if request.sharded:
            shards.check_part_settings(output, request.shards, settings)
        if request.overwrite:  # once a job: a task's retry resumes what its first try wrote
            output.unlink(missing_ok=True)
            progress_path(output).unlink(missing_ok=True)
        job = PreparedGenerate(request, output, tuple(rows), bank, settings, done)
        _open.append(job)
        try:
            yield job
        finally:
            _open.remove(job)
            if request.sharded:  # a run that wrote no part (no worker came) leaves no folder
                shards.remove_empty_folder(output)


def _bank(request: GenerateRequest, gen) -> tuple[Bank, Limits, str]:
    """The bank, the model's limits and the precision it runs in: ``gen``'s, or the request's, read from
    the registry and the model's config (the tracking store checked first: it answers in seconds)."""
    if gen is not None:
        return gen.bank, gen.lm.limits, gen.lm.dtype_name
    from knnssd import models, tracking
    from knnssd.settings import tracking_uri

    tracking.check_reachable(tracking_uri(request.tracking_uri), request.model_uri.startswith(("models:/", "runs:/")))
    bank = request.bank()
    return (bank, models.limits(bank.model, request.dtype, request.device),
            models.precision_name(request.dtype, request.device))


def pin_version(request: GenerateRequest) -> GenerateRequest:
    """``request`` on the version its alias names now (``models:/<name>/<version>``), so that every
    shard of a sharded run reads the same bank, even if the alias moves mid-run; as it is otherwise."""
    if not (request.model_uri.startswith("models:/") and "@" in request.model_uri):
        return request
    from knnssd import tracking
    from knnssd.settings import tracking_uri

    tracking.check_reachable(tracking_uri(request.tracking_uri), registered=True)
    version = tracking.resolve(request.model_uri, request.tracking_uri)
    return dataclasses.replace(request, model_uri=f"models:/{version.name}/{version.version}")
