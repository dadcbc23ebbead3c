"""Every default path and URI knnssd uses, in one place (each can be set by an environment variable).

    work_dir()      $KNNSSD_WORK, else ./artifacts: banks, logs, studies, prefill vectors, the
                    default tracking database
    cache_dir()     $KNNSSD_CACHE, else ~/.cache/knnssd: converted models and what the
                    exactness probe measured on this machine (shared by every work folder)
    tracking_uri()  $MLFLOW_TRACKING_URI, else sqlite:///<work_dir>/mlflow.db (``default_tracking_uri``)
"""
from __future__ import annotations

import os
from pathlib import Path


def work_dir() -> Path:
    return Path(os.environ.get("KNNSSD_WORK", Path.cwd() / "artifacts"))


def cache_dir() -> Path:
    return Path(os.environ.get("KNNSSD_CACHE", Path.home() / ".cache" / "knnssd"))


def default_tracking_uri() -> str:
    return f"sqlite:///{work_dir() / 'mlflow.db'}"


def tracking_uri() -> str:
    return os.environ.get("MLFLOW_TRACKING_URI") or default_tracking_uri()

