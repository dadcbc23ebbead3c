"""The private APIs knnssd leans on (``knnssd/shims.py``) are still there, on the pinned versions: these
fail loudly when a library or Python changes them, before a shim quietly falls back."""
import re
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from knnssd import shims

ROOT = Path(__file__).resolve().parents[1]


def test_prefect_is_the_pinned_version_and_its_server_hook_is_there():
    import prefect
    from prefect.server.api.server import SubprocessASGIServer

    pin = re.search(r'"prefect==([^"]+)"', (ROOT / "pyproject.toml").read_text()).group(1)
    assert prefect.__version__ == pin == shims.PREFECT_VERSION
    assert callable(SubprocessASGIServer._run_uvicorn_command)
    server = shims.prefect_server_class()
    assert server is not SubprocessASGIServer and issubclass(server, SubprocessASGIServer)


def test_predict_widens_the_executor_it_runs_on_to_the_batch():
    """``mlflow models serve`` runs ``predict`` on an executor of cores + 4 threads: predict lets it run
    one per slot, so that many requests can be in the batch at once."""
    from knnssd.serving.pyfunc import _admit_concurrent_requests

    assert sys.version_info[:2] in shims.PYTHONS
    with ThreadPoolExecutor(2) as pool:
        assert pool.submit(shims.widen_this_executor, 8).result() and pool._max_workers == 8
        pool.submit(_admit_concurrent_requests, 16).result()
        assert pool._max_workers == 16
        pool.submit(_admit_concurrent_requests, 4).result()  # never narrowed
        assert pool._max_workers == 16
    assert not shims.widen_this_executor(16)  # not on an executor's thread: nothing to widen
