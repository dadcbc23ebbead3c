"""Default paths and settings (``settings.py``)."""
from pathlib import Path


def test_empty_settings_variables_mean_their_defaults(monkeypatch, tmp_path):
    """The trial after issue 40: ``KNNSSD_WORK=`` made the current folder the work folder."""
    from knnssd import settings

    monkeypatch.chdir(tmp_path)
    for name in ("KNNSSD_WORK", "KNNSSD_CACHE"):
        monkeypatch.setenv(name, "")
    assert settings.work_dir() == tmp_path / "artifacts" and settings.cache_dir() == Path.home() / ".cache" / "knnssd"
