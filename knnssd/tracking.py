"""MLflow: calibration runs, the registered model ``knnssd-<model>`` and its aliases.

Each calibration is one run (params, metrics, the bank folder as a pyfunc model) and one new
version of the registered model; the new version gets alias ``candidate``, and ``champion``
too when the model has none yet. Tracking URI: ``$MLFLOW_TRACKING_URI``, else
``sqlite:///<cwd>/artifacts/mlflow.db`` (an ``http://`` server URL works the same).
"""
from __future__ import annotations

import hashlib
import os
import re
import shutil
import warnings
from dataclasses import dataclass
from pathlib import Path

from knnssd import __version__, reachable
from knnssd.console import stderr_to_log
from knnssd.settings import default_tracking_uri, tracking_uri, work_dir

# The pyfunc model is logged from its code file (MLflow "models from code"): a path, not an import.
MODEL_CODE = Path(__file__).with_name("serving") / "pyfunc_model.py"

EXPERIMENT = "knnssd-calibration"
CONNECT_TIMEOUT_S = 5
_reachable: set[tuple[str, bool]] = set()


class RegistryError(ValueError):
    """Unknown model URI, alias or version; one line."""


def slug(model: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", Path(model).name.lower()).strip("-") or "model"


def check_alias(alias: str) -> None:
    """A one-line ``RegistryError`` for an alias MLflow refuses (its rules: word characters and dashes, at
    most 255, neither ``latest`` nor ``v<N>``). MLflow said so only at registration, after the whole
    calibration, and the retried task had left a version without an alias each time."""
    if not isinstance(alias, str) or not re.fullmatch(r"[\w-]{1,255}", alias):
        raise RegistryError(f"alias {alias!r} is not one MLflow takes: 1 to 255 letters, digits, '_' or '-'")
    if alias.lower() == "latest" or re.fullmatch(r"[vV]\d+", alias):
        raise RegistryError(f"alias {alias!r} is reserved by MLflow (latest, v<N>)")


def metric_tag(label: str, most: int = 64) -> str:
    """A cluster label as part of a metric name: its slug, shortened with a hash of the label past ``most``
    characters (MLflow refuses metric names over 250: a 300-character domain failed after its search)."""
    tag = slug(label)
    if len(tag) <= most:
        return tag
    return f"{tag[:most - 9].rstrip('-')}-{hashlib.sha1(label.encode('utf-8', 'surrogatepass')).hexdigest()[:8]}"


def registered_name(model: str) -> str:
    return f"knnssd-{slug(model)}"


# What MLflow 3 takes as a tracking store: a server, or a database its SQLAlchemy store opens.
SCHEMES = ("http", "https", "sqlite", "postgresql", "mysql", "mssql", "databricks", "databricks-uc", "file")


def check_reachable(uri: str, registered: bool = False) -> None:
    """Raise a one-line ``RegistryError`` within seconds when the tracking store cannot be used: a
    scheme MLflow does not take, a server that does not answer, or a database file that cannot be
    written, is damaged, or lies in a folder that does not exist (a mistyped path is not made into a
    new database; only the default one, under the work folder, is created). With ``registered`` (a
    command that reads a registered version), a sqlite file that does not exist is an error too: a
    new database would hold no version, and be left behind. MLflow itself retries for minutes, or
    fails with a long traceback. Checked once per process and URI (a check with ``registered`` covers one
    without: ``generate`` checks before its bank is fetched, and its MLflow run is logged to the same store)."""
    if (uri, registered) in _reachable or (uri, True) in _reachable:
        return
    use = "use sqlite:///<path>/mlflow.db or http(s)://<server>"
    if not uri.strip():
        raise RegistryError(f"the tracking URI is empty ({use}, or leave the option out for the default)")
    scheme = uri.partition(":")[0].partition("+")[0].lower() if re.match(r"^[A-Za-z][\w+.-]+:", uri) else ""
    if scheme and scheme not in SCHEMES:
        raise RegistryError(f"tracking URI '{uri}': MLflow does not take '{scheme}:' ({use})")
    if scheme in ("file", "") and os.environ.get("MLFLOW_ALLOW_FILE_STORE", "").lower() not in ("true", "1"):
        # MLflow 3 refuses its file store only when a run or the registry is first used, after the model loads
        raise RegistryError(f"tracking URI '{uri}' is a file store, which MLflow 3 no longer opens ({use}; "
                            "`mlflow migrate-filestore` moves an old one)")
    if scheme == "sqlite" and uri.partition(":")[2].lstrip("/") in ("", ":memory:"):
        raise RegistryError(f"tracking URI '{uri}' is an in-memory database, which keeps nothing past this command "
                            f"({use})")
    if scheme in ("http", "https"):
        reason = reachable.error(uri.rstrip("/") + "/health", CONNECT_TIMEOUT_S)
        if reason is not None:
            raise RegistryError(f"tracking server {uri} does not answer within {CONNECT_TIMEOUT_S} s ({reason})")
    elif scheme in ("postgresql", "mysql", "mssql"):  # without its driver, MLflow failed with a 65-line traceback
        reason = reachable.database_error(uri, CONNECT_TIMEOUT_S)
        if reason is not None:
            raise RegistryError(f"tracking database {uri} cannot be opened ({reason})")
    elif uri.startswith("sqlite:///"):
        path = Path(uri[len("sqlite:///"):])
        if registered and path.parent.is_dir() and not path.exists():
            raise RegistryError(f"tracking database {path} does not exist, so nothing is registered there (check "
                                "the path, or run calibrate or demo first)")
        _check_sqlite(path, create=path.resolve() == Path(default_tracking_uri()[len("sqlite:///"):]).resolve())
    _reachable.add((uri, registered))


def _check_sqlite(path: Path, create: bool) -> None:
    import sqlite3

    if not path.parent.is_dir():
        if not create:
            raise RegistryError(f"tracking database {path}: folder {path.parent} does not exist (check the path, "
                                "or create the folder)")
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise RegistryError(f"tracking database {path} cannot be written ({e.strerror or e})") from None
    try:
        with open(path, "ab"):
            pass
    except OSError as e:
        raise RegistryError(f"tracking database {path} cannot be written ({e.strerror or e})") from None
    if path.stat().st_size == 0:
        return  # new: MLflow creates its tables
    try:
        con = sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=CONNECT_TIMEOUT_S)
        try:
            verdict = con.execute("PRAGMA quick_check(1)").fetchone()[0]
        finally:
            con.close()
    except sqlite3.OperationalError as e:
        if "locked" in str(e):  # another writer held it for seconds: busy, not damaged
            return
        verdict = str(e)
    except sqlite3.DatabaseError as e:
        verdict = str(e)
    if verdict != "ok":
        first = next((line for line in verdict.splitlines() if line.strip() and not line.startswith("***")), verdict)
        raise RegistryError(f"tracking database {path} is damaged ({first.strip()}); restore it from a backup, or "
                            "choose another --tracking-uri")


