"""``ServeConfig``: what ``knnssd serve`` was asked for, checked once by the command and passed whole to the
server (``openai_server.run``), its app (``create_app``) and the completions it answers."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from knnssd.serving.access import Keys
from knnssd.serving.quota import Caps


@dataclass(frozen=True)
class ServeConfig:
    model_uri: str  # models:/<name>@<alias> (followed live), models:/<name>/<version>, or a bank folder
    host: str = "127.0.0.1"
    port: int = 8000
    tracking_uri: str | None = None
    request_timeout_s: float = 600.0  # from arrival, queue included: past it a request is cancelled (504)
    reload_s: float = 30.0  # between checks of the alias for a new version (0: never)
    grace_s: float = 30.0  # on SIGTERM, for requests in flight
    keys: Keys = field(default_factory=Keys)  # asked for on /v1/* (none: open)
    metrics_open: bool = False  # /metrics without the key from beyond loopback
    head_timeout_s: float = 10.0  # for a request's line and headers (``connections.with_head_deadline``)
    max_connections: int = 1024  # open connections; past them uvicorn answers 503
    caps: Caps = field(default_factory=Caps)  # each key's (``quota``)

    @property
    def served(self) -> str:
        """The model id clients name: the registered model's name, or the bank folder's."""
        if self.model_uri.startswith("models:/"):
            return self.model_uri[len("models:/"):].split("@")[0].split("/")[0]
        return Path(self.model_uri).resolve().name
