"""One prompt file cut into shards, each generated into a part of its own, the parts joined into one output.

The rule (``shard_of``) is a hash of each row's id, so a row's shard never depends on the other rows, on
their order or on the machine; within a shard the rows keep the input's order. Each part is an output of
its own (``<output>.parts/shard-<i>-of-<n>.parquet``, with today's journal and lock), so a shard resumes
as any ``generate`` does. The final file is written once every part is complete (``join``): every input
id once, in input order, and nothing else; only then are the parts removed.
"""
from __future__ import annotations

import hashlib
import os
from pathlib import Path

from knnssd.prompts import Prompt
from knnssd.serving.output_paths import OutputError, lock_path, progress_path
from knnssd.serving.resume import check_output, prompt_hash, read_done, to_generate, write_parquet

MAX_SHARDS = 1024


def shard_of(row_id: str, shards: int) -> int:
    """The shard (0 .. ``shards`` - 1) that generates the row ``row_id``."""
    digest = hashlib.sha256(row_id.encode("utf-8", "surrogatepass")).digest()
    return int.from_bytes(digest[:8], "big") % shards


def rows_of(rows: list[Prompt], shard: int, shards: int) -> list[Prompt]:
    """The rows of ``shard``, in the input's order."""
    return [r for r in rows if shard_of(r.id, shards) == shard]


def check_count(shards: int) -> None:
    """``shards`` an integer from 1 to ``MAX_SHARDS`` (a one-line ``ValueError``)."""
    if isinstance(shards, bool) or not isinstance(shards, int) or not 1 <= shards <= MAX_SHARDS:
        raise ValueError(f"--shards must be an integer from 1 to {MAX_SHARDS}, got {shards!r}")


def check_shards(shards: int, rows: list[Prompt]) -> None:
    """``shards`` no more than the rows, and every shard holds a row (a one-line ``ValueError``)."""
    if shards > len(rows):
        raise ValueError(f"--shards {shards} is more than the input's {len(rows)} prompts; use at most {len(rows)}")
    empty = sorted(set(range(shards)) - {shard_of(r.id, shards) for r in rows})
    if empty:  # ids hash unevenly over a few rows: a shard with nothing to do would start a worker for nothing
        raise ValueError(f"--shards {shards}: shard {empty[0]} of the input's {len(rows)} prompts would be empty "
                         "(ids hash unevenly over few rows); use fewer shards")


def parts_folder(output: Path) -> Path:
    return output.with_name(output.name + ".parts")


def part_path(output: Path, shard: int, shards: int) -> Path:
    return parts_folder(output) / f"shard-{shard:04d}-of-{shards:04d}.parquet"


def check_parts_folder(output: Path) -> Path:
    """The parts' folder beside ``output``, made and writable (every worker writes there: a shared folder
    where the workers are on other machines); a one-line ``OutputError`` otherwise, before any work."""
    folder = parts_folder(output)
    probe = folder / f".probe-{os.getpid()}"
    try:
        folder.mkdir(exist_ok=True)
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as e:
        raise OutputError(f"cannot write the shards' parts in {folder} ({e.strerror or e}); make it writable, or "
                          "choose another --output") from None
    return folder


def cuts(output: Path) -> list[int]:
    """The shard counts of the parts in the output's parts folder."""
    return sorted({int(p.name.rsplit("-of-", 1)[1][:4]) for p in parts_folder(output).glob("shard-*-of-*")})


def check_parts(output: Path, shards: int, overwrite: bool) -> None:
    """The parts' folder is writable (``check_parts_folder``) and holds no parts of another cut (a rerun
    must keep its count: a row's shard depends on it); with ``overwrite``, every part there is removed."""
    check_parts_folder(output)
    for cut in cuts(output):
        if overwrite:
            remove_parts(output, cut)
        elif cut != shards:
            raise OutputError(f"{parts_folder(output)} holds the parts of a run cut into {cut} shards; run it again "
                              f"with --shards {cut}, or pass --overwrite")
    parts_folder(output).mkdir(exist_ok=True)


def check_part_settings(output: Path, shards: int, settings: dict) -> None:
    """Each part already there was made with ``settings`` (``resume.check_output``): a rerun after the
    alias moved would otherwise join rows of two banks."""
    for i in range(shards):
        part = part_path(output, i, shards)
        if part.exists() or progress_path(part).exists():
            check_output(part, False, settings)


def finished(part: Path) -> int:
    """The rows a part holds (its parquet and its journal), for the parent's progress bar."""
    return len(read_done(part))


def complete(rows: list[Prompt], part: Path) -> bool:
    """Does ``part`` hold an answer to each of ``rows`` (its shard's), with its journal folded in?"""
    return part.exists() and not progress_path(part).exists() and not to_generate(rows, read_done(part))


def join(output: Path, rows: list[Prompt], shards: int) -> list[dict]:
    """The final output from the parts: every input id once, in input order, each from the part of its
    shard and generated for its prompt, written atomically; the output's rows. A row missing is an
    ``OutputError`` that names its shard (the parts are kept for the rerun)."""
    done = [read_done(part_path(output, i, shards)) for i in range(shards)]
    joined = []
    for r in rows:
        row = done[shard_of(r.id, shards)].get(r.id)
        if row is None or row["prompt_hash"] != prompt_hash(r.prompt):
            raise OutputError(f"shard {shard_of(r.id, shards)} of {shards} has no answer for prompt '{r.id}'; run the "
                              "same command again to finish it")
        joined.append(row)
    write_parquet(joined, output)
    return joined


def remove_parts(output: Path, shards: int) -> None:
    """The parts, their journals and locks, then the folder if nothing else is in it."""
    for i in range(shards):
        part = part_path(output, i, shards)
        for path in (part, progress_path(part), lock_path(part)):
            path.unlink(missing_ok=True)
    remove_empty_folder(output)


def remove_empty_folder(output: Path) -> None:
    """The parts' folder, if nothing is in it."""
    try:
        parts_folder(output).rmdir()
    except OSError:  # something of the user's is there, or another cut's parts: kept
        pass