def setup(uri: str | None = None, experiment: str = EXPERIMENT) -> str:
    import mlflow

    uri = tracking_uri(uri)
    check_reachable(uri)
    mlflow.set_tracking_uri(uri)
    if mlflow.get_experiment_by_name(experiment) is None:
        location = None
        if uri.startswith("sqlite:///"):  # keep artifacts next to the database, not in ./mlruns
            location = (Path(uri[len("sqlite:///"):]).parent / "mlartifacts").resolve().as_uri()
        try:
            mlflow.create_experiment(experiment, artifact_location=location)
        except Exception:  # noqa: BLE001 - created concurrently by another process
            pass
    mlflow.set_experiment(experiment)
    return uri


@dataclass
class Registered:
    name: str
    version: str
    run_id: str
    aliases: list[str]

    @property
    def uri(self) -> str:
        return f"models:/{self.name}/{self.version}"


def register_bank(bank_dir: Path, model: str, params: dict, metrics: dict, uri: str | None = None,
                  run_name: str | None = None, alias: str = "candidate") -> Registered:
    """Log one calibration run with the bank as a pyfunc model and register a new version, aliased
    ``alias`` (and ``champion`` when the model has none and ``alias`` is ``candidate``)."""
    import mlflow
    from mlflow import MlflowClient

    check_alias(alias)
    setup(uri)
    name = registered_name(model)
    with mlflow.start_run(run_name=run_name) as run, stderr_to_log("mlflow"):
        mlflow.log_params({k: str(v)[:500] for k, v in params.items()})
        mlflow.log_metrics({k: float(v) for k, v in metrics.items()})
        for pic in sorted(Path(bank_dir).glob("*.png")):
            mlflow.log_artifact(str(pic), "pictures")
        mlflow.log_artifact(str(Path(bank_dir) / "bank.json"), "bank")
        with warnings.catch_warnings():  # the signature is given, so MLflow's advice to pass an example is noise
            warnings.filterwarnings("ignore", message=".*An input example was not provided")
            info = mlflow.pyfunc.log_model(name="knnssd", python_model=str(MODEL_CODE),
                                           artifacts={"bank": str(bank_dir)}, pip_requirements=[f"knnssd=={__version__}"],
                                           registered_model_name=name, signature=signature(), await_registration_for=60)
        version = str(info.registered_model_version)
    client = MlflowClient()
    client.update_model_version(name, version, description=describe(bank_dir, run.info.run_id))
    aliases = [alias]
    client.set_registered_model_alias(name, alias, version)
    if alias == "candidate":
        try:
            client.get_model_version_by_alias(name, "champion")
        except Exception:  # noqa: BLE001 - no champion yet
            client.set_registered_model_alias(name, "champion", version)
            aliases.append("champion")
    return Registered(name, version, run.info.run_id, aliases)


