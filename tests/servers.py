"""Helpers for tests that start real servers (Prefect, MLflow) on 127.0.0.1."""
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from knnssd.reachable import free_port

PREFECT = str(Path(sys.executable).parent / "prefect")
ROOT = Path(__file__).resolve().parents[1]  # the checkout: prefect.yaml, flows/


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


class PrefectServer:
    """A real `prefect server` on 127.0.0.1 in a throwaway PREFECT_HOME: started at once, waited for
    only when first needed (its database migration then overlaps other work), stopped and removed
    by ``stop``."""

    def __init__(self):
        self.home = Path(tempfile.mkdtemp(prefix="pytest-prefect-home-"))
        self.port = free_port()
        env = {**os.environ, "PREFECT_HOME": str(self.home), "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
               "PREFECT_UI_ENABLED": "false"}
        env.pop("PREFECT_API_URL", None)
        self.log = open(self.home / "server.log", "w")
        self.proc = subprocess.Popen([PREFECT, "server", "start", "--host", "127.0.0.1", "--port", str(self.port)],
                                     env=env, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)
        self.ready = False

    def env(self) -> dict:
        """What points a subprocess at this server (``{**os.environ, **server.env()}``), once it answers."""
        if not self.ready:
            wait_http(f"http://127.0.0.1:{self.port}/api/health", 120, self.proc)
            self.ready = True
        return {"PREFECT_HOME": str(self.home), "PREFECT_API_URL": f"http://127.0.0.1:{self.port}/api"}

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            self.proc.wait(30)
        self.log.close()
        shutil.rmtree(self.home, ignore_errors=True)
