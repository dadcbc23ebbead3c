"""Prompt sets: jsonl, parquet or csv files with a prompt field and optional domain, id and split.

Every problem is a ``PromptError`` with a one-line message naming the file (and row where it
helps): missing file, empty file, missing field, non-UTF-8 bytes, duplicate ids.
"""
from __future__ import annotations

import hashlib
import json
import numbers
import os
from dataclasses import dataclass
from pathlib import Path

DOMAINS = ("summarization", "reasoning", "translation", "storytelling", "text_to_sql")
OOD = ("ood_xsum", "ood_math", "ood_alpaca")


class PromptError(ValueError):
    """A prompt file cannot be used; the message is one line."""


@dataclass(frozen=True)
class Prompt:
    id: str
    prompt: str
    domain: str | None = None
    split: str | None = None


@dataclass(frozen=True)
class Fields:
    """Column names in the input file."""

    prompt: str = "prompt"
    id: str = "id"
    domain: str = "domain"
    split: str = "split"


def _rows(path: Path) -> list[dict]:
    suffix = path.suffix.lower()
    try:
        if suffix == ".json":  # one JSON document (a list of rows, or one row), else JSON lines
            text = path.read_text(encoding="utf-8-sig")  # a byte-order mark, as some editors write, is no text
            try:
                doc = json.loads(text)
            except json.JSONDecodeError:
                doc = None
            if isinstance(doc, (list, dict)):
                return doc if isinstance(doc, list) else [doc]
        if suffix in (".jsonl", ".json"):
            rows = []
            with open(path, encoding="utf-8-sig") as fh:
                for n, line in enumerate(fh, 1):
                    if line.strip():
                        try:
                            rows.append(json.loads(line))
                        except json.JSONDecodeError as e:
                            raise PromptError(f"{path}: line {n} is not JSON ({e.msg})") from None
            return rows
        if suffix in (".parquet", ".pq"):
            import pyarrow.parquet as pq

            return pq.read_table(path).to_pylist()
        if suffix == ".csv":
            import csv

            with open(path, encoding="utf-8-sig", newline="") as fh:
                reader = csv.DictReader(fh, strict=True)  # an unterminated quote is an error, not one long row
                names = reader.fieldnames or []
                twice = sorted({n for n in names if names.count(n) > 1})
                if twice:  # DictReader would keep one of them, silently
                    raise PromptError(f"{path}: column {twice[0]!r} appears more than once in the header")
                return list(reader)
    except UnicodeDecodeError as e:
        raise PromptError(f"{path}: not UTF-8 text (byte {e.start}: {e.reason})") from None
    except PromptError:
        raise
    except Exception as e:  # noqa: BLE001 - pyarrow/csv errors become one line
        raise PromptError(f"{path}: cannot read ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})") from None
    raise PromptError(f"{path}: unknown format '{suffix}' (use .jsonl, .parquet or .csv)")


def _hf_rows(spec: str) -> list[dict]:
    """``hf:<dataset>[:<config>][@<hf split>]`` through the ``datasets`` package (needs the network
    or a local HF datasets cache; ``HF_HUB_OFFLINE=1`` allows only the cache)."""
    name, _, hf_split = spec[3:].partition("@")
    name, _, config = name.partition(":")
    try:
        import datasets
    except ImportError:
        raise PromptError(f"{spec}: reading HF datasets needs `pip install datasets`") from None
    try:
        ds = datasets.load_dataset(name, config or None, split=hf_split or "train")
    except Exception as e:  # noqa: BLE001 - network, unknown name, offline: one line
        raise PromptError(f"{spec}: cannot load ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})") from None
    return [dict(r) for r in ds]