def describe(bank_dir: Path, run_id: str) -> str:
    """A version's description in the MLflow UI (markdown): the skip heatmap and one row per cluster."""
    from knnssd.routing import bank as banks

    b = banks.load(bank_dir)
    lines = [f"**{b.model}**, {b.dtype}, {b.n_layers} layers: {len(b.clusters)} clusters over {len(b.anchors)} anchors.",
             "", f"![skip heatmap: dark = skipped while drafting](/get-artifact?path=pictures%2Fskip_heatmap.png&run_uuid={run_id})",
             "", "| cluster | domain | drafter | skipped sub-layers | speedup (calib) |", "|---|---|---|---|---|"]
    for c in b.clusters:
        skipped = "–"
        if c.mask is not None:
            d = c.mask.to_dict()
            skipped = f"{c.mask.n_skipped}/{2 * c.mask.n_layers}: attn {d['skip_attn']}, mlp {d['skip_mlp']}"
        lines.append(f"| {c.id} | {c.label} | {c.drafter.describe()} | {skipped} | {c.speedup:.2f} |")
    return "\n".join(lines)


def signature():
    """Input: a ``prompt`` column; params: the generation parameters (seed -1 = random)."""
    import pandas as pd
    from mlflow.models import infer_signature

    from knnssd.engine.spec.request_params import GenerateParams

    from mlflow.types import ColSpec, Schema

    # stop strings are the OpenAI server's (an MLflow param cannot default to an empty list)
    defaults = {k: (-1 if v is None else v) for k, v in GenerateParams().__dict__.items() if k != "stop"}
    sig = infer_signature(pd.DataFrame({"prompt": ["Question: 2 + 2 = ?"]}), params=defaults)
    # optional, so that a request with no records or a misnamed field reaches predict's one-line reason
    sig.inputs = Schema([ColSpec("string", "prompt", required=False)])
    return sig


def resolve(model_uri: str, uri: str | None = None):
    """The ModelVersion behind ``models:/name@alias`` or ``models:/name/version``."""
    from mlflow import MlflowClient

    setup(uri)
    m = re.fullmatch(r"models:/([^/@]+)(?:@([\w-]+)|/(\d+))", model_uri)
    if not m:
        raise RegistryError(f"not a model URI: '{model_uri}' (use models:/<name>@<alias> or models:/<name>/<version>)")
    name, alias, version = m.groups()
    client = MlflowClient()
    try:
        return client.get_model_version_by_alias(name, alias) if alias else client.get_model_version(name, version)
    except Exception as e:  # noqa: BLE001
        what = f"alias '{alias}'" if alias else f"version {version}"
        raise RegistryError(f"{model_uri}: no {what} of registered model '{name}' at {tracking_uri(uri)}"
                            f" ({type(e).__name__})") from None


