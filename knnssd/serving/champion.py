"""A running server follows its alias: when ``models:/<name>@champion`` moves to another version of the
same base model, that version's bank is fetched and swapped into the batch (``Batcher.swap``) between
two steps. Requests in flight keep their drafters, new ones route with the new bank, and the model
is not reloaded. A version for another base model needs a restart: it is refused with one log line.
"""
from __future__ import annotations

import logging
import re
import threading

from knnssd import tracking
from knnssd.routing import bank as banks
from knnssd.serving.batcher import Batcher

log = logging.getLogger(__name__)


def follows_alias(model_uri: str) -> bool:
    return re.fullmatch(r"models:/[^/@]+@[\w-]+", model_uri) is not None


class ChampionWatch:
    def __init__(self, batcher: Batcher, model_uri: str, tracking_uri: str | None, every_s: float, on_swap=None):
        self.batcher, self.model_uri, self.tracking_uri, self.every_s = batcher, model_uri, tracking_uri, every_s
        self.on_swap = on_swap  # told the new version (metrics)
        self.refused: set[str] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="knnssd-champion", daemon=True)

    def start(self) -> "ChampionWatch":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)

    def _run(self) -> None:
        said = None  # the last failure logged: the same one again, every --reload-s, is not (trial 6)
        while not self._stop.wait(self.every_s):
            try:
                self.poll()
                said = None
            except Exception as e:  # noqa: BLE001 - a registry that does not answer now may answer next time
                why = str(e).splitlines()[0] if str(e) else type(e).__name__
                if why != said:
                    log.warning("could not check %s: %s (said once until it changes)", self.model_uri, why)
                said = why

    def poll(self) -> str | None:
        """Swap in the version the alias names, where it is new and fits the model; returns it, else None."""
        mv = tracking.resolve(self.model_uri, self.tracking_uri)
        version = str(mv.version)
        if version == self.batcher.version or version in self.refused:  # the version set by the last swap
            return None
        bank = banks.load(tracking.download_bank(f"models:/{mv.name}/{version}", uri=self.tracking_uri))
        lm = self.batcher.gen.lm
        try:
            bank.check_model(lm.fingerprint, lm.decoder.n_layers)
        except banks.BankError as e:
            self.refused.add(version)
            log.warning("%s moved to version %s, which this server cannot swap in (%s); restart the server to serve it",
                        self.model_uri, version, e)
            return None
        self.batcher.swap(bank, version)
        log.info("%s moved to version %s: new requests route with it", self.model_uri, version)
        if self.on_swap is not None:
            self.on_swap(version)
        return version
