"""GGUF files and their conversion (``conversion.py``): one conversion per file's contents, the cache
tidied, and a missing model package said in one line."""
import json
from pathlib import Path

import pytest

from knnssd import conversion, models


def test_a_gguf_converts_once_wherever_it_is_installed(tmp_path, monkeypatch):
    """Two installs of one GGUF (two paths, other times) share one conversion. The next conversion removes
    path-keyed ones (knnssd before content keys) whose GGUF is gone or was written after them, and a killed
    conversion's temp folder. It keeps a path-keyed one of a GGUF unchanged since, one whose recorded path
    is relative, a temp folder whose conversion holds its lock, and every lock file."""
    import os
    import shutil

    from tiny import tiny_gguf

    monkeypatch.setenv("KNNSSD_CACHE", str(tmp_path / "cache"))
    for d in "abc":
        (tmp_path / d).mkdir()
    a = tiny_gguf(tmp_path / "a" / "tiny.gguf")
    b, c = (Path(shutil.copy(a, tmp_path / d / "tiny.gguf")) for d in "bc")
    os.utime(b, (1, 1))
    root = tmp_path / "cache" / "models"
    root.mkdir(parents=True)

    def path_keyed(key: str, gguf: Path | str) -> Path:
        (root / f"tiny-{key}").mkdir()
        (root / f"tiny-{key}" / conversion.CACHE_MARKER).write_text(json.dumps({"gguf": str(gguf), "size": 1}))
        (root / f"tiny-{key}.lock").touch()
        return root / f"tiny-{key}"

    gone, changed = path_keyed("000000000000", tmp_path / "gone.gguf"), path_keyed("111111111111", c)
    later = (changed / conversion.CACHE_MARKER).stat().st_mtime + 10
    os.utime(c, (later, later))  # reinstalled after its conversion
    kept, relative = path_keyed("444444444444", a), path_keyed("555555555555", "tiny.gguf")
    killed, busy = root / ".tiny-222222222222.k7x_q1z0", root / ".tiny-333333333333.a1b2c3d4"
    killed.mkdir()
    busy.mkdir()
    (root / "tiny-222222222222.lock").touch()  # a killed conversion leaves its lock file, not held
    with conversion._locked(root / "tiny-333333333333"):
        target = conversion.convert_gguf(a, "tiny")
    assert conversion.convert_gguf(b, "tiny") == target
    assert json.loads((target / conversion.CACHE_MARKER).read_text())["sha256"] == conversion._digest(b)
    left = {p.name for p in root.iterdir()}
    assert left == {target.name, kept.name, relative.name, busy.name} | {
        f"tiny-{k}.lock" for k in ("000000000000", "111111111111", "222222222222", "333333333333",
                                   "444444444444", "555555555555")} | {f"{target.name}.lock"}, left
    assert not gone.exists() and not changed.exists() and not killed.exists()


def test_missing_model_package_is_one_line(monkeypatch, tmp_path):
    monkeypatch.setenv("KNNSSD_CACHE", str(tmp_path))
    monkeypatch.setitem(conversion.EMBEDDED, "ghost", conversion.Embedded("no_such_package_xyz", "pip install ghost", "g.gguf"))
    with pytest.raises(models.ModelError, match="needs package no_such_package_xyz: pip install ghost"):
        models.load("ghost")