def load(path: str | os.PathLike, split: str | None = None, fields: Fields = Fields(),
         domain: str | None = None) -> list[Prompt]:
    """Read prompts; keep only the rows of ``split`` (``of_split``) when given; ``domain`` fills rows that have none."""
    if str(path).startswith("hf:"):
        rows, path = _hf_rows(str(path)), Path(str(path)[3:].replace("/", "_").replace(":", "_"))
    else:
        path = Path(path)
        if path.is_dir():
            raise PromptError(f"{path} is a folder, not a prompt file")
        if path.exists() and not path.is_file():
            raise PromptError(f"{path} is not a regular file (a device or a pipe), not a prompt file")
        if not path.is_file():
            raise PromptError(f"prompt file not found: {path}")
        rows = _rows(path)
    if not rows:
        raise PromptError(f"{path}: no rows")
    out: list[Prompt] = []
    seen: dict[str, int] = {}
    repeats: dict[str, int] = {}
    for n, row in enumerate(rows, 1):
        if not isinstance(row, dict):
            raise PromptError(f"{path}: row {n} is not an object with a '{fields.prompt}' field (one JSON object a "
                              "line in .jsonl)")
        if fields.prompt not in row:
            raise PromptError(f"{path}: row {n} has no '{fields.prompt}' field")
        text = row[fields.prompt]
        if not isinstance(text, str):
            raise PromptError(f"{path}: row {n} field '{fields.prompt}' is not text")
        pid = row.get(fields.id)
        if isinstance(pid, float) and pid != pid:  # NaN: a csv's or parquet's missing id
            pid = None
        # str() made Python's text of the others ("{'x': 1}", "True", "b'x'"); numpy's bool_ is no Number
        if pid is not None and (isinstance(pid, bool) or not isinstance(pid, (str, numbers.Number))):
            kind = {"dict": "an object", "list": "an array", "bool": "a boolean", "bool_": "a boolean"}.get(
                type(pid).__name__, type(pid).__name__)
            raise PromptError(f"{path}: row {n} field '{fields.id}' must be a string or a number, got {kind}")
        pid = str(pid) if pid not in (None, "") else auto_id(path.stem, text, repeats)
        if pid in seen:
            raise PromptError(f"{path}: duplicate id '{pid}' (rows {seen[pid]} and {n})")
        seen[pid] = n
        out.append(Prompt(pid, text, row.get(fields.domain) or domain, row.get(fields.split)))
    chosen = of_split(out, split)
    if not chosen:
        raise PromptError(f"{path}: no rows with split '{split}'" + (
            "" if any(r.split for r in out) else f" (it has no split field: of its {len(out)} rows the first two "
            "thirds calibrate and the rest evaluate)"))
    return chosen


def of_split(rows: list[Prompt], split: str | None) -> list[Prompt]:
    """The rows of ``split`` (all of them for ``None``): by their ``split`` field where any row has one,
    else by position, the first two thirds calibrating and the rest evaluating, so that a file of plain
    prompts serves calibration and evaluation alike."""
    if split is None:
        return rows
    if any(r.split for r in rows):
        return [r for r in rows if r.split == split]
    cut = max(1, (2 * len(rows)) // 3)
    return {"calib": rows[:cut], "eval": rows[cut:]}.get(split, [])


def auto_id(stem: str, text: str, repeats: dict[str, int]) -> str:
    """The id of a row that has none: ``<file stem>-<hash of its prompt>`` (``-2``, ``-3``, ... for the
    same prompt again). Derived from the content, not the row's position, so a prompt put in front of
    the others leaves their ids, and a resumed output's rows, standing for the same prompts."""
    base = f"{stem}-{hashlib.sha256(text.encode('utf-8', 'surrogatepass')).hexdigest()[:12]}"
    repeats[base] = repeats.get(base, 0) + 1
    return base if repeats[base] == 1 else f"{base}-{repeats[base]}"


def default_data_dir() -> Path:
    """``$KNNSSD_DATA``, else ``../shared/data`` beside the checkout, else the bundled samples."""
    env = os.environ.get("KNNSSD_DATA")
    if env:
        return Path(env)
    shared = Path(__file__).resolve().parents[2] / "shared" / "data"
    return shared if shared.is_dir() else samples_dir()


def domain_files() -> list[str]:
    """The five domains' files of the data folder: what calibration and promotion use when given none.
    Where the folder is the bundled samples (no ``../shared/data``), the domains they hold: they lack
    summarization, which a run without ``--input`` then asked for and failed on."""
    data = default_data_dir()
    if data.resolve() == samples_dir().resolve():
        return sorted(str(p) for p in data.glob("*.jsonl"))
    return [str(data / f"{d}.jsonl") for d in DOMAINS]


def samples_dir() -> Path:
    return Path(__file__).resolve().parent / "samples"


def load_domains(data: Path, domains: tuple[str, ...], split: str | None, per_domain: int | None) -> list[Prompt]:
    """The first ``per_domain`` rows of ``split`` from ``<data>/<domain>.jsonl`` for each domain."""
    out: list[Prompt] = []
    for d in domains:
        rows = load(Path(data) / f"{d}.jsonl", split=split, domain=d)
        out.extend(rows[:per_domain] if per_domain else rows)
    return out
