"""Where knnssd keeps its files: ``$KNNSSD_WORK``, else ``./artifacts``."""
from __future__ import annotations

import os
from pathlib import Path


def work_dir() -> Path:
    return Path(os.environ.get("KNNSSD_WORK", Path.cwd() / "artifacts"))
