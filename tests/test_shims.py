"""The private APIs knnssd leans on (``knnssd/shims.py``) are still there, on the pinned versions: these
fail loudly when a library or Python changes them, before a shim quietly falls back."""
import re
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from knnssd import shims
from tiny import tiny_gguf

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


def test_a_gguf_file_is_parsed_once_while_transformers_converts_it(tmp_path):
    """transformers (the pinned release) imports ``GGUFReader`` and ``get_tensor_name_map`` from ``gguf`` when it
    loads a file, so the shim's stand-ins are the ones it calls; within the block a path read again gives the same
    reader, and after it the library's own functions are back."""
    import inspect

    import gguf
    import transformers
    from transformers import modeling_gguf_pytorch_utils as loading

    pin = re.search(r'"transformers==([^"]+)"', (ROOT / "pyproject.toml").read_text()).group(1)
    assert transformers.__version__ == pin == shims.TRANSFORMERS_VERSION
    source = inspect.getsource(loading)
    assert "from gguf import GGUFReader" in source and "from gguf import MODEL_ARCH_NAMES, get_tensor_name_map" in source
    path = tiny_gguf(tmp_path / "tiny.gguf")
    reader, name_map = gguf.GGUFReader, gguf.get_tensor_name_map
    with shims.gguf_parsed_once() as patched:
        assert patched
        first = gguf.GGUFReader(path)
        assert gguf.GGUFReader(str(path)) is first and first.tensors[0].name == "token_embd.weight"
        arch = gguf.MODEL_ARCH.LLAMA
        assert gguf.get_tensor_name_map(arch, 2) is gguf.get_tensor_name_map(arch, 2)
    assert (gguf.GGUFReader, gguf.get_tensor_name_map) == (reader, name_map)
    assert gguf.GGUFReader(path) is not first

