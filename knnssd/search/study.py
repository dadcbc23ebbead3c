"""Optuna studies of a search: storage, creation, finished trials, and the one encoding of a mask as
trial parameters."""
from __future__ import annotations

import json
import uuid
import warnings
from collections.abc import Callable
from pathlib import Path

from knnssd.engine.model.skip import SkipMask


def trial_params(mask: SkipMask, int8: bool) -> dict:
    """A draft's mask and precision as stage-1 trial parameters: ``int8``, ``a{i}`` and ``m{i}`` (skip layer i's
    attention / MLP). The one encoding of a mask in a study; ``trial_mask`` reads it back."""
    return {"int8": bool(int8), **{f"a{i}": bool(b) for i, b in enumerate(mask.attn)},
            **{f"m{i}": bool(b) for i, b in enumerate(mask.mlp)}}


def search_space(n_layers: int, precisions: list[bool]) -> dict[str, list]:
    """Each stage-1 parameter's choices (the names of ``trial_params``)."""
    return {"int8": precisions, **{f"a{i}": [False, True] for i in range(n_layers)},
            **{f"m{i}": [False, True] for i in range(n_layers)}}


def trial_mask(params: dict, n_layers: int) -> SkipMask:
    return SkipMask(tuple(params[f"a{i}"] for i in range(n_layers)), tuple(params[f"m{i}"] for i in range(n_layers)))


def open_study(storage, name: str, direction: str = "maximize", seed: int = 0):
    import optuna

    with warnings.catch_warnings():  # multivariate TPE is "experimental"; its per-trial notices are noise here
        warnings.simplefilter("ignore")
        sampler = optuna.samplers.TPESampler(seed=seed, n_startup_trials=8, multivariate=True,
                                             warn_independent_sampling=False)
    return optuna.create_study(storage=storage, study_name=name, direction=direction, sampler=sampler,
                               pruner=optuna.pruners.MedianPruner(n_startup_trials=2, n_warmup_steps=1),
                               load_if_exists=True)


def storage_for(url_or_path: str):
    """An Optuna storage: a journal file path (default) or any storage URL (sqlite:///, postgresql://, ...)."""
    import optuna

    if "://" in url_or_path:
        return url_or_path
    from optuna.storages.journal import JournalFileBackend, JournalFileOpenLock

    Path(url_or_path).parent.mkdir(parents=True, exist_ok=True)
    return optuna.storages.JournalStorage(JournalFileBackend(url_or_path, lock_obj=JournalFileOpenLock(url_or_path)))


def check_storage(url_or_path: str | None, timeout_s: int = 5) -> None:
    """A one-line ``ValueError``, in seconds, for a storage ``storage_for`` could not open: a journal path
    that is a folder, a journal or sqlite file in a folder that does not exist (a typo would otherwise
    make folders), a URL with no SQLAlchemy dialect or driver here, a database server that does not
    answer. (Each failed in the first search task, with a traceback of 133 lines.)"""
    if url_or_path is None:
        return
    if "://" not in url_or_path:
        path = Path(url_or_path)
        if path.is_dir():
            raise ValueError(f"--storage {path} is a folder; give a journal file path")
        if not path.parent.is_dir():  # as for a sqlite URL: a mistyped folder is an error, not new folders
            raise ValueError(f"--storage {path}: the folder {path.parent} does not exist; make it first, or give "
                             "a path in a folder that exists")
        if path.is_file() and path.stat().st_size:  # Optuna appends to any file: a prompt file was written to
            try:
                with path.open("rb") as f:
                    first = json.loads(f.readline())
            except (OSError, ValueError):
                first = None
            if not isinstance(first, dict) or "op_code" not in first:
                raise ValueError(f"--storage {path} is not an Optuna journal: give a new file's path, or a journal")
        return
    from knnssd.reachable import database_error

    reason = database_error(url_or_path, timeout_s)
    if reason is not None:
        raise ValueError(f"--storage {url_or_path} cannot be opened ({reason})")


def is_new(url_or_path: str) -> bool:
    """Does ``storage`` name a journal or sqlite file that does not exist yet (its studies will be made)?
    A server database's URL is taken as existing."""
    if url_or_path.startswith("sqlite:///"):
        name = url_or_path.removeprefix("sqlite:///").split("?")[0]
        return name != ":memory:" and not Path(name).exists()
    return "://" not in url_or_path and not Path(url_or_path).exists()


SETTINGS = "settings"  # the trial user attribute that holds a study's settings (``first_settings``)


def first_settings(study, measure: Callable[[], dict], params: dict) -> tuple[dict, bool]:
    """The settings every worker of ``study`` searches with (step costs, precisions): those on its
    lowest-numbered trial that carries them. Where no trial does, ``measure()`` is stored on a new waiting
    trial of ``params`` (valid whatever the settings). Workers that start together each measure and
    store, but a storage numbers trials in one order for all, so all take the first's: study attributes,
    where the last writer wins, once gave two workers two search spaces, and one failed on the other's
    enqueued trials. Returns (the settings, whether this call stored them)."""

    def first() -> dict | None:
        for t in sorted(study.get_trials(deepcopy=False), key=lambda t: t.number):
            if SETTINGS in t.user_attrs:
                return t.user_attrs[SETTINGS]
        return None

    found = first()
    if found is not None:
        return found, False
    token = uuid.uuid4().hex
    study.enqueue_trial(params, user_attrs={SETTINGS: {**measure(), "token": token}})
    found = first()
    return found, found.get("token") == token


def finished(study) -> list:
    import optuna

    return [t for t in study.trials if t.state in (optuna.trial.TrialState.COMPLETE, optuna.trial.TrialState.PRUNED)]
