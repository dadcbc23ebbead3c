"""The MLflow store (``tracking.py``): stores that cannot work fail in seconds and in one line, and
metric names and aliases follow MLflow's rules."""
import os

import pytest

from knnssd import tracking
from cli_cases import Stopwatch


def test_unreachable_or_unwritable_tracking_fails_in_seconds(tmp_path):
    watch = Stopwatch()
    with pytest.raises(tracking.RegistryError, match="does not answer"):
        tracking.check_reachable("http://127.0.0.1:9")
    assert watch.seconds() < 15
    with pytest.raises(tracking.RegistryError, match="cannot be written"):
        tracking.check_reachable("sqlite:////proc/x.db")
    (tmp_path / "ok").mkdir()
    tracking.check_reachable(f"sqlite:///{tmp_path / 'ok' / 'mlflow.db'}")


def test_tracking_uris_that_cannot_work_are_one_line_errors(tmp_path, monkeypatch):
    """Issue 40, defects 8, 11 and 14: an unsupported scheme (ftp:// gave a traceback), a damaged
    database (truncated, or pages overwritten: an 86-line traceback), and a mistyped sqlite path (its
    folders and a 954 kB database were created) are each one line; only the default database's folder
    is created."""
    import sqlite3

    with pytest.raises(tracking.RegistryError, match="MLflow does not take 'ftp:'"):
        tracking.check_reachable("ftp://example.org/mlflow")
    for uri in ("postgresql://u:p@127.0.0.1:1/db", "mysql://u:p@127.0.0.1:1/db"):  # no driver here, or no server
        with pytest.raises(tracking.RegistryError, match="cannot be opened"):
            tracking.check_reachable(uri)
    missing = tmp_path / "no" / "such" / "folder" / "mlflow.db"
    with pytest.raises(tracking.RegistryError, match="does not exist"):
        tracking.check_reachable(f"sqlite:///{missing}")
    assert not (tmp_path / "no").exists()
    monkeypatch.setenv("KNNSSD_WORK", str(tmp_path / "work"))  # the default database: made where it is missing
    tracking.check_reachable(f"sqlite:///{tmp_path / 'work' / 'mlflow.db'}")
    assert (tmp_path / "work").is_dir()

    db = tmp_path / "mlflow.db"
    with sqlite3.connect(db) as con:
        con.execute("CREATE TABLE runs (id INTEGER PRIMARY KEY, name TEXT)")
        con.executemany("INSERT INTO runs (name) VALUES (?)", [("run %d " % i * 20,) for i in range(3000)])
    size = db.stat().st_size
    tracking.check_reachable(f"sqlite:///{db}")
    for name, damage in (("truncated", lambda f: f.truncate(size // 2)),
                         ("overwritten", lambda f: (f.seek(size // 3), f.write(os.urandom(8192))))):
        bad = tmp_path / f"{name}.db"
        bad.write_bytes(db.read_bytes())
        with open(bad, "r+b") as f:
            damage(f)
        before = bad.read_bytes()
        with pytest.raises(tracking.RegistryError, match="is damaged") as e:
            tracking.check_reachable(f"sqlite:///{bad}")
        assert "\n" not in str(e.value) and bad.read_bytes() == before, name  # nothing written to it


def test_metric_names_of_long_labels_stay_within_mlflows_limit():
    """The trial after issue 40: a 300-character domain name failed at registration, after its search."""
    long = tracking.metric_tag("n" * 300)
    assert len(long) == 64 and long != tracking.metric_tag("n" * 299) and tracking.metric_tag("reasoning") == "reasoning"


@pytest.mark.parametrize("alias", ["champion", "candidate", "a-b_c", "x" * 255, "", "has space", "champion@x", "v1", "V23",
                                   "latest", "LATEST", "x" * 256, "ü"])
def test_aliases_follow_mlflows_rules(alias):
    """``tracking.check_alias`` restates MLflow's alias rules so a bad ``--alias`` fails before the search; this
    fails loudly where the pinned MLflow's own validators (private names) say otherwise."""
    from mlflow.exceptions import MlflowException
    from mlflow.utils.validation import _validate_model_alias_name, _validate_model_alias_name_reserved

    try:
        _validate_model_alias_name(alias)
        _validate_model_alias_name_reserved(alias)
        mlflow_takes = True
    except MlflowException:
        mlflow_takes = False
    try:
        tracking.check_alias(alias)
        ours = True
    except tracking.RegistryError:
        ours = False
    assert ours == mlflow_takes, alias
