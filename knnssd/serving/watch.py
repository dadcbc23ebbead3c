"""The drop folder: new domain files, and the unmatched-prompts log, waiting to be added to a bank.

A drop-folder file is *pending* until the state file records its name with the same content hash
(a file whose content changes is pending again); a file with fewer than ``min_prompts`` rows waits
for more. Unmatched-prompt logs (``<work>/unmatched/<model>/*.parquet``) are pending until
recorded; together they become one new domain once they hold ``min_prompts`` prompts. The state
file is JSON, written atomically, so the record survives restarts and kills.
"""
from __future__ import annotations

import datetime as dt
import hashlib
import json
import logging
import re
from dataclasses import dataclass, field
from pathlib import Path

from knnssd import prompts

log = logging.getLogger(__name__)
SUFFIXES = (".jsonl", ".parquet", ".csv")


@dataclass
class Item:
    kind: str  # "file" | "unmatched"
    path: str  # prompt file to add (unmatched logs are gathered into one jsonl)
    name: str  # the new domain's name
    sha256: str
    rows: int
    sources: list[str] = field(default_factory=list)  # state keys this item stands for


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def load_state(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        done = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        why = e.msg if isinstance(e, json.JSONDecodeError) else "not UTF-8"
        raise ValueError(f"{path}: watch state is corrupt ({why}); move it aside to reprocess everything") from None
    if not isinstance(done, dict) or not all(isinstance(v, dict) for v in done.values()):
        raise ValueError(f"{path}: watch state is corrupt (not an object of records); move it aside to reprocess "
                         "everything")
    return done


def check_drop(drop: Path) -> None:
    if drop.exists() and not drop.is_dir():
        raise ValueError(f"drop folder {drop} is a file: give the folder that new domain files are dropped into")
    if not drop.is_dir():
        raise FileNotFoundError(f"drop folder not found: {drop}")


def _name(stem: str) -> str:
    return re.sub(r"[^a-z0-9_-]+", "-", stem.lower()).strip("-") or "domain"


def pending(drop: Path, state: Path, model: str, min_prompts: int, use_unmatched: bool = True,
            work: Path | None = None) -> list[Item]:
    from knnssd.settings import work_dir

    check_drop(drop)
    done = load_state(state)
    out = []
    for f in sorted(p for p in drop.iterdir() if p.suffix.lower() in SUFFIXES and not p.name.startswith(".")):
        sha = _sha(f)
        if done.get(f.name, {}).get("sha256") == sha:
            continue
        try:
            n = len(prompts.load(f))
        except prompts.PromptError as e:
            log.warning("skipping %s", e)
            continue
        if n < min_prompts:
            log.info("%s: %d prompts, waiting for %d", f.name, n, min_prompts)
            continue
        out.append(Item("file", str(f), _name(f.stem), sha, n, [f.name]))
    if use_unmatched:
        logs = sorted((Path(work or work_dir()) / "unmatched" / model).glob("unmatched-*.parquet"))
        logs = [p for p in logs if f"unmatched/{p.name}" not in done]
        if logs:
            import pyarrow.parquet as pq

            rows = [r for p in logs for r in pq.read_table(p).to_pylist()]
            if len(rows) >= min_prompts:
                sha = hashlib.sha256("".join(p.name for p in logs).encode()).hexdigest()
                path = logs[0].parent / f"pending-{sha[:12]}.jsonl"
                seen, lines = set(), []
                for r in rows:
                    if r["id"] not in seen:
                        seen.add(r["id"])
                        lines.append(json.dumps({"id": r["id"], "prompt": r["prompt"]}))
                path.write_text("\n".join(lines) + "\n")
                out.append(Item("unmatched", str(path), f"unmatched-{sha[:6]}", sha, len(lines),
                                [f"unmatched/{p.name}" for p in logs]))
    return out


# The state's record of the newest version added and not yet through promotion (no drop-folder file
# is named with a leading dot, so the key is no file's): a watch killed before or during promotion
# promotes it on the next run, and new domains extend it rather than the champion.
UNPROMOTED = ".unpromoted"


def mark(state: Path, items: list[Item], result: dict) -> None:
    """Record ``items`` as added, in version ``result`` (``uri``, ``version``), which waits for promotion."""
    done = load_state(state)
    when = dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")
    for it in items:
        for key in it.sources:
            done[key] = {"sha256": it.sha256 if it.kind == "file" else None, "name": it.name, "at": when,
                         "result": result}
    waiting = done.get(UNPROMOTED, {}).get("inputs", [])
    done[UNPROMOTED] = {"uri": result["uri"], "version": result["version"],
                        "inputs": [*waiting, *(it.path for it in items)]}
    _write(state, done)


def unpromoted(state: Path) -> dict | None:
    """The version waiting for promotion (``uri``, ``version`` and the ``inputs`` of its new domains)."""
    return load_state(state).get(UNPROMOTED)


def promoted(state: Path) -> None:
    """Promotion has decided on the waiting version (moved the champion to it, or not)."""
    done = load_state(state)
    if done.pop(UNPROMOTED, None) is not None:
        _write(state, done)


def _write(state: Path, done: dict) -> None:
    state.parent.mkdir(parents=True, exist_ok=True)
    tmp = state.with_name(state.name + ".tmp")
    tmp.write_text(json.dumps(done, indent=2))
    tmp.replace(state)

