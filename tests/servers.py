"""Helpers for tests that start real servers (Prefect, MLflow) on 127.0.0.1."""
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

PREFECT = str(Path(sys.executable).parent / "prefect")
ROOT = Path(__file__).resolve().parents[1]  # the checkout: prefect.yaml, flows/


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_http(url: str, timeout: float, proc: subprocess.Popen | None = None) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode} before answering {url}")
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(0.5)
    raise TimeoutError(url)