def bank_folder(model_uri: str, uri: str | None = None) -> Path:
    """The bank behind ``model_uri``: a bank folder as is, or a registered version fetched (``download_bank``)."""
    if Path(model_uri).is_dir():
        return Path(model_uri)
    if not model_uri.startswith("models:/"):
        raise RegistryError(f"'{model_uri}' is neither models:/<name>@<alias> (or /<version>) nor a bank folder")
    return download_bank(model_uri, uri=uri)


def download_bank(model_uri: str, dest: Path | None = None, uri: str | None = None) -> Path:
    """Fetch the bank folder of a registered version; returns the folder holding bank.json.

    By default into ``<work>/banks/<name>-v<version>-<store>`` (``<store>``: a hash of the tracking
    store and the version's run), reused when already there: a version's files never change. It is
    fetched into a hidden sibling first and renamed into place, so a killed download leaves no half
    folder in use and nothing in /tmp (the next call removes it). An explicit ``dest`` is fetched into.
    """
    import mlflow

    mv = resolve(model_uri, uri)
    artifact = f"models:/{mv.name}/{mv.version}"
    if dest is not None:
        mlflow.artifacts.download_artifacts(artifact_uri=artifact, dst_path=str(dest))
        return _bank_in(Path(dest), model_uri, mv.version)
    store = hashlib.sha1(f"{mlflow.get_tracking_uri()}|{mv.run_id}|{mv.source}".encode()).hexdigest()[:10]
    dest = work_dir() / "banks" / f"{mv.name}-v{mv.version}-{store}"
    cached = next(dest.rglob("bank.json"), None) if dest.is_dir() else None
    if cached is not None:
        return cached.parent
    dest.parent.mkdir(parents=True, exist_ok=True)
    for stale in dest.parent.glob(f".{dest.name}.*.part"):
        if not _alive(stale.suffixes[-2].lstrip(".")):
            shutil.rmtree(stale, ignore_errors=True)
    part = dest.with_name(f".{dest.name}.{os.getpid()}.part")
    try:
        mlflow.artifacts.download_artifacts(artifact_uri=artifact, dst_path=str(part))
        _bank_in(part, model_uri, mv.version)
        shutil.rmtree(dest, ignore_errors=True)  # a folder without bank.json (an interrupted copy by hand)
        try:
            part.rename(dest)
        except OSError:  # another process renamed its copy into place first
            pass
    finally:
        shutil.rmtree(part, ignore_errors=True)
    return _bank_in(dest, model_uri, mv.version)


def _bank_in(folder: Path, model_uri: str, version) -> Path:
    found = next(folder.rglob("bank.json"), None)
    if found is None:
        raise RegistryError(f"{model_uri} (version {version}) holds no bank.json")
    return found.parent


def _alive(pid: str) -> bool:
    try:
        os.kill(int(pid), 0)
    except (ValueError, ProcessLookupError):
        return False
    except PermissionError:
        return True
    return True


def set_alias(model: str, alias: str, version: str, uri: str | None = None) -> None:
    from mlflow import MlflowClient

    setup(uri)
    MlflowClient().set_registered_model_alias(registered_name(model), alias, version)


def versions(model: str, uri: str | None = None) -> list:
    from mlflow import MlflowClient

    setup(uri)
    try:
        return list(MlflowClient().search_model_versions(f"name='{registered_name(model)}'"))
    except Exception:  # noqa: BLE001
        return []


def log_run(experiment: str, params: dict, metrics: dict, artifacts: list[str] = (), uri: str | None = None,
            run_name: str | None = None) -> str:
    """One MLflow run with params, metrics and files; returns the run id."""
    import mlflow

    setup(uri, experiment)
    with mlflow.start_run(run_name=run_name) as run:
        mlflow.log_params({k: str(v)[:500] for k, v in params.items()})
        mlflow.log_metrics({k: float(v) for k, v in metrics.items()})
        for path in artifacts:
            if path and Path(path).exists():
                mlflow.log_artifact(str(path))
    return run.info.run_id
