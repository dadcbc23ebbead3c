"""Does a server answer? One quick check for the services a command depends on: an HTTP server
(``error``) or a database behind an SQLAlchemy URL (``database_error``); and can a server of ours
listen where it is told to (``listen_error``), or on a free port (``free_port``). ``NoWorker``: a work
pool that has no worker to answer."""
from __future__ import annotations

import urllib.error
import urllib.request


class NoWorker(RuntimeError):
    """No worker came online in a Prefect work pool in time; one line naming the command that starts one."""


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


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` now (the system's pick), for a server started next."""
    import socket

    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def listen_error(host: str, port: int) -> str | None:
    """None when a TCP server can listen on ``host``:``port`` now, else why not (one line): a host that is
    no address of this machine, a port in use or not allowed. A server started there failed with its own
    traceback, and MLflow's UI still exited with status 0."""
    import socket

    if not 0 < port < 65536:
        return f"port {port} is not in 1..65535"
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        with socket.socket(family, kind, proto) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn does: TIME_WAIT is no conflict
            s.bind(address)
    except OSError as e:  # socket.gaierror included
        return e.strerror or str(e)
    return None
