"""One ``generate`` job as one object, from the CLI (or a deployment's parameters) through the flow and
its tasks to the batch and the routed generator (``GenerateRequest``).

Its fields are checked where it is made. What needs files is read once a process: the prompts
(``rows``: loaded and checked), the bank (``bank``) and the generator built on it (``generator``),
so the CLI's checks before any server starts and the flow's tasks after it share one read of each.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field
from pathlib import Path

from knnssd.engine.spec.request_params import GenerateParams, check_batch_size, check_prompt
from knnssd.prompts import Prompt
from knnssd.routing import bank as banks
from knnssd.serving.output_paths import check_paths, output_path
from knnssd.serving.shards import check_count, rows_of
from knnssd.settings import DTYPES


@dataclass(frozen=True)
class GenerateRequest:
    model_uri: str  # models:/knnssd-<model>@<alias> | models:/<name>/<version> | a bank folder
    input: str  # a prompt file (jsonl / parquet / csv, or hf:<dataset>)
    output: str  # a parquet file; an existing one is resumed unless ``overwrite``
    params: GenerateParams = field(default_factory=GenerateParams)
    split: str | None = None  # only rows of this split
    dtype: str = "auto"
    device: str = "auto"
    batch_size: int | None = None  # sequences decoded together: None auto (measured), 1 one at a time
    overwrite: bool = False
    tracking_uri: str | None = None
    shards: int = 1  # the input cut into this many shards, each run on a work pool's workers (``tasks.shards``)
    shard: int | None = None  # only this shard's rows (``serving.shards.rows_of``): one part of a sharded run

    def __post_init__(self):
        if isinstance(self.params, dict):  # a deployment's JSON parameters
            object.__setattr__(self, "params", GenerateParams.from_dict(self.params))
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype '{self.dtype}' is not one of {', '.join(DTYPES)}")
        check_batch_size(self.batch_size)
        check_count(self.shards)
        if self.shard is not None and not 0 <= self.shard < self.shards:
            raise ValueError(f"shard {self.shard} is not one of the {self.shards} shards")

    @property
    def sharded(self) -> bool:
        """Is this the parent of a sharded run (its shards' runs do the generating)?"""
        return self.shards > 1 and self.shard is None

    def output_path(self) -> Path:
        """Where the output is written (``output_paths.output_path``), checked against the input (``check_paths``):
        once a process, whichever layer asks first (the CLI, the flow, the batch)."""
        return _output(self.output, self.input)

    def rows(self) -> list[Prompt]:
        """The input's prompts (of ``split``; of ``shard``), checked (``check_rows``); read once while the file is
        unchanged."""
        path = Path(self.input)
        try:
            st = path.stat()
            key = (st.st_mtime_ns, st.st_size)
        except OSError:  # hf:... or missing: ``prompts.load`` says which
            key = None
        rows = list(_rows(self.input, self.split, key))
        return rows if self.shard is None else rows_of(rows, self.shard, self.shards)

    def bank(self) -> banks.Bank:
        """The bank behind ``model_uri`` (a registered version is fetched once into the work folder)."""
        return _bank(self.model_uri, self.tracking_uri)

    def generator(self):
        """The routed generator over the bank and its model, built once a process."""
        return _generator(self.model_uri, self.dtype, self.tracking_uri, self.device)


def check_rows(rows: list[Prompt]) -> None:
    """Reject the batch before generating anything if a prompt is empty or not text, or an id repeats."""
    seen = set()
    for r in rows:
        if not r.prompt.strip():
            raise ValueError(f"prompt '{r.id}' is empty")
        try:
            check_prompt(r.prompt)
        except ValueError as e:
            raise ValueError(f"prompt '{r.id}': {e}") from None
        if r.id in seen:
            raise ValueError(f"duplicate id '{r.id}'")
        seen.add(r.id)


@functools.lru_cache(maxsize=2)
def _rows(path: str, split: str | None, stamp) -> tuple[Prompt, ...]:
    from knnssd import prompts

    rows = prompts.load(path, split=split)
    if not rows:
        raise ValueError("no prompts")
    check_rows(rows)
    return tuple(rows)


@functools.lru_cache(maxsize=8)
def _output(output: str, input: str) -> Path:
    path = output_path(output)
    check_paths(path, [input])
    return path


@functools.lru_cache(maxsize=2)
def _bank(model_uri: str, tracking_uri: str | None) -> banks.Bank:
    from knnssd import tracking

    return banks.load(tracking.bank_folder(model_uri, tracking_uri))


@functools.lru_cache(maxsize=2)
def _generator(model_uri: str, dtype: str, tracking_uri: str | None, device: str):
    from knnssd import models
    from knnssd.serving.routed import RoutedGenerator

    bank = _bank(model_uri, tracking_uri)
    return RoutedGenerator(models.load(bank.model, dtype, device), bank)
