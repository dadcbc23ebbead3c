"""What an output already holds, and whether a run may go on with it.

Each row records what identifies its work (``prompt_hash``, ``settings``: ``run_settings``), so a
resume never pairs an id with another prompt's answer: a row whose prompt changed is generated
again (``to_generate``, warned), and an output made with other settings is refused in one line that
names them (``check_output``). A row that is not a knnssd row (torn, edited, foreign) is skipped and
generated again (``read_done``).
"""
from __future__ import annotations

import functools
import hashlib
import json
import logging
import math
import os
from pathlib import Path

from knnssd.engine.spec.request_params import GenerateParams
from knnssd.prompts import Prompt
from knnssd.routing.bank import Bank
from knnssd.serving.output_paths import OutputError, progress_path

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


def settings_text(settings: dict) -> str:
    return json.dumps(settings, sort_keys=True)


def check_output(output: Path, overwrite: bool, settings: dict | None = None) -> dict[str, dict]:
    """Unless ``overwrite``, the output (its paths checked: ``check_paths``) is one this tool can resume:
    its finished rows, each generated with ``settings`` when given (else a one-line ``OutputError`` that
    names what differs and offers ``--overwrite``)."""
    if overwrite:
        return {}
    done = read_done(output)
    if settings is not None:
        want = settings_text(settings)
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


def to_generate(rows: list[Prompt], done: dict[str, dict]) -> list[Prompt]:
    """The rows a resumed run generates: those not ``done``, and those whose id now holds another prompt."""
    return [r for r in rows if r.id not in done or done[r.id]["prompt_hash"] != prompt_hash(r.prompt)]


def write_parquet(rows: list[dict], output: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    tmp = output.with_name(f".{output.name}.{os.getpid()}.tmp")
    try:
        pq.write_table(pa.Table.from_pylist([{c: r.get(c) for c in COLUMNS} for r in rows]), tmp)
        os.replace(tmp, output)
    finally:
        tmp.unlink(missing_ok=True)
