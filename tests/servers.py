"""Helpers for tests that start real servers (Prefect, MLflow, `knnssd serve`) on 127.0.0.1."""
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

import openai

from knnssd.processes import group_members
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


class KnnssdServer:
    """`knnssd serve` in a process group of its own, on a free port, answering /health; with ``key``, one that asks
    for it (given through $KNNSSD_API_KEY), which ``client``, ``post`` and ``info`` send."""

    def __init__(self, tracking_uri: str, tmp: Path, *args: str, model_uri: str = "models:/knnssd-smollm2@champion",
                 key: str | None = None):
        self.port, self.key = free_port(), key
        self.log_path = tmp / f"serve-{self.port}.log"
        self.log = open(self.log_path, "w")
        env = {**os.environ, "MLFLOW_TRACKING_URI": tracking_uri}
        env.pop("KNNSSD_API_KEY", None)
        if key is not None:
            env["KNNSSD_API_KEY"] = key
        self.proc = subprocess.Popen([sys.executable, "-m", "knnssd.cli", "serve", "--model-uri", model_uri,
                                      "--port", str(self.port), *args], env=env, stdout=self.log,
                                     stderr=subprocess.STDOUT, start_new_session=True)
        try:
            wait_http(f"{self.url}/health", 240, self.proc)
        except BaseException:
            self.stop()
            raise
        self.client = openai.OpenAI(base_url=f"{self.url}/v1", api_key=key or "none", max_retries=0, timeout=300)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def headers(self) -> dict:
        """What a request sends for the key (none without one)."""
        return {"Authorization": f"Bearer {self.key}"} if self.key else {}

    def post(self, path: str, body) -> tuple[int, dict, dict]:
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        req = urllib.request.Request(self.url + path, data, {"Content-Type": "application/json", **self.headers})
        try:
            with urllib.request.urlopen(req, timeout=300) as r:
                return r.status, json.loads(r.read()), dict(r.headers)
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read()), dict(e.headers)

    def info(self) -> dict:
        with urllib.request.urlopen(urllib.request.Request(f"{self.url}/v1/models", headers=self.headers),
                                    timeout=30) as r:
            return json.loads(r.read())["data"][0]

    def stop(self) -> int:
        """SIGTERM to the group; the exit status (the group must be gone within 60 s)."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            code = self.proc.wait(60)
        finally:
            if group_members(self.proc.pid):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.log.close()
        return code
