"""Does a server answer? One quick check for the services a command depends on: an HTTP server
(``error``) or a database behind an SQLAlchemy URL (``database_error``)."""
from __future__ import annotations

import urllib.error
import urllib.request


def error(url: str, timeout: float) -> str | None:
    """None when ``url`` gives any HTTP answer within ``timeout`` seconds, else why not (one line)."""
    try:
        urllib.request.urlopen(url, timeout=timeout).close()
    except urllib.error.HTTPError:
        return None  # it answered
    except (urllib.error.URLError, OSError, ValueError) as e:
        return str(getattr(e, "reason", e))
    return None


def database_error(url: str, timeout: float) -> str | None:
    """None when the database behind the SQLAlchemy ``url`` opens within about ``timeout`` seconds, else
    why not (one line): no dialect or driver here, a sqlite file in a folder that does not exist, a server
    that does not answer. A sqlite file that does not exist yet is made (empty), as its first use would."""
    from pathlib import Path

    import sqlalchemy

    try:
        u = sqlalchemy.engine.make_url(url)
        backend = u.get_backend_name()
        if backend == "sqlite" and u.database not in (None, "", ":memory:") and not Path(u.database).parent.is_dir():
            return f"folder {Path(u.database).parent} does not exist"
        args = {"connect_timeout": int(timeout)} if backend in ("postgresql", "mysql") else {}
        engine = sqlalchemy.create_engine(u, connect_args=args)
        try:
            with engine.connect() as con:
                if backend == "sqlite":  # opening reads nothing: a file that is not a database fails here
                    con.exec_driver_sql("PRAGMA schema_version")
        finally:
            engine.dispose()
    except Exception as e:  # noqa: BLE001 - a dialect, driver or server that is not there
        from knnssd.console import first_line

        return first_line(e)
    return None
